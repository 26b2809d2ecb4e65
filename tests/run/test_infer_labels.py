"""torch's ``PP::`` labels of pipeline p2p (issue 24 item 6a).

pytorch#178907 ("[PP] annotate pipeline parallel P2P ops with dist.record_comm", covering
ScheduleGPipe, Schedule1F1B, _ScheduleForwardOnly and _PipelineScheduleRuntime) wraps each
``_batch_p2p`` in ``dist.record_comm(...)`` so that the op shows as ``PP::fwd_send (stage 0)``.
The descs are the schedules' own (torch 2.13 torch/distributed/pipelining/schedules.py:853,
860, 936, 948 ``_sorted_batch_p2p(ops, desc="fwd_recv" | "fwd_send" | "bwd_recv" |
"bwd_send")``, 1105 ``desc="fwd_send_bwd_recv"``, 1127 ``desc="bwd_send_fwd_recv"``).
torch 2.13 has ``dist.record_comm`` (distributed_c10d.py:6887) but its schedules do not call it,
so the traces here are synthetic, laid out as torch 2.13 writes an op under ``record_comm`` on
gloo (measured: the label replaces ``gloo:send`` / ``gloo:recv`` as the main thread's range,
opening inside the ``c10d::send`` / ``c10d::recv_`` post and closing when wait() returns) and
on NCCL (the label replaces ``nccl:send``: inside ``record_param_comms``, around the kernel's
launch; a coalesced batch's around its one launch at endCoalescing).
"""
from __future__ import annotations

import pytest

from pptrace.ingest.frame import build_frame
from pptrace.ingest.p2p_args import p2p_positions, pp_comm_label
from pptrace.run.build import load_run
from pptrace.run.infer.names import name_table
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

BWD = "autograd::engine::evaluate_function: SleepBackward"


def test_labels_parse():
    assert pp_comm_label("PP::fwd_send (stage 0)") == ("fwd", "", 0)
    assert pp_comm_label("PP::bwd_recv (stage 3)") == ("", "bwd", 3)
    assert pp_comm_label("PP::fwd_send_bwd_recv (stage 1)") == ("fwd", "bwd", 1)
    assert pp_comm_label("PP::bwd_send_fwd_recv (stage 12)") == ("bwd", "fwd", 12)
    for other in ("PP::Stage0-Forward1", "PP:0SEND_F1", "gloo:send", "PP::fwd_send (stage x)", None):
        assert pp_comm_label(other) is None
    table = name_table(["PP::fwd_send (stage 2)", "PP::bwd_recv (stage 1)", "PP::fwd_send_bwd_recv (stage 0)"])
    assert table.to_dict("records") == [
        {"kind": "wire", "stage": 2, "act": "", "mb": -1, "send": True, "send_dir": "fwd", "recv_dir": ""},
        {"kind": "wire", "stage": 1, "act": "", "mb": -1, "send": False, "send_dir": "", "recv_dir": "bwd"},
        {"kind": "wire", "stage": 0, "act": "", "mb": -1, "send": True, "send_dir": "fwd", "recv_dir": "bwd"}]
    # the loader reads their args (bytes with record_shapes) as it does gloo's ranges
    assert p2p_positions(["aten::mm", "PP::fwd_send (stage 0)", "gloo:recv", "PP:0F1"]) == [1, 2]


# --------------------------------------------------------------------------------------
# gloo: the label is the main thread's range of the op
# --------------------------------------------------------------------------------------
def _p2p(t: RankTrace, send: bool, peer: int, post: float, end: float, label: str, shapes: bool) -> None:
    """A c10d post (post .. post+4 us) and its labelled range from inside it to ``end``."""
    args = {"Concrete Inputs": ["", "", str(peer), "0"]} if shapes else {}
    t.add("c10d::send" if send else "c10d::recv_", post, 4, cat="cpu_op", args=args)
    t.add(label, post + 2, end - post - 2)


def _op(t: RankTrace, name: str, start: float, end: float) -> None:
    t.add(name, start, end - start, cat="cpu_op")


def _looped(out, shapes: bool):
    """One microbatch through 4 stages on 2 ranks (stage s on rank s % 2, torch's looped
    placement) as _PipelineScheduleRuntime runs it: PP: action ranges and PP:: labelled p2p.
    Rank 1 -> rank 0 carries stage 1's activation to stage 2 (forward) and rank 0 -> rank 1
    stage 2's gradient to stage 1 (backward): the opposite of what rank order says."""
    r0, r1 = (RankTrace(r, world_size=2, pptrace_block=False) for r in (0, 1))
    for t in (r0, r1):
        t.step(1, 0, 2000)
    # (rank trace, action, start, end): forward 100 us, backward 200 us per stage
    r0.add("PP:0F0", 10, 100)
    _op(r0, "aten::mm", 12, 110)
    _p2p(r0, True, 1, 112, 130, "PP::fwd_send (stage 0)", shapes)
    _p2p(r1, False, 0, 5, 130, "PP::fwd_recv (stage 1)", shapes)
    r1.add("PP:1F0", 130, 110)
    _op(r1, "aten::mm", 132, 240)
    _p2p(r1, True, 0, 242, 260, "PP::fwd_send (stage 1)", shapes)
    _p2p(r0, False, 1, 140, 260, "PP::fwd_recv (stage 2)", shapes)
    r0.add("PP:2F0", 260, 110)
    _op(r0, "aten::mm", 262, 370)
    _p2p(r0, True, 1, 372, 390, "PP::fwd_send (stage 2)", shapes)
    _p2p(r1, False, 0, 270, 390, "PP::fwd_recv (stage 3)", shapes)
    r1.add("PP:3F0", 390, 110)
    _op(r1, "aten::mm", 392, 500)
    r1.add("PP:3B0", 500, 205)
    _op(r1, BWD, 502, 700)
    _p2p(r1, True, 0, 702, 720, "PP::bwd_send (stage 3)", shapes)
    _p2p(r0, False, 1, 400, 720, "PP::bwd_recv (stage 2)", shapes)
    r0.add("PP:2B0", 720, 205)
    _op(r0, BWD, 722, 920)
    _p2p(r0, True, 1, 922, 940, "PP::bwd_send (stage 2)", shapes)
    _p2p(r1, False, 0, 730, 940, "PP::bwd_recv (stage 1)", shapes)
    r1.add("PP:1B0", 940, 205)
    _op(r1, BWD, 942, 1140)
    _p2p(r1, True, 0, 1142, 1160, "PP::bwd_send (stage 1)", shapes)
    _p2p(r0, False, 1, 950, 1160, "PP::bwd_recv (stage 0)", shapes)
    r0.add("PP:0B0", 1160, 205)
    _op(r0, BWD, 1162, 1360)
    return write_run(out, [r0, r1])


@pytest.mark.parametrize("shapes", [True, False], ids=["record_shapes", "no_shapes"])
def test_labelled_gloo_p2p_pairs_with_its_direction_and_stage(tmp_path, shapes):
    """Every labelled op is pipeline p2p with the direction and stage its label gives, the
    wrap-around ones included (rank order would read them the other way), paired one to one
    with its peer's; no wait booked as transfer."""
    from pptrace.analysis import analyze

    run = load_run(_looped(tmp_path, shapes), use_cache=False)
    assert (run.layout.pp, run.vpp) == (2, 2)
    pairs = run.pairs
    got = sorted(zip(pairs["src"].astype(int), pairs["dst"].astype(int), pairs["direction"], pairs["chunk"].astype(int)))
    # chunk: the receiving stage's (stage // pp)
    assert got == sorted([(0, 1, "fwd", 0), (1, 0, "fwd", 1), (0, 1, "fwd", 1),
                          (1, 0, "bwd", 1), (0, 1, "bwd", 0), (1, 0, "bwd", 0)])
    ev = run.events
    p2p = ev[ev["category"] == "p2p"]
    assert len(p2p) == 12 and p2p["inferred"].all()
    assert not [w for w in run.warnings if "unmatched" in w or "no matching" in w or "implausible" in w]
    report = analyze(run).to_json()
    for rank in report["ranks"]:
        for step in rank["steps"]:
            # at most the 18 us from each of the rank's 6 pairs' last post to its end; the rest waited
            assert step["breakdown_s"]["pp_transfer"] <= 6 * 18e-6 + 1e-9 < step["breakdown_s"]["pp_bubble"]
    if not shapes:
        assert run.inferred["layout"].startswith("pp2 from the stage ids")
        assert any("record_shapes=True" in w for w in run.warnings)


def test_labelled_1f1b_without_pass_names_finds_its_stages(tmp_path):
    """Schedule1F1B writes no action ranges: with its p2p labelled, the stage ids of the
    labels give the pipeline (no timing needed), the passes come from the ops between posts."""
    r0, r1 = (RankTrace(r, world_size=2, pptrace_block=False) for r in (0, 1))
    for t in (r0, r1):
        t.step(1, 0, 1000)
    _op(r0, "aten::mm", 12, 100)
    _p2p(r0, True, 1, 100, 120, "PP::fwd_send (stage 0)", False)
    _p2p(r1, False, 0, 2, 110, "PP::fwd_recv (stage 1)", False)
    _op(r1, "aten::mm", 110, 200)
    _op(r1, BWD, 210, 350)
    _p2p(r1, True, 0, 355, 380, "PP::bwd_send (stage 1)", False)
    _p2p(r0, False, 1, 231, 380, "PP::bwd_recv (stage 0)", False)
    _op(r0, BWD, 380, 550)
    run = load_run(write_run(tmp_path, [r0, r1]), use_cache=False)
    assert run.inferred["layout"].startswith("pp2 from the stage ids") and run.layout.pp == 2
    assert sorted(zip(run.pairs["src"].astype(int), run.pairs["dst"].astype(int), run.pairs["direction"])) == [
        (0, 1, "fwd"), (1, 0, "bwd")]
    ev = run.events
    passes = ev[ev["category"] == "compute"].sort_values(["rank", "start_ns"])
    assert [(int(r), str(o)) for r, o in zip(passes["rank"], passes["op"])] == [
        (0, "fwd"), (0, "bwd"), (1, "fwd"), (1, "bwd")]


# --------------------------------------------------------------------------------------
# NCCL: the label is around the kernel's launch
# --------------------------------------------------------------------------------------
SENDRECV = "ncclDevKernel_SendRecv(ncclDevComm*)"


class _Gpu:
    """One GPU rank of Layout(pp=2): its pipeline group [0, 1]; each op a record_param_comms
    with its global peer, the label inside it, the launch inside the label."""

    def __init__(self, rank: int):
        self.rank, self.corr = rank, 0
        self.t = RankTrace(rank, layout=Layout(pp=2), pptrace_block=False)
        self.t.header["host_name"] = "gpu-node-0"
        self.t.header["distributedInfo"] = {
            "backend": "nccl", "rank": rank, "world_size": 2, "pg_count": 1,
            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2, "ranks": [0, 1]}]}
        self.t.step(1, 0, 5000)

    def _rpc(self, h: float, dur: float, coll: str, peer: int) -> None:
        self.t.add("record_param_comms", h, dur, cat="cpu_op", args={
            "Collective name": coll, "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float",
            "Group size": 2, "Process Group Name": "0", "Process Group Ranks": "[0, 1]", "Rank": peer,
            "Dst Rank" if coll == "send" else "Src Rank": peer})

    def _launch(self, h: float, gpu: float) -> None:
        self.corr += 1
        self.t.add("cudaLaunchKernel", h, 6, cat="cuda_runtime", args={"correlation": self.corr, "cbid": 211})
        self.t.kernel(SENDRECV, gpu, 50, stream=24, correlation=self.corr)

    def op(self, coll: str, peer: int, h: float, gpu: float, label: str | None) -> None:
        self.t.add("c10d::send" if coll == "send" else "c10d::recv_", h, 40, cat="cpu_op")
        self._rpc(h + 2, 36, coll, peer)
        self.t.add(label or f"nccl:{coll}", h + 4, 30)
        self._launch(h + 10, gpu)

    def batch(self, ops: list, h: float, gpu: float, label: str) -> None:
        for k, (coll, peer) in enumerate(ops):
            self.t.add("c10d::send" if coll == "send" else "c10d::recv_", h + 30 * k, 24, cat="cpu_op")
            self._rpc(h + 30 * k + 2, 20, coll, peer)
        end = h + 30 * len(ops)
        self.t.add(label, end, 24)
        self._launch(end + 6, gpu)


def _ops(g: _Gpu) -> list:
    warnings: list = []
    ev, _ = build_frame([(g.t.to_dict()["traceEvents"], None)], g.rank, g.t.base_ns, "x", warnings)
    p2p = ev[ev["category"] == "p2p"].sort_values("start_ns")
    return [(str(o), int(p)) for o, p in zip(p2p["op"], p2p["peer"])]


def test_nccl_label_gives_the_direction_rank_order_cannot():
    """Rank 1 holds stages 1 and 3, rank 0 stages 0 and 2 (looped, v=2). Its labelled send to
    rank 0 from stage 1 carries an activation to stage 2 (forward, where rank order reads
    backward); a coalesced batch on rank 0 from stage 2 sends a gradient back to stage 1 and
    receives stage 1's next activation, each op its own side's direction. An unlabelled op
    keeps the rank-order reading."""
    g1 = _Gpu(1)
    g1.op("send", 0, 100, 200, "PP::fwd_send (stage 1)")
    g1.op("recv", 0, 300, 400, "PP::bwd_recv (stage 1)")
    g1.op("send", 0, 500, 600, None)
    assert _ops(g1) == [("send_fwd", 0), ("recv_bwd", 0), ("send_bwd", 0)]
    g0 = _Gpu(0)
    g0.batch([("send", 1), ("recv", 1)], 100, 300, "PP::bwd_send_fwd_recv (stage 2)")
    assert _ops(g0) == [("send_bwd", 1), ("recv_fwd", 1)]


# --------------------------------------------------------------------------------------
# real gloo: what torch 2.13 writes for an op under dist.record_comm
# --------------------------------------------------------------------------------------
def _labelled_worker(rank: int, cfg: dict, store: str) -> None:
    """Two ranks, two microbatches of a 1F1B pipeline done by hand with sleeping passes, each
    p2p op posted under the label pytorch#178907 gives it; plain torch.profiler, defaults."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    x = torch.zeros(512)
    peer = 1 - rank

    def p2p(op, label):
        with dist.record_comm(f"PP::{label} (stage {rank})"):
            work = op(x, peer)
        work.wait()

    def compute(ms):  # a pass: ops with Python between them
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        time.sleep(ms / 1e3)
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                                  on_trace_ready=lambda p: p.export_chrome_trace(f"{cfg['out']}/traces/rank{rank}.json"))
    with prof:
        for _ in range(2):
            for mb in range(2):
                if rank == 0:
                    compute(5)
                    p2p(dist.isend, "fwd_send")
                else:
                    p2p(dist.irecv, "fwd_recv")
                    compute(5)
            for mb in range(2):
                if rank == 1:
                    with torch.enable_grad():
                        torch.ones(4, requires_grad=True).sum().backward()  # an autograd run: the backward
                    compute(10)
                    p2p(dist.isend, "bwd_send")
                else:
                    p2p(dist.irecv, "bwd_recv")
                    with torch.enable_grad():
                        torch.ones(4, requires_grad=True).sum().backward()
                    compute(10)
            dist.all_reduce(x)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_what_torch_writes_under_record_comm_on_gloo_is_pipeline_p2p(tmp_path):
    """torch 2.13's own record_comm on gloo: the labels are the main thread's p2p ranges (no
    gloo:send left), read as pipeline p2p with the label's direction and stage, paired."""
    from pipelining_run import spawn_ranks

    (tmp_path / "traces").mkdir()
    spawn_ranks(_labelled_worker, {"out": str(tmp_path)}, 2, 120, "record_comm run")
    run = load_run(tmp_path, use_cache=False)
    ev = run.events
    assert not ev["name"].isin(["gloo:send", "gloo:recv"]).any()
    assert ev["name"].astype(str).str.startswith("PP::").sum() == 8
    assert run.layout.pp == 2 and run.inferred["layout"].startswith("pp2 from the stage ids")
    pairs = run.pairs
    assert sorted(zip(pairs["src"].astype(int), pairs["dst"].astype(int), pairs["direction"], pairs["mb"].astype(int))) \
        == [(0, 1, "fwd", 0), (0, 1, "fwd", 1), (1, 0, "bwd", 0), (1, 0, "bwd", 1)]
