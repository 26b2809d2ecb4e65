"""Bad input: every case is a TraceError with one clear line, or a warning with partial results."""
from __future__ import annotations

import gzip
import os
import zlib
import shutil

import pytest

from pptrace.errors import TraceError
from pptrace.ingest.files import find_trace_files
from pptrace.ingest.load import load_rank
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, pipeline_run, write_run


def _one_line(exc: TraceError, *must_contain: str) -> str:
    text = str(exc)
    assert "\n" not in text and text
    for part in must_contain:
        assert part in text, (part, text)
    return text


def _trace(rank=0, n=50, layout=None, **kw) -> RankTrace:
    t = RankTrace(rank=rank, layout=layout or Layout(dp=1), **kw)
    t.step(1, 0, 10 * n + 10)
    for i in range(n):
        t.region("compute:fwd", 10 * i + 1, 5, mb=i)
    return t


def test_truncated_json_keeps_the_events_before_the_cut(tmp_path):
    data = _trace().dumps()
    path = tmp_path / "rank0.json"
    path.write_bytes(data[: int(len(data) * 0.6)])
    frame, meta = load_rank(path)
    assert 10 < len(frame) < 51
    assert any("truncated" in w for w in meta["warnings"])
    # the events kept are exactly the first ones
    assert sorted(frame.loc[frame["kind"] == "compute", "mb"].tolist()) == list(range((frame["kind"] == "compute").sum()))


def test_truncated_before_the_events_is_an_error(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_bytes(_trace().dumps()[:40])
    with pytest.raises(TraceError) as info:
        load_rank(path)
    _one_line(info.value, str(path), "not valid JSON")


def test_truncated_gzip_is_salvaged_as_a_truncated_json_is(tmp_path):
    """Issue 25 item 3: a .gz cut short lost the whole rank where the same cut in a .json kept
    the events before it; both keep them now."""
    data = _trace().dumps()
    deflate = zlib.compressobj(6, zlib.DEFLATED, 31)  # the writer died: the stream never ends
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(deflate.compress(data[: int(len(data) * 0.6)]) + deflate.flush(zlib.Z_SYNC_FLUSH))
    frame, meta = load_rank(path)
    assert 10 < len(frame) < 51
    assert any("truncated" in w for w in meta["warnings"])
    assert sorted(frame.loc[frame["kind"] == "compute", "mb"].tolist()) == list(range((frame["kind"] == "compute").sum()))


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(_trace().dumps())[:30])  # a cut before any event
    with pytest.raises(TraceError) as info:
        load_rank(path)
    _one_line(info.value, str(path))
    path.write_bytes(b"\x1f\x8b" + os.urandom(200))
    with pytest.raises(TraceError):
        load_rank(path)


def test_empty_file(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_bytes(b"")
    with pytest.raises(TraceError) as info:
        load_rank(path)
    _one_line(info.value, str(path), "empty")


@pytest.mark.parametrize("content", [b'{"hello": 1}', b"[1, 2, 3]", b'{"traceEvents": 5}', b"not json at all"])
def test_non_trace_json(tmp_path, content):
    path = tmp_path / "rank0.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        load_rank(path)
    _one_line(info.value, str(path))


def test_invalid_utf8_is_replaced_with_a_warning(tmp_path):
    t = _trace(n=3)
    t.add("BADNAME", 12, 1, cat="cpu_op")
    data = t.dumps().replace(b"BADNAME", b"bad\xff\xfename")
    path = tmp_path / "rank0.json"
    path.write_bytes(data)
    frame, meta = load_rank(path)
    assert any("UTF-8" in w for w in meta["warnings"])
    assert "bad\ufffd\ufffdname" in set(frame["name"].astype(str))
    assert (frame["kind"] == "compute").sum() == 3


def test_huge_integers_become_nulls(tmp_path):
    t = _trace(n=3)
    t.events[1]["args"]["External id"] = "HUGE"
    data = t.dumps().replace(b'"HUGE"', b"123456789012345678901234567890")
    path = tmp_path / "rank0.json"
    path.write_bytes(data)
    frame, _ = load_rank(path)
    assert len(frame) == 4 and frame["external_id"].isna().sum() == 1


def test_missing_rank_is_a_warning(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=4, dp=1, microbatches=2)
    (run_dir / "traces" / "rank2.json.gz").unlink()
    run = load_run(run_dir, use_cache=False)
    assert run.ranks == (0, 1, 3)
    text = " | ".join(run.warnings)
    assert "1 of 4 ranks have no usable trace (ranks [2])" in text
    assert "no matching" in text  # the p2p partners of rank 2 are reported, not dropped
    assert len(run.pairs) > 0


def test_two_files_claiming_one_rank(tmp_path):
    write_run(tmp_path / "run", [_trace(0, layout=Layout(dp=2)), _trace(1, layout=Layout(dp=2))])
    shutil.copy(tmp_path / "run" / "traces" / "rank1.json.gz", tmp_path / "run" / "traces" / "rank1-copy.json.gz")
    with pytest.raises(TraceError) as info:
        load_run(tmp_path / "run")
    _one_line(info.value, "both claim rank 1")


def test_two_runs_mixed_by_layout(tmp_path):
    write_run(tmp_path / "run", [_trace(0, layout=Layout(dp=2)), _trace(1, layout=Layout(pp=2))])
    with pytest.raises(TraceError) as info:
        load_run(tmp_path / "run")
    _one_line(info.value, "different runs")


def test_two_runs_mixed_by_time(tmp_path):
    later = 3 * 3600 * 10**9  # the second "run" happened three hours later
    write_run(tmp_path / "run", [_trace(0, layout=Layout(dp=2)), _trace(1, layout=Layout(dp=2), skew_ns=later)])
    with pytest.raises(TraceError) as info:
        load_run(tmp_path / "run", use_cache=False)
    _one_line(info.value, "different runs", "rank1.json.gz")


def test_steps_that_differ_between_ranks(tmp_path):
    a, b = _trace(0, layout=Layout(dp=2)), _trace(1, layout=Layout(dp=2))
    b.step(2, 600, 100)
    write_run(tmp_path / "run", [a, b])
    run = load_run(tmp_path / "run", use_cache=False)
    assert run.steps == (1,)
    assert any("different steps" in w for w in run.warnings)


def test_traces_without_distributed_info(tmp_path):
    t = _trace(0, distributed=False, pptrace_block=False)
    t.write(tmp_path / "one" / "trace.json")
    run = load_run(tmp_path / "one" / "trace.json", use_cache=False)
    assert run.ranks == (0,) and any("assuming rank 0" in w for w in run.warnings)
    # rank from the file name when the trace has none
    _trace(3, distributed=False, pptrace_block=False).write(tmp_path / "named" / "rank3.json")
    _trace(5, distributed=False, pptrace_block=False).write(tmp_path / "named" / "rank5.json")
    assert load_run(tmp_path / "named", use_cache=False).ranks == (3, 5)
    # several files and no way to tell their ranks
    _trace(0, distributed=False, pptrace_block=False).write(tmp_path / "anon" / "a.json")
    _trace(0, distributed=False, pptrace_block=False).write(tmp_path / "anon" / "b.json")
    with pytest.raises(TraceError) as info:
        load_run(tmp_path / "anon")
    _one_line(info.value, "cannot tell which rank")


def test_directory_without_traces(tmp_path):
    (tmp_path / "empty" / "traces").mkdir(parents=True)
    with pytest.raises(TraceError) as info:
        find_trace_files(tmp_path / "empty")
    _one_line(info.value, "no trace files")
    with pytest.raises(TraceError) as info:
        load_run(tmp_path / "does-not-exist")
    _one_line(info.value, "no such file")


def test_unreadable_files(tmp_path):
    write_run(tmp_path / "run", [_trace(0, layout=Layout(dp=2)), _trace(1, layout=Layout(dp=2))])
    traces = tmp_path / "run" / "traces"
    # A name that cannot be opened as a file: a dangling link (root can read any mode bits).
    os.symlink(traces / "gone.json.gz", traces / "rank7.json.gz")
    run = load_run(tmp_path / "run", use_cache=False)
    assert run.ranks == (0, 1) and any("cannot read" in w and "rank7" in w for w in run.warnings)
    with pytest.raises(TraceError) as info:
        load_rank(traces / "rank7.json.gz")
    _one_line(info.value, "cannot read", "rank7")
    path = traces / "rank1.json.gz"
    os.chmod(path, 0)
    try:
        readable = os.access(path, os.R_OK)
        if readable:
            pytest.skip("running as root: mode 000 files stay readable")
        run = load_run(tmp_path / "run", use_cache=False)
        assert run.ranks == (0,)
    finally:
        os.chmod(path, 0o644)


def test_a_run_of_only_bad_files_is_an_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rank0.json").write_bytes(b"")
    (tmp_path / "run" / "rank1.json").write_bytes(b"{}")
    with pytest.raises(TraceError) as info:
        load_run(tmp_path / "run")
    _one_line(info.value, "no readable trace")
