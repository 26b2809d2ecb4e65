"""Mixture of experts over expert parallelism (instrumented_model/expert_parallel.py): on real
gloo ranks, every ep layout (ep inside dp, inside dp x cp, beside tp + SP) gives the loss and
gradients of one process holding every expert; the all-to-alls are traced as ep ranges."""
from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.distributed as dist

import pptrace
from instrumented_model.data import get_microbatch
from instrumented_model.data_parallel import finish_grad_sync
from instrumented_model.expert_parallel import Imbalance, token_splits
from instrumented_model.model import GPTConfig, build_model_chunks
from instrumented_model.parallel_state import initialize_model_parallel, single_process_state
from instrumented_model.train_config import TrainConfig, config_from_args
from pptrace.naming import parse_name
from pptrace.topology import Layout

from gloo_helpers import cases_by_world, run_case_worlds

# 4 experts, top-2, every layer MoE: tokens cross ranks in every layer
CFG = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2, seed=7,
                experts=4, topk=2, moe_every=1)
M, MBS = 2, 2
REL = 1e-5


def _train(pstate, chunks, dp: int, m: int) -> float:
    denom = CFG.seq_len * MBS * m * dp
    total = 0.0
    for mb in range(m):
        tokens, labels = get_microbatch(CFG, pstate, 0, mb, MBS, m)
        loss = chunks[0](tokens, labels) / denom
        loss.backward()
        total += loss.item()
    finish_grad_sync(chunks, pstate, bucket_bytes=4096)
    return total


def _run_case(case: dict) -> dict:
    layout = Layout(**case["layout"])
    pstate = initialize_model_parallel(layout, sequence_parallel=case.get("sp", False))
    chunks = build_model_chunks(CFG, pstate)
    if case.get("profile_dir"):
        with pptrace.profile(case["profile_dir"], steps="0-0", layout=layout) as prof:
            loss = _train(pstate, chunks, layout.dp, M)
            prof.step()
    else:
        loss = _train(pstate, chunks, layout.dp, M)
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total, group=pstate.dp_cp_group)
    # a tp rank's share of a dense replicated grad is whole; experts are not tensor-parallel
    return {"loss": total.item(), "tp_rank": pstate.tp_rank,
            "grads": {n: p.grad.clone() for n, p in chunks[0].named_parameters()
                      if not getattr(p, "tensor_model_parallel", False)}}


CASES = {
    "dp2_ep2": dict(layout=dict(dp=2, ep=2), world=2),
    "dp4_ep2": dict(layout=dict(dp=4, ep=2), world=4, profile="dp4_ep2"),
    "dp2_cp2_ep4": dict(layout=dict(dp=2, cp=2, ep=4), world=4),
    "tp2_sp_dp2_ep2": dict(layout=dict(tp=2, dp=2, ep=2), sp=True, world=4),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_case_worlds(_run_case, cases_by_world(CASES), tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def reference():
    """One process, every expert, the global batch of each dp size."""
    refs = {}
    for dp in (2, 4):
        pstate = single_process_state()
        chunks = build_model_chunks(CFG, pstate)
        loss = _train(pstate, chunks, 1, M * dp)
        refs[dp] = (loss, {n: p.grad.clone() for n, p in chunks[0].named_parameters()})
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_single_process(results, reference, name):
    layout = Layout(**CASES[name]["layout"])
    ref_loss, ref_grads = reference[layout.dp]  # cp cuts sequences, not the batch
    seen = set()
    for rank, res in enumerate(results[name]):
        assert res["loss"] == pytest.approx(ref_loss, rel=REL), f"rank {rank} loss"
        ep_rank = layout.expert_coords(rank)[0]
        per = CFG.experts // layout.ep
        local = {f"experts.{e}." for e in range(ep_rank * per, (ep_rank + 1) * per)}
        for pname, grad in res["grads"].items():
            if ".experts." in pname:
                assert any(tag in pname for tag in local) or layout.ep == 1, (rank, pname)
            want = ref_grads[pname]
            err = (grad - want).abs().max().item()
            assert err <= REL * want.abs().max().item(), f"{name} rank {rank} {pname}: {err:.3g}"
            seen.add(pname)
    # every expert is held (and checked) somewhere
    assert {n for n in ref_grads if ".experts." in n} <= seen


@pytest.mark.slow
def test_all_to_alls_are_traced_as_ep_ranges(results):
    """Each MoE layer's forward: the count exchange and the token dispatch, then the
    combine; backward both again with dir=bwd; compute:expert between them."""
    trace = next((results["trace_root"] / "dp4_ep2" / "traces").glob("rank0.json*"))
    doc = json.loads(gzip.decompress(trace.read_bytes()) if trace.suffix == ".gz" else trace.read_text())
    names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    parsed = [parse_name(n) for n in names if n.startswith(("ep:", "compute:expert"))]
    ops = [(p.kind, p.op, p.tags.get("what"), p.tags.get("dir")) for p in parsed]
    per_layer_fwd = [("ep", "dispatch", "counts", None), ("ep", "dispatch", None, None),
                     ("compute", "expert", None, None), ("ep", "combine", None, None)]
    assert ops[:4] == per_layer_fwd
    assert ops.count(("ep", "combine", None, "bwd")) == ops.count(("ep", "dispatch", None, "bwd")) == 2 * M
    assert all(int(p.tags["bytes"]) > 0 for p in parsed if p.kind == "ep")
    assert doc["pptrace"]["layout"]["ep"] == 2  # layout metadata carries ep


def test_token_splits_put_factor_times_the_mean_on_the_hot_rank():
    assert token_splits(128, 4, None) == [32, 32, 32, 32]
    assert token_splits(128, 4, Imbalance(2, 2.0)) == [21, 21, 64, 22]
    assert sum(token_splits(101, 3, Imbalance(0, 1.5))) == 101


@pytest.mark.parametrize("argv,message", [
    (["--dp", "4", "--ep", "3", "--experts", "6"], "Layout.ep 3 must divide dp\\*cp = 4"),
    (["--dp", "2", "--ep", "2"], "--ep 2 needs MoE layers"),
    (["--dp", "2", "--ep", "2", "--experts", "3"], "--experts 3 must be divisible by --ep 2"),
    (["--experts", "2", "--topk", "3"], "--topk 3 exceeds --experts 2"),
    (["--dp", "2", "--ep", "2", "--experts", "2", "--moe-imbalance", "1:2"],
     "--moe-imbalance skews sleep mode"),
    (["--dp", "2", "--ep", "2", "--experts", "2", "--compute", "sleep", "--moe-imbalance", "2:1"],
     "rank 2 is outside the 2 ep ranks"),
    (["--dp", "2", "--ep", "2", "--experts", "2", "--compute", "sleep", "--moe-imbalance", "1:3"],
     "factor 3 exceeds --ep 2"),
    (["--dp", "2", "--ep", "2", "--experts", "2", "--compute", "sleep", "--moe-imbalance", "x"],
     "must look like RANK:FACTOR"),
])
def test_bad_moe_flags_name_the_bad_value(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(argv)


def test_moe_config_carries_ep_into_the_layout():
    config = TrainConfig(dp=4, ep=2, experts=4, topk=2)
    assert config.layout.ep == 2 and config.layout.to_dict()["ep"] == 2


@pytest.mark.slow
def test_a_model_mode_ep_run_analyses_with_every_collective_complete(results):
    """Each rank's all-to-all sends its own bytes, and the experts' grad sync spans the
    expert-data-parallel group, not dp's: every instance still holds all its ranks."""
    run = pptrace.load_run(results["trace_root"] / "dp4_ep2", progress=False)
    assert run.layout.ep == 2 and not [w for w in run.warnings if "lack ranks" in w], run.warnings
    inst = run.collectives
    assert inst["complete"].all()
    ep = inst[inst["kind"] == "ep"]
    assert len(ep) and set(ep["group"]) == {"0,1", "2,3"}
    edp = inst[inst["name"].str.contains("expert_grads")]
    assert set(edp["group"]) == {"0,2", "1,3"}
