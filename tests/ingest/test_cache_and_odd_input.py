"""Issue 15, ingest: the cache never serves another version of a trace, never stops a command
and is shared like the traces; odd bytes (a BOM, absurd nesting) load; a FIFO never hangs;
``info`` refuses what ``analyze`` refuses; pptrace's own outputs are not taken for ranks.

Each test runs the real command (tests/hostile.py) on a run whose numbers are known from a
clean copy of the same traces, and checks that the trace files are left as they were."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import pytest

from hostile import checksums, no_traceback, one_line_error, pptrace, stderr_lines
from pptrace.ingest import load, store
from pptrace.run.build import load_run
from tracegen import RankTrace, pipeline_run, write_run


def _report(run_dir, *extra) -> dict:
    """``analyze --json`` that succeeded quietly: its document."""
    r = pptrace("analyze", run_dir, "--json", *extra)
    no_traceback(r)
    assert r.returncode == 0 and stderr_lines(r) == [], r.stderr[-2000:]
    return json.loads(r.stdout)


def _numbers(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "warnings"}


def _fresh_numbers(run_dir, tmp_path) -> dict:
    """The numbers of these traces parsed from scratch (a copy without any cache)."""
    copy = tmp_path / f"fresh{time.monotonic_ns()}"
    shutil.copytree(run_dir / "traces", copy / "traces", ignore=shutil.ignore_patterns(store.CACHE_DIRNAME))
    return _numbers(_report(copy))


def _shorter_forwards(data: bytes) -> bytes:
    """The same trace with every 1 ms forward 0.9 ms long: other numbers, same size."""
    edited = data.replace(b'"dur": 1000.0,', b'"dur": 900.00,')
    assert edited != data and len(edited) == len(data)
    return edited


# -------------------------------------------------------------------------------------------
# 2. the cache never keeps another version of a trace
# -------------------------------------------------------------------------------------------
def test_a_trace_replaced_while_it_is_parsed_is_reported_new_on_the_next_run(tmp_path, monkeypatch):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False)
    target = run_dir / "traces" / "rank1.json"
    old_numbers = _fresh_numbers(run_dir, tmp_path)
    new_bytes = _shorter_forwards(target.read_bytes())
    real_build = load.build_frame

    def replace_mid_parse(slices, rank, base, path, warnings, **options):
        # the trace is read; the writer's os.replace lands while its events are parsed
        if str(path) == str(target) and target.read_bytes() != new_bytes:
            (target.parent / "incoming.tmp").write_bytes(new_bytes)
            os.replace(target.parent / "incoming.tmp", target)
        return real_build(slices, rank, base, path, warnings, **options)

    monkeypatch.setattr(load, "build_frame", replace_mid_parse)
    first = load_run(run_dir)
    assert [w for w in first.warnings if "changed while pptrace read it" in w and "rank1.json" in w]
    monkeypatch.undo()
    assert target.read_bytes() == new_bytes
    before = checksums(run_dir)
    report = _report(run_dir)
    assert _numbers(report) == _fresh_numbers(run_dir, tmp_path) != old_numbers
    assert not [w for w in report["warnings"] if "changed while" in w]
    assert _numbers(_report(run_dir)) == _numbers(report)  # and from the cache it now holds
    assert checksums(run_dir) == before


def test_an_edit_that_keeps_size_and_mtime_is_reported_new(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False)
    target = run_dir / "traces" / "rank1.json"
    old = _numbers(_report(run_dir))  # now cached
    st = os.stat(target)
    with open(target, "r+b") as fh:  # in place, as an editor that keeps the inode would
        edited = _shorter_forwards(fh.read())
        fh.seek(0)
        fh.write(edited)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # touch -r
    now = os.stat(target)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    before = checksums(run_dir)
    new = _numbers(_report(run_dir))
    assert new == _fresh_numbers(run_dir, tmp_path) != old
    assert checksums(run_dir) == before


# -------------------------------------------------------------------------------------------
# 3. a broken cache never stops a command; killed writes leave nothing usable; shared modes
# -------------------------------------------------------------------------------------------
def test_a_damaged_cache_entry_is_dropped_and_its_trace_parsed_again(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=8)
    expected = _numbers(_report(run_dir))
    entry = store.cache_path(run_dir / "traces" / "rank0.json.gz")
    good = entry.read_bytes()
    damaged = bytearray(good)
    middle = len(damaged) // 2  # inside the record batch, past the footer's reach
    damaged[middle:middle + 64] = bytes(b ^ 0x5A for b in damaged[middle:middle + 64])
    entry.write_bytes(bytes(damaged))
    assert store.lookup(run_dir / "traces" / "rank0.json.gz") is not None  # the footer still reads
    before = checksums(run_dir)
    # (merge reads every op from the traces themselves, never the compact cache)
    for command in (("analyze", "--json"), ("whatif", "--json")):
        entry.write_bytes(bytes(damaged))
        r = pptrace(command[0], run_dir, *command[1:])
        no_traceback(r)
        assert r.returncode == 0 and stderr_lines(r) == [], r.stderr
        assert entry.read_bytes() != bytes(damaged)  # replaced by a good entry
        if command[0] == "analyze":
            assert _numbers(json.loads(r.stdout)) == expected
    assert store.lookup(run_dir / "traces" / "rank0.json.gz") is not None
    assert checksums(run_dir) == before


_DIE_WHILE_WRITING = """
import os, sys
from pptrace.ingest.columnar import StoredTable
real = StoredTable.write_ipc
def die_midway(table, sink):
    if isinstance(sink, str):  # the entry's file: half of it, then the process is killed
        with open(sink, "wb") as fh:
            fh.write(b"ARROW1\\0\\0 half an entry")
        os._exit(137)
    return real(table, sink)
StoredTable.write_ipc = staticmethod(die_midway)
from pptrace.cli import cli
cli(["analyze", sys.argv[1], "--json"])
"""


def test_a_run_killed_while_writing_the_cache_leaves_nothing_taken_for_an_entry(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh_numbers(run_dir, tmp_path)
    killed = subprocess.run([sys.executable, "-c", _DIE_WHILE_WRITING, str(run_dir)], capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == 137, killed.stderr[-2000:]
    cache_dir = run_dir / "traces" / store.CACHE_DIRNAME
    left = sorted(p.name for p in cache_dir.iterdir())
    assert len(left) == 1 and left[0].startswith(".rank0.json.gz.arrow.") and left[0].endswith(".tmp")
    before = checksums(run_dir)
    assert _numbers(_report(run_dir)) == expected  # the half file is not an entry
    assert (cache_dir / left[0]).exists()  # young: it could be a concurrent run's write
    hour_ago = time.time() - 3600
    os.utime(cache_dir / left[0], (hour_ago, hour_ago))
    assert _numbers(_report(run_dir)) == expected
    assert sorted(p.name for p in cache_dir.iterdir()) == ["rank0.json.gz.arrow", "rank1.json.gz.arrow"]
    assert checksums(run_dir) == before


def _tree(root) -> dict:
    """relative path -> (sha256, mtime) of every file under ``root``, links not followed."""
    import hashlib

    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def test_a_symlinked_cache_directory_is_never_written_nor_swept(tmp_path):
    """Issue 25 item 2: with ``traces/.pptrace-cache`` a symlink to another directory, pptrace
    wrote its entries there and its sweep deleted that directory's old ``*.tmp`` and
    ``*.parquet`` files. A cache directory pptrace did not create is not used (the entries go
    to the user cache), and even in its own only the temporary names it gives are swept."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh_numbers(run_dir, tmp_path)
    other = tmp_path / "someone-elses"
    other.mkdir()
    hour_ago = time.time() - 3600
    for name in ("notes.tmp", ".rank0.json.gz.arrow.1.abcdef01.tmp", "rank0.json.gz.parquet", "data.parquet"):
        (other / name).write_text(name)
        os.utime(other / name, (hour_ago, hour_ago))
    (run_dir / "traces" / store.CACHE_DIRNAME).symlink_to(other, target_is_directory=True)
    before, theirs = checksums(run_dir), _tree(other)
    user_cache = tmp_path / "user-cache"
    for _ in range(2):  # cold, then from the cache
        r = pptrace("analyze", run_dir, "--json", env={"XDG_CACHE_HOME": str(user_cache)})
        no_traceback(r)
        assert r.returncode == 0 and stderr_lines(r) == [], r.stderr[-2000:]
        assert _numbers(json.loads(r.stdout)) == expected
    assert _tree(other) == theirs and checksums(run_dir) == before
    assert sorted(p.name for p in user_cache.rglob("*.arrow")) == ["rank0.json.gz.arrow", "rank1.json.gz.arrow"]


def test_a_symlinked_trace_is_cached_beside_its_link_and_only_pptrace_temporaries_are_swept(tmp_path):
    """The cache of a symlinked trace goes where the link is (the run directory), not beside
    its target (a write outside the run); in pptrace's own cache directory an old file that
    pptrace did not name stays."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh_numbers(run_dir, tmp_path)
    traces, elsewhere = run_dir / "traces", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(traces / "rank1.json.gz", elsewhere / "rank1.json.gz")
    (traces / "rank1.json.gz").symlink_to(elsewhere / "rank1.json.gz")
    cache_dir = traces / store.CACHE_DIRNAME
    cache_dir.mkdir()
    hour_ago = time.time() - 3600
    for name in ("mine.tmp", ".rank9.json.gz.arrow.77.0123abcd.tmp"):
        (cache_dir / name).write_text(name)
        os.utime(cache_dir / name, (hour_ago, hour_ago))
    theirs = _tree(elsewhere)
    assert _numbers(_report(run_dir)) == expected
    assert _tree(elsewhere) == theirs and not (elsewhere / store.CACHE_DIRNAME).exists()
    assert sorted(p.name for p in cache_dir.iterdir()) == ["mine.tmp", "rank0.json.gz.arrow", "rank1.json.gz.arrow"]


@pytest.mark.parametrize("umask, trace_mode, entry_mode", [(0o022, 0o644, 0o644), (0o022, 0o640, 0o640),
                                                            (0o002, 0o664, 0o664), (0o077, 0o644, 0o600)])
def test_cache_entries_are_readable_like_the_traces_within_the_umask(tmp_path, umask, trace_mode, entry_mode):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    for trace in (run_dir / "traces").glob("*.json.gz"):
        os.chmod(trace, trace_mode)
    r = pptrace("analyze", run_dir, "--json", umask=umask)
    assert r.returncode == 0, r.stderr[-2000:]
    entries = sorted((run_dir / "traces" / store.CACHE_DIRNAME).iterdir())
    assert [p.name for p in entries] == ["rank0.json.gz.arrow", "rank1.json.gz.arrow"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in entries} == {entry_mode}


# -------------------------------------------------------------------------------------------
# 5. a BOM, absurdly deep args
# -------------------------------------------------------------------------------------------
def test_a_utf8_bom_in_front_of_a_trace_is_skipped(tmp_path):
    clean = _numbers(_report(pipeline_run(tmp_path / "clean", pp=2, gz=False)[0]))
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False)
    plain = run_dir / "traces" / "rank1.json"
    plain.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    zipped = run_dir / "traces" / "rank0.json"  # BOM inside the gzip stream
    (run_dir / "traces" / "rank0.json.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + zipped.read_bytes()))
    zipped.unlink()
    before = checksums(run_dir)
    report = _report(run_dir)
    assert _numbers(report) == clean and report["warnings"] == []
    r = pptrace("info", run_dir)
    no_traceback(r)
    assert r.returncode == 0 and "ranks: 2 (0, 1)" in r.stdout and "warning" not in r.stdout
    assert checksums(run_dir) == before


def test_deeply_nested_unused_args_load_with_one_warning(tmp_path):
    clean = _numbers(_report(pipeline_run(tmp_path / "clean", pp=2, gz=False)[0]))
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False)
    path = run_dir / "traces" / "rank1.json"
    data = path.read_bytes()
    at = data.index(b'"args": {', data.index(b'"name": "compute:fwd')) + len(b'"args": {')
    deep = (b'"objects": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000
            + b', "lists": ' + b"[" * 100_000 + b"]" * 100_000 + b", ")
    path.write_bytes(data[:at] + deep + data[at:])
    before = checksums(run_dir)
    report = _report(run_dir)
    assert _numbers(report) == clean
    nested = [w for w in report["warnings"] if "nested more than" in w]
    assert len(nested) == 1 and "rank1.json" in nested[0] and len(report["warnings"]) == 1
    r = pptrace("info", run_dir)
    no_traceback(r)
    assert r.returncode == 0 and "ranks: 2 (0, 1)" in r.stdout
    assert checksums(run_dir) == before


# -------------------------------------------------------------------------------------------
# 6. regular files only
# -------------------------------------------------------------------------------------------
def test_a_fifo_or_socket_named_like_a_rank_is_skipped_and_a_symlink_is_read(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh_numbers(run_dir, tmp_path)
    traces = run_dir / "traces"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(traces / "rank1.json.gz", elsewhere / "rank1.json.gz")
    (traces / "rank1.json.gz").symlink_to(elsewhere / "rank1.json.gz")
    os.mkfifo(traces / "rank2.json")
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(traces)  # a relative name: AF_UNIX paths are short
    try:
        sock.bind("rank3.json")
    finally:
        os.chdir(cwd)
    before = checksums(tmp_path)
    try:
        report = _report(run_dir)  # the hostile helper's timeout: a blocked read fails here
        assert _numbers(report) == expected
        skipped = report["warnings"]
        assert len(skipped) == 2, skipped
        assert "rank2.json" in skipped[0] and "named pipe" in skipped[0]
        assert "rank3.json" in skipped[1] and "socket" in skipped[1]
        r = pptrace("info", run_dir, timeout=60)
        no_traceback(r)
        assert r.returncode == 0 and "ranks: 2 (0, 1)" in r.stdout and "named pipe" in r.stdout
        one_line_error(pptrace("analyze", traces / "rank2.json", timeout=60), "rank2.json", "named pipe")
    finally:
        sock.close()
    assert checksums(tmp_path) == before


# -------------------------------------------------------------------------------------------
# 14. info says what analyze says; pptrace's own outputs are not ranks
# -------------------------------------------------------------------------------------------
def _same_refusal(run_dir, *must_contain) -> None:
    before = checksums(run_dir)
    line = one_line_error(pptrace("analyze", run_dir), *must_contain)
    assert one_line_error(pptrace("info", run_dir), *must_contain) == line
    assert checksums(run_dir) == before


def test_info_refuses_two_traces_of_one_rank_as_analyze_does(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    shutil.copy(run_dir / "traces" / "rank0.json.gz", run_dir / "traces" / "rank0-again.json.gz")
    _same_refusal(run_dir, "rank0-again.json.gz", "rank0.json.gz", "both claim rank 0")


def test_info_refuses_mixed_world_sizes_as_analyze_does(tmp_path):
    traces = []
    for rank, world in ((0, 2), (1, 4)):
        t = RankTrace(rank=rank, world_size=world, pptrace_block=False)
        t.step(1, 0, 1000)
        t.region("compute:fwd", 10, 500, mb=0)
        traces.append(t)
    _same_refusal(write_run(tmp_path / "run", traces), "different runs", "world sizes [2, 4]")


def test_pptrace_outputs_in_a_trace_directory_are_skipped_with_a_warning(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh_numbers(run_dir, tmp_path)
    traces = run_dir / "traces"
    for command in (("merge", run_dir, "-o", traces / "merged.json.gz"),
                    ("whatif", run_dir, "--trace", traces / "sim_rank0.json.gz")):
        r = pptrace(*command)
        assert r.returncode == 0, r.stderr[-2000:]
    before = checksums(run_dir)
    report = _report(run_dir)
    assert _numbers(report) == expected
    assert len(report["warnings"]) == 2, report["warnings"]
    assert "merged.json.gz" in report["warnings"][0] and "pptrace merge" in report["warnings"][0]
    assert "sim_rank0.json.gz" in report["warnings"][1] and "pptrace whatif" in report["warnings"][1]
    r = pptrace("info", run_dir)
    no_traceback(r)
    assert r.returncode == 0 and "ranks: 2 (0, 1)" in r.stdout
    assert "merged.json.gz: written by `pptrace merge`" in r.stdout and "sim_rank0.json.gz" in r.stdout
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(traces / "sim_rank0.json.gz", alone / "rank0.json.gz")  # renamed: the metadata tells
    one_line_error(pptrace("analyze", alone), "rank0.json.gz", "pptrace whatif --trace")
    assert checksums(run_dir) == before


# -------------------------------------------------------------------------------------------
# Issue 25 item 4: a trace whose every event appears twice
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["concatenated", "one copy beside"])
def test_events_recorded_twice_are_dropped_with_one_warning(tmp_path, how):
    """A bad concatenation or re-export repeats every complete event of a rank; the analyses
    would count each range twice (theory fraction 0.27 -> 0.48 in the audit). The copies are
    dropped and counted in one line; the numbers are the clean trace's."""
    clean = _numbers(_report(pipeline_run(tmp_path / "clean", pp=2, gz=False)[0]))
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False)
    path = run_dir / "traces" / "rank1.json"
    doc = json.loads(path.read_bytes())
    events = doc["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X" and e.get("dur", 0) > 0]
    if how == "concatenated":
        doc["traceEvents"] = events + complete
    else:  # each copy right after its original
        doc["traceEvents"] = [c for e in events for c in ([e, dict(e)] if e in complete else [e])]
    path.write_text(json.dumps(doc))
    before = checksums(run_dir)
    r = pptrace("analyze", run_dir, "--json")
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert _numbers(report) == clean
    (warning,) = report["warnings"]
    assert "rank1.json" in warning and "recorded twice" in warning and f"{len(complete)} events" in warning
    assert checksums(run_dir) == before


# -------------------------------------------------------------------------------------------
# Issue 25 item 9: terminal escapes and bidi overrides in file names
# -------------------------------------------------------------------------------------------
def test_control_characters_in_file_names_are_shown_written_out(tmp_path):
    """A file name holding ESC [2J (clears the screen) or U+202E (reverses what follows) is
    printed with the character written out, in the tables, the warnings and the errors."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    traces = run_dir / "traces"
    (traces / "rank1.json.gz").rename(traces / "rank1\x1b[2J\u202e.json.gz")
    (traces / "rank7\x1b]0;owned\x07.json").write_text("{not json")  # a broken one: a warning names it
    before = checksums(run_dir)
    for args in (("info", run_dir), ("analyze", run_dir)):
        r = pptrace(*args)
        no_traceback(r)
        assert r.returncode == 0, r.stderr[-2000:]
        for stream in (r.stdout, r.stderr):
            assert not any(c in stream for c in "\x1b\x07\u202e"), repr(stream[-500:])
        assert "rank7\\x1b]0;owned\\x07.json" in r.stdout + r.stderr
    assert "rank1\\x1b[2J\\u202e.json.gz" in pptrace("info", run_dir).stdout
    r = pptrace("analyze", traces / "rank7\x1b]0;owned\x07.json")  # the error names the file
    assert r.returncode == 1 and "\x1b" not in r.stderr and "rank7\\x1b]0;owned\\x07.json" in r.stderr
    assert checksums(run_dir) == before


def test_thousands_of_empty_files_are_one_warning(tmp_path):
    """Issue 25 item 14: 2,000 empty trace files beside two good ones are one problem, said
    once with its count (in analyze and info alike), not 2,000 lines."""
    clean = _numbers(_report(pipeline_run(tmp_path / "clean", pp=2)[0]))
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    for i in range(2, 2002):
        (run_dir / "traces" / f"rank{i}.json").touch()
    report = json.loads(pptrace("analyze", run_dir, "--json").stdout)
    assert _numbers(report) == clean
    empty = [w for w in report["warnings"] if "empty file" in w]
    assert empty == ["skipped: 2000 files: empty file; the rank probably died before writing its trace "
                     "(rank10.json, rank100.json, rank1000.json and 1997 more)"], empty
    r = pptrace("info", run_dir)
    assert r.returncode == 0 and sum("empty file" in line for line in r.stdout.splitlines()) == 1


def test_a_json_error_says_where_once(tmp_path):
    """Issue 25 item 14: the parse error's position, once (the fallback parser's re-raise
    added a second one, "line 1 column 1 (char 0)", which was wrong)."""
    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    (traces / "rank0.json").write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2, "pid": 1, "tid": 1},, ]}')
    line = one_line_error(pptrace("analyze", tmp_path / "run"), "rank0.json", "not valid JSON", "line 1 column 82")
    assert line.count("line ") == 1 and "char 0" not in line, line
