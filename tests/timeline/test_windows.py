"""pptrace/timeline/windows.py: when each rank's step ran (host ProfilerStep range, or the
GPU work launched in it), when each step's pipeline ran, and which steps were profiled.

Two kinds of input: events tables the real loader made from tracegen traces (times in µs
of true time, so every window is a sum done by hand), and tiny tables built here with only
the columns the functions read, for edge cases and a randomized comparison with a
brute-force reference.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import pptrace
from pptrace.ingest.load import load_rank
from pptrace.run.model import Run
from pptrace.timeline.windows import (gpu_step_windows, host_step_windows, pipeline_windows, profiled_steps,
                                      step_windows)
from pptrace.topology import Layout
from tracegen import ORIGIN_NS, US, RankTrace

LAYOUT = Layout(pp=2)


def _load(tmp_path, traces) -> pd.DataFrame:
    frames = [load_rank(t.write(tmp_path / f"rank{t.rank}.json.gz"), t.rank)[0] for t in traces]
    events = pd.concat(frames, ignore_index=True)
    for column in frames[0].columns:  # categories of different ranks union to object: back to category
        if isinstance(frames[0][column].dtype, pd.CategoricalDtype):
            events[column] = events[column].astype(str).where(events[column].notna()).astype("category")
    return events


def _launch(t: RankTrace, corr: int, host_us, gpu_us, dur_us, name="ampere_sgemm_128x64_nn", cat="kernel",
            stream=7):
    t.add("cudaLaunchKernel", host_us, 2, cat="cuda_runtime", args={"correlation": corr})
    t.kernel(name, gpu_us, dur_us, stream=stream, correlation=corr, cat=cat)


def _gpu_traces():
    """rank 0 runs on a GPU, rank 1 on the host only.

    rank 0  host: step 1 [0, 1000), step 2 [1000, 2000); a ProfilerStep#1 on a worker
            thread too, [0, 3000) (not the main thread's: ignored)
            GPU: step 1 launches [100, 300), [350, 600) and a memcpy [900, 1200);
                 step 2 launches [1100, 1300) (before step 1's memcpy ends) and a memset
                 [1400, 1450); a kernel launched outside any step at [5000, 5100)
    rank 1  host: step 1 [10, 990), step 2 [990, 1990)
    """
    t0 = RankTrace(rank=0, layout=LAYOUT)
    t0.step(1, 0, 1000)
    t0.step(2, 1000, 1000)
    t0.thread(77, "pt_autograd_0")
    t0.add("ProfilerStep#1", 0, 3000, tid=77)
    _launch(t0, 1, 10, 100, 200)
    _launch(t0, 2, 20, 350, 250)
    _launch(t0, 3, 30, 900, 300, "Memcpy HtoD (Pageable -> Device)", cat="gpu_memcpy")
    _launch(t0, 4, 1010, 1100, 200)
    _launch(t0, 5, 1020, 1400, 50, "Memset (Device)", cat="gpu_memset")
    _launch(t0, 6, 4000, 5000, 100)
    t1 = RankTrace(rank=1, layout=LAYOUT)
    t1.step(1, 10, 980)
    t1.step(2, 990, 1000)
    return [t0, t1]


@pytest.fixture(scope="module")
def gpu_events(tmp_path_factory):
    return _load(tmp_path_factory.mktemp("gpu"), _gpu_traces())


@pytest.fixture(scope="module")
def clock():
    return RankTrace(rank=0).raw_ns  # true µs -> the ns the loader reports (no skew)


# -- host step windows ----------------------------------------------------------------------
def test_host_step_windows_are_the_main_thread_s_profiler_steps(gpu_events, clock):
    assert host_step_windows(gpu_events) == {
        (0, 1): (clock(0), clock(1000)), (0, 2): (clock(1000), clock(2000)),
        (1, 1): (clock(10), clock(990)), (1, 2): (clock(990), clock(1990)),
    }


def test_host_step_windows_select_steps(gpu_events, clock):
    assert host_step_windows(gpu_events, steps=[2]) == {(0, 2): (clock(1000), clock(2000)),
                                                        (1, 2): (clock(990), clock(1990))}
    assert host_step_windows(gpu_events, steps={7}) == {}


def _table(**columns) -> pd.DataFrame:
    """A hand-made events table: the columns given, the rest of what the windows read defaulted."""
    n = len(next(iter(columns.values())))
    base = {"rank": np.zeros(n, np.int64), "lane_kind": ["host"] * n, "step": np.zeros(n, np.int64),
            "gpu_annotation": np.zeros(n, bool), "op": [None] * n,
            "external_id": pd.array([None] * n, dtype="Int64")}
    return pd.DataFrame({**base, **columns})


def test_host_step_windows_without_a_main_lane_take_any_host_thread():
    ev = _table(category=["step", "step", "step"], lane=["thread:5 w", "thread:6 x", "stream 7"],
                lane_kind=["host", "host", "gpu"], step=[1, 2, 3], start_ns=[0, 10, 20], end_ns=[9, 19, 29])
    assert host_step_windows(ev) == {(0, 1): (0, 9), (0, 2): (10, 19)}  # never a GPU lane
    # a table with no lane column at all
    assert host_step_windows(ev.drop(columns="lane")) == {(0, 1): (0, 9), (0, 2): (10, 19)}


def test_host_step_windows_fall_back_per_rank():
    ev = _table(category=["step", "step"], rank=[0, 1], lane=["main", "thread:5 trainer"], step=[1, 1],
                start_ns=[0, 3], end_ns=[10, 12])
    alone = host_step_windows(ev[ev["rank"] == 1])
    assert alone == {(1, 1): (3, 12)}
    assert host_step_windows(ev) == {(0, 1): (0, 10), **alone}


def test_host_step_windows_of_a_table_without_steps():
    ev = _table(category=["compute"], lane=["main"], start_ns=[0], end_ns=[5])
    assert host_step_windows(ev) == {}
    assert host_step_windows(ev.iloc[:0]) == {}


# -- GPU step windows -----------------------------------------------------------------------
def test_gpu_step_windows_span_the_work_launched_in_each_step(gpu_events, clock):
    # step 1: first kernel at 100 to the memcpy's end at 1200, cut where step 2's first
    # kernel starts (1100); step 2: 1100 to the memset's end; rank 1 has no GPU work; the
    # kernel launched outside a step belongs to none
    assert gpu_step_windows(gpu_events) == {(0, 1): (clock(100), clock(1100)), (0, 2): (clock(1100), clock(1450))}


def test_gpu_step_windows_cut_at_a_next_step_that_is_not_selected(gpu_events, clock):
    assert gpu_step_windows(gpu_events, steps={1}) == {(0, 1): (clock(100), clock(1100))}
    assert gpu_step_windows(gpu_events, steps={2}) == {(0, 2): (clock(1100), clock(1450))}
    assert gpu_step_windows(gpu_events, steps=set()) == {}


def test_gpu_step_windows_keep_each_rank_apart():
    # rank 0's step 2 starts before rank 1's step 1 ends: no cut across ranks
    ev = _table(category=["kernel_compute", "kernel_compute", "kernel_comm", "memcpy"], rank=[0, 0, 1, 1],
                step=[1, 2, 1, 2], start_ns=[0, 50, 10, 300], end_ns=[40, 90, 200, 310])
    assert gpu_step_windows(ev) == {(0, 1): (0, 40), (0, 2): (50, 90), (1, 1): (10, 200), (1, 2): (300, 310)}
    assert gpu_step_windows(ev[ev["category"] == "runtime"]) == {}


def _gpu_step_windows_ref(ev: pd.DataFrame, steps=None) -> dict:
    """gpu_step_windows row by row: each (rank, step)'s first start and last end, cut at the
    same rank's next step."""
    spans: dict = {}
    for r, s, c, a, b in zip(ev["rank"], ev["step"], ev["category"], ev["start_ns"], ev["end_ns"]):
        if c in ("kernel_compute", "kernel_comm", "memcpy") and s >= 0:
            lo, hi = spans.get((r, s), (a, b))
            spans[(r, s)] = (min(lo, a), max(hi, b))
    keys = sorted(spans)
    out = {}
    for i, key in enumerate(keys):
        lo, hi = spans[key]
        if i + 1 < len(keys) and keys[i + 1][0] == key[0]:
            hi = min(hi, spans[keys[i + 1]][0])
        if steps is None or key[1] in steps:
            out[key] = (lo, hi)
    return out


@pytest.mark.parametrize("path", ["table", "table, small slices", "groupby"])
def test_gpu_step_windows_equal_a_row_by_row_reference(monkeypatch, path):
    """Both ways gpu_step_windows gathers (a table of (rank, step) cells read a slice of rows
    at a time; a groupby where the cells would be too many), against the reference."""
    import pptrace.timeline.windows as windows

    if path == "groupby":
        monkeypatch.setattr(windows, "_MAX_CELLS", 0)
    if path.endswith("small slices"):
        monkeypatch.setattr(windows, "_CHUNK_ROWS", 3)
    rng = np.random.default_rng(8)
    kinds = np.array(["kernel_compute", "kernel_comm", "memcpy", "runtime", "other"], dtype=object)
    for _ in range(150):
        n = int(rng.integers(1, 40))
        start = rng.integers(0, 1000, n)
        ev = _table(category=kinds[rng.integers(0, len(kinds), n)], rank=rng.integers(0, 4, n),
                    step=rng.integers(-1, 6, n), start_ns=start, end_ns=start + rng.integers(0, 50, n))
        steps = None if rng.random() < 0.5 else set(rng.integers(0, 6, 2).tolist())
        assert gpu_step_windows(ev, steps) == _gpu_step_windows_ref(ev, steps)


# -- the partition's window ------------------------------------------------------------------
def test_step_windows_take_the_gpu_s_for_gpu_ranks(gpu_events, clock):
    host = host_step_windows(gpu_events)
    assert step_windows(gpu_events) == host
    windows = step_windows(gpu_events, gpu_ranks=frozenset({0}))
    assert windows == {**host, (0, 1): (clock(100), clock(1100)), (0, 2): (clock(1100), clock(1450))}
    assert step_windows(gpu_events, steps=(2,), gpu_ranks=(0,)) == {(0, 2): (clock(1100), clock(1450)),
                                                                    (1, 2): (clock(990), clock(1990))}


def test_a_gpu_step_without_a_host_step_is_not_added():
    ev = _table(category=["step", "kernel_compute", "kernel_compute"], lane=["main", "stream 7", "stream 7"],
                lane_kind=["host", "gpu", "gpu"], step=[1, 1, 2], start_ns=[0, 5, 200], end_ns=[100, 50, 300])
    assert step_windows(ev, gpu_ranks=(0,)) == {(0, 1): (5, 50)}


def test_the_run_caches_the_windows_of_its_steps(gpu_events, clock):
    run = Run.from_events(gpu_events, LAYOUT)
    assert run.steps == (1, 2)
    assert run.gpu_ranks == frozenset({0})
    assert run.step_windows == step_windows(gpu_events, (1, 2), frozenset({0}))
    assert run.step_windows is run.step_windows
    assert Run.from_events(gpu_events, LAYOUT, steps=(1,)).step_windows == {
        (0, 1): (clock(100), clock(1100)), (1, 1): (clock(10), clock(990))}


def test_a_selection_of_no_profiled_step_has_no_step_rows(gpu_events):
    a = pptrace.analyze(Run.from_events(gpu_events, LAYOUT), steps=[9])
    assert a.to_json()["run"]["steps"] == []
    assert a.steps.empty


# -- pipeline windows -----------------------------------------------------------------------
def test_pipeline_window_of_the_hand_built_pipeline(scenario_run):
    # tracegen.STAGE0/STAGE1: the first pass is stage 0's fwd mb=0 at 10 µs (stage 1's
    # recv_fwd, posted at 5, waits on it and is no part of the window), the last stage 0's
    # bwd mb=1 ending at 212; the all-reduce and the optimizer after it are not pipeline
    # work, and the ProfilerStep [0, 260) is not the window. The replay's span, p2p
    # included, starts at the recv.
    assert pipeline_windows(scenario_run.events, 2) == {1: (ORIGIN_NS + 10 * US, ORIGIN_NS + 212 * US)}
    assert scenario_run.pipeline_windows == {1: (ORIGIN_NS + 10 * US, ORIGIN_NS + 212 * US)}
    assert scenario_run.pipeline_spans == {1: (ORIGIN_NS + 5 * US, ORIGIN_NS + 212 * US)}
    assert scenario_run.step_windows == {(0, 1): (ORIGIN_NS, ORIGIN_NS + 260 * US), (1, 1): (ORIGIN_NS, ORIGIN_NS + 260 * US)}


def test_no_pipeline_no_window(scenario_run):
    assert pipeline_windows(scenario_run.events, 1) == {}
    ev = _table(category=["step", "compute", "p2p"], lane=["main"] * 3, op=[None, "optimizer", "send_fwd"],
                step=[1, 1, -1], start_ns=[0, 10, 20], end_ns=[100, 20, 30])
    # the optimizer is no pass, and p2p outside a step is in no step's window
    assert pipeline_windows(ev, 2) == {}


def test_pipeline_windows_which_ops_count():
    ops = ["fwd", "bwd", "bwd_input", "bwd_weight", "loss", "optimizer", "send_fwd", "fwd", "fwd"]
    ev = _table(category=["compute"] * 6 + ["p2p", "compute", "compute"],
                lane_kind=["host"] * 8 + ["gpu"], gpu_annotation=[False] * 7 + [True, False], op=ops,
                step=[1, 1, 2, 2, 3, 3, 3, 3, 3],
                start_ns=[10, 20, 5, 30, 40, 0, 60, 1, 2], end_ns=[15, 25, 8, 35, 45, 99, 65, 200, 300])
    # step 3: the loss counts, the send only in the replay's span; the optimizer, a
    # gpu_user_annotation copy and a GPU-lane row do not
    assert pipeline_windows(ev, 4) == {1: (10, 25), 2: (5, 35), 3: (40, 45)}
    assert pipeline_windows(ev, 4, with_p2p=True) == {1: (10, 25), 2: (5, 35), 3: (40, 65)}


def test_pipeline_windows_on_gpu_traces_are_where_the_work_ran(tmp_path, clock):
    """A send launched on the host at [30, 60) µs whose transfer ran on the GPU [500, 800)
    (its gpu_user_annotation, same External id): the replay's span ends at 800, not 60; the
    window at the last pass (the forward of stage 1, launched at 700 with no GPU work)."""
    t0, t1 = RankTrace(0, layout=LAYOUT), RankTrace(1, layout=LAYOUT)
    for t in (t0, t1):
        t.step(1, 0, 1000)
    t0.region("compute:fwd", 10, 15, mb=0)
    send = t0.region("pp:send_fwd", 30, 30, peer=1, mb=0)
    t0.add(send["name"], 500, 300, cat="gpu_user_annotation", pid=0, tid=20,
           args={"External id": send["args"]["External id"]})
    t1.region("pp:recv_fwd", 40, 20, peer=0, mb=0)
    t1.region("compute:fwd", 700, 50, mb=0)
    events = _load(tmp_path, [t0, t1])
    assert pipeline_windows(events, 2, with_p2p=True) == {1: (clock(10), clock(800))}
    assert pipeline_windows(events, 2) == {1: (clock(10), clock(750))}


# -- profiled steps -------------------------------------------------------------------------
def test_profiled_steps(gpu_events, scenario_run):
    assert profiled_steps(gpu_events) == (1, 2)
    assert profiled_steps(scenario_run.events) == (1,)
    # any rank's, sorted, once each, outside-a-step marks (-1) left out, as Python ints
    ev = _table(category=["step", "step", "compute", "step", "step"], rank=[0, 1, 0, 1, 0],
                step=[3, 1, 9, 3, -1], start_ns=[0] * 5, end_ns=[1] * 5)
    got = profiled_steps(ev)
    assert got == (1, 3) and all(type(s) is int for s in got)
    assert profiled_steps(ev.iloc[:0]) == ()


# -- randomized, against a brute-force reference --------------------------------------------
def _host_ref(rows, steps):
    # per rank: its main thread's marks, else any host thread's (the generator below gives
    # every rank a main mark when any rank has one, so a whole-table fallback agrees)
    out = {}
    for rank in {r["rank"] for r in rows}:
        marks = [r for r in rows if r["rank"] == rank and r["category"] == "step" and r["lane_kind"] == "host"]
        marks = [r for r in marks if r["lane"] == "main"] or marks
        out.update({(rank, r["step"]): (r["start_ns"], r["end_ns"]) for r in marks if not steps or r["step"] in steps})
    return out


def _gpu_ref(rows, steps):
    spans = {}
    for r in rows:
        if r["category"] in ("kernel_compute", "kernel_comm", "memcpy") and r["step"] >= 0:
            lo, hi = spans.get((r["rank"], r["step"]), (r["start_ns"], r["end_ns"]))
            spans[(r["rank"], r["step"])] = (min(lo, r["start_ns"]), max(hi, r["end_ns"]))
    out = {}
    for (rank, step), (lo, hi) in spans.items():
        later = [t for (k, t) in spans if k == rank and t > step]
        if later:  # cut where the rank's next step with GPU work starts
            hi = min(hi, spans[(rank, min(later))][0])
        if steps is None or step in steps:
            out[(rank, step)] = (lo, hi)
    return out


def _pipe_ref(rows, with_p2p=False):
    out = {}
    for r in rows:
        pipe = (with_p2p and r["category"] == "p2p") or (
            r["category"] == "compute" and r["op"] in ("fwd", "bwd", "bwd_input", "bwd_weight", "loss"))
        if pipe and r["lane_kind"] == "host" and not r["gpu_annotation"] and r["step"] >= 0:
            lo, hi = out.get(r["step"], (r["start_ns"], r["end_ns"]))
            out[r["step"]] = (min(lo, r["start_ns"]), max(hi, r["end_ns"]))
    return out


def test_windows_random_against_brute_force():
    rng = np.random.default_rng(22)
    categories = ["step", "compute", "p2p", "kernel_compute", "kernel_comm", "memcpy", "runtime", "other"]
    ops = ["fwd", "bwd", "bwd_weight", "loss", "optimizer", "send_fwd", None]
    for trial in range(60):
        n = int(rng.integers(0, 40))
        start = 1_790_000_000_000_000_000 + rng.integers(0, 50, n)
        rows = pd.DataFrame({
            "rank": rng.integers(0, 3, n), "category": rng.choice(categories, n),
            "lane": rng.choice(["main", "thread:9 w"] if trial % 3 else ["thread:9 w"], n),
            "lane_kind": rng.choice(["host", "host", "gpu"], n), "step": rng.integers(-1, 4, n),
            "start_ns": start, "end_ns": start + rng.integers(0, 30, n),
            "op": rng.choice(np.array(ops, object), n), "gpu_annotation": rng.random(n) < 0.1,
            "external_id": pd.array([None] * n, dtype="Int64"),
        })
        # one step mark per (rank, step, lane), as a trace has: the dict's last would win otherwise
        rows.loc[rows["lane_kind"] == "gpu", "lane"] = "stream 7"
        rows = rows[~((rows["category"] == "step").to_numpy()
                      & rows.duplicated(["rank", "step", "lane", "lane_kind", "category"]).to_numpy())]
        if trial % 3:
            main = pd.DataFrame({"rank": range(3), "category": "step", "lane": "main", "lane_kind": "host",
                                 "step": 0, "start_ns": 1_790_000_000_000_000_000, "end_ns": 1_790_000_000_000_000_060,
                                 "op": None, "gpu_annotation": False,
                                 "external_id": pd.array([None] * 3, dtype="Int64")})
            rows = pd.concat([rows, main[~main["rank"].isin(rows.loc[(rows["category"] == "step") & (rows["lane"] == "main"), "rank"])]])
        rows = rows.reset_index(drop=True)
        records = rows.to_dict("records")
        steps = [None, [1, 2], [3]][trial % 3]
        assert host_step_windows(rows, steps) == _host_ref(records, steps), trial
        assert gpu_step_windows(rows, None if steps is None else set(steps)) == _gpu_ref(
            records, None if steps is None else set(steps)), trial
        assert pipeline_windows(rows, 2) == _pipe_ref(records), trial
        assert pipeline_windows(rows, 2, with_p2p=True) == _pipe_ref(records, with_p2p=True), trial
        assert profiled_steps(rows) == tuple(sorted({r["step"] for r in records
                                                     if r["category"] == "step" and r["step"] >= 0})), trial
