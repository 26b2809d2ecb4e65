"""Plain traces (no pptrace in the run) inferred: pptrace/run/infer/ (issue 12).

Synthetic traces pin the rules to the microsecond: the names torch writes, peers from
"Concrete Inputs", FIFO pairing, passes as the span of their action less the p2p waits (Python
between ops is compute), a loss's own backward() calls no passes, the first stage's set-up no
part of its first forward, the layout from pg_config or the p2p chain, the pipeline and peers
from timing without record_shapes, one line when the structure is implausible. Then real
torch.distributed.pipelining runs on
4 gloo ranks (tests/pipelining_run.py, plain torch.profiler): the pipeline found and marked
inferred, compute against the logged sleeps, idle against the truth's pipeline window,
every send paired.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pptrace.run import infer
from pptrace.run.infer.names import _overlap_parts, name_table
from pptrace.run.infer.p2p import _global_peers
from pptrace.run.infer.pipeline import find_pipeline, fit_layout
from pptrace.ingest.p2p_args import p2p_args
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, write_run
from truth_checks import (Bracket, assert_inside, check_dashboard, check_whatif_replay, compute_brackets, covered,
                          idle_brackets, megatron_frames_to_posts, megatron_sleeps, passes_to_posts_and_own_work,
                          passes_to_posts, sends_per_step, sleeps)


# --------------------------------------------------------------------------------------
# names and args
# --------------------------------------------------------------------------------------
def test_torch_names_parse():
    table = name_table([
        "PP:0F3", "PP:12I7", "PP:5SEND_B2", "PP:1RECV_F0", "PP:(7F5;0B1)OVERLAP_F_B", "PP:1UNSHARD",
        "Forward 3", "Backward 0", "c10d::send", "c10d::recv_", "gloo:send", "gloo:recv",
        "autograd::engine::evaluate_function: AddBackward0", "aten::mm", "Forward pass", None,
    ])[["kind", "stage", "act", "mb", "send"]].to_dict("records")  # PP:: labels: test_infer_labels.py
    assert table[0] == {"kind": "pass", "stage": 0, "act": "F", "mb": 3, "send": False}
    assert table[1] == {"kind": "pass", "stage": 12, "act": "I", "mb": 7, "send": False}
    assert table[2] == {"kind": "pp_p2p", "stage": 5, "act": "B", "mb": 2, "send": True}
    assert table[3] == {"kind": "pp_p2p", "stage": 1, "act": "F", "mb": 0, "send": False}
    assert table[4]["kind"] == "overlap"
    assert _overlap_parts("PP:(7F5;0B1)OVERLAP_F_B") == [(7, "F", 5), (0, "B", 1)]
    assert table[5]["kind"] == "pp_other"
    assert (table[6]["kind"], table[6]["act"], table[6]["mb"]) == ("gpipe", "F", 3)
    assert (table[7]["kind"], table[7]["act"], table[7]["mb"]) == ("gpipe", "B", 0)
    assert [t["kind"] for t in table[8:12]] == ["post", "post", "wire", "wire"]
    assert [t["send"] for t in table[8:12]] == [True, False, True, False]
    assert table[12]["kind"] == "autograd"
    assert [t["kind"] for t in table[13:]] == ["", "", ""]


def test_p2p_args_from_what_torch_writes():
    assert p2p_args("c10d::send", ["", "", "2", "0"], None, None) == {"group_peer": 2, "tag": 0}
    assert p2p_args("c10d::recv_", ["", "", "0", "7"], None, None) == {"group_peer": 0, "tag": 7}
    assert p2p_args("c10d::send", None, None, None) is None  # record_shapes=False
    assert p2p_args("gloo:recv", [""], [[2, 256]], ["float"]) == {"bytes": 2048}
    assert p2p_args("gloo:send", [""], [[4, 8]], ["c10::BFloat16"]) == {"bytes": 64}
    assert p2p_args("gloo:send", [""], [[4, 8]], ["weird"]) is None


# --------------------------------------------------------------------------------------
# a synthetic plain 1F1B run on 2 ranks (no pass names: passes from the ops between posts)
# --------------------------------------------------------------------------------------
def _p2p(t: RankTrace, send: bool, peer: int, post: float, end: float, shapes: bool = True) -> None:
    """A c10d post (post .. post+4 us) and its gloo range (to ``end``), as torch writes them."""
    args = {"Concrete Inputs": ["", "", str(peer), "0"], "Input Dims": [[[2, 256]], [], [], []],
            "Input type": ["TensorList", "", "Scalar", "Scalar"]} if shapes else {}
    t.add("c10d::send" if send else "c10d::recv_", post, 4, cat="cpu_op", args=args)
    wire = {"Input Dims": [[2, 256]], "Input type": ["float"]} if shapes else {}
    t.add("gloo:send" if send else "gloo:recv", post + 4, end - post - 4, args=wire)


def _op(t: RankTrace, name: str, start: float, end: float) -> None:
    t.add(name, start, end - start, cat="cpu_op")


BWD = "autograd::engine::evaluate_function: SleepBackward"
#: rank -> [(op, mb, start us, end us)]: the passes the traces below hold
TRUTH = {
    0: [("fwd", 0, 12, 100), ("fwd", 1, 125, 210), ("bwd", 0, 400, 550), ("bwd", 1, 700, 850)],
    1: [("fwd", 0, 110, 210), ("bwd", 0, 210, 352), ("fwd", 1, 390, 490), ("bwd", 1, 490, 650)],
}


def _plain_1f1b(out: Path, shapes: bool = True, skew_ns: int = 0) -> Path:
    """``skew_ns``: rank 1 on a host of its own, its clock that far off, with two all-reduces
    at the step's end (the user's ``dp:all_reduce`` ranges) that align the clocks."""
    r0 = RankTrace(0, world_size=2, pptrace_block=False)
    r0.step(1, 0, 1000)
    _op(r0, "aten::split", 10, 12)  # the schedule's set-up: no part of the forward
    _op(r0, "aten::mm", 12, 40)
    _op(r0, "aten::mm", 70, 100)  # 30 us between ops: Python of the pass, compute
    _p2p(r0, True, 1, 100, 120, shapes)
    _op(r0, "aten::mm", 125, 160)
    _op(r0, "aten::mm", 180, 210)
    _p2p(r0, True, 1, 210, 230, shapes)
    _p2p(r0, False, 1, 231, 400, shapes)
    _op(r0, BWD, 400, 550)
    _p2p(r0, False, 1, 555, 700, shapes)
    _op(r0, BWD, 700, 850)
    _op(r0, "Optimizer.step#SGD.step", 860, 900)  # after the last post: no pass
    r1 = RankTrace(1, world_size=2, pptrace_block=False, skew_ns=skew_ns)
    r1.step(1, 0, 1000)
    _p2p(r1, False, 0, 2, 110, shapes)
    _op(r1, "aten::mm", 110, 200)
    _op(r1, "aten::mse_loss", 200, 210)
    _op(r1, BWD, 210, 350)
    _op(r1, "aten::detach_", 350, 352)  # the backward's tail, before its send
    _p2p(r1, True, 0, 355, 380, shapes)
    _p2p(r1, False, 0, 380, 390, shapes)
    _op(r1, "aten::mm", 390, 480)
    _op(r1, "aten::mse_loss", 480, 490)
    _op(r1, BWD, 490, 650)
    _p2p(r1, True, 0, 652, 700, shapes)
    _op(r1, "Optimizer.step#SGD.step", 860, 900)
    if skew_ns:
        for rank, t in enumerate((r0, r1)):
            t.header["host_name"] = f"node{rank}"
            for start in (905, 955):  # both leave at once (rank 0 arrives late); the user's own ranges
                arrive = start + 20 * (rank == 0)
                t.region("dp:all_reduce", arrive, start + 40 - arrive)
    return write_run(out, [r0, r1])


def _passes(run, rank: int) -> list:
    """(op, mb, start, end) of a rank's passes, in µs of its own clock from the origin."""
    ev = run.events
    c = ev[(ev["category"] == "compute") & (ev["rank"] == rank)].sort_values("start_ns")
    t0 = RankTrace(rank).raw_ns(0)
    raw = run.raw_ns(c)
    return [(op, int(mb), round((s - t0) / 1e3, 3), round((e - t0) / 1e3, 3))
            for op, mb, s, e in zip(c["op"].astype(str), c["mb"], raw["raw_start_ns"], raw["raw_end_ns"])]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return load_run(_plain_1f1b(tmp_path_factory.mktemp("plain1f1b")), use_cache=False)


def test_synthetic_pipeline_and_marks(synthetic):
    run = synthetic
    assert (run.layout.pp, run.layout.dp) == (2, 1)
    assert [run.layout.coords(r).pp for r in (0, 1)] == [0, 1]
    assert run.schedule == "1f1b" and run.microbatches == 2
    assert {"layout", "peers", "p2p", "passes", "schedule", "microbatches"} <= set(run.inferred)
    assert "0 -> 1" in run.inferred["layout"]
    contract = run.events[run.events["category"].isin(["compute", "p2p"])]
    assert len(contract) and contract["inferred"].all()
    # the foreign rows stay as the trace has them
    assert (run.events.loc[run.events["name"] == "gloo:send", "category"] == "other").all()


def test_synthetic_passes_are_the_ops_between_posts(synthetic):
    for rank, truth in TRUTH.items():
        assert _passes(synthetic, rank) == [(op, mb, float(s), float(e)) for op, mb, s, e in truth]
    # the 30 us without an op inside rank 0's first forward is compute; the split before it,
    # which its other forward does not run, is not
    act = synthetic.activities[0]
    ev = synthetic.events[synthetic.events["rank"] == 0]
    t0 = RankTrace(0).raw_ns(0) + int((ev["start_ns"] - synthetic.raw_ns(ev)["raw_start_ns"]).iloc[0])  # on the aligned clock
    assert act.compute.covered([t0 + 10_000], [t0 + 100_000])[0] == 88_000
    assert not synthetic.events["name"].astype(str).str.contains("between_ops").any()


def test_synthetic_sends_pair_fifo_with_peers_and_directions(synthetic):
    pairs = synthetic.pairs.sort_values(["direction", "mb"])
    assert pairs[["src", "dst", "direction", "mb", "bytes"]].to_numpy().tolist() == [
        [1, 0, "bwd", 0, 2048], [1, 0, "bwd", 1, 2048], [0, 1, "fwd", 0, 2048], [0, 1, "fwd", 1, 2048]]
    # a send spans its post (the data leaves there) to its wait's end
    fwd0 = pairs[(pairs["direction"] == "fwd") & (pairs["mb"] == 0)].iloc[0]
    ev = synthetic.events
    raw = synthetic.raw_ns()
    send, recv = raw.loc[fwd0["send_index"]], raw.loc[fwd0["recv_index"]]
    t0 = RankTrace(0).raw_ns(0)
    assert (send["raw_start_ns"] - t0, send["raw_end_ns"] - t0) == (100_000, 120_000)
    assert (recv["raw_start_ns"] - t0, recv["raw_end_ns"] - t0) == (2_000, 110_000)
    assert not [w for w in synthetic.warnings if "no matching" in w or "peers" in w]


def test_without_record_shapes_the_pipeline_and_peers_come_from_timing(tmp_path):
    """No "Concrete Inputs": rank 0 sends before it receives and rank 1's first recv completes
    after that send (one host, one clock): 0 -> 1. Each send's direction is the pass before
    its post, each recv's the pass after its wait, the peer the neighbouring stage, the k-th
    send paired with the k-th recv; marked inferred, the warning says record_shapes makes it
    exact."""
    run = load_run(_plain_1f1b(tmp_path, shapes=False), use_cache=False)
    warning = [w for w in run.warnings if "record_shapes=True" in w]
    assert len(warning) == 1
    assert "peers of 8 p2p sends/recvs" in warning[0] and "ranks [0, 1]" in warning[0]
    assert "Concrete Inputs" in warning[0] and infer.NO_PEERS_HINT in warning[0]
    assert (run.layout.pp, run.layout.dp) == (2, 1)
    assert run.inferred["layout"].startswith("pp2 inferred from timing") and "0 -> 1" in run.inferred["layout"]
    assert run.inferred["peers"].startswith("inferred")
    pairs = run.pairs.sort_values(["direction", "mb"])
    assert pairs[["src", "dst", "direction", "mb"]].to_numpy().tolist() == [
        [1, 0, "bwd", 0], [1, 0, "bwd", 1], [0, 1, "fwd", 0], [0, 1, "fwd", 1]]
    assert run.schedule == "1f1b" and run.microbatches == 2
    # the passes are still found: the backward's tail on the last stage is no forward
    for rank, truth in TRUTH.items():
        assert [(op, mb) for op, mb, *_ in _passes(run, rank)] == [(op, mb) for op, mb, *_ in truth]
    assert not [w for w in run.warnings if "implausible" in w]


def test_across_hosts_the_start_order_is_read_on_clocks_aligned_by_the_collectives(tmp_path):
    """Rank 1 on another host, its clock 300 us behind: on the raw clocks its first recv
    completes before rank 0's first send was posted, which no pipeline does; the step-end
    all-reduces align the clocks first, and the order 0 -> 1 holds."""
    run = load_run(_plain_1f1b(tmp_path, shapes=False, skew_ns=-300_000), use_cache=False)
    assert (run.layout.pp, run.layout.dp) == (2, 1)
    assert "0 -> 1" in run.inferred["layout"] and "aligned clocks" in run.inferred["layout"]
    assert len(run.pairs) == 4


def test_two_pipelines_from_timing():
    """dp 2 x pp 2, no peers: ranks 0 and 1 send first (two pipelines), ranks 2 and 3 follow in
    the order their first recv completed; a recv completing before any send was posted is
    no pipeline."""
    import pandas as pd

    from pptrace.run.infer.pipeline import _timing_chain

    def ops(rows):  # (rank, is_send, post, end) in step 1
        f = pd.DataFrame(rows, columns=["rank", "is_send", "post_start", "end_ns"])
        return f.assign(step=1, start_ns=f["post_start"] + 5, peer=-1)

    found = _timing_chain(ops([(0, True, 100, 120), (1, True, 110, 130), (2, False, 5, 125), (3, False, 6, 140),
                               (2, True, 300, 320), (3, True, 310, 330)]), None)
    assert found == ({0: 0, 1: 0, 2: 1, 3: 1}, 2, [[0, 2], [1, 3]])
    assert _timing_chain(ops([(0, True, 100, 120), (1, False, 5, 90)]), None) is None
    # on clocks that say rank 1's times read 50 ns early, its recv completes after the send
    assert _timing_chain(ops([(0, True, 100, 120), (1, False, 5, 90)]), {1: -50}) == ({0: 0, 1: 1}, 2, [[0, 1]])


def test_an_unplaced_p2p_wait_is_never_transfer(tmp_path):
    """No peer and no order that a pipeline has (both ranks receive first): the gloo ranges
    stay foreign rows, their time is no pp_transfer."""
    from pptrace.analysis import analyze

    traces = []
    for rank in (0, 1):
        t = RankTrace(rank, world_size=2, pptrace_block=False)
        t.step(1, 0, 1000)
        _p2p(t, False, 1 - rank, 10, 400, shapes=False)
        _op(t, "aten::mm", 400, 500)
        _p2p(t, True, 1 - rank, 500, 520, shapes=False)
        traces.append(t)
    report = analyze(write_run(tmp_path, traces), use_cache=False).to_json()
    assert report["run"]["layout"]["pp"] == 1
    assert all(s["breakdown_s"]["pp_transfer"] == 0 for r in report["ranks"] for s in r["steps"])
    assert any("never booked as transfer" in w for w in report["warnings"])


def test_a_traced_pipeline_is_left_alone(tmp_path):
    """Traces with contract ranges (pptrace in the run) are not inferred."""
    from tracegen import pipeline_run

    pipeline_run(tmp_path, pp=2, microbatches=2, steps=(1,))
    run = load_run(tmp_path, use_cache=False)
    assert run.inferred == {} and not run.events["inferred"].any()


LOSS_BWD = "autograd::engine::evaluate_function: MmBackward0"


def test_a_losss_own_backward_calls_and_a_wait_inside_a_pass_are_no_passes(tmp_path):
    """torchtitan's chunked loss calls backward() per chunk between the last stage's forward
    and its backward, with no post between: the stage's backward is the last autograd run
    before its send, the earlier ones its forward's loss. torch's 1F1B clears the previous
    forward send after the next forward (a wait returning inside the ops between two posts):
    the forward ends with its last op before that wait."""
    r0 = RankTrace(0, world_size=2, pptrace_block=False)
    r0.step(1, 0, 1000)
    _op(r0, "aten::mm", 10, 100)
    _p2p(r0, True, 1, 100, 300)       # waited at 300, after the next forward
    _op(r0, "aten::mm", 105, 200)
    _op(r0, "aten::detach", 300, 302)  # the next send's output, after the wait
    _p2p(r0, True, 1, 305, 330)
    _p2p(r0, False, 1, 331, 500)
    _op(r0, BWD, 500, 600)
    _p2p(r0, False, 1, 605, 800)
    _op(r0, BWD, 800, 900)
    r1 = RankTrace(1, world_size=2, pptrace_block=False)
    r1.step(1, 0, 1000)
    _p2p(r1, False, 0, 2, 110)
    for start in (110, 400):  # forward, the loss's two chunks (each with its backward()), backward
        _op(r1, "aten::mm", start, start + 90)
        _op(r1, "aten::mse_loss", start + 90, start + 95)
        _op(r1, LOSS_BWD, start + 95, start + 100)
        _op(r1, "aten::mse_loss", start + 102, start + 105)
        _op(r1, LOSS_BWD, start + 105, start + 110)
        _op(r1, "aten::ones_like", start + 112, start + 114)  # torch's stage code between loss and backward
    _op(r1, BWD, 230, 350)
    _p2p(r1, True, 0, 355, 380)
    _p2p(r1, False, 0, 380, 400)
    _op(r1, BWD, 520, 640)
    _p2p(r1, True, 0, 652, 700)
    run = load_run(write_run(tmp_path, [r0, r1]), use_cache=False)
    assert _passes(run, 0) == [("fwd", 0, 10.0, 100.0), ("fwd", 1, 105.0, 200.0), ("bwd", 0, 500.0, 600.0),
                               ("bwd", 1, 800.0, 900.0)]
    assert _passes(run, 1) == [("fwd", 0, 110.0, 224.0), ("bwd", 0, 230.0, 350.0), ("fwd", 1, 400.0, 514.0),
                               ("bwd", 1, 520.0, 640.0)]
    assert (run.schedule, run.microbatches) == ("1f1b", 2)
    assert not [w for w in run.warnings if "implausible" in w]


def test_an_implausible_structure_is_said_in_one_line_and_the_p2p_count_wins():
    """72 forwards a step where the p2p carries 8 microbatches, 2 ms passes in a 1.4 s step."""
    import pandas as pd

    from pptrace.run.infer.consistency import check_structure
    from pptrace.run.infer.result import Inference

    n = 72
    passes = pd.DataFrame({"rank": 1, "step": 1, "start_ns": np.arange(2 * n) * 3_000_000,
                           "op": ["fwd", "bwd"] * n, "mb": np.repeat(np.arange(n), 2), "chunk": 0})
    passes["end_ns"] = passes["start_ns"] + 2_000_000
    ops = pd.DataFrame({"rank": [0] * 8 + [1] * 8, "step": 1, "is_send": [True] * 8 + [False] * 8, "dir": "fwd"})
    steps = pd.DataFrame({"rank": [0, 1], "step": 1, "start_ns": 0, "end_ns": 1_400_000_000})
    out = Inference(events=None, microbatches=n, vpp=1)
    check_structure(passes, ops, steps, {0: 0, 1: 1}, 2, False, out)
    assert out.microbatches == 8 and "the passes disagree" in out.inferred["microbatches"]
    (line,) = out.warnings
    assert line.startswith("the inferred pipeline looks implausible: the p2p carries 8 microbatches")
    assert "rank 1 step 1 runs 72 forwards and 72 backwards, not 8" in line
    assert "rank 1's median pass is 2.00 ms" in line
    # the same passes, right in number and size: nothing to say
    fine = passes[passes["mb"] < 8].assign(end_ns=lambda f: f["start_ns"] + 80_000_000)
    out = Inference(events=None, microbatches=8, vpp=1)
    check_structure(fine, ops, steps, {0: 0, 1: 1}, 2, False, out)
    assert out.warnings == [] and out.microbatches == 8


# --------------------------------------------------------------------------------------
# named passes: the recv wait they include is cut off
# --------------------------------------------------------------------------------------
def test_named_pass_starts_after_its_recv_wait_and_ends_before_its_send(tmp_path):
    r0 = RankTrace(0, world_size=2, pptrace_block=False)
    r0.step(1, 0, 1000)
    r0.add("PP:0F0", 10, 110)
    _op(r0, "aten::mm", 20, 100)
    r0.add("PP:0SEND_F0", 120, 10)
    _p2p(r0, True, 1, 121, 900)  # waited at the end of the step
    r1 = RankTrace(1, world_size=2, pptrace_block=False)
    r1.step(1, 0, 1000)
    r1.add("PP:1RECV_F0", 5, 10)
    _p2p(r1, False, 0, 6, 300)   # posted early, waited inside PP:1F0
    r1.add("PP:1F0", 50, 400)
    _op(r1, "aten::mm", 300, 440)
    run = load_run(write_run(tmp_path, [r0, r1]), use_cache=False)
    assert _passes(run, 0) == [("fwd", 0, 20.0, 100.0)]
    assert _passes(run, 1) == [("fwd", 0, 300.0, 440.0)]
    assert run.inferred["layout"].startswith("pp2 from the stage ids")
    assert run.pairs[["src", "dst", "direction", "mb", "chunk"]].to_numpy().tolist() == [[0, 1, "fwd", 0, 0]]


# --------------------------------------------------------------------------------------
# layout from pg_config: Megatron's group names, group ranks -> global ranks
# --------------------------------------------------------------------------------------
def _megatron_metas(world=4, pp=2):
    layout = Layout(pp=pp, dp=world // pp)
    metas = {}
    for r in range(world):
        groups = [{"pg_name": "0", "pg_desc": "default_pg", "ranks": list(range(world))},
                  {"pg_name": "1", "pg_desc": "PIPELINE_MODEL_PARALLEL_GROUP", "ranks": layout.group_ranks("pp", r)},
                  {"pg_name": "2", "pg_desc": "DATA_PARALLEL_GROUP", "ranks": layout.group_ranks("dp", r)}]
        metas[r] = {"world_size": world, "distributed": {"pg_config": groups}}
    return metas, layout


def test_layout_and_peers_from_megatron_process_groups():
    metas, truth = _megatron_metas()
    assert truth.group_ranks("pp", 1) == [1, 3]
    # group rank 1 of rank 1's pipeline group [1, 3] is global rank 3
    peers = _global_peers(np.array([0, 1, 3]), np.array([1, 1, 0]), metas)
    assert peers.tolist() == [2, 3, 1]
    out = infer.Inference(events=None)
    stage_of, pp, v = find_pipeline(name_table([]).assign(rank=[]), None, metas, out)
    assert (pp, v) == (2, 1) and stage_of == {0: 0, 1: 0, 2: 1, 3: 1}
    assert fit_layout(stage_of, pp, 4, metas, out) == truth
    assert "pipeline process group" in out.inferred["layout"]


def test_a_stage_order_no_layout_has_is_reported():
    out = infer.Inference(events=None)
    layout = fit_layout({0: 0, 1: 2, 2: 1, 3: 3}, 4, 4, {}, out)
    assert layout.pp == 4
    assert any("fits no Megatron-style layout" in w for w in out.warnings)


# --------------------------------------------------------------------------------------
# real torch.distributed.pipelining runs, plain torch.profiler
# --------------------------------------------------------------------------------------
RUN = dict(world=4, microbatches=8, steps=3, profile_steps="1-2", fwd_ms=20, bwd_ms=40)
PROFILED = (1, 2)
REAL = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
#: what the inference calls each schedule (torch's class names where its names say which)
NAMED = {"Schedule1F1B": "1f1b"}


@dataclass
class Plain:
    schedule: str
    run: object
    analysis: object  # pptrace.Analysis of run
    truth: dict

    @property
    def report(self) -> dict:
        return self.analysis.to_json()


@pytest.fixture(scope="module", params=REAL)
def plain(request, tmp_path_factory) -> Plain:
    from pipelining_run import load_truth, run
    from pptrace.analysis import analyze

    out = run(tmp_path_factory.mktemp(request.param) / "run", request.param, mode="plain", **RUN)
    loaded = load_run(out, use_cache=False)
    return Plain(request.param, loaded, analyze(loaded), load_truth(out))


@pytest.mark.slow
def test_plain_pipeline_found_and_marked_inferred(plain):
    run, truth = plain.run, plain.truth
    assert (run.layout.pp, run.layout.dp, run.layout.tp, run.layout.cp) == (4, 1, 1, 1)
    assert [run.layout.coords(r).pp for r in sorted(truth)] == [truth[r]["pp_rank"] for r in sorted(truth)]
    assert run.schedule == NAMED.get(plain.schedule, plain.schedule)
    assert run.microbatches == 8 and run.vpp == truth[0]["vpp"]
    assert {"layout", "peers", "p2p", "passes", "schedule", "microbatches"} <= set(run.inferred)
    ev = run.events
    assert ev.loc[ev["category"].isin(["compute", "p2p"]), "inferred"].all()
    assert plain.report["run"]["layout"]["pp"] == 4


@pytest.mark.slow
def test_plain_compute_lies_between_the_sleeps_and_the_passes(plain):
    """Compute is the passes (from where their input's wait returned to their last op, Python
    between them included): at least the sleeps, at most the passes as torch ran them
    (autograd and the profiler around each sleep) stretched to the p2p calls beside them, plus
    the rank's work outside the schedule."""
    assert_inside(compute_brackets(plain.report, plain.truth, PROFILED, sleeps, passes_to_posts_and_own_work),
                  "compute")


@pytest.mark.slow
def test_plain_bubble_and_p2p_lie_within_the_idle_time(plain):
    """Idle in the pipeline window, within this rank's own step (what precedes it belongs to
    its previous step): at least the first to the last pass less the passes stretched to the
    p2p calls beside them (what a plain pass may hold: see the compute check), at most the
    earliest call of schedule.step() to the latest return less the sleeps."""
    assert_inside(idle_brackets(plain.report, plain.truth, PROFILED, sleeps, passes_to_posts), "bubble + p2p")


@pytest.mark.slow
def test_plain_sends_pair_with_their_recvs(plain):
    expected = sends_per_step(plain.truth)
    ev = plain.run.events
    p2p = ev[(ev["category"] == "p2p") & ev["step"].isin(PROFILED)]
    assert p2p["op"].astype(str).isin(["send_fwd", "send_bwd", "recv_fwd", "recv_bwd"]).all()
    assert p2p["peer"].notna().all()
    assert len(p2p) == 2 * expected * len(PROFILED)
    assert plain.report["p2p"]["pairs"] == expected
    assert not [w for w in plain.report["warnings"] if "no matching" in w or "unmatched" in w]


@pytest.mark.slow
def test_plain_whatif_replays_the_measured_schedule(plain):
    check_whatif_replay(plain.run, plain.run.schedule)


@pytest.mark.slow
def test_plain_dashboard_page_is_written(plain, tmp_path):
    check_dashboard(plain.analysis, tmp_path / "report.html")


def _pass_bracket(compute, least: list, most: list) -> Bracket:
    """A rank-step's inferred passes (its compute rows) against its sleeps and the
    framework's spans around them. An inferred pass runs from one p2p post to the next, so it
    takes in the schedule's own bookkeeping beside the pass function (torch's stage send/recv
    op building, Megatron's deallocate_output_tensor and its interleaved helpers' tensor
    handling): ``most`` is the framework's spans stretched to the p2p calls around them
    (passes_to_posts, megatron_frames_to_posts)."""
    lo, hi = min(a for a, _ in most), max(b for _, b in most)
    return Bracket(compute["dur_ns"].sum() / 1e9, covered(least, lo, hi) / 1e9, covered(most, lo, hi) / 1e9)


@pytest.mark.slow
def test_plain_without_record_shapes_warns_and_still_finds_the_passes(tmp_path):
    from pipelining_run import load_truth, run

    out = run(tmp_path / "run", "Schedule1F1B", mode="plain-noshapes", **RUN)
    loaded = load_run(out, use_cache=False)
    warning = [w for w in loaded.warnings if infer.NO_PEERS_HINT in w]
    assert len(warning) == 1 and "ranks [0, 1, 2, 3]" in warning[0]
    truth = load_truth(out)
    ev = loaded.events
    brackets = {}
    for rank, t in truth.items():
        for step in PROFILED:
            mine = ev[(ev["category"] == "compute") & (ev["rank"] == rank) & (ev["step"] == step)]
            assert (mine["op"] == "fwd").sum() == (mine["op"] == "bwd").sum() == 8
            brackets[rank, step] = _pass_bracket(mine, sleeps(t, step), passes_to_posts(t, step))
    assert_inside(brackets, "inferred passes")


@pytest.mark.slow
def test_plain_device_mesh_pipelines_from_mesh_pp(tmp_path):
    """dp = 2: two pipelines of 2 stages, the pp group named by DeviceMesh ("mesh_pp");
    the peers in "Concrete Inputs" are ranks of that group."""
    from pipelining_run import load_truth, run

    out = run(tmp_path / "run", "Schedule1F1B", mode="plain", **{**RUN, "dp": 2, "microbatches": 4})
    loaded, truth = load_run(out, use_cache=False), load_truth(out)
    assert (loaded.layout.pp, loaded.layout.dp) == (2, 2)
    assert "pipeline process group" in loaded.inferred["layout"]
    for rank, t in truth.items():
        assert loaded.layout.group_ranks("pp", rank) == t["pp_ranks"]
        assert loaded.layout.coords(rank).pp == t["pp_rank"]
    pairs = loaded.pairs[loaded.pairs["step"].isin(PROFILED)]
    assert len(pairs) == 2 * 2 * 4 * len(PROFILED)  # 2 replicas x (fwd + bwd) x 4 microbatches
    assert {(int(s), int(d)) for s, d in zip(pairs["src"], pairs["dst"])} == {
        (a, b) for g in ({0: [0, 2], 1: [1, 3]}).values() for a, b in ((g[0], g[1]), (g[1], g[0]))}


@pytest.mark.slow
@pytest.mark.parametrize("schedule, world", [("1f1b", 4), ("interleaved", 4), ("interleaved", 2)])
def test_plain_megatron_core(tmp_path, schedule, world):
    """Megatron-Core names nothing in a torch.profiler trace: the layout comes from its
    PIPELINE_MODEL_PARALLEL_GROUP, passes from the ops between posts, and the schedule, with
    every pass's microbatch and model chunk, from their order. With two stages the stage
    order cannot tell the interleaved schedule's forward wrap-around from a backward message:
    the directions come from the passes (test_infer_pp2.py), with no warning."""
    pytest.importorskip("megatron.core")
    from megatron_run import load_truth, run

    out = run(tmp_path / "run", schedule, world=world, microbatches=8, steps=3, profile_steps="1-2", mode="plain",
              fwd_ms=20, bwd_ms=40)
    loaded, truth = load_run(out, use_cache=False), load_truth(out)
    assert (loaded.layout.pp, loaded.layout.dp) == (world, 1)
    assert [loaded.layout.coords(r).pp for r in sorted(truth)] == [truth[r]["pp_rank"] for r in sorted(truth)]
    assert (loaded.schedule, loaded.microbatches, loaded.vpp) == (schedule, 8, 2 if schedule == "interleaved" else 1)
    ev = loaded.events
    brackets = {}
    for rank, t in truth.items():
        for step in PROFILED:
            mine = ev[(ev["category"] == "compute") & (ev["rank"] == rank) & (ev["step"] == step)]
            brackets[rank, step] = _pass_bracket(mine, megatron_sleeps(t, step), megatron_frames_to_posts(t, step))
            # each logged pass lies in an inferred pass with its op, microbatch and chunk
            for p in (p for p in t["passes"] if p["step"] == step):
                mid = (p["start_ns"] + p["end_ns"]) // 2
                raw = loaded.raw_ns(mine)
                hit = mine[(raw["raw_start_ns"] <= mid) & (raw["raw_end_ns"] >= mid)]
                assert [(str(o), int(m), int(c)) for o, m, c in zip(hit["op"], hit["mb"], hit["chunk"])] == [
                    (p["op"], p["mb"], p["chunk"])], (rank, step, p)
    assert_inside(brackets, "inferred passes")
    from pptrace.whatif.predict import whatif

    assert abs(whatif(loaded)["replay"]["error_fraction"]) < 0.10
    boundaries = world * (2 if schedule == "interleaved" else 1) - 1
    assert len(loaded.pairs[loaded.pairs["step"].isin(PROFILED)]) == 2 * boundaries * 8 * len(PROFILED)
    assert not [w for w in loaded.warnings if "no matching" in w or "implausible" in w]
