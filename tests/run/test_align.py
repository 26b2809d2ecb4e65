"""Clock alignment: recover skews we put in ourselves (synthetic and real gloo traces)."""
from __future__ import annotations

import gzip

import orjson
import pytest

from pptrace.ingest.load import load_rank
from pptrace.run.align import apply_offsets, estimate_offsets
from pptrace.run.build import load_run
from tracegen import pipeline_run


def test_synthetic_skews_recovered_within_their_bounds(tmp_path):
    skew = {3: 5_000_000, 6: -3_000_000, 7: 250_000}
    run_dir, truth = pipeline_run(tmp_path / "run", pp=4, dp=2, microbatches=4, skew_ns=skew, latency_us=50)
    run = load_run(run_dir, use_cache=False)
    off = run.offsets.set_index("rank")
    for rank in range(8):
        error = abs(int(off.at[rank, "offset_ns"]) - skew.get(rank, 0))
        assert error <= off.at[rank, "uncertainty_ns"], (rank, error)
        assert error < 100_000  # latency is 50 µs: the bound is of that order
    # aligned times are true times (+ the common origin), raw times keep each rank's clock
    ev = run.events
    assert (run.raw_ns()["raw_start_ns"] - ev["start_ns"]).groupby(ev["rank"]).first().to_dict() == {
        r: int(off.at[r, "offset_ns"]) for r in range(8)}
    # after alignment no recv ends before its send started
    assert (run.pairs["recv_end_ns"] >= run.pairs["send_start_ns"]).all()


def test_rank_without_evidence_keeps_its_clock(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=1, microbatches=2)
    run = load_run(run_dir, use_cache=False)
    table, warnings = estimate_offsets([0, 1, 5], run.collectives, run.pairs, run.events)
    row = table.set_index("rank").loc[5]
    assert row["offset_ns"] == 0 and row["method"] == "epoch"
    assert any("[5]" in w for w in warnings)


def _shift_copy(src_dir, dst_dir, shifts_ns: dict):
    """Copy a run, moving the clocks of some ranks as a skewed host clock would: Kineto's
    baseTimeNanoseconds and the pptrace wall-clock samples move, nothing else."""
    (dst_dir / "traces").mkdir(parents=True)
    for path in sorted((src_dir / "traces").glob("rank*.json.gz")):
        doc = orjson.loads(gzip.decompress(path.read_bytes()))
        rank = doc["pptrace"]["rank"]
        shift = shifts_ns.get(rank, 0)
        doc["baseTimeNanoseconds"] += shift
        for sample in doc["pptrace"]["clock"].values():
            sample["wall_ns"] += shift
        (dst_dir / "traces" / path.name).write_bytes(gzip.compress(orjson.dumps(doc)))
    return dst_dir


@pytest.mark.slow
def test_real_gloo_skew_recovered(gloo_run, tmp_path):
    """Ranks of the gloo run share one host clock (true offsets 0); shifting rank 2 (stage 1)
    by +5 ms and rank 3 (stage 1, other pipeline) by -3 ms must be recovered to 0.5 ms."""
    shifts = {2: 5_000_000, 3: -3_000_000}
    skewed = load_run(_shift_copy(gloo_run, tmp_path / "skewed", shifts), use_cache=False)
    off = skewed.offsets.set_index("rank")
    for rank, shift in shifts.items():
        error = abs(int(off.at[rank, "offset_ns"]) - shift)
        assert error < 500_000, (rank, error, skewed.offsets)
    for rank in range(4):  # the reported bound holds for every rank
        error = abs(int(off.at[rank, "offset_ns"]) - shifts.get(rank, 0))
        assert error <= off.at[rank, "uncertainty_ns"] + 1, (rank, error, skewed.offsets)
    # the shift moved raw clocks, and alignment undid it: aligned events agree with the
    # unshifted run's aligned events to within the estimation error
    plain = load_run(gloo_run, use_cache=False)
    a = plain.events.groupby("rank")["start_ns"].min()
    b = skewed.events.groupby("rank")["start_ns"].min()
    assert ((a - b).abs() < 500_000).all()


def test_raw_ns_are_the_traces_own_times(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=1, skew_ns={1: 1_000_000})
    run = load_run(run_dir, use_cache=False)
    raw = run.raw_ns()
    for rank, trace in enumerate(sorted((run_dir / "traces").iterdir())):  # the times each trace wrote
        recorded, meta = load_rank(trace)
        assert meta["rank"] == rank
        mine = raw[run.events["rank"].to_numpy() == rank]
        assert mine["raw_start_ns"].tolist() == recorded["start_ns"].tolist()
        assert mine["raw_end_ns"].tolist() == recorded["end_ns"].tolist()
    assert abs(run.offsets.set_index("rank").at[1, "offset_ns"]) > 500_000  # rank 1's clock was moved
    again = apply_offsets(run.events.assign(start_ns=raw["raw_start_ns"], end_ns=raw["raw_end_ns"]), run.offsets)
    assert (again["start_ns"] == run.events["start_ns"]).all() and (again["end_ns"] == run.events["end_ns"]).all()
    # a subset keeps its index
    sub = run.events[run.events["rank"] == 1]
    assert run.raw_ns(sub).index.equals(sub.index)


@pytest.mark.slow
def test_one_host_keeps_its_shared_clock(gloo_run):
    """All ranks of the gloo run read one system clock: alignment must not move them (any
    refinement would only add the ~0.5 ms scheduling noise of the constraints)."""
    run = load_run(gloo_run, use_cache=False)
    assert set(run.offsets["method"]) == {"same host"}
    assert (run.offsets["offset_ns"] == 0).all()
    assert not [w for w in run.warnings if "alignment" in w or "contradict" in w]
    assert (run.pairs["recv_end_ns"] >= run.pairs["send_start_ns"]).all()


def test_clock_step_warning_needs_more_than_the_sampling_bracket():
    from pptrace.run.align import clock_drift_warnings

    def meta(end_wall_shift_ns, bracket_ns):
        start = {"wall_ns": 1_000_000_000, "perf_ns": 5_000, "bracket_ns": bracket_ns}
        end = {"wall_ns": 2_000_000_000 + end_wall_shift_ns, "perf_ns": 1_000_005_000, "bracket_ns": bracket_ns}
        return {"pptrace": {"clock": {"start": start, "end": end}}}

    # a 3 ms step of the wall clock while profiling is reported ...
    assert clock_drift_warnings({0: meta(3_000_000, 200)}) == [
        "rank 0: its wall clock moved +3.0 ms against its monotonic clock while profiling (NTP step?); "
        "its timeline may be stretched"]
    # ... but not when the samples themselves were only good to 2 ms each (a preempted read)
    assert clock_drift_warnings({0: meta(3_000_000, 2_000_000)}) == []
    assert clock_drift_warnings({0: meta(500_000, 0)}) == []


def test_async_cp_ranges_are_not_causality_facts():
    """CP's ring exchange is posted async (cp:send_kv / cp:recv_kv end when posted) and
    completed by a cp:wait: a recv range ending 30 ms before its send started is normal there
    and must not move one host's shared clock. The same gap on pipeline ranges, which span
    posting to completion, is a real violation."""
    import pandas as pd

    def pairs(kind):
        return pd.DataFrame({"kind": [kind], "src": [0], "dst": [1], "send_start_ns": [40_000_000],
                             "recv_start_ns": [9_000_000], "recv_end_ns": [10_000_000]})

    hosts = {0: "vm", 1: "vm"}
    offsets, warnings = estimate_offsets([0, 1], pairs=pairs("cp"), hosts=hosts)
    assert list(offsets["method"]) == ["same host", "same host"] and not warnings
    offsets, _ = estimate_offsets([0, 1], pairs=pairs("pp"), hosts=hosts)
    assert "same host" not in set(offsets["method"])
