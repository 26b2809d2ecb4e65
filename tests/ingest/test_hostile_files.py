"""Issue 25, second wave: a decompression bomb among the traces is skipped with one line
saying how to read it anyway, in bounded memory, the other ranks analysed; a cache directory
or entry that is a symlink pptrace did not make is never written, read or swept.

Each test runs the real command (tests/hostile.py) and checks that the trace files, and
every file of a directory a link points to, are left as they were."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from hostile import checksums, no_traceback, pptrace, stderr_lines
from pptrace.errors import TraceError
from pptrace.ingest import files, store
from tracegen import pipeline_run

_MiB = 1 << 20
#: What one bomb inflates to: over the limits the tests set, generated in ~2 s (255 KB on disk).
_BOMB_BYTES = 256 * _MiB
_PEAK_RSS_BOUND = 1 << 30


def _bomb(path, prefix: bytes, fill: bytes = b" ", claimed: int | None = None) -> None:
    """``prefix`` then _BOMB_BYTES of ``fill``, gzipped a block at a time (never the whole
    in memory); ``claimed``: the length the trailer then says (a bomb of 2**33 zeros has 0)."""
    block = fill * (16 * _MiB)
    with open(path, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=6, mtime=0) as gz:
        gz.write(prefix)
        for _ in range(_BOMB_BYTES // len(block)):
            gz.write(block)
    if claimed is not None:
        with open(path, "r+b") as fh:
            fh.seek(-4, os.SEEK_END)
            fh.write(claimed.to_bytes(4, "little"))


def _measured(*args, env: dict) -> tuple[subprocess.CompletedProcess, int]:
    """``pptrace ARGS`` under a parent of its own -> (the result, the peak RSS in bytes of the
    command or any of its worker processes: RUSAGE_CHILDREN of a parent that ran only it)."""
    parent = (
        "import json, resource, subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'pptrace', *sys.argv[1:]], capture_output=True, text=True)\n"
        "print(json.dumps([r.returncode, r.stdout, r.stderr, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n"
    )
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1", **env}
    full_env.pop("PPTRACE_DEBUG", None)
    out = subprocess.run([sys.executable, "-c", parent, *map(str, args)], capture_output=True, text=True,
                         timeout=300, env=full_env, check=True)
    code, stdout, stderr, peak_kb = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, code, stdout, stderr), peak_kb * 1024


def _run_with_a_bomb(tmp_path, **bomb):
    """A 2x2 run whose rank 3 is a bomb: its real trace, then _BOMB_BYTES of filler."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2)
    target = run_dir / "traces" / "rank3.json.gz"
    _bomb(target, gzip.decompress(target.read_bytes()), **bomb)
    return run_dir, target


def _analyzed_without(run_dir, target, env: dict, env_var: str) -> int:
    """``analyze --json`` with ``env``: ranks 0-2 analysed, ``target`` skipped in one warning
    line naming it and ``env_var``; returns the command's peak RSS."""
    before = checksums(run_dir)
    r, peak = _measured("analyze", run_dir, "--json", env=env)
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert sorted(rank["rank"] for rank in report["ranks"]) == [0, 1, 2]
    said = [w for w in report["warnings"] if str(target) in w]
    assert len(said) == 1 and env_var in said[0] and said[0].startswith("skipped: "), report["warnings"]
    assert sum(str(target) in line for line in stderr_lines(r)) <= 1, r.stderr
    assert checksums(run_dir) == before
    print(f"peak RSS of analyze beside a {_BOMB_BYTES >> 20} MiB bomb ({env_var}): {peak >> 20} MiB")
    return peak


def test_a_bomb_past_the_size_limit_is_skipped_in_bounded_memory(tmp_path):
    """Issue 25 item 1: a valid trace followed by gigabytes of whitespace, a few MB of gzip,
    took 7 GB to analyse. Past PPTRACE_MAX_TRACE_BYTES the rank is skipped with one line, the
    others analysed; inflating stops at the limit, so memory stays far below the bomb."""
    run_dir, target = _run_with_a_bomb(tmp_path)
    env = {files.MAX_BYTES_ENV: "64M", files.MAX_RATIO_ENV: "100000"}  # the size limit alone
    peak = _analyzed_without(run_dir, target, env, files.MAX_BYTES_ENV)
    assert peak < _PEAK_RSS_BOUND
    # info reads headers within the same limit
    r, peak = _measured("info", run_dir, env=env)
    no_traceback(r)
    assert r.returncode == 0 and "ranks: 3 (0, 1, 2)" in r.stdout, r.stdout + r.stderr
    print(f"peak RSS of info: {peak >> 20} MiB")
    said = [line for line in r.stdout.splitlines() if str(target.name) in line and "warning" in line]
    assert len(said) == 1 and files.MAX_BYTES_ENV in said[0], r.stdout
    assert peak < _PEAK_RSS_BOUND
    # raised, the limit lets the same file through to the loader's own checks
    r = pptrace("analyze", run_dir, "--json", env={files.MAX_BYTES_ENV: "1G", files.MAX_RATIO_ENV: "100000"})
    no_traceback(r)
    assert not [w for w in json.loads(r.stdout)["warnings"] if files.MAX_BYTES_ENV in w]


def test_a_bomb_is_refused_by_its_inflate_ratio_under_the_default_size_limit(tmp_path):
    """Under the default size limit (a share of this machine's memory, maybe above the bomb)
    a .gz inflating over 100x its size is taken for a bomb: skipped, naming the ratio's variable."""
    run_dir, target = _run_with_a_bomb(tmp_path)
    env = {files.MAX_BYTES_ENV: "", files.MAX_RATIO_ENV: ""}
    peak = _analyzed_without(run_dir, target, env, files.MAX_RATIO_ENV)
    assert peak < _PEAK_RSS_BOUND


def test_a_bomb_whose_trailer_lies_is_never_held(tmp_path):
    """2**33 bytes of zeros give a trailer length of 0 (it is the length mod 4 GiB): nothing is
    believed of it, the bytes past it are only counted until the limit."""
    run_dir, target = _run_with_a_bomb(tmp_path, fill=b"\0", claimed=1000)
    env = {files.MAX_BYTES_ENV: "128M", files.MAX_RATIO_ENV: "100000"}
    peak = _analyzed_without(run_dir, target, env, files.MAX_BYTES_ENV)
    assert peak < _PEAK_RSS_BOUND


def test_the_default_limit_is_a_share_of_memory_and_the_variables_are_checked(monkeypatch, tmp_path):
    monkeypatch.delenv(files.MAX_BYTES_ENV, raising=False)
    monkeypatch.delenv(files.MAX_RATIO_ENV, raising=False)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit, reason = files.size_limit("rank0.json.gz")
    assert files.machine_memory() <= ram and limit == files.machine_memory() // 4
    assert files.MAX_BYTES_ENV in reason
    for pages in (1 << 20, 1 << 25):  # 4 GiB and 128 GiB of 4 KiB pages
        monkeypatch.setattr(files, "machine_memory", lambda pages=pages: pages * 4096)
        assert files.size_limit("rank0.json.gz")[0] == pages * 4096 // 4
    # a small .gz may inflate far, up to the floor; a large one up to 100x
    assert files.inflate_limit("r.json.gz", 1000)[0] == 64 * _MiB
    assert files.inflate_limit("r.json.gz", 10 * _MiB)[0] == 1000 * _MiB
    monkeypatch.setenv(files.MAX_BYTES_ENV, "8G")
    assert files.size_limit("r.json.gz")[0] == 8 << 30
    monkeypatch.setenv(files.MAX_BYTES_ENV, "12345")
    assert files.inflate_limit("r.json.gz", 10 * _MiB)[0] == 12345
    monkeypatch.setenv(files.MAX_BYTES_ENV, "lots")
    with pytest.raises(TraceError, match=f"{files.MAX_BYTES_ENV}='lots' is not a limit"):
        files.size_limit("r.json.gz")
    # through the command: one line, no traceback
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    r = pptrace("analyze", run_dir, env={files.MAX_BYTES_ENV: "lots"})
    no_traceback(r)
    lines = stderr_lines(r)
    assert r.returncode == 1 and len(lines) == 1 and files.MAX_BYTES_ENV in lines[0], lines


def test_a_trace_within_the_limits_inflates_as_before(tmp_path):
    """Several members, NUL padding after one, and the trailer's length all read as gzip reads
    them; a truncated file is still said to be truncated, not a bomb."""
    one, two = b'{"traceEvents": [' + b" " * 5000, b"]}"
    for raw in (gzip.compress(one + two), gzip.compress(one) + gzip.compress(two),
                gzip.compress(one + two) + b"\0" * 10):
        assert files.gunzip(raw, "r.json.gz") == gzip.decompress(raw)
    with pytest.raises(EOFError):
        files.gunzip(gzip.compress(one * 100)[:-100], "r.json.gz")
    with pytest.raises(OSError):
        files.gunzip(gzip.compress(one) + b"trailing junk", "r.json.gz")


# -------------------------------------------------------------------------------------------
# the cache never follows a link it did not make
# -------------------------------------------------------------------------------------------
def _tree(root) -> dict:
    """relative path -> (sha256, mtime) of every entry under ``root``, links not followed."""
    out = {}
    for p in sorted(root.rglob("*")):
        data = os.readlink(p).encode() if p.is_symlink() else p.read_bytes() if p.is_file() else b""
        out[str(p.relative_to(root))] = (hashlib.sha256(data).hexdigest(), p.lstat().st_mtime_ns)
    return out


def _reports(run_dir, user_cache, times: int = 2) -> list:
    out = []
    for _ in range(times):  # cold, then from the cache
        r = pptrace("analyze", run_dir, "--json", env={"XDG_CACHE_HOME": str(user_cache)})
        no_traceback(r)
        assert r.returncode == 0 and stderr_lines(r) == [], r.stderr[-2000:]
        out.append({k: v for k, v in json.loads(r.stdout).items() if k != "warnings"})
    return out


def test_a_symlinked_cache_directory_is_neither_written_nor_swept(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    other = tmp_path / "someone-elses"
    other.mkdir()
    hour_ago = time.time() - 3600
    for name in ("notes.tmp", ".rank0.json.gz.arrow.1.abcdef01.tmp", "rank0.json.gz.parquet",
                 "rank0.json.gz.arrow", "data.parquet"):
        (other / name).write_text(name)
        os.utime(other / name, (hour_ago, hour_ago))
    (run_dir / "traces" / store.CACHE_DIRNAME).symlink_to(other, target_is_directory=True)
    before, theirs = checksums(run_dir), _tree(other)
    cold, cached = _reports(run_dir, tmp_path / "user-cache")
    assert cold == cached
    assert _tree(other) == theirs and checksums(run_dir) == before
    assert sorted(p.name for p in (tmp_path / "user-cache").rglob("*.arrow")) == \
        ["rank0.json.gz.arrow", "rank1.json.gz.arrow"]


def test_a_symlinked_cache_entry_is_neither_read_nor_its_target_written(tmp_path):
    """An entry that is a link (pptrace makes none) is a miss; its replacement is written
    over the link, never through it."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    user_cache = tmp_path / "user-cache"
    expected = _reports(run_dir, user_cache, times=1)[0]
    cache_dir = run_dir / "traces" / store.CACHE_DIRNAME
    entry = cache_dir / "rank0.json.gz.arrow"
    outside = tmp_path / "outside"
    outside.mkdir()
    os.replace(entry, outside / "theirs.arrow")  # a valid entry, even: still not followed
    entry.symlink_to(outside / "theirs.arrow")
    theirs, before = _tree(outside), checksums(run_dir)
    assert _reports(run_dir, user_cache) == [expected, expected]
    assert _tree(outside) == theirs and checksums(run_dir) == before
    assert not entry.is_symlink() and entry.is_file()
