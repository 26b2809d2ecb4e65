"""The streamed parse (document.StreamedTrace): the same table, header and warnings as the
whole-buffer path, without ever holding the document; what it cannot read goes to that path."""
from __future__ import annotations

import gzip
import tracemalloc

import orjson
import pandas as pd
import pytest

from pptrace.ingest import document, files, load, store
from pptrace.ingest.document import StreamedTrace, Unstreamable
from pptrace.ingest.load import load_rank
from tracegen import RankTrace, pipeline_run

FIXTURES = ["nccl_allreduce_world2_rank0.json.gz", "no_distributed_info.json.gz",
            "sendrecv_world128_rank0.json.gz", "gloo_cpu_only_world300_rank34.json.gz"]


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces, slices and inflate output far smaller than a trace: every boundary is crossed
    (a separator split between two pieces, a slice over several)."""
    monkeypatch.setattr(files, "_IN_PIECE", 1000)
    monkeypatch.setattr(store, "_PROBE_BYTES", 700)  # within a piece, as 64 KB is within 1 MB
    monkeypatch.setattr(files, "_OUT_PIECE", 3001)
    monkeypatch.setattr(document, "_CHUNK_BYTES", 2000)


def _same(path, rank=None):
    """The streamed parse (no fallback: it would raise here) equals the whole-buffer one."""
    streamed = load._parse_streamed(path, rank, True, True)
    whole = load._parse_whole(path, rank, True, True)
    pd.testing.assert_frame_equal(streamed[1], whole[1])
    assert streamed[0] == whole[0]  # header
    assert streamed[2] == whole[2]  # info
    assert streamed[3] == whole[3]  # warnings, in the same order
    (opened, probe, *placed), (opened_whole, probe_whole, *placed_whole) = streamed[4], whole[4]
    assert store.key_of(opened, probe) == store.key_of(opened_whole, probe_whole)  # (not the atime: a read sets it)
    assert placed == placed_whole  # base, what is wrong with it, rank
    return streamed


@pytest.mark.parametrize("name", FIXTURES)
def test_streamed_equals_whole_on_gpu_fixtures(hta_fixtures, name, small_pieces):
    _, frame, *_ = _same(hta_fixtures / name)
    assert len(frame) > 0


@pytest.mark.parametrize("gz", [True, False])
def test_streamed_equals_whole_on_a_tracegen_run(tmp_path, gz, small_pieces):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=4, cpu_ops_per_mb=20, gz=gz)
    for path in sorted((run_dir / "traces").iterdir()):
        header, frame, info, warnings, (opened, probe, base, bad, rank) = _same(path)
        assert probe == store.probe_of(path.read_bytes())  # the probe of the whole file, read in pieces
        assert base == header["baseTimeNanoseconds"] and frame["start_ns"].min() > base
        assert rank == int(path.name[4])


def _kineto_after(t: RankTrace) -> bytes:
    """Kineto's order: baseTimeNanoseconds (and traceName) after traceEvents."""
    doc = t.to_dict()
    base = doc.pop("baseTimeNanoseconds")
    events = doc.pop("traceEvents")
    return orjson.dumps({**doc, "traceEvents": events, "baseTimeNanoseconds": base, "traceName": "x"})


def test_the_base_and_rank_written_after_the_events_are_applied_at_the_end(tmp_path, small_pieces):
    t = RankTrace(rank=3, world_size=4, pptrace_block=False)
    t.step(1, 0, 5000)
    for i in range(300):
        t.add(f"op{i}", 10 * i, 5, cat="cpu_op", tid=7)
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(_kineto_after(t)))
    _, frame, _, _, (_, _, base, _, rank) = _same(path)
    assert (base, rank) == (t.base_ns, 3)
    assert set(frame["rank"]) == {3}
    assert frame["start_ns"].min() == t.raw_ns(0)


def test_a_bad_base_warns_before_the_slices_warnings_as_the_whole_path(tmp_path, small_pieces):
    t = RankTrace(rank=0)
    t.step(1, 0, 5000)
    for i in range(300):
        t.add(f"op{i}", 10 * i, 5, cat="cpu_op", tid=7)
    doc = orjson.loads(_kineto_after(t))
    doc["baseTimeNanoseconds"] = "soon"
    data = orjson.dumps(doc).replace(b'"op10"', b'"op\xff10"')  # invalid UTF-8: that slice's warning
    path = tmp_path / "rank0.json"
    path.write_bytes(data)
    warnings = _same(path)[3]
    assert "not a number" in warnings[0] and "invalid UTF-8" in warnings[1]


def test_the_stream_never_holds_the_document(tmp_path):
    t = RankTrace(rank=0)
    t.step(1, 0, 10**6)
    dims = [[1024, 1024]] * 24  # args the table does not read: JSON, not columns
    for i in range(40_000):
        t.add(f"aten::op{i % 50}", 10 * i, 5, cat="cpu_op", tid=7, args={"Input Dims": dims})
    path = t.write(tmp_path / "rank0.json")
    size = path.stat().st_size
    assert size > 24 << 20

    def peak(parse):
        tracemalloc.start()
        try:
            parse(path, None, True, True)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert peak(load._parse_whole) > size  # the document, then its slices' columns
    assert peak(load._parse_streamed) < 0.5 * size


def _fallback_gives_the_whole_path(path, reason: str):
    with StreamedTrace(path) as stream, pytest.raises((Unstreamable, orjson.JSONDecodeError), match=reason):
        for _ in stream:
            pass
    frame, meta, key = load_rank(path, with_key=True)
    whole = load._parse_whole(path, None, True, True)
    pd.testing.assert_frame_equal(frame, whole[1])
    assert meta["warnings"] == whole[3]
    return frame, meta


def _trace(n: int = 400) -> RankTrace:
    t = RankTrace(rank=0)
    t.step(1, 0, 10_000)
    for i in range(n):
        t.add(f"op{i}", 10 * i, 5, cat="cpu_op", tid=7)
    return t


def test_a_truncated_gzip_is_salvaged_by_the_whole_path(tmp_path, small_pieces):
    data = gzip.compress(_trace().dumps())
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    _, meta = _fallback_gives_the_whole_path(path, "end-of-stream")
    assert any(document.TRUNCATED in w for w in meta["warnings"])


def test_a_byte_order_mark_goes_to_the_whole_path(tmp_path, small_pieces):
    path = tmp_path / "rank0.json"
    path.write_bytes(b"\xef\xbb\xbf" + _trace().dumps())
    frame, _ = _fallback_gives_the_whole_path(path, "byte order mark")
    assert len(frame) == 401


def test_a_cut_inside_an_event_goes_to_the_whole_path(tmp_path, small_pieces):
    t = _trace(0)
    for i in range(200):
        t.add(f"odd}}, {{name {i}", i, 1, cat="cpu_op")
    path = t.write(tmp_path / "rank0.json", compact=True)
    frame, meta = _fallback_gives_the_whole_path(path, None)
    assert len(frame) == 201 and not meta["warnings"]


def test_separators_in_the_metadata_after_the_events_go_to_the_whole_path(tmp_path, small_pieces):
    """The stream cuts before it knows where the events end: a cut in a list of objects after
    them makes a slice that is no JSON, and the whole path reads the trace as before."""
    doc = orjson.loads(_kineto_after(_trace()))
    doc["deviceProperties"] = [{"id": i, "name": "x" * 50} for i in range(200)]  # after the events
    doc = {k: doc[k] for k in [k for k in doc if k != "deviceProperties"] + ["deviceProperties"]}
    path = tmp_path / "rank0.json"
    path.write_bytes(orjson.dumps(doc))
    frame, _ = _fallback_gives_the_whole_path(path, None)
    assert len(frame) == 401


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 1999, 2000, 2001, 2500, 7000])
def test_raw_pieces_give_the_probe_of_the_whole_file(tmp_path, monkeypatch, size):
    monkeypatch.setattr(files, "_IN_PIECE", 1000)
    monkeypatch.setattr(store, "_PROBE_BYTES", 700)  # the probe reads less than a piece of each end
    data = bytes(range(256)) * (size // 256 + 1)
    path = tmp_path / "f"
    path.write_bytes(data[:size])
    fh, st = files.open_trace(path)
    with fh:
        raw = files.RawPieces(fh, st.st_size + 1)
        assert b"".join(raw) == data[:size]
    assert store.probe_of(raw.ends()) == store.probe_of(data[:size])
