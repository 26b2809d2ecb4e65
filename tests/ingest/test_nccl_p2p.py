"""Pipeline p2p of plain NCCL traces: no pptrace range anywhere, only what PyTorch writes.

Four GPU ranks, Layout(pp=2, dp=2): pipelines [0, 2] and [1, 3], Megatron's 1F1B with two
microbatches, two profiled steps. Each send/recv is a ``record_param_comms`` (Collective name
send|recv, ``Dst Rank`` / ``Src Rank`` = the peer's global rank, ``Rank`` = its group rank)
inside ``c10d::send`` / ``c10d::recv_``, launching its own NCCL kernel — except pipeline
[0, 2]'s steady-state exchange (send_forward_recv_backward / send_backward_recv_forward),
posted with batch_isend_irecv: its two ops launch nothing, one ``ncclDevKernel_SendRecv``
carrying both is launched at endCoalescing, outside their scopes. Pipeline [1, 3] posts that
exchange as two plain ops in Megatron's even/odd order. Each step ends with an all_to_all over
the expert group ([0, 1] and [2, 3]), which NCCL also runs as a SendRecv kernel.

The GPU timeline follows NCCL's rules: a comm kernel starts once the compute issued before it
is done; the two kernels of a pair end together, ``X`` after the later one started (the
earlier one spins until then); a forward waits for its activation's recv kernel.
"""
from __future__ import annotations

import numpy as np
import pytest

from pptrace.vocab import PARTS
from pptrace.analyzers.p2p import match_pairs
from pptrace.ingest.frame import build_frame
from pptrace.export.report import build_report
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

LAYOUT = Layout(pp=2, dp=2)
US = 1e-6
STEPS = (1, 2)
NEW_SENDRECV = "ncclDevKernel_SendRecv(ncclDevComm*)"
OLD_SENDRECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
#: pg_name -> (ranks, desc), as every rank's distributedInfo.pg_config lists its groups
GROUPS = {"0": ([0, 1, 2, 3], "default_pg"), "1": ([0, 2], "PIPELINE_MODEL_PARALLEL_GROUP"),
          "2": ([1, 3], "PIPELINE_MODEL_PARALLEL_GROUP"), "3": ([0, 1], "EXPERT_MODEL_PARALLEL_GROUP"),
          "4": ([2, 3], "EXPERT_MODEL_PARALLEL_GROUP")}
ACT_NELEMS = 65536  # bf16: 128 KiB per message
A2A_NELEMS = 1 << 20


def _group_of(rank: int, kind: str) -> str:
    return next(name for name, (ranks, desc) in GROUPS.items() if rank in ranks and desc.startswith(kind))


class NcclRank:
    """One rank's trace as PyTorch + Kineto write it on NCCL: host ops that launch kernels
    (record_param_comms, cudaLaunchKernel with a correlation id, the kernel with the op's
    External id), the host running ahead of the GPU. Records the GPU truth as it goes."""

    def __init__(self, rank: int, old_names: bool = False):
        self.rank = rank
        self.t = RankTrace(rank, layout=LAYOUT, pptrace_block=False)
        # One host, one clock: host_name tells the loader so (plain traces carry no pptrace
        # block with the hostname), and alignment keeps the recorded clocks. Without it, the
        # offsets are the midpoints of what causality allows, tens of µs off on this run.
        self.t.header["host_name"] = "gpu-node-0"
        self.t.header["distributedInfo"] = {
            "backend": "nccl", "rank": rank, "world_size": 4, "nccl_version": "2.21.5",
            "pg_count": len(GROUPS),
            "pg_config": [{"pg_name": n, "pg_desc": d, "backend_config": "cuda:nccl", "pg_size": len(r), "ranks": r}
                          for n, (r, d) in GROUPS.items() if rank in r],
        }
        self.sendrecv = OLD_SENDRECV if old_names else NEW_SENDRECV
        self.host = 0.0   # next host time (µs)
        self.corr = 0
        self.kernels: list = []  # (kind, start, end, step): kind compute | p2p | a2a

    def _ext(self) -> int:
        return self.t._ext + 1  # the External id RankTrace.add gives the next event

    def _launch(self, name: str, ext: int, start: float, end: float, stream: int, kind: str, step: int,
                at: float, runtime: str = "cudaLaunchKernel") -> None:
        self.corr += 1
        self.t.add(runtime, at, 6, cat="cuda_runtime", args={"External id": ext, "correlation": self.corr, "cbid": 211})
        self.t.kernel(name, start, end - start, stream=stream, correlation=self.corr, **{"External id": ext})
        self.kernels.append((kind, start, end, step))

    def step(self, n: int, start: float, dur: float) -> None:
        self.t.step(n, start, dur)
        self.host = start + 20

    def compute(self, start: float, dur: float, step: int) -> None:
        h, ext = self.host, self._ext()
        self.t.add("aten::mm", h, 20, cat="cpu_op")
        self._launch(GEMM, ext, start, start + dur, 7, "compute", step, h + 5)
        self.host += 40

    def _rpc(self, h: float, dur: float, coll: str, peer: int | None, nelems: int, group: str) -> int:
        ranks, desc = GROUPS[group]
        args = {"Collective name": coll, "In msg nelems": nelems, "Out msg nelems": nelems, "Group size": len(ranks),
                "dtype": "BFloat16", "In split size": "[]", "Out split size": "[]",
                "Global rank start": ranks[0], "Global rank stride": ranks[1] - ranks[0],
                "Process Group Name": group, "Process Group Description": desc,
                "Process Group Ranks": str(ranks)}
        if peer is not None:
            args["Rank"] = ranks.index(peer)  # the peer's rank in the group
            args["Dst Rank" if coll == "send" else "Src Rank"] = peer  # its global rank
        ext = self._ext()
        self.t.add("record_param_comms", h, dur, cat="cpu_op", args=args)
        return ext

    def p2p(self, coll: str, peer: int, start: float, end: float, step: int) -> None:
        """isend / irecv on its own: c10d op > record_param_comms > nccl:<op> > launch."""
        h, group = self.host, _group_of(self.rank, "PIPELINE")
        self.t.add("c10d::send" if coll == "send" else "c10d::recv_", h, 34, cat="cpu_op")
        ext = self._rpc(h + 2, 30, coll, peer, ACT_NELEMS, group)
        arrow = f"{self.rank}->{peer}" if coll == "send" else f"{self.rank}<-{peer}"
        self.t.add(f"nccl:{coll} {arrow}", h + 4, 26, cat="user_annotation")
        self._launch(self.sendrecv, ext, start, end, 24, "p2p", step, h + 12)
        self.host += 50

    def batch(self, ops: list, start: float, end: float, step: int) -> None:
        """batch_isend_irecv: each op records its record_param_comms and launches nothing;
        endCoalescing launches one kernel for all, inside no op's scope."""
        group = _group_of(self.rank, "PIPELINE")
        for coll, peer in ops:
            self.t.add("c10d::send" if coll == "send" else "c10d::recv_", self.host, 24, cat="cpu_op")
            self._rpc(self.host + 2, 20, coll, peer, ACT_NELEMS, group)
            self.host += 30
        ext = self._ext()
        self.t.add("nccl:coalesced", self.host, 24, cat="user_annotation")
        self._launch(NEW_SENDRECV, ext, start, end, 24, "p2p", step, self.host + 6, "cudaLaunchKernelExC")
        self.host += 40

    def all_to_all(self, start: float, end: float, step: int) -> None:
        h, group = self.host, _group_of(self.rank, "EXPERT")
        self.t.add("c10d::alltoall_base_", h, 34, cat="cpu_op")
        ext = self._rpc(h + 2, 30, "all_to_all", None, A2A_NELEMS, group)
        self.t.add("nccl:all_to_all", h + 4, 26, cat="user_annotation")
        self._launch(self.sendrecv, ext, start, end, 28, "a2a", step, h + 12)
        self.host += 50


def _one_f_one_b(s0: NcclRank, s1: NcclRank, T: float, F: float, B: float, X: float, step: int,
                 batched: bool, pairs: list) -> tuple[float, float]:
    """Megatron 1F1B, 2 stages, 2 microbatches, GPU times from T; appends the true pairs
    (src, dst, step, send_start, send_end, recv_start, recv_end); returns when each stage
    is ready for the step's all_to_all."""
    r0, r1 = s0.rank, s1.rank

    def pair(src, dst, send_start, recv_start):
        end = max(send_start, recv_start) + X
        pairs.append((src, dst, step, send_start, end, recv_start, end))
        return end

    # warm-up: stage 0 F0, send_forward; stage 1 has posted recv_forward long before
    s0.compute(T, F, step)
    e = pair(r0, r1, T + F, T + 10)
    s0.p2p("send", r1, T + F, e, step)
    s1.p2p("recv", r0, T + 10, e, step)
    s0.compute(T + F, F, step)
    s1.compute(e, F, step)
    s1.compute(e + F, B, step)
    a, g = T + 2 * F, e + F + B  # stage 0 posts act1 / grad0 after F1, stage 1 after B0
    if batched:  # send_forward_recv_backward | send_backward_recv_forward: one kernel each
        h = pair(r0, r1, a, g)
        pair(r1, r0, g, a)
        s0.batch([("send", r1), ("recv", r1)], a, h, step)
        s1.batch([("send", r0), ("recv", r0)], g, h, step)
    else:  # even pipeline rank sends first, odd receives first; one stream per peer pair
        h1 = pair(r0, r1, a, g)
        s0.p2p("send", r1, a, h1, step)
        s1.p2p("recv", r0, g, h1, step)
        h = pair(r1, r0, h1, h1)
        s1.p2p("send", r0, h1, h, step)
        s0.p2p("recv", r1, h1, h, step)
    s0.compute(h, B, step)
    s1.compute(h, F, step)
    s1.compute(h + F, B, step)
    k = h + F + B  # stage 1 sends grad1; stage 0 posted its recv after B0
    m = pair(r1, r0, k, h + B)
    s0.p2p("recv", r1, h + B, m, step)
    s1.p2p("send", r0, k, m, step)
    s0.compute(m, B, step)
    return m + B, m


def _build():
    ranks = [NcclRank(0), NcclRank(1, old_names=True), NcclRank(2), NcclRank(3, old_names=True)]
    pairs: list = []
    for step, T in zip(STEPS, (1000.0, 3000.0)):
        for r in ranks:
            r.step(step, T - 600, 2000)
        slow = 15.0 * (step - 1)  # step 2 runs slower: different numbers per step
        ready_a = _one_f_one_b(ranks[0], ranks[2], T, 100 + slow, 200, 20, step, True, pairs)
        ready_b = _one_f_one_b(ranks[1], ranks[3], T, 120, 180 + slow, 30, step, False, pairs)
        for (u, v), (tu, tv) in (((0, 1), (ready_a[0], ready_b[0])), ((2, 3), (ready_a[1], ready_b[1]))):
            end = max(tu, tv) + 40
            ranks[u].all_to_all(tu, end, step)
            ranks[v].all_to_all(tv, end, step)
    return ranks, pairs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    ranks, pairs = _build()
    out = write_run(tmp_path_factory.mktemp("nccl") / "run", [r.t for r in ranks])
    run = load_run(out, layout=LAYOUT, use_cache=False, progress=False)
    return ranks, pairs, run


def _us(ns) -> int:
    return int(round(ns / 1e3))


def test_clocks_untouched(built):
    """One host, true clocks: alignment leaves them (the exact numbers below rely on it)."""
    _, _, run = built
    assert set(run.offsets["offset_ns"]) == {0}


def test_send_recv_ops_become_inferred_pp_rows(built):
    ranks, pairs, run = built
    ev = run.events
    p2p = ev[ev["category"] == "p2p"]
    assert len(p2p) == 2 * len(pairs)  # one row per side of every message
    assert p2p["inferred"].all() and (p2p["kind"] == "pp").all()
    assert set(p2p["name"].astype(str)) == {"record_param_comms"}
    assert set(p2p["bytes"]) == {2 * ACT_NELEMS}
    # the peer is the global rank (Dst/Src Rank), not the group rank ("Rank")
    assert set(zip(p2p["rank"], p2p["peer"])) == {(0, 2), (2, 0), (1, 3), (3, 1)}
    # the coalesced kernels are p2p, not the "coalesced" range open at endCoalescing
    coalesced = ev[(ev["category"] == "kernel_comm") & (ev["stream"] == 24) & ev["rank"].isin([0, 2])]
    assert "batch_isend_irecv" in set(coalesced["collective"].astype(str))
    assert not ev["inferred"][ev["category"] != "p2p"].any()


def test_every_pair_found_with_exact_wait_and_transfer(built):
    _, truth, run = built
    pairs, unmatched = match_pairs(run)
    assert len(unmatched) == 0 and len(pairs) == len(truth) == 2 * 4 * len(STEPS)
    base = RankTrace(0).raw_ns(0)
    got = sorted((int(p.src), int(p.dst), int(p.step), _us(p.send_start_ns - base), _us(p.recv_start_ns - base),
                  _us(p.wait_ns), _us(p.transfer_ns)) for p in pairs.itertuples())
    want = sorted((src, dst, step, round(ss), round(rs), round(abs(ss - rs)), round(se - max(ss, rs)))
                  for src, dst, step, ss, se, rs, re in truth)
    assert got == want
    # both kinds of wait occur: the receiver's (recv kernel first) and the sender's
    assert any(ss < rs for _, _, _, ss, _, rs, _ in truth) and any(ss > rs for _, _, _, ss, _, rs, _ in truth)


def test_links_and_totals_in_the_report(built):
    _, truth, run = built
    report = build_report(run)
    p2p = report["p2p"]
    n = len(STEPS)
    assert p2p["pairs"] == len(truth) / n and p2p["unmatched"] == 0
    assert round(p2p["wait_s"] / US * n) == sum(abs(ss - rs) for *_, ss, _, rs, _ in truth)
    assert round(p2p["transfer_s"] / US * n) == sum(se - max(ss, rs) for *_, ss, se, rs, _ in truth)
    links = {(link["src"], link["dst"]): link for link in p2p["links"]}
    assert set(links) == {(0, 2), (2, 0), (1, 3), (3, 1)}
    for (src, dst), link in links.items():
        mine = [t for t in truth if (t[0], t[1]) == (src, dst)]
        assert link["count"] * n == len(mine)
        assert link["bytes"] * n == len(mine) * 2 * ACT_NELEMS
        assert round(link["wait_s"] / US * n) == sum(abs(ss - rs) for *_, ss, _, rs, _ in mine)
        assert round(link["transfer_s"] / US * n) == sum(se - max(ss, rs) for *_, ss, se, rs, _ in mine)


def test_all_to_all_stays_a_collective(built):
    ranks, truth, run = built
    inst = run.collectives
    a2a = inst[inst["op"] == "all_to_all"]
    assert len(a2a) == 2 * 2 * len(STEPS) and a2a["complete"].all()
    assert set(a2a["group"]) == {"0,1", "2,3"}
    assert not inst["op"].astype(str).str.contains("send|recv|batch").any()  # p2p kernels kept out
    acts = run.activities
    for r in ranks:
        p2p_us = sum(e - s for kind, s, e, _ in r.kernels if kind == "p2p")
        a2a_us = sum(e - s for kind, s, e, _ in r.kernels if kind == "a2a")
        assert round(acts[r.rank].p2p.total / 1e3) == p2p_us  # p2p kernels never overlap here
        assert round(acts[r.rank].comm["ep"].total / 1e3) == a2a_us
    ep = {c["dim"]: c for c in build_report(run)["collectives"]}["ep"]
    want = sum(e - s for r in ranks for kind, s, e, _ in r.kernels if kind == "a2a") / len(ranks) / len(STEPS)
    assert round(ep["exposed_s"] / US, 3) == want  # no compute runs beside the all_to_alls here


def _mask(spans, lo, hi) -> np.ndarray:
    m = np.zeros(int(hi - lo), bool)
    for s, e in spans:
        m[int(max(s, lo) - lo):int(max(min(e, hi), lo) - lo)] = True
    return m


def test_partition_follows_the_kernel_timeline(built):
    """compute > ep > pp_transfer > pp_bubble (waits and the pipeline window) > other, on a
    1 µs grid built from the kernels alone."""
    ranks, truth, run = built
    report = {r["rank"]: {s["step"]: s for s in r["steps"]} for r in build_report(run)["ranks"]}
    for step in STEPS:
        mine = [t for t in truth if t[2] == step]
        p2p_spans = [(k[1], k[2]) for r in ranks for k in r.kernels if k[0] == "p2p" and k[3] == step]
        pipe = (min(s for s, _ in p2p_spans), max(e for _, e in p2p_spans))
        for r in ranks:
            kern = [k for k in r.kernels if k[3] == step]
            lo, hi = min(k[1] for k in kern), max(k[2] for k in kern)
            compute = _mask([(s, e) for kind, s, e, _ in kern if kind == "compute"], lo, hi)
            ep = _mask([(s, e) for kind, s, e, _ in kern if kind == "a2a"], lo, hi) & ~compute
            moving = [(max(ss, rs), se) for src, dst, _, ss, se, rs, _ in mine if r.rank in (src, dst)]
            transfer = _mask(moving, lo, hi) & ~compute & ~ep
            blocked = _mask([(s, e) for kind, s, e, _ in kern if kind == "p2p"], lo, hi)
            bubble = (blocked | _mask([pipe], lo, hi)) & ~compute & ~ep & ~transfer
            want = {"compute": compute.sum(), "ep_exposed": ep.sum(), "pp_transfer": transfer.sum(),
                    "pp_bubble": bubble.sum(), "tp_exposed": 0, "cp_exposed": 0, "dp_exposed": 0}
            want["other"] = (hi - lo) - sum(want.values())
            got = report[r.rank][step]
            assert round(got["time_s"] / US) == hi - lo
            assert {k: round(v / US) for k, v in got["breakdown_s"].items()} == want, (r.rank, step)
            assert set(got["breakdown_s"]) == set(PARTS)


# -------------------------------------------------------------------------------------------
# single ranks, straight from build_frame
# -------------------------------------------------------------------------------------------
def _frame(r: NcclRank):
    warnings: list = []
    ev, _ = build_frame([(r.t.to_dict()["traceEvents"], None)], r.rank, r.t.base_ns, "x", warnings)
    return ev, warnings


def test_peer_of_a_two_rank_group_without_src_dst_rank():
    """Traces before PyTorch 2.4 name no peer; in a group of two it is the other member."""
    r = NcclRank(2)
    r.step(1, 0, 2000)
    r.p2p("recv", 0, 100, 200, 1)
    r.p2p("send", 0, 300, 400, 1)
    for e in r.t.events:
        for key in ("Src Rank", "Dst Rank", "Rank"):
            e["args"].pop(key, None)
    ev, warnings = _frame(r)
    p2p = ev[ev["category"] == "p2p"].sort_values("start_ns")
    assert list(p2p["op"].astype(str)) == ["recv_fwd", "send_bwd"] and list(p2p["peer"]) == [0, 0]
    assert not warnings


def test_ops_without_peer_or_kernel_are_named_in_a_warning():
    r = NcclRank(0)
    r.step(1, 0, 2000)
    r.p2p("send", 2, 100, 200, 1)
    for e in r.t.events:
        if e["name"] == "record_param_comms":
            e["args"].pop("Dst Rank")
            e["args"]["Process Group Ranks"] = "[0, 1, 2, 3]"
    r.t.events = [e for e in r.t.events if e.get("cat") != "kernel"] + [e for e in r.t.events if e.get("cat") == "kernel"]
    ev, warnings = _frame(r)
    assert not (ev["category"] == "p2p").any()
    assert len(warnings) == 1 and "1 without a peer" in warnings[0] and "Dst Rank" in warnings[0]


def test_pairs_of_different_sizes_are_reported(tmp_path):
    """FIFO pairing is checked against nelems x dtype: a lost op shows as mismatched sizes."""
    s, r = NcclRank(0), NcclRank(2)
    for t in (s, r):
        t.step(1, 0, 2000)
    s.p2p("send", 2, 100, 200, 1)
    r.p2p("recv", 0, 50, 200, 1)
    for e in r.t.events:
        if e["name"] == "record_param_comms":
            e["args"]["In msg nelems"] = e["args"]["Out msg nelems"] = ACT_NELEMS // 2
    run = load_run(write_run(tmp_path / "run", [s.t, r.t]), layout=Layout(pp=2, dp=2), use_cache=False, progress=False)
    assert len(run.pairs) == 1
    assert any("differ in size" in w and "131072 vs 65536" in w for w in run.warnings)


def test_dashboard_and_whatif_on_the_plain_nccl_run(built, tmp_path):
    """The page draws the run; what-if says in one line why it cannot replay it (NCCL traces
    name no passes) instead of failing."""
    from pptrace.analysis import analyze
    from pptrace.export.dashboard import write_page
    from pptrace.whatif.predict import whatif

    _, _, run = built
    html = write_page(analyze(run), tmp_path / "report.html").read_text()
    assert 'id="fig-timeline"' in html
    with pytest.raises(ValueError, match="no pipeline passes"):
        whatif(run)
