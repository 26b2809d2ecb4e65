"""--ep-overlap (instrumented_model/expert_parallel.py): each MoE layer as two halves, one
half's all-to-all posted async on a group of its own and moved by gloo's worker thread while
the main thread computes the other half's experts. Model mode computes the serial model's
loss and gradients; in sleep mode the truth logs each call from post to completion and the
main thread's posts and waits, so the hidden EP time is known (truth ``overlap_ns``) and
pptrace's ``hidden_ep`` is held to it per rank and step.

One sleep run for the trace checks: dp 2 / ep 2, 2 experts, top-1, one MoE layer, 2
microbatches, 1200 us per token (a half's experts sleep 38.4 ms forward, 76.8 ms backward).
Hidden 131072, so that a call moves 16 MB and takes several milliseconds: the truth's calls
run from the post, a trace's transfers from when gloo's worker picks the op up, 50-100 us
later on a 2-core box and up to ~5 ms when it is busy, so that gap must stay small against
a step's transfers (here pptrace reads 0.4-5% under the logged overlap; with 8 MB calls
1-9%, and 10.6% once with two such runs side by side)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import box
import pptrace
from instrumented_model.data import get_microbatch
from instrumented_model.data_parallel import finish_grad_sync
from instrumented_model.expert_parallel import enable_overlap, overlap_group, overlap_ns
from instrumented_model.model import GPTConfig, build_model_chunks
from instrumented_model.parallel_state import initialize_model_parallel, single_process_state
from instrumented_model.train_config import config_from_args
from pptrace.naming import parse_name
from pptrace.topology import Layout

from gloo_helpers import cases_by_world, run_case_worlds

M, LAYERS, STEPS = 2, 1, ("2", "3", "4")
SLEEP_RUN = ["--dp", "2", "--ep", "2", "--experts", "2", "--topk", "1", "--layers", str(LAYERS),
             "--hidden", "131072", "--compute", "sleep", "--fwd-ms", "2", "--bwd-ms", "2", "--microbatches", str(M),
             "--expert-us-per-token", "1200", "--ep-overlap", "--steps", "5", "--profile-steps", "2-4"]
TOLERANCE = 0.10  # the issue's: hidden EP within 10% of the logged overlap


@pytest.fixture(scope="module")
def sleep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_overlap") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    with box.alone():
        done = subprocess.run([sys.executable, "-m", "instrumented_model.train", *SLEEP_RUN, "--out", str(out)],
                              cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    truth = {int(p.stem[4:]): json.loads(p.read_text()) for p in (out / "truth").glob("rank*.json")}
    return out, truth, pptrace.analyze(out, progress=False)


def _trace(out: Path, rank: int) -> dict:
    return json.loads(gzip.decompress((out / "traces" / f"rank{rank}.json.gz").read_bytes()))


def span(event: dict) -> tuple[int, int]:
    """A trace event's (start, end) in ns of its trace's clock."""
    return round(event["ts"] * 1e3), round((event["ts"] + event["dur"]) * 1e3)


def _main_thread(xs: list) -> tuple:
    """(tid, its user_annotation events) of the thread that computes the experts."""
    main = next(e["tid"] for e in xs if e["name"].startswith("compute:expert"))
    return main, [e for e in xs if e["tid"] == main and e.get("cat") == "user_annotation"]


def _in_step(events: list, window: tuple) -> list:
    return [span(e) for e in events if window[0] <= span(e)[0] < window[1]]


# -- the trace ------------------------------------------------------------------------------
@pytest.mark.slow
def test_transfers_run_on_gloos_worker_under_the_main_threads_experts(sleep_run):
    """The main thread posts and waits (ep:dispatch / ep:combine, ep:wait), four of each per
    MoE layer and pass, two per half; the all-to-alls themselves run on a pt_gloo_runloop
    thread, and some of them while the main thread is inside compute:expert."""
    out, truth, _ = sleep_run
    for rank in truth:
        doc = _trace(out, rank)
        xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
                   if e.get("ph") == "M" and e.get("name") == "thread_name"}
        main, _ = _main_thread(xs)
        ranges = [(e, parse_name(e["name"])) for e in xs if e.get("cat") == "user_annotation"]
        ep = [(e, p) for e, p in ranges if p is not None and p.kind == "ep"]
        assert ep and {e["tid"] for e, _ in ep} == {main}, rank
        posts = [p for _, p in ep if p.op in ("dispatch", "combine")]
        waits = [p for _, p in ep if p.op == "wait"]
        layer_passes = len(STEPS) * M * LAYERS * 2  # profiled steps x microbatches x layers x (fwd, bwd)
        assert len(posts) == len(waits) == 4 * layer_passes, (rank, len(posts), len(waits))
        assert Counter(p.tags["half"] for p in posts) == {0: 2 * layer_passes, 1: 2 * layer_passes}, rank
        moved = [e for e in xs if e["name"] == "gloo:all_to_all"]
        assert len(moved) == len(posts) and main not in {e["tid"] for e in moved}, rank
        assert all("pt_gloo_runloop" in threads.get(e["tid"], "") for e in moved), rank
        experts = [span(e) for e, p in ranges
                   if p is not None and p.kind == "compute" and p.op == "expert" and e["tid"] == main]
        under = overlap_ns([span(e) for e in moved], experts)
        assert under > 0, rank


# -- hidden EP against the truth ------------------------------------------------------------
def _pickup_waits(out: Path, rank: int) -> dict:
    """step -> s the rank computed while a posted exchange waited for gloo's worker to pick
    it up: from the end of each post's range to the start of its gloo:all_to_all (the k-th
    of each: the group has one exchange in flight at a time), under the main thread's
    passes outside its ep ranges. The truth's calls start at the post, a trace's transfers
    at the pick-up: this is the part of the logged overlap no trace can show."""
    xs = [e for e in _trace(out, rank)["traceEvents"] if e.get("ph") == "X"]
    main, on_main = _main_thread(xs)
    posts = sorted(span(e) for e in on_main if e["name"].startswith(("ep:dispatch", "ep:combine")))
    moved = sorted(span(e) for e in xs if e["name"] == "gloo:all_to_all" and e["tid"] != main)
    assert len(posts) == len(moved), (rank, len(posts), len(moved))
    waiting = [(post[1], transfer[0]) for post, transfer in zip(posts, moved) if transfer[0] > post[1]]
    ep = [span(e) for e in on_main if e["name"].startswith("ep:")]
    waits = {}
    for step in STEPS:
        window = next(span(e) for e in on_main if e["name"] == f"ProfilerStep#{step}")
        passes = _in_step([e for e in on_main if e["name"].startswith(("compute:fwd", "compute:bwd"))], window)
        waits[step] = overlap_ns(waiting, passes, ep) / 1e9
    return waits


@pytest.mark.slow
def test_hidden_ep_per_rank_and_step_is_the_logged_overlap(sleep_run):
    """pptrace's hidden_ep per rank and step within 10% of the truth's overlap_ns: calls in
    flight (post to completion) while the main thread ran its pass outside its ep posts
    and waits. Below it, also by the time posted exchanges waited for gloo's worker (read
    from the trace, _pickup_waits: typically 1-3% of the overlap, up to ~10% when the box
    is busy). The part under the expert sleeps is smaller still, and each layer's first and
    last exchange stay exposed."""
    out, truth, analysis = sleep_run
    steps = analysis.steps.set_index(["rank", "step"])
    seen = {}
    for rank, t in truth.items():
        e = t["experts"]
        assert e["overlap"] is True
        pickup = _pickup_waits(out, rank)
        for step in STEPS:
            want = e["overlap_ns"][step] / 1e9
            got = steps.loc[(rank, int(step)), "hidden_ep"]
            seen[(rank, step)] = tuple(round(x * 1e3, 3) for x in (got, want, pickup[step]))  # ms
            assert want > 0 and e["overlap_expert_ns"][step] / 1e9 <= want
            assert want - TOLERANCE * want - pickup[step] <= got <= want + TOLERANCE * want, \
                ("(rank, step): (hidden_ep, logged overlap, pick-up waits) ms", seen)
            assert steps.loc[(rank, int(step)), "ep_exposed"] > 0
    report = analysis.to_json()
    for r in report["ranks"]:
        mine = analysis.steps[analysis.steps["rank"] == r["rank"]]
        assert r["mean"]["hidden_s"]["ep"] == pytest.approx(mine["hidden_ep"].mean(), rel=1e-6)


@pytest.mark.slow
def test_hidden_ep_is_the_workers_transfers_under_the_main_threads_compute(sleep_run):
    """What pptrace reads from each trace, by hand: gloo's all-to-all spans on the worker
    threads intersected with the main thread's passes less its ep ranges (posts, waits),
    per ProfilerStep: equal to hidden_ep within 1%. (The 10% against the truth is for what
    no trace shows: a posted op waiting for its worker.)"""
    out, truth, analysis = sleep_run
    steps = analysis.steps.set_index(["rank", "step"])
    for rank in truth:
        xs = [e for e in _trace(out, rank)["traceEvents"] if e.get("ph") == "X"]
        main, on_main = _main_thread(xs)
        moved = [span(e) for e in xs if e["name"] == "gloo:all_to_all" and e["tid"] != main]
        ep = [span(e) for e in on_main if e["name"].startswith("ep:")]
        for step in STEPS:
            window = next(span(e) for e in on_main if e["name"] == f"ProfilerStep#{step}")
            passes = _in_step([e for e in on_main if e["name"].startswith(("compute:fwd", "compute:bwd"))], window)
            want = overlap_ns(moved, passes, ep) / 1e9
            got = steps.loc[(rank, int(step)), "hidden_ep"]
            assert got == pytest.approx(want, rel=0.01, abs=1e-4), (rank, step, got, want)


@pytest.mark.slow
def test_compute_is_the_sleeps_and_no_wait_reads_as_compute(sleep_run):
    """Compute lies between each rank's logged sleeps (passes and experts) and its logged
    passes less the main thread's ep posts and waits: waiting for an overlapped all-to-all
    is never compute."""
    _, truth, analysis = sleep_run
    steps = analysis.steps.set_index(["rank", "step"])
    for rank, t in truth.items():
        e = t["experts"]
        sleeps = M * (t["sleeps_s"]["fwd"] + t["sleeps_s"]["bwd_input"] + t["sleeps_s"]["bwd_weight"]) \
            + M * sum(len(x) for x in e["layers"]) * (e["fwd_s"] + e["bwd_s"])
        for step in STEPS:
            passes = sum(end - start for *_, start, end in t["steps"][step]) / 1e9
            blocked = sum(end - start for start, end in e["blocked"][step]) / 1e9
            compute = steps.loc[(rank, int(step)), "compute"]
            assert 0.99 * sleeps <= compute <= passes - blocked + 0.002, (rank, step, sleeps, compute, passes - blocked)


# -- numerics -------------------------------------------------------------------------------
# 4 experts, top-2, every layer MoE: tokens cross ranks in every layer; a rank's 32 tokens of
# a microbatch (seq 16 x mbs 2) are cut into halves of 16 (of 8 under cp 2, or tp 2 with SP)
CFG = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2, seed=7,
                experts=4, topk=2, moe_every=1)
MODEL_M, MBS, REL = 2, 2, 1e-5  # microbatches, their size; the serial model's tolerance


def _train(pstate, chunks, dp: int, m: int, split_backward: bool = False) -> float:
    denom = CFG.seq_len * MBS * m * dp
    params = list(chunks[0].parameters())
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    dense = [p for p in params if not getattr(p, "expert_parallel", False)]
    total = 0.0
    for mb in range(m):
        tokens, labels = get_microbatch(CFG, pstate, 0, mb, MBS, m)
        loss = chunks[0](tokens, labels) / denom
        if split_backward:
            # ZB-H1's shape: one walk for some parameters, keeping the graph, then another for
            # the rest: the overlapped backward runs twice, each grad lands once
            torch.autograd.backward(loss, inputs=dense, retain_graph=True)
            torch.autograd.backward(loss, inputs=experts)
        else:
            loss.backward()
        total += loss.item()
    finish_grad_sync(chunks, pstate, bucket_bytes=4096)
    return total


def _run_case(case: dict) -> dict:
    layout = Layout(**case["layout"])
    pstate = initialize_model_parallel(layout, sequence_parallel=case.get("sp", False))
    chunks = build_model_chunks(CFG, pstate)
    enable_overlap(chunks, overlap_group(pstate))
    if case.get("profile_dir"):
        with pptrace.profile(case["profile_dir"], steps="0-0", layout=layout) as prof:
            loss = _train(pstate, chunks, layout.dp, MODEL_M, case.get("split", False))
            prof.step()
    else:
        loss = _train(pstate, chunks, layout.dp, MODEL_M, case.get("split", False))
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total, group=pstate.dp_cp_group)
    return {"loss": total.item(),
            "grads": {n: p.grad.clone() for n, p in chunks[0].named_parameters()
                      if not getattr(p, "tensor_model_parallel", False)}}


CASES = {
    "dp2_ep2": dict(layout=dict(dp=2, ep=2), world=2, profile="dp2_ep2"),
    "dp2_ep2_split_backward": dict(layout=dict(dp=2, ep=2), split=True, world=2),
    "dp2_cp2_ep4": dict(layout=dict(dp=2, cp=2, ep=4), world=4),
    "tp2_sp_dp2_ep2": dict(layout=dict(tp=2, dp=2, ep=2), sp=True, world=4),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_case_worlds(_run_case, cases_by_world(CASES), tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def reference():
    """One process, every expert, serial (a group of one has nothing to overlap)."""
    pstate = single_process_state()
    chunks = build_model_chunks(CFG, pstate)
    loss = _train(pstate, chunks, 1, MODEL_M * 2)  # every case is dp 2: its global batch
    return loss, {n: p.grad.clone() for n, p in chunks[0].named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_overlapped_layer_computes_the_serial_models_loss_and_grads(results, reference, name):
    ref_loss, ref_grads = reference
    seen = set()
    for rank, res in enumerate(results[name]):
        assert res["loss"] == pytest.approx(ref_loss, rel=REL), f"{name} rank {rank} loss"
        for pname, grad in res["grads"].items():
            want = ref_grads[pname]
            err = (grad - want).abs().max().item()
            assert err <= REL * want.abs().max().item(), f"{name} rank {rank} {pname}: {err:.3g}"
            seen.add(pname)
    assert {n for n in ref_grads if ".experts." in n} <= seen


@pytest.mark.slow
def test_model_mode_overlaps_forward_and_backward(results):
    """Each MoE layer's forward and backward: two count exchanges on the main thread, then
    two posts and two waits of each exchange, one per half, backward's tagged dir=bwd."""
    doc = _trace(results["trace_root"] / "dp2_ep2", 0)
    names = [parse_name(e["name"]) for e in doc["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    ep = [(f"wait:{p.tags['op']}" if p.op == "wait" else p.op, p.tags.get("what"), p.tags.get("dir"),
           p.tags.get("half")) for p in names if p is not None and p.kind == "ep"]
    per_layer_fwd = [("dispatch", "counts", None, 0), ("dispatch", "counts", None, 1),
                     ("dispatch", None, None, 0), ("wait:dispatch", None, None, 0),
                     ("dispatch", None, None, 1), ("wait:dispatch", None, None, 1),
                     ("combine", None, None, 0), ("wait:combine", None, None, 0),
                     ("combine", None, None, 1), ("wait:combine", None, None, 1)]
    assert ep[:10] == per_layer_fwd, ep[:10]
    layers_mbs = CFG.layers * MODEL_M
    for op in ("combine", "dispatch", "wait:combine", "wait:dispatch"):
        for half in (0, 1):
            assert ep.count((op, None, "bwd", half)) == layers_mbs, (op, half)
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    main, _ = _main_thread(xs)
    moved = [e for e in xs if e["name"] == "gloo:all_to_all"]
    assert moved and main not in {e["tid"] for e in moved}


# -- the flag and the truth's arithmetic ----------------------------------------------------
def test_ep_overlap_needs_ep():
    with pytest.raises(ValueError, match="--ep-overlap .* needs --ep > 1, got --ep 1"):
        config_from_args(["--ep-overlap"])
    assert config_from_args(["--dp", "2", "--ep", "2", "--experts", "2", "--ep-overlap"]).ep_overlap


def test_overlap_ns_is_the_intersection_less_the_blocked_part():
    calls = [(0, 10), (5, 15), (30, 40)]  # in flight 0-15 and 30-40
    compute = [(8, 35)]
    assert overlap_ns(calls, compute) == 7 + 5
    assert overlap_ns(calls, compute, blocked=[(9, 11), (31, 32)]) == 12 - 2 - 1
    assert overlap_ns([], compute) == 0
