"""Loader: real GPU fixtures, synthetic traces with known timestamps, cache, parallel load."""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import orjson

from pptrace.ingest import document, files, frame, header, load, store as cache
from pptrace.ingest.columnar import StoredTable, frame_from_tables, from_arrow, to_arrow
from pptrace.ingest.schema import CATEGORIES, COLUMNS, INT32_COLUMNS, NULLABLE_INT_COLUMNS, RawEvent, classify, nullable_int
from pptrace.ingest.header import read_header
from pptrace.ingest.files import find_trace_files
from pptrace.ingest.load import load_rank
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, pipeline_run, write_run

FIXTURE_FILES = [
    "gloo_cpu_only_world300_rank34.json.gz", "nccl_allreduce_world2_rank0.json.gz",
    "no_distributed_info.json.gz", "sendrecv_allreduce_world8_rank3.json.gz",
    "sendrecv_world128_rank0.json.gz", "sendrecv_world128_rank1.json.gz",
    "single_gpu_world1_rank0.json.gz",
]


def _x_events(path):
    import orjson

    doc = orjson.loads(gzip.decompress(path.read_bytes()))
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("pid"), int)
            and isinstance(e.get("tid"), int)]


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_every_hta_fixture_loads(hta_fixtures, name):
    path = hta_fixtures / name
    frame, meta = load_rank(path)
    assert list(frame.columns) == list(COLUMNS)
    # nested plain CPU ops are folded (compact.py), counted
    assert len(frame) + meta["folded"] == len(_x_events(path)) == meta["n_events"]
    assert meta["folded"] < meta["n_events"]
    assert set(frame["category"].astype(str)) <= set(CATEGORIES)
    assert (frame["dur_ns"] >= 0).all() and (frame["end_ns"] - frame["start_ns"] == frame["dur_ns"]).all()
    expected_rank = re.search(r"rank(\d+)", name)
    assert meta["rank"] == (int(expected_rank.group(1)) if expected_rank else 0)
    assert meta["profiler_steps"], "every fixture has ProfilerStep ranges"
    assert (frame["step"] >= 0).any()


def test_nanosecond_fractions_survive_epoch_microseconds(hta_fixtures):
    """single_gpu writes ts as epoch µs with 3 decimals: floats cannot hold that exactly."""
    path = hta_fixtures / "single_gpu_world1_rank0.json.gz"
    text = gzip.decompress(path.read_bytes())
    stamps = re.findall(rb'"ts": (\d+)\.(\d{3}), "dur"', text)[:500]
    want = sorted(int(a) * 1000 + int(b) for a, b in stamps)
    frame, meta = load_rank(path, compact=False)  # every event, nested ops too
    assert not meta["warnings"]
    got = set(frame["start_ns"].tolist())
    assert all(w in got for w in want)
    assert any(w % 1000 for w in want)  # the fractions are really there


def test_gpu_fields_from_nccl_fixture(hta_fixtures):
    frame, _ = load_rank(hta_fixtures / "nccl_allreduce_world2_rank0.json.gz")
    kernels = frame[frame["cat"] == "kernel"]
    nccl = kernels[kernels["is_nccl"]]
    assert len(nccl) > 0 and (nccl["category"] == "kernel_comm").all()
    assert (kernels.loc[~kernels["is_nccl"], "category"] == "kernel_compute").all()
    assert set(nccl["lane"].astype(str)) <= {f"stream {s}" for s in kernels["stream"].dropna().unique()}
    assert (frame.loc[frame["lane_kind"] == "gpu", "stream"].notna()).all()
    rpc = frame[frame["name"] == "record_param_comms"]
    assert len(rpc) > 0 and "[0, 1]" in set(rpc["group_ranks"].astype(str))
    assert set(nccl["collective"].astype(str)) <= {"allreduce", "broadcast"}
    assert (nccl["in_nelems"] > 0).all()
    # GPU work takes the step of the call that launched it, not of the wall time it ran at.
    launched = frame[(frame["cat"] == "cuda_runtime") & frame["correlation"].notna()]
    step_of = dict(zip(launched["correlation"], launched["step"]))
    sample = kernels[kernels["correlation"].isin(step_of)].head(200)
    assert len(sample) and all(step_of[c] == s for c, s in zip(sample["correlation"], sample["step"]))
    assert frame["gpu_annotation"].any()


def test_synthetic_times_are_exact(tmp_path):
    t = RankTrace(rank=1, layout=Layout(pp=2), skew_ns=1_234_567)
    t.step(3, 0, 10_000)
    t.region("pp:send_fwd", 100.001, 20.5, peer=0, mb=2, chunk=1, bytes=64)
    t.region("compute:fwd", 200, 1000, mb=2)
    t.region("cp:send_kv", 1300, 5, peer=0, step=2, layer=1)
    t.region("dp:wait op=all_reduce", 1400, 5, bucket=3)
    t.add("aten::mm", 250, 10, cat="cpu_op")
    t.add("outside", 20_000, 1, cat="cpu_op")
    path = t.write(tmp_path / "rank1.json.gz")
    frame, meta = load_rank(path)
    row = frame[frame["op"] == "send_fwd"].iloc[0]
    assert row["start_ns"] == t.raw_ns(100.001) and row["dur_ns"] == 20_500
    assert (row["kind"], row["peer"], row["mb"], row["chunk"], row["bytes"]) == ("pp", 0, 2, 1, 64)
    assert row["category"] == "p2p" and row["lane"] == "main" and row["step"] == 3
    kv = frame[frame["op"] == "send_kv"].iloc[0]
    assert (kv["ring_step"], kv["layer"], kv["category"]) == (2, 1, "comm:cp")
    wait = frame[frame["op"] == "wait"].iloc[0]
    assert wait["category"] == "wait" and wait["bucket"] == 3 and wait["tags"] == '{"op":"all_reduce"}'
    assert frame.loc[frame["name"] == "outside", "step"].iloc[0] == -1
    assert frame.loc[frame["name"] == "aten::mm", "category"].iloc[0] == "other"
    assert meta["rank"] == 1 and meta["pptrace"]["layout"]["pp"] == 2 and meta["profiler_steps"] == [3]


def test_threads_become_lanes(tmp_path):
    t = RankTrace(rank=0)
    t.thread(77, "pt_gloo_runloop")
    t.step(1, 0, 100)
    t.add("gloo:all_reduce", 10, 5, tid=77)
    frame, _ = load_rank(t.write(tmp_path / "rank0.json"))
    assert frame.loc[frame["name"] == "gloo:all_reduce", "lane"].iloc[0] == "thread:77 pt_gloo_runloop"
    assert set(frame["lane_kind"].astype(str)) == {"host"}


@pytest.mark.parametrize("category,name,cat", [
    ("compute", "compute:fwd mb=1", "user_annotation"), ("comm:tp", "tp:all_reduce layer=1", "user_annotation"),
    ("comm:dp", "dp:all_reduce bucket=0", "user_annotation"), ("comm:ep", "ep:all_to_all", "user_annotation"),
    ("comm:cp", "cp:all_to_all layer=0", "user_annotation"), ("p2p", "pp:recv_bwd peer=1 mb=0", "user_annotation"),
    ("wait", "cp:wait op=send_recv_kv", "user_annotation"), ("step", "ProfilerStep#7", "user_annotation"),
    ("kernel_comm", "ncclDevKernel_SendRecv(ncclDevComm*)", "kernel"), ("kernel_compute", "sgemm_128x64", "kernel"),
    ("memcpy", "Memcpy HtoD", "gpu_memcpy"), ("memcpy", "Memset", "gpu_memset"),
    ("runtime", "cudaLaunchKernel", "cuda_runtime"), ("other", "aten::mm", "cpu_op"),
    ("other", "gloo:all_reduce", "user_annotation"), ("p2p", "pp:send_fwd peer=1 mb=0", "gpu_user_annotation"),
])
def test_categories(category, name, cat):
    assert classify(name, cat)["category"] == category


def test_chunked_parse_equals_whole_document(tmp_path, monkeypatch):
    pipeline_run(tmp_path / "a", pp=2, microbatches=3, cpu_ops_per_mb=5, gz=False)
    path = tmp_path / "a" / "traces" / "rank1.json"
    whole, _ = load_rank(path)
    monkeypatch.setattr(document, "_CHUNK_BYTES", 2000)  # forces dozens of slices
    data = path.read_bytes()
    _, start, end = document._locate_events(data)
    chunks = list(document._parse_slices(data, start, end, path, []))
    assert len(chunks) > 10 and all(blob is not None for _, blob in chunks)
    sliced, _ = load_rank(path)
    pd.testing.assert_frame_equal(whole, sliced)
    # the compact layout (one line, no Kineto indentation) gives the same table
    t = RankTrace(rank=0)
    t.step(1, 0, 50)
    t.region("compute:fwd", 1, 2, mb=0)
    a, _ = load_rank(t.write(tmp_path / "k.json"))
    b, _ = load_rank(t.write(tmp_path / "c.json", compact=True))
    pd.testing.assert_frame_equal(a, b)


def test_find_trace_files_and_headers(tmp_path):
    t = RankTrace(rank=2, layout=Layout(dp=4))
    t.step(1, 0, 10)
    t.write(tmp_path / "flat" / "job.pt.trace.json.gz")
    (tmp_path / "flat" / "notes.txt").write_text("x")
    files = find_trace_files(tmp_path / "flat")
    assert [f.name for f in files] == ["job.pt.trace.json.gz"]
    header = read_header(files[0])
    assert header["pptrace"]["rank"] == 2 and header["distributedInfo"]["world_size"] == 4
    assert "traceEvents" not in header or header["traceEvents"] == []
    write_run(tmp_path / "nested", [t])
    assert find_trace_files(tmp_path / "nested")[0].parent.name == "traces"


def test_arrow_round_trip_keeps_values(hta_fixtures):
    frame, _ = load_rank(hta_fixtures / "nccl_allreduce_world2_rank0.json.gz")
    back = from_arrow(to_arrow(frame))
    for column in COLUMNS:
        assert back[column].astype(object).equals(frame[column].astype(object)), column
    # many ranks assembled column by column equal the plain concatenation
    other, _ = load_rank(hta_fixtures / "sendrecv_world128_rank1.json.gz")
    tables = [to_arrow(frame), to_arrow(other)]
    joined = frame_from_tables(tables)
    assert tables == []
    expected = pd.concat([frame, other], ignore_index=True)
    for column in COLUMNS:
        assert joined[column].astype(object).equals(expected[column].astype(object)), column
    assert joined["name"].dtype == "category"
    # the documented dtypes, the same whether a rank was parsed or assembled
    for column in NULLABLE_INT_COLUMNS:
        want = "Int32" if column in INT32_COLUMNS else "Int64"
        assert str(joined[column].dtype) == str(frame[column].dtype) == str(back[column].dtype) == want, column


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mtime_ns


def test_cache_skips_parsing_and_never_touches_traces(tmp_path, monkeypatch):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2)
    files = find_trace_files(run_dir)
    before = [_digest(f) for f in files]
    first = load_run(run_dir)
    assert all(cache.cache_path(f).parent.name == ".pptrace-cache" and cache.cache_path(f).exists() for f in files)

    def boom(*a, **k):
        raise AssertionError("parsed although cached")

    monkeypatch.setattr(load, "load_rank", boom)
    second = load_run(run_dir)
    pd.testing.assert_frame_equal(first.events, second.events)
    assert [_digest(f) for f in files] == before
    # A rewritten trace (new size/mtime) invalidates its entry.
    monkeypatch.undo()
    t = RankTrace(rank=1, layout=Layout(pp=2, dp=2))
    t.step(1, 0, 10)
    t.write(files[1])
    os.utime(files[1], ns=(before[1][1] + 10**9, before[1][1] + 10**9))
    third = load_run(run_dir)
    assert (third.events["rank"] == 1).sum() == 1


def test_a_block_after_the_events_still_gives_the_layout(tmp_path):
    """Ranks are read from the heads (distributedInfo); a rewritten trace whose pptrace block
    follows the events still has its layout (pp=2, which the headers alone would miss):
    the run is the same as with the block before the events."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2)
    moved = tmp_path / "moved" / "traces"
    moved.mkdir(parents=True)
    for f in find_trace_files(run_dir):
        doc = orjson.loads(gzip.decompress(f.read_bytes()))
        block = doc.pop("pptrace")
        (moved / f.name).write_bytes(gzip.compress(orjson.dumps({**doc, "pptrace": block})))
        assert read_header(moved / f.name, enough=("pptrace", "distributedInfo"))["pptrace"] is None
    first, second = load_run(run_dir, use_cache=False), load_run(moved.parent, use_cache=False)
    assert second.layout == first.layout and second.layout.pp == 2
    assert second.warnings == first.warnings
    pd.testing.assert_frame_equal(first.events, second.events)


def test_parallel_load_matches_serial(tmp_path, monkeypatch):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2)
    serial = load_run(run_dir, use_cache=False)
    monkeypatch.setattr(load, "_POOL_MIN_BYTES", 0)
    parallel = load_run(run_dir, use_cache=False, workers=2)
    pd.testing.assert_frame_equal(serial.events, parallel.events)
    assert not list((run_dir / "traces").glob(".pptrace-cache/*"))  # use_cache=False writes nothing
    assert np.array_equal(serial.offsets["offset_ns"], parallel.offsets["offset_ns"])


@pytest.mark.skipif(load._start_method() != "fork", reason="the child inherits this test's wrapper by fork")
def test_a_cold_load_parses_in_a_child_and_keeps_nothing_of_it(tmp_path, monkeypatch):
    """Above a few MB of traces the parse runs in a child process (its fragmented heap goes
    with it); the parent gets the same tables, from the cache the child wrote."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=1, microbatches=2)
    here = load_run(run_dir, use_cache=False)
    original = load.load_rank

    def recording(*args, **kwargs):
        frame, meta, key = original(*args, **kwargs)
        return frame, {**meta, "parsed_by": os.getpid()}, key

    monkeypatch.setattr(load, "load_rank", recording)
    monkeypatch.setattr(load, "_POOL_MIN_BYTES", 0)
    child = load_run(run_dir)
    parsed_by = {m["parsed_by"] for m in child.meta.values()}
    assert len(parsed_by) == 1 and os.getpid() not in parsed_by  # one child, not this process
    pd.testing.assert_frame_equal(here.events, child.events)
    assert len(list((run_dir / "traces").glob(".pptrace-cache/*"))) == 2
    monkeypatch.setattr(load, "_POOL_MIN_BYTES", 8 << 20)  # a small run stays in process
    shutil.rmtree(run_dir / "traces" / ".pptrace-cache")
    assert {m["parsed_by"] for m in load_run(run_dir).meta.values()} == {os.getpid()}


def test_cut_inside_a_string_falls_back_to_whole_parse(tmp_path, monkeypatch):
    """'}, {' inside a name is not an event boundary: the slice fails, the whole parse wins."""
    t = RankTrace(rank=0)
    t.step(1, 0, 1000)
    for i in range(200):
        t.add(f"odd}}, {{name {i}", i, 1, cat="cpu_op")
    path = t.write(tmp_path / "rank0.json", compact=True)
    monkeypatch.setattr(document, "_CHUNK_BYTES", 300)
    frame, meta = load_rank(path)
    assert len(frame) == 201 and not meta["warnings"]
    assert set(frame.loc[frame["cat"] == "cpu_op", "name"].astype(str)) == {f"odd}}, {{name {i}" for i in range(200)}


def test_cache_goes_elsewhere_when_the_trace_dir_is_read_only(tmp_path, monkeypatch):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=1)
    traces = run_dir / "traces"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    os.chmod(traces, 0o555)
    try:
        load_run(run_dir)
        assert not (traces / cache.CACHE_DIRNAME).exists()
        entries = list((tmp_path / "xdg" / "pptrace").rglob("*.arrow"))
        assert len(entries) == 2
        assert cache.read(traces / "rank0.json.gz") is not None
    finally:
        os.chmod(traces, 0o755)


# -------------------------------------------------------------------------------------------
# typed decoding (msgspec) against the straightforward reference (orjson -> dicts)
# -------------------------------------------------------------------------------------------
def _same_load(path):
    typed, typed_meta = load_rank(path)
    reference, reference_meta = load_rank(path, typed=False)
    pd.testing.assert_frame_equal(typed, reference)
    assert typed_meta == reference_meta
    return typed


def _slice_kinds(path):
    _, slices, _ = document.parse_document(path)
    return {type(events[0]) for events, _ in slices if events}


@pytest.mark.parametrize("name", FIXTURE_FILES)
def test_typed_decoding_equals_dict_reference_on_hta_fixtures(hta_fixtures, name):
    assert _slice_kinds(hta_fixtures / name) == {RawEvent}  # the fast path really ran
    _same_load(hta_fixtures / name)


@pytest.mark.parametrize("gz", [False, True])
def test_typed_decoding_equals_dict_reference_on_tracegen_runs(tmp_path, monkeypatch, gz):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=4, cpu_ops_per_mb=40, gz=gz)
    monkeypatch.setattr(document, "_CHUNK_BYTES", 20_000)  # many slices
    for path in find_trace_files(run_dir):
        assert _slice_kinds(path) == {RawEvent}
        frame = _same_load(path)
        assert len(frame) > 500 and frame["mb"].notna().any()


def test_slices_the_typed_decoder_rejects_are_parsed_as_dicts(tmp_path, monkeypatch):
    """An odd value (``args`` as a list, a thread name event without args, NaN) sends only
    its slice through orjson/json; the table equals the all-dicts reference."""
    t = RankTrace(rank=0)
    t.thread(77, "pt_gloo_runloop")
    t.step(1, 0, 10_000)
    for i in range(300):
        t.region("compute:fwd", 10 * i + 1, 5, mb=i, tid=77 if i % 7 == 0 else None)
    t.events[40]["args"] = [1, 2]
    t.events[41]["args"] = None
    t.events[42]["cat"] = 5
    t.events[43]["pid"] = "Spans"
    t.events[44]["name"] = None
    del t.events[45]["ts"]
    t.events[250]["dur"] = "NAN_HERE"
    data = t.dumps().replace(b'"NAN_HERE"', b"NaN")
    path = tmp_path / "rank0.json"
    path.write_bytes(data)
    monkeypatch.setattr(document, "_CHUNK_BYTES", 3000)
    assert _slice_kinds(path) == {RawEvent, dict}
    frame = _same_load(path)
    # the events without ts and with the NaN duration are dropped (issue 15), not clamped to 0
    assert len(frame) == 298 and frame["cat"].isna().sum() == 1 and (frame["name"] == "").sum() == 1
    assert (frame["dur_ns"] >= 0).all()


def test_nullable_ints_value_by_value():
    data, mask = frame._nullable_parts([1, None, 2**70, "7", 3.0, 1.5, True, -(2**63)])
    assert mask.tolist() == [False, True, True, True, False, True, True, False]
    assert data[~mask].tolist() == [1, 3, -(2**63)]
    assert frame._nullable_parts([None] * 3)[1].all()
    assert frame._nullable_parts((4, 5))[0].tolist() == [4, 5]


# -------------------------------------------------------------------------------------------
# compact per-rank tables, cache format, worker count
# -------------------------------------------------------------------------------------------
def test_stored_tables_assemble_like_a_concatenation(hta_fixtures, tmp_path):
    import pickle

    a, _ = load_rank(hta_fixtures / "nccl_allreduce_world2_rank0.json.gz")
    t = RankTrace(rank=1)
    t.step(1, 0, 1000)
    for i in range(300):  # more names than int8 category codes hold
        t.add(f"op{i}", i, 1, cat="cpu_op")
    b, _ = load_rank(t.write(tmp_path / "rank1.json"))
    packed = pickle.loads(pickle.dumps(StoredTable.pack(to_arrow(b))))  # worker -> parent
    assert packed.num_rows == len(b) and packed.path is None
    tables = [to_arrow(a), packed, StoredTable(0, ipc=StoredTable.pack(to_arrow(b.iloc[:0])).ipc)]
    joined = frame_from_tables(tables)
    assert tables == []
    expected = pd.concat([a, b], ignore_index=True)
    for column in COLUMNS:
        assert joined[column].astype(object).equals(expected[column].astype(object)), column
    assert joined["name"].cat.codes.dtype == np.int16 and joined["lane_kind"].cat.codes.dtype == np.int8
    assert str(joined["stream"].dtype) == "Int32" and str(joined["correlation"].dtype) == "Int64"


def test_values_an_int32_column_cannot_hold_are_null(tmp_path):
    t = RankTrace(0)
    t.step(1, 0, 1000)
    t.region("compute:fwd mb=3000000000 layer=7", 10, 5)  # an mb past int32
    t.add("kernel", 20, 5, cat="kernel", args={"stream": 2**40, "correlation": 2**40})
    frame, _ = load_rank(t.write(tmp_path / "rank0.json"))
    fwd = frame[frame["category"] == "compute"].iloc[0]
    assert fwd["mb"] is pd.NA and fwd["layer"] == 7
    kernel = frame[frame["name"] == "kernel"].iloc[0]
    assert kernel["stream"] is pd.NA and kernel["correlation"] == 2**40  # Int64 holds it
    assert nullable_int("mb", np.array([1, 2**31, -(2**31)]), np.zeros(3, bool)).tolist() == [1, pd.NA, -(2**31)]


def test_cache_entries_are_arrow_files_that_replace_old_parquet_ones(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=1)
    files = find_trace_files(run_dir)
    entry = cache.cache_path(files[0])
    assert entry.suffix == ".arrow"
    entry.parent.mkdir()
    stale = entry.with_name(entry.name.replace(".arrow", ".parquet"))
    stale.write_bytes(b"an entry from an earlier pptrace")
    first = load_run(run_dir)
    assert entry.exists() and not stale.exists()
    found = cache.lookup(files[0])
    assert found is not None and found[0].path == entry and found[0].num_rows == found[1]["n_events"]
    table, meta = cache.read(files[0])
    assert table.num_rows == (first.events["rank"] == 0).sum() and meta["rank"] == 0
    entry.write_bytes(b"garbage")  # a broken entry is a miss, never an error
    assert cache.lookup(files[0]) is None
    pd.testing.assert_frame_equal(first.events, load_run(run_dir).events)


def test_worker_count_keeps_the_parse_below_the_analysis(monkeypatch):
    monkeypatch.setattr(load, "_cpus", lambda: 8)
    mb = 1 << 20
    monkeypatch.setattr(load, "_start_method", lambda: "fork")
    assert load._worker_count(None, [1 * mb] * 4) == 0  # too little to pay for a pool: in-process
    # bench_analyze's trainer run: two workers, as many as its analysis' memory covers
    assert load._worker_plan(None, [65 * mb] * 8) == (2, "2 workers: 8 CPUs, memory allows 2")
    monkeypatch.setattr(load, "_cpus", lambda: 2)
    assert load._worker_plan(None, [65 * mb] * 8) == (2, "2 workers: 2 CPUs, memory allows 2")
    monkeypatch.setattr(load, "_cpus", lambda: 1)
    assert load._worker_plan(None, [65 * mb] * 8) == (1, "1 worker: 1 CPU, memory allows 2")
    monkeypatch.setattr(load, "_cpus", lambda: 8)
    assert load._worker_count(None, [400 * mb] + [20 * mb] * 7) == 1  # one big trace: one worker
    # 64 x 10 MB: as many workers as the analysis' memory covers, not one more
    sizes = [10 * mb] * 64
    n, total = load._worker_count(None, sizes), sum(sizes)
    per_worker = load._WORKER_BYTES_PER_TRACE_BYTE * max(sizes)
    analysis = load._ANALYSIS_BYTES_PER_TRACE_BYTE * total
    assert n == 8 and n * per_worker <= analysis  # CPU-bound here
    monkeypatch.setattr(load, "_cpus", lambda: 64)
    n = load._worker_count(None, sizes)
    assert n * per_worker <= analysis < (n + 1) * per_worker
    assert load._worker_plan(3, [47 * mb] * 8) == (3, "3 workers: as asked")
    assert load._worker_count(3, [47 * mb] * 2) == 2
    monkeypatch.setattr(load, "_start_method", lambda: "spawn")  # macOS, Windows, Linux from 3.14
    assert load._worker_count(None, [400 * mb] + [20 * mb] * 7) == 0  # one spawned child is not worth it
    assert load._worker_count(None, sizes) == n  # several are


def test_cpus_are_those_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert load._cpus() == 3  # a container's or taskset's share, not the machine's


def test_the_progress_line_says_how_many_workers_and_why(tmp_path, monkeypatch, capsys):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2)
    monkeypatch.setattr(load, "_POOL_MIN_BYTES", 0)
    monkeypatch.setattr(load, "_cpus", lambda: 2)
    monkeypatch.setattr(load, "_start_method", lambda: "fork")
    jobs = [(path, None) for path in find_trace_files(run_dir)]
    monkeypatch.setattr(load, "_ANALYSIS_BYTES_PER_TRACE_BYTE", 4 * load._WORKER_BYTES_PER_TRACE_BYTE)
    load.load_ranks(jobs, use_cache=False, progress=True)
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"pptrace: loading traces 4/4 \(2 workers: 2 CPUs, memory allows \d+\) \(\d+\.\d\d s\)", line), line
    monkeypatch.setattr(load, "_ANALYSIS_BYTES_PER_TRACE_BYTE", 0.0)
    load.load_ranks(jobs, use_cache=False, progress=True)
    assert "(1 worker: 2 CPUs, memory allows 1)" in capsys.readouterr().err


def test_trace_size_is_the_decompressed_size(tmp_path):
    doc = b'{"traceEvents": []}' + b" " * 100_000
    (tmp_path / "a.json").write_bytes(doc)
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(doc))
    assert files.trace_size(tmp_path / "a.json") == len(doc)
    assert files.trace_size(tmp_path / "a.json.gz") == len(doc)
    assert files.trace_size(tmp_path / "missing.json") == 0


def test_gunzip_takes_gzips_way_for_several_members(tmp_path):
    """The trailer describes the last member only: a concatenation still loads whole."""
    one, two = b'{"traceEvents": [', b"]}"
    assert document._gunzip(gzip.compress(one) + gzip.compress(two)) == one + two
    assert document._gunzip(gzip.compress(one + two)) == one + two


def test_a_stored_table_that_went_bad_is_one_clear_error(tmp_path):
    from pptrace.errors import TraceError

    with pytest.raises(TraceError) as info:
        frame_from_tables([StoredTable(5, ipc=b"not arrow at all")])
    assert "\n" not in str(info.value) and "delete the cache entry" in str(info.value)
    t = RankTrace(rank=0)
    t.step(1, 0, 10)
    frame, _ = load_rank(t.write(tmp_path / "rank0.json"))
    wrong = StoredTable(len(frame) + 3, ipc=StoredTable.pack(to_arrow(frame)).ipc)
    with pytest.raises(TraceError, match="rows where"):
        frame_from_tables([wrong])


def test_rank_assignment_reads_only_the_head_when_it_has_everything(tmp_path):
    """Kineto writes every add_metadata_json key (distributedInfo, the pptrace block) before
    the events: finding ranks and layout then never inflates the .gz to its end (where it
    puts baseTimeNanoseconds). A head with none of them is read to the end; one whose block
    was moved after the events (a rewritten file) gives what the head has."""
    events = ",".join(f'{{"ph": "X", "name": "op", "pid": 1, "tid": 1, "ts": {i}, "dur": 1}}' for i in range(50_000))
    block = '{"rank": 3, "world_size": 4, "layout": {"pp": 4}}'
    dist = '{"rank": 3, "world_size": 4}'
    before = f'{{"pptrace": {block}, "distributedInfo": {dist}, "traceEvents": [{events}], "baseTimeNanoseconds": 7}}'
    after = f'{{"distributedInfo": {dist}, "traceEvents": [{events}], "pptrace": {block}, "baseTimeNanoseconds": 7}}'
    plain = f'{{"schemaVersion": 1, "traceEvents": [{events}], "distributedInfo": {dist}, "baseTimeNanoseconds": 7}}'
    for name, doc in (("before", before), ("after", after), ("plain", plain)):
        path = tmp_path / f"{name}.json.gz"
        path.write_bytes(gzip.compress(doc.encode()))
        assert len(doc) > 2 * header._HEADER_PEEK  # the tail is a separate read
        full = read_header(path)
        assert full["distributedInfo"]["rank"] == 3 and full["baseTimeNanoseconds"] == 7
        enough = read_header(path, enough=("pptrace", "distributedInfo"))
        assert enough["distributedInfo"] == full["distributedInfo"]
        assert enough["pptrace"] == (full["pptrace"] if name == "before" else None)
        assert ("baseTimeNanoseconds" in enough) == (name == "plain")  # the tail was read only when needed
    # a head that is all there is to read: the tail's damage is the load's business
    cut = gzip.compress(before.encode())
    (tmp_path / "cut.json.gz").write_bytes(cut[: len(cut) // 2])
    assert read_header(tmp_path / "cut.json.gz", enough=("pptrace", "distributedInfo"))["pptrace"]["rank"] == 3
