"""Megatron-Core's own range names are read as contract ranges where names are classified
(events.classify), so a Megatron job profiled without pptrace.region still shows its
pipeline p2p, compute and schedule phases."""
from __future__ import annotations

import pytest

from pptrace.events import classify
from pptrace.megatron_names import parse_megatron_name
from pptrace.report import build_report
from pptrace.run import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

P2P = "megatron.core.pipeline_parallel.p2p_communication."
INTERLEAVED = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving."


@pytest.mark.parametrize("name, kind, op", [
    (P2P + "recv_forward", "pp", "recv_fwd"),
    (P2P + "send_backward", "pp", "send_bwd"),
    (P2P + "send_forward_recv_backward", "pp", "send_fwd+recv_bwd"),
    (P2P + "send_backward_recv_forward", "pp", "send_bwd+recv_fwd"),
    (P2P + "P2PCommunicator.send_forward_backward_recv_forward_backward", "pp",
     "send_fwd+send_bwd+recv_fwd+recv_bwd"),
    ("forward-compute", "compute", "fwd"),
    ("backward-compute", "compute", "bwd"),
    ("forward-backward", "schedule", "forward_backward"),
    (INTERLEAVED + "steady", "schedule", "steady"),
    (INTERLEAVED + "cooldown", "schedule", "cooldown"),
])
def test_names(name, kind, op):
    parsed = parse_megatron_name(name)
    assert (parsed.kind, parsed.op) == (kind, op)
    info = classify(name, "user_annotation")
    expected = {"pp": "p2p", "compute": "compute", "schedule": "other"}[kind]
    assert (info["kind"], info["op"], info["category"]) == (kind, op, expected)
    assert info["mb"] is None and info["peer"] is None  # Megatron does not name them


@pytest.mark.parametrize("name", [
    P2P + "_communicate", "recv_forward", INTERLEAVED + "bogus", "forward-compute-x", "", "aten::mm",
])
def test_other_names_are_left_alone(name):
    assert parse_megatron_name(name) is None


def test_contract_names_win():
    assert classify("pp:send_fwd peer=1 mb=0", "user_annotation")["op"] == "send_fwd"


def _stage(rank: int, ranges) -> RankTrace:
    t = RankTrace(rank=rank, layout=Layout(pp=2), steps=[1], pptrace_block=False)
    t.step(1, 0, 8000)
    t.add("forward-backward", 5, 7000)
    for name, start, end in ranges:
        t.add(name, start, end - start)
    return t


def test_megatron_trace_partition(tmp_path):
    """Two stages in Megatron names only (µs): stage 0 forward [10,1010), combined
    send_forward_recv_backward [1015,5000), backward [5000,7000); stage 1 recv_forward
    [10,1100), forward [1100,2100), backward [2100,4100), send_backward [4105,4125).
    Without mb/peer tags the p2p ranges cannot pair: they count as pp_transfer; the rest
    of the pipeline window [10,7000) is bubble; the step outside it is other."""
    t0 = _stage(0, [(INTERLEAVED + "warmup", 8, 1012), ("forward-compute", 10, 1010),
                    (P2P + "send_forward_recv_backward", 1015, 5000), ("backward-compute", 5000, 7000)])
    t1 = _stage(1, [(P2P + "recv_forward", 10, 1100), ("forward-compute", 1100, 2100),
                    ("backward-compute", 2100, 4100), (P2P + "P2PCommunicator.send_backward", 4105, 4125)])
    run = load_run(write_run(tmp_path / "run", [t0, t1]), layout=Layout(pp=2), use_cache=False, progress=False)
    report = build_report(run)
    parts = {r["rank"]: {k: round(v * 1e6) for k, v in r["steps"][0]["breakdown_s"].items() if v}
             for r in report["ranks"]}
    assert parts[0] == {"compute": 3000, "pp_transfer": 3985, "pp_bubble": 5, "other": 1010}
    assert parts[1] == {"compute": 3000, "pp_transfer": 1110, "pp_bubble": 2880, "other": 1010}
    assert any("3 pipeline p2p ranges carry no peer" in w for w in report["warnings"])
    assert not any("without pptrace ranges" in w for w in report["warnings"])
    ops = run.events.loc[run.events["category"] == "p2p", "op"].astype(str)
    assert sorted(ops) == ["recv_fwd", "send_bwd", "send_fwd+recv_bwd"]
