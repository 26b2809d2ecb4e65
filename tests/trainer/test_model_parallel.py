"""Numerics of the reference trainer's model side: every layout (TP, TP+SP, CP ring/Ulysses,
DP) must give the loss and gradients of one process on the same global batch, on real gloo
ranks. The reference is computed in the test process with no process groups at all."""
from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.distributed as dist

import pptrace
from instrumented_model.data import cp_positions, get_microbatch
from instrumented_model.data_parallel import OverlappedGradReducer, finish_grad_sync, make_buckets
from instrumented_model.model import (
    GPTConfig,
    activation_shape,
    build_model_chunks,
    layers_for_chunk,
    num_local_tokens,
)
from instrumented_model.parallel_state import ParallelState, initialize_model_parallel, single_process_state
from instrumented_model.tensor_parallel import shard_full_tensor
from pptrace.naming import parse_name
from pptrace.topology import Layout

from gloo_helpers import run_case_worlds

CFG = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2, seed=7)
M, MBS = 2, 2  # microbatches per dp rank, micro-batch size
REL = 1e-5


def _train(pstate, chunks, num_microbatches, reducer=None, grad_twice=False) -> float:
    """Forward+backward of one step's microbatches (pp=1) and the grad sync; returns this
    rank's share of the global-mean loss."""
    denom = CFG.seq_len * MBS * num_microbatches * pstate.dp_size
    total = 0.0
    for mb in range(num_microbatches):
        if reducer is not None:
            reducer.enable(mb == num_microbatches - 1)
        tokens, labels = get_microbatch(CFG, pstate, 0, mb, MBS, num_microbatches)
        loss = chunks[0](tokens, labels) / denom
        if grad_twice:
            # Walk the retained graph twice, as ZB-H1's separate B and W passes do.
            torch.autograd.grad(loss, [chunks[0].embedding.word.weight], retain_graph=True)
        loss.backward()
        total += loss.item()
    if reducer is not None:
        # Buckets whose all-reduce backward already launched (overlapping it), before finish.
        reducer.launched_during_backward = reducer.launched_buckets
        reducer.finish()
    else:
        finish_grad_sync(chunks, pstate, bucket_bytes=4096)
    return total


def _run_case(case: dict) -> dict:
    layout = Layout(**case["layout"])
    pstate = initialize_model_parallel(
        layout,
        sequence_parallel=case.get("sp", False),
        cp_algo=case.get("cp_algo", "ring"),
        cp_overlap=case.get("cp_overlap", True),
    )
    chunks = build_model_chunks(CFG, pstate)
    reducer = OverlappedGradReducer(chunks, pstate, bucket_bytes=4096) if case.get("overlap_dp") else None
    if case.get("profile_dir"):
        with pptrace.profile(case["profile_dir"], steps="0-0", layout=layout) as prof:
            loss = _train(pstate, chunks, M, reducer)
            prof.step()
    else:
        loss = _train(pstate, chunks, M, reducer, case.get("grad_twice", False))
    tokens, labels = get_microbatch(CFG, pstate, 0, 0, MBS, M)
    with torch.no_grad():
        embedded_shape = tuple(chunks[0].embedding(tokens).shape)
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total, group=pstate.dp_cp_group)
    launched = (reducer.launched_during_backward, len(reducer.buckets)) if reducer else None
    grads = {
        name: (p.grad.clone(), p.tensor_model_parallel, p.partition_dim if p.tensor_model_parallel else 0,
               getattr(p, "partition_stride", 1))
        for name, p in chunks[0].named_parameters()
    }
    return {"loss": total.item(), "tp_rank": pstate.tp_rank, "tp_size": pstate.tp_size, "grads": grads,
            "act_shape": activation_shape(CFG, pstate, MBS), "embedded_shape": embedded_shape,
            "tokens": num_local_tokens(CFG, pstate, MBS), "labels": labels.numel(), "launched": launched}


CASES_2 = {
    "tp2": dict(layout=dict(tp=2)),
    "tp2_sp": dict(layout=dict(tp=2), sp=True),
    "cp2_ring": dict(layout=dict(cp=2), cp_algo="ring", profile="overlap"),
    "cp2_ring_no_overlap": dict(layout=dict(cp=2), cp_algo="ring", cp_overlap=False, profile="no_overlap"),
    "cp2_ulysses": dict(layout=dict(cp=2), cp_algo="ulysses", grad_twice=True),
    "dp2": dict(layout=dict(dp=2)),
    "dp2_overlapped_reducer": dict(layout=dict(dp=2), overlap_dp=True),
}
CASES_4 = {
    "tp2_sp_cp2_ring": dict(layout=dict(tp=2, cp=2), sp=True, grad_twice=True),
    "tp2_sp_cp2_ulysses": dict(layout=dict(tp=2, cp=2), sp=True, cp_algo="ulysses"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_case_worlds(_run_case, {2: CASES_2, 4: CASES_4}, tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def reference():
    """Single-process loss and full gradients, per data-parallel size (global batch size)."""
    refs = {}
    for dp in (1, 2):
        pstate = single_process_state()
        chunks = build_model_chunks(CFG, pstate)
        loss = _train(pstate, chunks, M * dp)
        refs[dp] = (loss, {n: p.grad.clone() for n, p in chunks[0].named_parameters()})
    return refs


def _assert_close(got, want, what):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= REL * scale, f"{what}: max abs error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CASES_2, *CASES_4])
def test_layout_matches_single_process(results, reference, name):
    ranks = results[name]
    dp = (CASES_2 | CASES_4)[name]["layout"].get("dp", 1)
    ref_loss, ref_grads = reference[dp]
    for rank, res in enumerate(ranks):
        assert res["act_shape"] == res["embedded_shape"]
        assert res["tokens"] == res["labels"]
        assert res["loss"] == pytest.approx(ref_loss, rel=REL), f"rank {rank} loss"
        assert set(res["grads"]) == set(ref_grads)
        for pname, (grad, sharded, dim, stride) in res["grads"].items():
            want = ref_grads[pname]
            if sharded:
                want = shard_full_tensor(want, dim, stride, res["tp_rank"], res["tp_size"])
            assert grad.shape == want.shape, pname
            _assert_close(grad, want, f"{name} rank {rank} {pname}")


@pytest.mark.slow
def test_overlapped_reducer_launches_buckets_during_backward(results):
    for res in results["dp2_overlapped_reducer"]:
        launched, buckets = res["launched"]
        assert buckets > 1
        assert launched == buckets, "every bucket's all-reduce should start inside backward"


def _ranges(path, kind="cp"):
    with gzip.open(path) as fh:
        events = json.load(fh)["traceEvents"]
    out = []
    for ev in events:
        parsed = parse_name(ev.get("name", "")) if ev.get("ph") == "X" else None
        if parsed is not None and parsed.kind in (kind, "compute"):
            out.append((parsed, ev["ts"], ev["ts"] + ev["dur"]))
    return out


def _start(item):
    return item[1]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_ring_exchange_overlaps_attention_only_when_asked(results, overlap):
    ranges = _ranges(results["trace_root"] / ("overlap" if overlap else "no_overlap") / "traces" / "rank0.json.gz")
    for layer in range(CFG.layers):
        attn = [r for r in ranges if r[0].op == "attn" and r[0].tags == {"step": 0, "layer": layer}]
        sends = [r for r in ranges if r[0].op == "send_kv" and r[0].tags.get("layer") == layer
                 and r[0].tags.get("step") == 1 and "dir" not in r[0].tags]
        waits = [r for r in ranges if r[0].op == "wait" and r[0].tags.get("layer") == layer
                 and r[0].tags.get("step") == 1 and "dir" not in r[0].tags]
        assert len(attn) == len(sends) == len(waits) == M  # one per microbatch
        attn, sends, waits = sorted(attn, key=_start), sorted(sends, key=_start), sorted(waits, key=_start)
        for (_, a0, a1), (send, s0, _), (_, w0, _) in zip(attn, sends, waits):
            assert send.tags["peer"] == 1
            assert w0 >= a1  # the wait always follows step 0's compute
            if overlap:
                assert s0 < a1, "exchange for step 1 must be posted before step 0's attention ends"
            else:
                assert s0 >= a1, "without overlap the exchange must start after step 0's attention"
    backward = [r for r in ranges if r[0].op in ("send_kv", "recv_kv") and r[0].tags.get("dir") == "bwd"]
    assert len(backward) == 2 * CFG.layers * M


def test_layers_for_chunk_interleaved_assignment():
    cfg = GPTConfig(layers=8)
    # p=2, v=2: rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7 (Megatron).
    assert layers_for_chunk(cfg, 2, 0, 2, 0) == [0, 1]
    assert layers_for_chunk(cfg, 2, 1, 2, 0) == [2, 3]
    assert layers_for_chunk(cfg, 2, 0, 2, 1) == [4, 5]
    assert layers_for_chunk(cfg, 2, 1, 2, 1) == [6, 7]
    assert layers_for_chunk(cfg, 4, 3, 1, 0) == [6, 7]
    every = sorted(l for r in range(2) for c in range(2) for l in layers_for_chunk(cfg, 2, r, 2, c))
    assert every == list(range(8))
    with pytest.raises(ValueError, match="layers=8"):
        layers_for_chunk(cfg, 3, 0, 1, 0)


def test_cp_positions_load_balanced():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="seq_len=6"):
        cp_positions(6, 2, 0)


def test_microbatches_of_dp_ranks_tile_the_single_process_batch():
    single = single_process_state()
    rows = torch.cat([get_microbatch(CFG, single, 3, mb, MBS, 2 * M)[0] for mb in range(2 * M)])
    parts = []
    for dp_rank in range(2):
        layout = Layout(dp=2)
        ps = ParallelState(layout=layout, rank=layout.rank(dp=dp_rank), device=torch.device("cpu"))
        parts += [get_microbatch(CFG, ps, 3, mb, MBS, M)[0] for mb in range(M)]
    assert torch.equal(torch.cat(parts), rows)
    assert not torch.equal(get_microbatch(CFG, single, 4, 0, MBS, 1)[0], get_microbatch(CFG, single, 3, 0, MBS, 1)[0])


def test_config_and_layout_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="hidden=30"):
        GPTConfig(hidden=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="tp=1"):
        single_process_state(sequence_parallel=True)
    with pytest.raises(ValueError, match="cp_algo"):
        single_process_state(cp_algo="tree")
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets([], 0)


def test_pipeline_chunks_chain_to_the_single_process_model():
    """pp=2, vpp=2 chunks run in virtual-stage order in one process equal the whole model:
    layer assignment, pre/post processing and activation_shape fit together."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4, mlp_ratio=2, seed=3)
    layout = Layout(pp=2)
    stages = [ParallelState(layout=layout, rank=layout.rank(pp=r), device=torch.device("cpu")) for r in range(2)]
    per_rank = [build_model_chunks(cfg, ps, vpp=2) for ps in stages]
    assert [c.layer_ids for c in per_rank[0]] == [[0], [2]]
    assert [(c.pre_process, c.post_process) for r in range(2) for c in per_rank[r]] == [
        (True, False), (False, False), (False, False), (False, True)]
    whole = build_model_chunks(cfg, single_process_state())[0]
    tokens, labels = get_microbatch(cfg, stages[0], 0, 0, 2, 1)
    x = tokens
    for chunk in range(2):
        for r in range(2):
            x = per_rank[r][chunk](x, labels)
            if x.dim() == 3:
                assert tuple(x.shape) == activation_shape(cfg, stages[r], 2)
    want = whole(tokens, labels)
    assert torch.allclose(x, want, rtol=REL)
    x.backward()
    want.backward()
    got = {n: p.grad for r in range(2) for c in per_rank[r] for n, p in c.named_parameters()}
    assert set(got) == {n for n, _ in whole.named_parameters()}
    for name, param in whole.named_parameters():
        _assert_close(got[name], param.grad, name)


def test_layouts_that_do_not_split_the_model_are_refused():
    def state(layout, **options):
        return ParallelState(layout=layout, rank=0, device=torch.device("cpu"), **options)

    with pytest.raises(ValueError, match="vocab_size=64 not divisible by tp=3"):
        build_model_chunks(CFG, state(Layout(tp=3)))
    with pytest.raises(ValueError, match=r"heads/tp=4 not divisible by cp=8"):
        build_model_chunks(CFG, state(Layout(cp=8), cp_algo="ulysses"))
    with pytest.raises(ValueError, match="seq_len=16 not divisible by 2\\*cp=32"):
        build_model_chunks(CFG, state(Layout(cp=16)))
