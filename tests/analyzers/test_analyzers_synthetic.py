"""Analyzers on hand-built traces whose every number is known.

Each scenario is written as torch.profiler-shaped Chrome traces (times in whole µs), loaded
by the real loader, and analysed; the expected values are worked out by hand in the
comments, and every part must match to the nanosecond.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pptrace.analyzers.partition import breakdown_table, partition_run
from pptrace.vocab import PARTS
from pptrace.timeline.intervals import Intervals, partition, private_axes, union
from pptrace.analyzers.p2p import link_table, match_pairs
from pptrace.analyzers.bubble import balanced_theory_bubble, pipeline_stages, theory_step
from pptrace.analyzers.collectives import profiled_waits
from pptrace.analyzers.stragglers import find_stragglers
from pptrace.topology import Layout
from tracegen import US, run_from_docs, trace_doc


def _us(table: pd.DataFrame, rank: int, step: int) -> dict:
    row = table[(table["rank"] == rank) & (table["step"] == step)].iloc[0]
    return {k: round(row[k] * 1e6, 6) for k in ("time_s", *PARTS, "hidden_tp", "hidden_cp", "hidden_dp", "hidden_ep")}


# ------------------------------------------------------------------------------------------
# interval algebra
# ------------------------------------------------------------------------------------------
def test_interval_union_intersect_subtract():
    a = union([0, 5, 20], [10, 12, 30])       # [0,12) [20,30)
    b = union([8, 25], [22, 40])              # [8,22) [25,40)
    assert list(zip(a.starts, a.ends)) == [(0, 12), (20, 30)]
    assert (a & b).total == 4 + 2 + 5
    assert list(zip((a - b).starts, (a - b).ends)) == [(0, 8), (22, 25)]
    assert (a | b).total == 40
    assert Intervals.empty().total == 0 and (a - a).total == 0


def test_interval_covered_equals_the_intersection_per_query():
    a = union([10, 30], [20, 50])  # [10,20) [30,50)
    queries = [(0, 5), (15, 35), (25, 28), (0, 100), (45, 55), (60, 70), (20, 30), (10, 50)]
    expected = [(a & Intervals.span(lo, hi)).total for lo, hi in queries]
    assert expected == [0, 10, 0, 30, 5, 0, 0, 30]
    assert a.covered(*zip(*queries)).tolist() == expected
    assert Intervals.empty().covered([0], [10]).tolist() == [0]


def test_private_axes_keep_each_keys_answer():
    """Two keys whose intervals overlap in time: on their private axes one union and one
    ``covered`` give each key what it gives alone, and touching ends never merge keys."""
    keys = [3, 3, 1, 1, 1]
    starts, ends = [0, 40, 10, 50, 0], [30, 60, 45, 60, 5]  # key 3 up to 60, key 1 from 0
    shift = private_axes(keys, starts, ends)
    both = union(np.add(starts, shift), np.add(ends, shift))
    alone = {k: union([s for s, kk in zip(starts, keys) if kk == k], [e for e, kk in zip(ends, keys) if kk == k])
             for k in (1, 3)}
    assert len(both) == len(alone[1]) + len(alone[3]) and both.total == alone[1].total + alone[3].total
    for k in (1, 3):
        off = int(shift[keys.index(k)])
        assert both.covered([off + 0, off + 20], [off + 60, off + 55]).tolist() == \
            alone[k].covered([0, 20], [60, 55]).tolist()
    with pytest.raises(ValueError, match="private axes"):
        private_axes([0, 1, 2, 3], [0, 0, 0, 0], [2**61, 1, 1, 1])


def test_partition_priority_and_exact_sum():
    parts = partition((0, 100), [("x", union([10], [50])), ("y", union([40], [70])), ("z", union([0], [200]))], rest="r")
    assert {k: v.total for k, v in parts.items()} == {"x": 40, "y": 20, "z": 40, "r": 0}
    parts = partition((0, 100), [("x", union([10], [20]))], rest="r")
    assert parts["r"].total == 90


def test_pipeline_partition_exact(scenario_run):
    table = breakdown_table(partition_run(scenario_run))
    zero = {"tp_exposed": 0, "cp_exposed": 0, "ep_exposed": 0, "hidden_tp": 0, "hidden_cp": 0, "hidden_dp": 0, "hidden_ep": 0}
    # Pipeline window [10, 212): the first pass (stage 0's first forward) to the last (its
    # last backward); stage 1's recv posted at 5 does not widen it. Data moves from both
    # sides posted until the first side is done. Stage 0: compute 20+20+40+40+8; transfer
    # 8+5+4; bubble = window 202 - compute 120 - transfer 17 = 65 (its waits
    # 2+2+36+1+22+2); grad-norm after the window is dp (18); other [0,10) [230,232)
    # [240,260) = 32.
    assert _us(table, 0, 1) == {"time_s": 260, "compute": 128, "pp_transfer": 17, "pp_bubble": 65,
                                "dp_exposed": 18, "other": 32, **zero}
    # Stage 1: transfer 8+5+3+4; bubble = its recv wait inside the window [10, 30) 20 +
    # grad-norm inside the window [170, 212) 42; the wait's [5, 10), on stage 0's set-up
    # before any pass, is other; the grad-norm's remainder [212, 230) is dp.
    assert _us(table, 1, 1) == {"time_s": 260, "compute": 128, "pp_transfer": 20, "pp_bubble": 62,
                                "dp_exposed": 18, "other": 32, **zero}


def test_pipeline_partition_a_rank_at_a_time_is_the_same(scenario_run, monkeypatch):
    """partition_run sweeps the ranks in groups (SWEEP_INTERVALS): one rank per group places
    the same parts, to the nanosecond, as every rank in one sweep."""
    import pptrace.analyzers.partition as partition_mod

    whole = partition_run(scenario_run)
    monkeypatch.setattr(partition_mod, "SWEEP_INTERVALS", 1)
    assert partition_mod._rank_groups(whole.rank, scenario_run.activities, 1) == [(0, 1), (1, 2)]
    apart = partition_run(scenario_run)
    assert set(apart.parts) == set(whole.parts)
    for name, placed in whole.parts.items():
        assert apart.parts[name].starts.tolist() == placed.starts.tolist()
        assert apart.parts[name].ends.tolist() == placed.ends.tolist()
    assert {d: v.tolist() for d, v in apart.hidden.items()} == {d: v.tolist() for d, v in whole.hidden.items()}
    assert breakdown_table(apart).equals(breakdown_table(whole))


def test_pipeline_parts_sum_to_step_to_the_nanosecond(scenario_run):
    for p in partition_run(scenario_run):
        assert sum(iv.total for iv in p.parts.values()) == p.wall_ns == 260 * US


def test_p2p_pairs_and_links(scenario_run):
    pairs, unmatched = match_pairs(scenario_run)
    assert len(pairs) == 4 and unmatched.empty
    got = {(r.src, r.direction, r.mb): (r.wait_ns // US, r.transfer_ns // US) for r in pairs.itertuples()}
    assert got == {(0, "fwd", 0): (25, 8), (0, "fwd", 1): (0, 3), (1, "bwd", 0): (36, 5), (1, "bwd", 1): (22, 4)}
    links = link_table(pairs).set_index(["src", "dst"])
    assert links.loc[(0, 1), "count"] == 2 and links.loc[(0, 1), "bytes"] == 200
    assert round(links.loc[(0, 1), "wait_s"] * 1e6) == 25 and round(links.loc[(0, 1), "transfer_s"] * 1e6) == 11
    assert round(links.loc[(1, 0), "wait_s"] * 1e6) == 58 and round(links.loc[(1, 0), "transfer_s"] * 1e6) == 9


def test_pipeline_stages_bubble_phases_and_theory(scenario_run):
    stages, summary = pipeline_stages(scenario_run, partition_run(scenario_run))
    s0, s1 = stages.iloc[0], stages.iloc[1]
    assert round(s0.bubble_s * 1e6) == 65 and round(s1.bubble_s * 1e6) == 62
    # Stage 0's first backward starts at 104 (its last forward ended at 60): warm-up bubble
    # 2 + 2 + 36 + 1 = 41, cool-down 22 + 2. Stage 1: warm-up to 58 holds its recv wait in the window (20),
    # steady (58..126) none, cool-down the grad-norm's 42 µs inside the window.
    assert [round(s0[k] * 1e6) for k in ("warmup_bubble_s", "steady_bubble_s", "cooldown_bubble_s")] == [41, 0, 24]
    assert [round(s1[k] * 1e6) for k in ("warmup_bubble_s", "steady_bubble_s", "cooldown_bubble_s")] == [20, 0, 42]
    assert round(s0.t_fwd_s * 1e6) == 20 and round(s0.t_bwd_s * 1e6) == 40
    # 1F1B theory, (p-1)(t_f+t_b) = 60 µs of a (m+p-1)(t_f+t_b) = 180 µs step.
    assert round(s0.theory_bubble_s * 1e6) == 60 and round(s0.theory_bubble_balanced_s * 1e6) == 60
    assert summary["theory_bubble_fraction"] == pytest.approx(60 / 180)
    assert summary["bubble_fraction"] == pytest.approx((65 / 260 + 62 / 260) / 2)


def test_theory_formulas():
    t = pd.Series([30.0, 30.0, 30.0, 30.0]).to_numpy()
    w = pd.Series([10.0] * 4).to_numpy()
    assert theory_step("1f1b", 8, 1, t, w) == pytest.approx(11 * 30)
    assert theory_step("interleaved", 8, 2, t, w) == pytest.approx(8 * 30 + 3 * 30 / 2)
    # Qi et al. 2023: ZB-H1's bubble is (p-1)(T_F + T_B - T_W), a third of 1F1B's at equal times.
    assert theory_step("zb-h1", 8, 1, t, w) == pytest.approx(8 * 30 + 3 * 10)
    assert balanced_theory_bubble("gpipe", 4, 1, 30, 0) == 90
    assert balanced_theory_bubble("interleaved", 4, 2, 30, 0) == 45
    assert balanced_theory_bubble("zb-h1", 4, 1, 30, 10) == 30
    # Unequal stages: a slow stage paces every round; the others' bubble grows by m x excess.
    slow = pd.Series([30.0, 35.0, 30.0, 30.0]).to_numpy()
    step = theory_step("1f1b", 8, 1, slow, w * 0)
    assert step - 8 * 30 == pytest.approx(90 + 8 * 5) and step - 8 * 35 == pytest.approx(90)


# ------------------------------------------------------------------------------------------
# scenario 2: nested TP, async CP ring exchange under attention, async DP bucket under
# backward, a fire-and-forget EP all-to-all done by a gloo worker thread
# ------------------------------------------------------------------------------------------
OVERLAP_MAIN = [
    ("ProfilerStep#3", 0, 100),
    ("compute:fwd mb=0", 0, 60),
    ("tp:all_reduce layer=0 bytes=64", 10, 15),            # sync, nested in the forward
    ("cp:send_kv peer=2 step=0 layer=0 bytes=32", 20, 21),  # async exchange posted ...
    ("cp:recv_kv peer=2 step=0 layer=0 bytes=32", 21, 22),
    ("cp:wait op=send_recv_kv step=0 layer=0", 40, 45),     # ... and waited after attention
    ("c10d::allreduce_", 50, 51),                           # enqueued by compute itself: no dim
    ("dp:all_reduce bucket=0 bytes=1024", 70, 71),
    ("c10d::allreduce_", 70, 71),
    ("compute:bwd mb=0", 71, 80),
    ("dp:wait op=all_reduce bucket=0", 80, 90),
    ("ep:all_to_all bytes=16", 92, 93),
    ("c10d::alltoall_base_", 92, 93),
]
OVERLAP_WORKER = [
    ("gloo:all_reduce", 61, 65),     # the compute-enqueued one (FIFO): not communication of a dim
    ("gloo:all_reduce", 72, 85),     # the DP bucket
    ("gloo:all_to_all", 93, 96),     # EP: only the enqueue says it is ep
]


def test_overlap_hidden_exposed_and_worker_attribution(tmp_path):
    layout = Layout(cp=2, dp=2)
    run = run_from_docs(tmp_path, {0: trace_doc(0, 4, OVERLAP_MAIN, OVERLAP_WORKER, layout)}, layout)
    table = breakdown_table(partition_run(run))
    # compute: fwd 60 - nested tp 5 - cp ranges 2 - cp wait 5 = 48, + bwd 9 = 57.
    # cp in progress [20,45): under compute [22,40) 18 hidden, 7 exposed.
    # dp in progress [70,90) (launch to wait end, worker inside): 9 hidden under bwd, 11 exposed.
    # ep [92,93) range + [93,96) worker = 4 exposed. other: [60,70) + [90,92) + [96,100) = 16.
    assert _us(table, 0, 3) == {
        "time_s": 100, "compute": 57, "tp_exposed": 5, "cp_exposed": 7, "dp_exposed": 11, "ep_exposed": 4,
        "pp_transfer": 0, "pp_bubble": 0, "other": 16,
        "hidden_tp": 0, "hidden_cp": 18, "hidden_dp": 9, "hidden_ep": 0,
    }


# ------------------------------------------------------------------------------------------
# scenario 3: data-parallel straggler — rank 1 computes 20 µs longer, arrives last
# ------------------------------------------------------------------------------------------
def _dp_rank(compute_us: int) -> list:
    return [
        ("ProfilerStep#1", 0, 200),
        ("compute:fwd mb=0", 0, compute_us),
        ("dp:all_reduce bucket=0 bytes=8", compute_us, 150),
        ("ProfilerStep#2", 200, 400),
        ("compute:fwd mb=0", 200, 200 + compute_us),
        ("dp:all_reduce bucket=0 bytes=8", 200 + compute_us, 350),
    ]


def test_dp_straggler_named_first(tmp_path):
    layout = Layout(dp=3)
    traces = {r: trace_doc(r, 3, _dp_rank(c), layout=layout) for r, c in ((0, 100), (1, 120), (2, 100))}
    run = run_from_docs(tmp_path, traces, layout)
    parts = partition_run(run)
    found = find_stragglers(parts, None, profiled_waits(run, run.collectives))
    top = found.iloc[0]
    assert int(top["rank"]) == 1
    assert set(found["rank"]) == {1}
    by_metric = {r.metric: r for r in found.itertuples()}
    # compute 120 vs median 100 per step: +20%, 20 µs; last to arrive by 20 µs every step.
    assert by_metric["compute"].slowdown == pytest.approx(0.2)
    assert by_metric["compute"].cost_s == pytest.approx(20e-6)
    assert by_metric["collective_arrival"].cost_s == pytest.approx(20e-6)
    assert by_metric["collective_arrival"].slowdown == pytest.approx(1.0)
    # The others' wait shows as dp exposed: 50 µs vs the culprit's 30.
    table = breakdown_table(parts)
    assert _us(table, 0, 2)["dp_exposed"] == 50 and _us(table, 1, 2)["dp_exposed"] == 30


def test_recv_wait_excludes_the_receivers_own_compute(tmp_path):
    """A recv posted early and waited later (torch.distributed.pipelining, overlap_p2p_comm):
    rank 1 posts its recv at 0 µs, computes 0..60 µs inside it, and the send is posted at
    80 µs. The recv waited only 60..80 µs: 20 µs, not 80."""
    layout = Layout(pp=2)
    traces = {
        0: trace_doc(0, 2, [("ProfilerStep#1", 0, 200), ("compute:fwd mb=0", 0, 80),
                         ("pp:send_fwd peer=1 mb=0", 80, 95)], layout=layout),
        1: trace_doc(1, 2, [("ProfilerStep#1", 0, 200), ("pp:recv_fwd peer=0 mb=0", 0, 90),
                         ("compute:fwd mb=1", 0, 60)], layout=layout),
    }
    pairs, unmatched = match_pairs(run_from_docs(tmp_path, traces, layout))
    assert unmatched.empty and len(pairs) == 1
    assert pairs.loc[0, "wait_ns"] == 20 * US
    assert pairs.loc[0, "transfer_ns"] == 10 * US
