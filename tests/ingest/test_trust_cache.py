"""Issue 25 item 10: a cache entry is used only when this user's pptrace wrote it.

Anyone who can write ``traces/.pptrace-cache`` (a shared run directory) could put an entry
there under a trace's valid key, its CRC-32s recomputed over a table of their own, and change
every number pptrace reports. The entries' digests are keyed with a secret of the invoking
user's (a 0600 file in a 0700 directory of the user cache): an entry that secret does not
verify is parsed again, the numbers are the trace's.

Each test runs the real command (tests/hostile.py) with a user cache of its own."""
from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pyarrow as pa
import pytest

from hostile import checksums, no_traceback, pptrace, stderr_lines
from pptrace.ingest import store
from pptrace.ingest.columnar import CHECKSUM_KEY, StoredTable
from tracegen import pipeline_run


def _analyze(run_dir, user_cache) -> tuple[dict, list]:
    """``analyze --json`` under ``user_cache``: (its numbers, its warnings)."""
    r = pptrace("analyze", run_dir, "--json", env={"XDG_CACHE_HOME": str(user_cache)})
    no_traceback(r)
    assert r.returncode == 0 and stderr_lines(r) == [], r.stderr[-2000:]
    report = json.loads(r.stdout)
    return {k: v for k, v in report.items() if k != "warnings"}, report["warnings"]


def _fresh(run_dir, tmp_path) -> dict:
    """The numbers of these traces parsed from scratch: a copy without a cache, its own user cache."""
    copy = tmp_path / "fresh"
    shutil.copytree(run_dir / "traces", copy / "traces", ignore=shutil.ignore_patterns(store.CACHE_DIRNAME))
    return _analyze(copy, tmp_path / "fresh-user-cache")[0]


def _shortened(entry) -> tuple[pa.Table, dict]:
    """The entry's table with every forward 0.5 ms shorter, and the entry's schema metadata
    (the payload naming the trace's valid key) less its checksums."""
    with pa.OSFile(str(entry)) as source:
        table = pa.ipc.open_file(source).read_all()
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != CHECKSUM_KEY}
    forward = np.array([str(n).startswith("compute:fwd") for n in table.column("name").to_pylist()])
    assert forward.sum() >= 4
    end = table.column("end_ns").to_numpy() - np.where(forward, 500_000, 0)
    dur = table.column("dur_ns").to_numpy() - np.where(forward, 500_000, 0)
    table = table.set_column(table.schema.get_field_index("end_ns"), "end_ns", pa.array(end))
    table = table.set_column(table.schema.get_field_index("dur_ns"), "dur_ns", pa.array(dur))
    return table.replace_schema_metadata(metadata), metadata


@pytest.mark.parametrize("how", ["CRC-32s recomputed", "keyed with the forger's own secret"])
def test_a_forged_entry_under_a_valid_key_is_not_used(tmp_path, monkeypatch, how):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    user_cache = tmp_path / "user-cache"
    expected = _fresh(run_dir, tmp_path)
    assert _analyze(run_dir, user_cache)[0] == expected  # entries written, with this user's secret
    trace = run_dir / "traces" / "rank1.json.gz"
    entry = store.cache_path(trace)
    table, metadata = _shortened(entry)
    # what the entry's writer would make of it: the forgery, if trusted, changes the numbers
    with monkeypatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(user_cache))
        payload = json.loads(metadata[b"pptrace.ingest.store"])
        assert store.write(trace, table.replace_schema_metadata({}), payload["meta"], payload["key"]) == entry
    trusted, warnings = _analyze(run_dir, user_cache)
    assert trusted != expected and warnings == []
    # the forger's: the same table under the same payload (valid key, this user's secret
    # named), checksummed as pptrace checks entries, but without that secret
    StoredTable.write_checked(table, str(entry), None if how.startswith("CRC") else os.urandom(32))
    forged = entry.read_bytes()
    before = checksums(run_dir)
    numbers, warnings = _analyze(run_dir, user_cache)
    assert numbers == expected
    (line,) = warnings
    assert "rank1.json.gz.arrow" in line and "not written by your pptrace" in line and "parsed again" in line
    assert entry.read_bytes() != forged  # replaced by an entry of this user's
    assert _analyze(run_dir, user_cache) == (expected, [])  # which is used, quietly
    assert checksums(run_dir) == before


def test_the_secret_is_private_and_kept_in_the_user_cache(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    user_cache = tmp_path / "user-cache"
    before = checksums(run_dir)
    _analyze(run_dir, user_cache)
    secret_dir = user_cache / "pptrace" / "secret"
    key = secret_dir / "cache-key"
    assert stat.S_IMODE(os.lstat(secret_dir).st_mode) == 0o700 and os.lstat(secret_dir).st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(key).st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert sorted(p.name for p in secret_dir.iterdir()) == ["cache-key"]  # no temporary left
    written = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert written == ["traces/.pptrace-cache/rank0.json.gz.arrow", "traces/.pptrace-cache/rank1.json.gz.arrow",
                       "traces/rank0.json.gz", "traces/rank1.json.gz"]
    assert key.read_bytes() not in b"".join(p.read_bytes() for p in run_dir.rglob("*.arrow"))
    secret = key.read_bytes()
    _analyze(run_dir, user_cache)
    assert key.read_bytes() == secret and checksums(run_dir) == before


def test_another_users_entries_are_parsed_again_quietly(tmp_path):
    """A colleague's entries in a shared run directory verify with their secret, not yours:
    a miss, said nothing of (they are no forgery), and replaced by yours."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh(run_dir, tmp_path)
    entries = [store.cache_path(run_dir / "traces" / f"rank{r}.json.gz") for r in (0, 1)]
    assert _analyze(run_dir, tmp_path / "colleague") == (expected, [])
    theirs = [e.read_bytes() for e in entries]
    assert _analyze(run_dir, tmp_path / "you") == (expected, [])
    assert all(e.read_bytes() != t for e, t in zip(entries, theirs))


def test_a_secret_others_can_read_is_not_used_and_nothing_is_cached(tmp_path):
    user_cache = tmp_path / "user-cache"
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    expected = _fresh(run_dir, tmp_path)
    (user_cache / "pptrace" / "secret").mkdir(parents=True, mode=0o755)
    os.chmod(user_cache / "pptrace" / "secret", 0o755)
    before = checksums(run_dir)
    for _ in range(2):
        assert _analyze(run_dir, user_cache) == (expected, [])
        assert not list(run_dir.rglob("*.arrow")) and not list(user_cache.rglob("*.arrow"))
        assert not (user_cache / "pptrace" / "secret" / "cache-key").exists()
    assert checksums(run_dir) == before
