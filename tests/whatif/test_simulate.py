"""The pipeline simulator against the schedules' closed forms (pure Python, no processes)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pptrace.schedules.tables import schedule_table
from pptrace.schedules.replay import SEND_MODES, PipelineTimes, simulate, stage_program

TF, TB = 0.010, 0.020


@pytest.mark.parametrize("sends", SEND_MODES)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (3, 5), (4, 16)])
def test_flat_schedules_take_m_plus_p_minus_1_slots(schedule, p, m, sends):
    timeline = simulate(schedule, PipelineTimes.uniform(p, m, TF, TB), sends=sends)
    assert timeline.makespan_s == pytest.approx((m + p - 1) * (TF + TB))
    # every stage idles (p-1)(t_f+t_b) of the window, the last stage included
    assert timeline.stages["bubble_s"].to_numpy() == pytest.approx([(p - 1) * (TF + TB)] * p)


@pytest.mark.parametrize("sends", SEND_MODES)
@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (2, 4, 2), (4, 4, 2), (4, 16, 3)])
def test_interleaved_bubble_shrinks_by_v(p, m, v, sends):
    timeline = simulate("interleaved", PipelineTimes.uniform(p, m, TF, TB), vpp=v, sends=sends)
    bubble = (p - 1) * (TF + TB) / v
    assert timeline.makespan_s == pytest.approx(m * (TF + TB) + bubble)
    assert timeline.stages["bubble_s"].to_numpy() == pytest.approx([bubble] * p)
    # each chunk pass takes 1/v of the stage's per-microbatch time
    f = timeline.ops[timeline.ops["kind"] == "F"]
    assert (f["end_s"] - f["start_s"]).to_numpy() == pytest.approx(np.full(len(f), TF / v))
    assert len(f) == p * m * v


@pytest.mark.parametrize("tf,tb,tw", [(0.010, 0.010, 0.010), (0.010, 0.012, 0.006), (0.012, 0.010, 0.004)])
@pytest.mark.parametrize("p,m", [(4, 8), (3, 6)])
@pytest.mark.parametrize("sends", SEND_MODES)
def test_zb_h1_bubble(p, m, tf, tb, tw, sends):
    """ZB-H1 (Qi et al.): bubble (p-1)(t_f + t_b - t_w), t_b the input-grad part, t_w <= t_f.
    Holds with blocking sends too because the trainer runs the deferred W's between posting
    its exchange and waiting for it."""
    timeline = simulate("zb-h1", PipelineTimes.uniform(p, m, tf, tb, tw), sends=sends)
    assert timeline.makespan_s == pytest.approx(m * (tf + tb + tw) + (p - 1) * (tf + tb - tw))
    assert timeline.stages["bubble_s"].max() == pytest.approx((p - 1) * (tf + tb - tw))


def test_slow_stage_sets_the_pace():
    """One stage 1.5x slower: GPipe takes every stage once plus (m-1) slowest-stage slots; in
    1F1B's steady state the first stage's backwards come one slowest-stage slot apart."""
    p, m = 4, 8
    fwd = np.array([[0.010] * m, [0.010] * m, [0.015] * m, [0.010] * m])
    times = PipelineTimes(fwd, 2 * fwd, np.zeros_like(fwd), 0.0)
    per_stage = 3 * fwd[:, 0]
    assert simulate("gpipe", times).makespan_s == pytest.approx(per_stage.sum() + (m - 1) * per_stage.max())
    ops = simulate("1f1b", times).ops
    b0 = ops[(ops["kind"] == "B") & (ops["stage"] == 0)]["start_s"].to_numpy()
    steady = np.diff(b0)[: m - p + 1]
    assert steady == pytest.approx(np.full(steady.size, per_stage.max()))


def test_latency_is_paid_on_every_hop_of_the_critical_path():
    # p=2, m=1: F0 -> send -> F1, B1 -> send -> B0: two transfers, each after both posted.
    lat, over = 0.003, 0.0005
    timeline = simulate("1f1b", PipelineTimes.uniform(2, 1, TF, TB, latency_s=lat, overhead_s=over))
    # 4 compute passes and 2 exchanges on the path, each followed by the host overhead
    # (the path ends with B0's, which the window does not include)
    assert timeline.makespan_s == pytest.approx(2 * (TF + TB) + 2 * lat + 5 * over)
    transfer = timeline.stages.set_index("stage")["transfer_s"]
    assert transfer.to_numpy() == pytest.approx([2 * lat, 2 * lat])


def test_drawn_latencies_equal_the_fixed_one_when_all_samples_agree():
    p, m, lat = 4, 8, 0.002
    fixed = simulate("interleaved", PipelineTimes.uniform(p, m, TF, TB, latency_s=lat), vpp=2)
    times = PipelineTimes.uniform(p, m, TF, TB, latency_s=0.0)
    times.latency_samples = np.full(5, lat)
    drawn = simulate("interleaved", times, vpp=2, rng=np.random.default_rng(1))
    assert drawn.makespan_s == pytest.approx(fixed.makespan_s)
    assert fixed.makespan_s > m * (TF + TB) + (p - 1) * (TF + TB) / 2  # latency costs time


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_program_compute_order_is_the_trainers_table(schedule, v, p):
    m = 2 * p
    if schedule == "interleaved" and p == 1:
        pytest.skip("interleaved needs pp > 1")
    for r in range(p):
        program = stage_program(schedule, p, r, m, v)
        compute = [(op.kind, op.mb, op.chunk) for op in program if op.kind in ("F", "B", "W")]
        assert compute == schedule_table(schedule, p, r, m, v)


def test_every_send_has_exactly_one_recv():
    p, m, v = 4, 8, 2
    sends, recvs = [], []
    for r in range(p):
        for op in stage_program("interleaved", p, r, m, v):
            for msg in op.msgs:
                (sends if msg.is_send else recvs).append(msg.key)
    assert sorted(sends) == sorted(recvs)
    assert len(set(sends)) == len(sends) == 2 * (p * v - 1) * m


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="shape"):
        PipelineTimes(np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((2, 3)), 0.0)
    with pytest.raises(ValueError, match="latency_s"):
        PipelineTimes(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="fwd"):
        PipelineTimes(-np.ones((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)), 0.0)
    with pytest.raises(ValueError, match="microbatches % pp"):
        simulate("interleaved", PipelineTimes.uniform(4, 6, TF, TB), vpp=2)
    with pytest.raises(ValueError, match="schedule"):
        simulate("pipedream", PipelineTimes.uniform(4, 6, TF, TB))


# -- whatif glue on a synthetic run with exact timing (tests/tracegen.py) -------------------
@pytest.fixture(scope="module")
def synthetic_gpipe(tmp_path_factory):
    from pptrace.run.build import load_run
    from tracegen import pipeline_run

    out, _ = pipeline_run(tmp_path_factory.mktemp("wi"), pp=3, microbatches=6, steps=(1, 2),
                          fwd_us=1000.0, bwd_us=2000.0)
    return load_run(out, progress=False)


def test_whatif_measures_and_replays_a_synthetic_run(synthetic_gpipe):
    from pptrace.whatif.predict import whatif

    result = whatif(synthetic_gpipe)
    assert result["model"]["t_fwd_s"] == pytest.approx([0.001] * 3)
    assert result["model"]["t_bwd_s"] == pytest.approx([0.002] * 3)
    assert abs(result["replay"]["error_fraction"]) < 0.03
    # 1F1B has GPipe's bubble; interleaving v=3 cuts it to a third
    f1b = whatif(synthetic_gpipe, schedule="1f1b")["predicted"]
    il = whatif(synthetic_gpipe, schedule="interleaved", vpp=3)["predicted"]
    assert f1b["stages"][0]["bubble_s"] == pytest.approx(2 * 0.003, rel=0.1)
    # ideal 2 ms; three times the exchanges pay three times the per-op overhead
    assert 2 * 0.003 / 3 <= il["stages"][0]["bubble_s"] < f1b["stages"][0]["bubble_s"] / 2
    assert il["step_time_s"] < f1b["step_time_s"]


def test_whatif_rejects_impossible_changes(synthetic_gpipe):
    from pptrace.whatif.predict import whatif

    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        whatif(synthetic_gpipe, schedule="1f1b", vpp=2)
    with pytest.raises(ValueError, match="microbatches % pp"):
        whatif(synthetic_gpipe, schedule="interleaved", vpp=2, microbatches=4)


def test_posting_an_exchange_waited_later_costs_post_s():
    """ZB-H1's W passes run between posting B's grad and waiting for it: the first starts
    post_s after B."""
    post = 0.0007
    timeline = simulate("zb-h1", replace(PipelineTimes.uniform(4, 8, TF, TB, TF), post_s=post))
    checked = 0
    for stage in range(4):
        program = stage_program("zb-h1", 4, stage, 8)
        rows = timeline.ops[timeline.ops["stage"] == stage].itertuples()
        # the timeline has a row per pass and per completed exchange ("post" opens one, no row)
        prev_end, after_post = None, False
        for op in program:
            if op.kind == "post":
                after_post = True
                continue
            row = next(rows)
            if op.kind in ("F", "B", "W") and after_post:
                assert row.start_s - prev_end == pytest.approx(post), (stage, op)
                checked += 1
            prev_end, after_post = row.end_s, False
    assert checked > 8


def _steps_kept(walls: dict) -> tuple[list, list]:
    """The steps what-if measures a run from, given each step's wall time (ms, on 2 ranks)."""
    from types import SimpleNamespace

    from pptrace.whatif.predict import _typical_steps

    run = SimpleNamespace(step_windows={(rank, step): (0, int(ms * 1e6)) for step, ms in walls.items()
                                        for rank in (0, 1)})
    notes: list = []
    return sorted(_typical_steps(run, notes).index), notes


def test_a_stalled_step_is_left_out_even_of_two():
    """A stall only lengthens a step. Of two steps, both lie half a stall from their median
    (a long stall dropped both, and what-if had no step to replay): the shorter one is the
    reference. Of three or more, the median."""
    kept, notes = _steps_kept({1: 3000, 2: 500})
    assert kept == [2] and notes == ["step 1 left out: 3000.0 ms against the shorter step of 500.0 ms"]
    assert _steps_kept({1: 520, 2: 500})[0] == [1, 2]
    kept, notes = _steps_kept({1: 500, 2: 510, 3: 2000, 4: 505})
    assert kept == [1, 2, 4] and len(notes) == 1
    # no two alike: the shortest
    assert _steps_kept({1: 100, 2: 400, 3: 1600, 4: 6400})[0] == [1]
