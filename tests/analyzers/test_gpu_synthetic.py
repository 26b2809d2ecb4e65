"""A hand-built two-rank GPU trace with known answers: compute kernels on stream 7, an NCCL
send/recv on stream 20 launched inside record_param_comms and a pp:send_fwd / pp:recv_fwd
range projected onto the stream (gpu_user_annotation), a memcpy, a launch-bound gap.

All times in µs of true time (tracegen). Host launches happen early; the GPU runs later.

rank 0 (stage 0)   GPU: compute [100,300) [350,600) on stream 7, send [250,500) on stream 20
rank 1 (stage 1)   GPU: recv [150,500) stream 20, compute [500,800), idle [800,820),
                        memcpy [820,850) whose launch call is [810,815) on the host

The recv is posted on the GPU 100 µs before the send: wait 100; both posted at 250, the
data moves until 500: transfer 250.
"""
from __future__ import annotations

import pandas as pd
import pytest

from pptrace.timeline.activity import rank_activity
from pptrace.analyzers.gpu_timeline import gpu_timeline
from pptrace.ingest.schema import classify
from pptrace.export.report import build_report
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

LAYOUT = Layout(pp=2)
US = 1e-6


def _launch(t: RankTrace, corr: int, host_us: float, gpu_us: float, dur_us: float, name: str,
            stream: int = 7, cat: str = "kernel") -> None:
    t.add("cudaLaunchKernel", host_us, 5, cat="cuda_runtime", args={"correlation": corr})
    t.kernel(name, gpu_us, dur_us, stream=stream, correlation=corr, cat=cat)


def _p2p(t: RankTrace, op: str, peer: int, gpu_start: float, gpu_end: float) -> None:
    host = t.region(f"pp:{op}", 30, 30, peer=peer, mb=0)
    t.add("record_param_comms", 32, 26, cat="cpu_op",
          args={"Collective name": op.split("_")[0], "Process Group Ranks": "[0, 1]",
                "Process Group Name": "1", "In msg nelems": 1024, "dtype": "Float"})
    _launch(t, 3, 40, gpu_start, gpu_end - gpu_start, "ncclDevKernel_SendRecv(ncclDevComm*)", stream=20)
    t.add(host["name"], gpu_start, gpu_end - gpu_start, cat="gpu_user_annotation", pid=0, tid=20,
          args={"External id": host["args"]["External id"]})


def _traces():
    t0 = RankTrace(rank=0, layout=LAYOUT, steps=[1])
    t0.step(1, 0, 1000)
    _launch(t0, 1, 10, 100, 200, "ampere_sgemm_128x64_nn")
    _launch(t0, 2, 20, 350, 250, "ampere_sgemm_128x64_nn")
    _p2p(t0, "send_fwd", 1, 250, 500)
    t1 = RankTrace(rank=1, layout=LAYOUT, steps=[1])
    t1.step(1, 0, 1000)
    _p2p(t1, "recv_fwd", 0, 150, 500)
    _launch(t1, 1, 70, 500, 300, "ampere_sgemm_128x64_nn")
    _launch(t1, 2, 810, 820, 30, "Memcpy DtoD (Device -> Device)", cat="gpu_memcpy")
    return t0, t1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = write_run(tmp_path_factory.mktemp("gpu") / "run", _traces())
    return load_run(out, use_cache=False, progress=False)


def test_p2p_pairs_on_gpu_extent(run):
    report = build_report(run)
    assert report["p2p"]["pairs"] == 1
    assert round(report["p2p"]["wait_s"] / US) == 100
    assert round(report["p2p"]["transfer_s"] / US) == 250


def test_partition_on_gpu_windows(run):
    ranks = {r["rank"]: r["steps"][0] for r in build_report(run)["ranks"]}
    parts0 = {k: round(v / US) for k, v in ranks[0]["breakdown_s"].items()}
    parts1 = {k: round(v / US) for k, v in ranks[1]["breakdown_s"].items()}
    # GPU windows: first to last GPU activity launched in the step, not the CPU [0, 1000)
    assert round(ranks[0]["time_s"] / US) == 500 and round(ranks[1]["time_s"] / US) == 700
    assert parts0 == {"compute": 450, "pp_transfer": 50, "pp_bubble": 0, "other": 0,
                      "tp_exposed": 0, "cp_exposed": 0, "dp_exposed": 0, "ep_exposed": 0}
    assert parts1 == {"compute": 300, "pp_transfer": 250, "pp_bubble": 100, "other": 50,
                      "tp_exposed": 0, "cp_exposed": 0, "dp_exposed": 0, "ep_exposed": 0}


def test_gpu_timeline_overlap_idle_memcpy_launch_bound(run):
    table = gpu_timeline(run.events).set_index("rank")
    r0, r1 = table.loc[0], table.loc[1]
    us = lambda x: round(x / US)  # noqa: E731
    assert (us(r0.comm_s), us(r0.overlap_s), us(r0.comm_exposed_s), us(r0.idle_s)) == (250, 200, 50, 0)
    assert r0.overlap_pct == pytest.approx(80.0)
    assert (us(r1.comm_s), us(r1.overlap_s), us(r1.memcpy_s), us(r1.memcpy_exposed_s)) == (350, 0, 30, 30)
    assert (us(r1.idle_s), us(r1.launch_bound_s), us(r1.host_launching_s)) == (20, 20, 5)
    assert not r0.launch_bound and not r1.launch_bound  # 20 of 700 µs idle: not worth a hint
    report = build_report(run)
    gpu1 = report["ranks"][1]["steps"][0]["gpu"]
    assert round(gpu1["memcpy_s"] / US) == 30 and round(gpu1["idle_s"] / US) == 20


def test_gpu_timeline_of_all_ranks_is_each_ranks_own(run):
    """All ranks in one pass (private time axes) give every rank the rows it gets alone,
    though both ranks use correlation ids 1..3 and share one clock."""
    ev = run.events
    together = gpu_timeline(ev)
    alone = pd.concat([gpu_timeline(ev[(ev["rank"] == r).to_numpy()]) for r in (0, 1)], ignore_index=True)
    assert len(together) == 2
    pd.testing.assert_frame_equal(together, alone, check_exact=True)


def test_gpu_timeline_swept_a_rank_at_a_time_is_the_same(run, monkeypatch):
    """Ranks are swept CHUNK_ROWS rows at a time so that memory stays bounded: chunks of one
    rank (one row) give the table of one sweep over all of them."""
    import pptrace.analyzers.gpu_timeline as module

    whole = gpu_timeline(run.events)
    monkeypatch.setattr(module, "CHUNK_ROWS", 1)
    pd.testing.assert_frame_equal(gpu_timeline(run.events), whole, check_exact=True)


def test_sendrecv_kernel_of_an_all_to_all_is_a_collective():
    """NCCL runs all_to_all as SendRecv kernels: the launching op decides, not the name."""
    t = RankTrace(rank=0, layout=Layout(dp=2), steps=[1])
    t.step(1, 0, 1000)
    t.add("nccl:all_to_all", 30, 30, cat="user_annotation")
    _launch(t, 5, 40, 200, 100, "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", stream=20)
    t.add("nccl:send", 70, 20, cat="user_annotation")
    _launch(t, 6, 75, 400, 50, "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclWorkElem)", stream=20)
    from pptrace.ingest.frame import build_frame

    ev, _ = build_frame([(t.to_dict()["traceEvents"], None)], 0, t.base_ns, "x", [])
    kernels = ev[ev["category"] == "kernel_comm"].sort_values("start_ns")
    assert list(kernels["collective"].astype(str)) == ["all_to_all", "send"]
    act = rank_activity(ev, 0, Layout(dp=2))
    assert round(act.p2p.total / 1e3) == 50
    assert round(act.comm["ep"].total / 1e3) == 100 and act.unknown_groups == 1


def test_pg_desc_names_the_dim():
    t = RankTrace(rank=0, layout=Layout(tp=2, dp=2), steps=[1])
    t.step(1, 0, 1000)
    t.add("record_param_comms", 30, 30, cat="cpu_op",
          args={"Collective name": "allreduce", "Process Group Name": "7"})
    _launch(t, 5, 40, 200, 100, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", stream=20)
    from pptrace.ingest.frame import build_frame

    ev, _ = build_frame([(t.to_dict()["traceEvents"], None)], 0, t.base_ns, "x", [])
    groups = {"7": {"desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [2, 3]}}
    act = rank_activity(ev, 0, Layout(tp=2, dp=2), groups)
    assert round(act.comm["tp"].total / 1e3) == 100 and act.unknown_groups == 0
    # without the desc, the group's ranks [0, 2] are rank 0's dp group in tp-cp-dp-pp order
    groups = {"7": {"desc": "default_pg", "ranks": [0, 2]}}
    act = rank_activity(ev, 0, Layout(tp=2, dp=2), groups)
    assert round(act.comm["dp"].total / 1e3) == 100 and act.unknown_groups == 0


def test_memcpy_is_neither_compute_nor_comm():
    info = classify("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy")
    assert info["category"] == "memcpy"
