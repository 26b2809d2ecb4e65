"""Megatron-Core's own range names (NVTX only) read as contract ranges where names are classified
(events.classify): the strings megatron-core 0.16.1 really builds, proven by recording the NVTX
ranges of a real Megatron run, and nothing else."""
from __future__ import annotations

import os

import pytest

from pptrace.ingest.schema import classify
from pptrace.ingest.megatron_names import P2P_OPS, parse_megatron_name
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

P2P = "megatron.core.pipeline_parallel.p2p_communication."
INTERLEAVED = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving."


@pytest.mark.parametrize("name, kind, op, tags", [
    (P2P + "recv_forward", "pp", "recv_fwd", {"megatron": "recv_forward"}),
    (P2P + "send_backward", "pp", "send_bwd", {"megatron": "send_backward"}),
    (P2P + "send_forward_recv_backward", "pp", "send_fwd+recv_bwd", {"megatron": "send_forward_recv_backward"}),
    (P2P + "send_backward_recv_forward", "pp", "send_bwd+recv_fwd", {"megatron": "send_backward_recv_forward"}),
    (P2P + "send_forward_backward_recv_forward_backward", "pp", "send_fwd+send_bwd+recv_fwd+recv_bwd",
     {"megatron": "send_forward_backward_recv_forward_backward"}),
    (INTERLEAVED + "warmup", "schedule", "warmup", {"schedule": "interleaved"}),
    (INTERLEAVED + "cooldown", "schedule", "cooldown", {"schedule": "interleaved"}),
    ("attn forward", "compute", "fwd", {"megatron": "attn"}),
    ("mlp backward", "compute", "bwd", {"megatron": "mlp"}),
    ("mlp wgrad", "compute", "bwd_weight", {"megatron": "mlp"}),
    ("loss_func forward", "compute", "fwd", {"megatron": "loss_func"}),
    ("moe_dispatch forward", "ep", "all_to_all", {"megatron": "moe_dispatch", "dir": "fwd"}),
    ("moe_combine backward", "ep", "all_to_all", {"megatron": "moe_combine", "dir": "bwd"}),
])
def test_names(name, kind, op, tags):
    parsed = parse_megatron_name(name)
    assert (parsed.kind, parsed.op, parsed.tags) == (kind, op, tags)
    info = classify(name, "user_annotation")
    expected = {"pp": "p2p", "compute": "compute", "schedule": "other", "ep": "comm:ep"}[kind]
    assert (info["kind"], info["op"], info["category"]) == (kind, op, expected)
    assert info["mb"] is None and info["peer"] is None  # Megatron names neither


@pytest.mark.parametrize("name", [
    # invented forms: Megatron names no class, and its timers write to its log, not a trace
    P2P + "P2PCommunicator.recv_forward", "forward-compute", "backward-compute", "forward-backward",
    # only the interleaved schedule pushes phases
    "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving.warmup",
    INTERLEAVED + "bogus", P2P + "_communicate", "recv_forward", "send_forward_recv_backward",
    # layer ranges enclose the node ranges; dispatch/combine have no weight grad; other names
    "layer_3f", "layer_2f-layer_5b", "moe_dispatch wgrad", "Model forward", "attn  forward", "", "aten::mm",
])
def test_other_names_are_left_alone(name):
    assert parse_megatron_name(name) is None


def test_contract_names_win():
    assert classify("pp:send_fwd peer=1 mb=0", "user_annotation")["op"] == "send_fwd"


def test_megatron_names_in_a_trace_are_classified(tmp_path):
    """Two stages in Megatron names only: the loader gives each its category and contract op."""
    traces = []
    for rank, ranges in enumerate([
        [(INTERLEAVED + "warmup", 8, 1012), ("attn forward", 10, 1010),
         (P2P + "send_forward_recv_backward", 1015, 5000), ("attn backward", 5000, 7000)],
        [(P2P + "recv_forward", 10, 1100), ("attn forward", 1100, 2100), ("attn backward", 2100, 4100),
         (P2P + "send_backward", 4105, 4125)],
    ]):
        t = RankTrace(rank=rank, layout=Layout(pp=2), steps=[1], pptrace_block=False)
        t.step(1, 0, 8000)
        for name, start, end in ranges:
            t.add(name, start, end - start)
        traces.append(t)
    run = load_run(write_run(tmp_path / "run", traces), layout=Layout(pp=2), use_cache=False, progress=False)
    events = run.events[run.events["name"].astype(str).str.contains("megatron|forward|backward")]
    got = sorted(zip(events["rank"], events["category"].astype(str), events["op"].astype(str)))
    assert got == [(0, "compute", "bwd"), (0, "compute", "fwd"), (0, "other", "warmup"),
                   (0, "p2p", "send_fwd+recv_bwd"), (1, "compute", "bwd"), (1, "compute", "fwd"),
                   (1, "p2p", "recv_fwd"), (1, "p2p", "send_bwd")]


@pytest.mark.slow
def test_names_a_real_megatron_run_emits(tmp_path, recorder, monkeypatch):
    """Megatron-Core's interleaved schedule on 2 gloo ranks with its NVTX ranges on, recorded by
    an NVTX injection library as Nsight would: every Megatron name it pushes is read, and the
    schedule's phases and p2p calls are among them."""
    pytest.importorskip("megatron.core")
    from megatron_run import run

    monkeypatch.setenv("NVTX_INJECTION64_PATH", str(recorder))
    monkeypatch.setenv("NVTX_RECORDER_OUT", str(tmp_path / "nvtx.%p.log"))
    run(tmp_path / "run", schedule="interleaved", world=2, microbatches=4, steps=1, profile_steps="0-0",
        mode="plain-noshapes", fwd_ms=1, bwd_ms=1, nvtx=True)
    names = set()
    for log in tmp_path.glob("nvtx.*.log"):
        for line in log.read_text().splitlines():
            fields = line.split(" ", 5)
            if fields[0] == "push" and fields[3] == "(default)":
                names.add(fields[5])
    assert names, f"no default-domain NVTX range recorded ({os.listdir(tmp_path)})"
    assert all(parse_megatron_name(n) is not None for n in names), sorted(names)
    assert {INTERLEAVED + p for p in ("warmup", "steady", "cooldown", "misc")} <= names
    p2p = {n[len(P2P):] for n in names if n.startswith(P2P)}
    assert {"recv_forward", "send_forward_recv_forward", "send_backward_recv_backward"} <= p2p <= set(P2P_OPS)
