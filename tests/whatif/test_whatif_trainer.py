"""What-if and critical path against the real trainer in sleep mode (4 gloo processes that
mostly sleep, so step times follow the schedule). Ground truth = running the trainer the way
the what-if asks, and measuring it.

Base run: 1F1B, p=4, m=8, forward 10 ms, backward 10 ms input grad + 10 ms weight grad (so
ZB-H1 has W's to defer). Theory for it: (m+p-1)(t_f+t_b) = 330 ms plus p2p latency.
"""
from __future__ import annotations

import numpy as np
import pytest

from pptrace.analyzers.critical_path import critical_path
from pptrace.run.build import load_run
from pptrace.schedules.replay import stage_program
from pptrace.export.perfetto import write_simulated_trace
from pptrace.whatif.predict import measure, whatif
from sleep_runs import DELAY_S, DELAYED_RANK, M, P
from truth_checks import check_whatif_replay

pytestmark = pytest.mark.slow

#: this file's names for the suite's shared runs (tests/sleep_runs.py)
RUNS = {"base": "1f1b", "interleaved": "interleaved", "zb-h1": "zb-h1", "m16": "m16", "delay": "delay"}


@pytest.fixture(scope="session")
def trainer_runs(sleep_run):
    """name -> loaded Run of the shared sleep-mode runs."""
    return {name: load_run(sleep_run(shared), progress=False) for name, shared in RUNS.items()}


def _close(predicted: float, actual: float, tolerance: float) -> bool:
    return abs(predicted / actual - 1) <= tolerance


#: each run's sleeps alone (t_f = t_b = t_w = 10 ms): 1F1B (m+p-1)(t_f+t_b+t_w); interleaved
#: v=2 m(...) + (p-1)(...)/v; ZB-H1 m(...) + (p-1)(t_f+t_b-t_w); m16 1F1B with 2m.
SLEEP_THEORY_S = {"base": 0.330, "interleaved": 0.285, "zb-h1": 0.270, "m16": 0.570}


def _prediction_tolerance(actual: float, theory: float) -> float:
    """5% of the step, plus the share of it the run paid beyond its sleeps. The sleeps are
    known and must be predicted closely; the latency of a run not yet made can only come from
    another run's, and on a slow or busy box the other schedule's latency is not the measured
    one's (interleaved's doubled exchanges paid 2-3x the 1F1B run's per step under load): that
    part is bounded by what the run really paid, no more. 12-15% on a quiet 2-core box."""
    return 0.05 + max(actual - theory, 0.0) / actual


@pytest.mark.parametrize("name", list(RUNS))
def test_replaying_the_measured_schedule_reproduces_the_step(trainer_runs, name):
    """The bar every harness's replay is held to (truth_checks.check_whatif_replay). The
    trainer's interleaved runs (overlap_p2p_comm) replay 4-5% short on this 2-core box: the
    latency of an exchange waited after a pass is not observed, only that of blocking ones."""
    check_whatif_replay(trainer_runs[name], trainer_runs[name].schedule)


@pytest.mark.parametrize("name,change", [
    ("interleaved", {"schedule": "interleaved", "vpp": 2}),
    ("zb-h1", {"schedule": "zb-h1"}),
    ("m16", {"microbatches": 2 * M}),
])
def test_predictions_from_1f1b_match_running_it(trainer_runs, name, change):
    predicted = whatif(trainer_runs["base"], **change)["predicted"]["step_time_s"]
    actual = measure(trainer_runs[name]).step_time_s
    tolerance = _prediction_tolerance(actual, SLEEP_THEORY_S[name])
    assert predicted >= SLEEP_THEORY_S[name] - 0.002, (name, predicted)  # no faster than the sleeps
    assert _close(predicted, actual, tolerance), (name, predicted, actual, tolerance)


def test_predictions_separate_the_schedules(trainer_runs):
    """Not only close: ordered as theory says (ZB-H1 beats 1F1B; m=16 costs less than twice
    m=8: the bubble is paid once). Interleaved is left out: its gain (45 ms) is of the size of
    the extra latency its doubled exchanges pay on a loaded 2-core box."""
    base = trainer_runs["base"]
    f1b = whatif(base)["predicted"]["step_time_s"]
    assert whatif(base, schedule="zb-h1")["predicted"]["step_time_s"] < 0.95 * f1b
    # 1F1B lasts (m+p-1) microbatch slots: doubling m scales the step by (2m+p-1)/(m+p-1)
    doubled = whatif(base, microbatches=2 * M)["predicted"]["step_time_s"]
    assert doubled / f1b == pytest.approx((2 * M + P - 1) / (M + P - 1), rel=0.10)


def test_no_straggler_predicts_the_run_without_the_delay(trainer_runs):
    result = whatif(trainer_runs["delay"], no_straggler=True)
    assert result["predicted"]["straggler_stage"] == DELAYED_RANK
    actual = measure(trainer_runs["base"]).step_time_s
    tolerance = _prediction_tolerance(actual, SLEEP_THEORY_S["base"])
    assert _close(result["predicted"]["step_time_s"], actual, tolerance), (result["predicted"]["step_time_s"], actual)
    # the delay really cost time: taking rank 2's 5 ms out of each of its forwards saves the
    # run at least half of them (judged within the delayed run itself: the base run was made
    # at another moment, under another load, and a busy worker once made it 410 ms to 421)
    assert result["measured"]["step_time_s"] - result["predicted"]["step_time_s"] > 0.5 * M * DELAY_S, (
        result["measured"]["step_time_s"], result["predicted"]["step_time_s"])


def test_p2p_free_removes_the_transfer_time(trainer_runs):
    result = whatif(trainer_runs["base"], p2p_free=True)
    assert all(s["transfer_s"] == 0 for s in result["predicted"]["stages"])
    assert result["predicted"]["step_time_s"] < result["replay"]["step_time_s"]


def test_program_matches_the_traced_order_of_passes_and_exchanges(trainer_runs):
    """The simulator's stage programs are the trainer's: per rank, the traced sequence of
    passes and p2p exchanges (ranges nested in the first one = one exchange; an exchange
    posted while another is open outlives it) equals the program's."""
    for name, run in trainer_runs.items():
        ev = run.events
        step = run.steps[-1]
        sel = ev[(ev["step"] == step).to_numpy() & (ev["lane"] == "main").to_numpy()
                 & (ev["category"].isin(["compute", "p2p"])).to_numpy()
                 & ~ev["op"].isin(["optimizer", "loss"]).to_numpy()].sort_values("start_ns")
        v = run.vpp or 1
        overlap = measure(run).overlap_p2p_comm
        for rank, g in sel.groupby("rank", observed=True):
            traced, first_end = [], -1
            for row in g.itertuples():
                kind = {"fwd": "F", "bwd": "B", "bwd_input": "B", "bwd_weight": "W"}.get(row.op, "comm")
                if kind == "comm":
                    direction = ("send" if row.op.startswith("send") else "recv", row.op[-3:], int(row.mb))
                    if traced and traced[-1][0] == "comm" and row.start_ns < first_end and row.end_ns <= first_end:
                        traced[-1][1].add(direction)
                    else:
                        traced.append(("comm", {direction}))
                        first_end = row.end_ns
                else:
                    traced.append((kind, int(row.mb), int(row.chunk) if v > 1 else 0))
            program = []
            for op in stage_program(run.schedule, P, run.layout.coords(int(rank)).pp, run.microbatches, v, overlap):
                if op.kind in ("comm", "post"):
                    program.append(("comm", {("send" if m.is_send else "recv", m.direction, m.mb) for m in op.msgs}))
                elif op.kind != "wait":
                    program.append((op.kind, op.mb, op.chunk))
            assert traced == program, (name, rank)


def test_critical_path_crosses_every_stage_and_spans_the_step(trainer_runs):
    run = trainer_runs["base"]
    m_fwd = measure(run).times
    lengths, step_times, computes = [], [], []
    for step in run.steps:
        path = critical_path(run, step)
        assert path.stages == list(range(P))
        lengths.append(path.length_s)
        step_times.append(path.step_time_s)
        computes.append(path.segments.loc[path.segments["phase"].str.startswith("compute:"), "dur_ns"].sum() / 1e9)
    # A stalled pass can stretch one step (CI once measured +6% on one of 8); over the steps:
    # 1F1B's critical path computes (m+p-1) forward+backward slots, and path and step agree.
    slot = float(m_fwd.fwd.mean() + m_fwd.bwd.mean() + m_fwd.wgrad.mean())
    assert _close(float(np.median(computes)), (M + P - 1) * slot, 0.05), (computes, (M + P - 1) * slot)
    assert _close(float(np.median(lengths)), float(np.median(step_times)), 0.02), (lengths, step_times)


def test_critical_path_runs_through_the_straggler(trainer_runs):
    """Judged over every profiled step: on a loaded box one step's path may leave the
    straggler for a stretch another rank was slowed in."""
    run = trainer_runs["delay"]
    fwd = sum(critical_path(run, step).by_rank_phase.query("phase == 'compute:fwd'").set_index("rank")["time_s"]
              for step in run.steps)
    # the delayed rank's forwards (15 ms each) lie on the path, far more than any other's
    late = fwd[DELAYED_RANK]
    assert fwd.idxmax() == DELAYED_RANK and late >= 0.75 * M * 0.015 * len(run.steps), fwd
    # quiet: 3.5x the next rank's (rank 3's cool-down forwards); a busy box stretches those
    assert late > 2 * fwd.drop(DELAYED_RANK).max(), fwd


def test_simulated_trace_is_a_loadable_chrome_trace(trainer_runs, tmp_path):
    import gzip

    import orjson

    result = whatif(trainer_runs["base"], schedule="interleaved", vpp=2)
    out = write_simulated_trace(result, tmp_path / "sim.json.gz")
    doc = orjson.loads(gzip.decompress(out.read_bytes()))
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == set(range(P))
    fwd = [e for e in xs if e["name"].startswith("compute:fwd")]
    assert len(fwd) == P * M * 2 and all("chunk=" in e["name"] for e in fwd)
    end = max(e["ts"] + e["dur"] for e in xs) / 1e6
    assert end == pytest.approx(result["predicted"]["window_s"], rel=1e-6)
