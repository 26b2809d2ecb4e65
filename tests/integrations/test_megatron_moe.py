"""Megatron-Core's MoE layer (alltoall token dispatcher) profiled with nothing but ``pptrace.profile``.

Megatron's own ``MoELayer`` s (2 layers, 4 experts, top-2, a router skewed towards expert 0 on ep
rank 0) train on 2 gloo ranks (dp = ep = 2) through Megatron's ``forward_backward_no_pipelining``
(tests/megatron_moe_run.py, which says what it stands in for on the CPU). The analysis is
checked against what the same run logged outside pptrace: every ``all_to_all_single`` the
dispatcher made (splits, rows, wall time), the count exchange's all-gathers, the tokens each
local expert was handed. Then the patches: restored on remove, refused dispatchers, never a crash.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'pptrace[megatron]')")
from megatron.core.tensor_parallel import mappings  # noqa: E402
from megatron.core.transformer.moe import moe_layer, token_dispatcher  # noqa: E402

from megatron_moe_run import run  # noqa: E402
from megatron_run import load_truth  # noqa: E402  (one truth format for both harnesses)
from pptrace.integrations import megatron as integration  # noqa: E402

RUN = dict(world=2, layers=2, microbatches=2, steps=3, profile_steps="1-2", hot_expert=0, skew=3.0)
PROFILED = (1, 2)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    import pptrace

    out = run(tmp_path_factory.mktemp("moe") / "run", **RUN)
    return pptrace.analyze(out, progress=False), load_truth(out)


def _ms(spans) -> float:
    return sum(s["end_ns"] - s["start_ns"] for s in spans) / 1e9


@pytest.mark.slow
def test_layout_has_its_expert_parallelism(measured):
    analysis, truth = measured
    report = analysis.to_json()
    assert report["run"]["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 2, "ep": 2, "order": "tp-cp-dp-pp"}
    assert {r["rank"]: r["describe"] for r in report["ranks"]} == {r: f"dp{r} ep{t['ep_rank']}" for r, t in truth.items()}
    assert report["ep"]["unmeasured_ranks"] == [] and not [w for w in report["warnings"] if "ep" in w]


@pytest.mark.slow
def test_pairs_are_the_logged_splits(measured):
    """Per step and (src, dst): the rows src's all-to-alls of hidden states sent dst (dispatch
    and combine, forward and backward) as Megatron handed them to all_to_all_single."""
    analysis, truth = measured
    want = defaultdict(int)
    for src, t in truth.items():
        for call in t["a2a"]:
            if call["step"] in PROFILED and call["dim"] == 2:  # the router probabilities' are the same rows
                for dst, rows in enumerate(call["send"]):
                    if dst != src:
                        want[call["step"], src, dst] += rows
    got = {(int(p.step), int(p.src), int(p.dst)): p.tokens for p in analysis.ep_pairs.itertuples()}
    assert got == want and min(want.values()) > 0
    report = {(p["src"], p["dst"]): p["tokens"] for p in analysis.to_json()["ep"]["pairs"]}
    assert report == {(s, d): sum(v for (_, s2, d2), v in want.items() if (s2, d2) == (s, d)) / len(PROFILED)
                      for _, s, d in want}


@pytest.mark.slow
def test_expert_tokens_are_the_dispatchers_tokens_per_expert(measured):
    analysis, truth = measured
    want = defaultdict(int)
    for rank, t in truth.items():
        local = t["experts"] // t["ep"]
        for call in t["experts_calls"]:
            if call["step"] in PROFILED:
                for i, n in enumerate(call["tokens_per_expert"]):
                    want[rank, call["step"], t["ep_rank"] * local + i] += n
    got = {(int(e.rank), int(e.step), int(e.expert)): int(e.tokens) for e in analysis.expert_tokens.itertuples()}
    assert got == want
    assert {(e["rank"], e["step"], e["expert"]): e["tokens"] for e in analysis.to_json()["ep"]["expert_tokens"]} == want


@pytest.mark.slow
def test_the_skewed_ranks_experts_are_named_hottest(measured):
    analysis, truth = measured
    per_rank = {r: sum(sum(c["tokens_per_expert"]) for c in t["experts_calls"] if c["step"] in PROFILED)
                for r, t in truth.items()}
    hot = max(per_rank, key=per_rank.get)
    assert truth[hot]["ep_rank"] == 0 and per_rank[hot] > 1.2 * min(per_rank.values())  # the skew took
    load = analysis.experts.set_index("rank")
    assert load.index[load["hottest"]].tolist() == [hot]
    assert {r: load.loc[r, "tokens"] for r in truth} == {r: n / len(PROFILED) for r, n in per_rank.items()}


@pytest.mark.slow
def test_ep_time_is_the_logged_exchanges_and_not_compute(measured):
    """Per rank and step: ep time (exposed + hidden) at least the logged all-to-alls and
    count all-gathers, at most that plus Megatron's own work around each call (its buffers,
    autograd: 0.14 ms a call measured at world 2, 0.5 at world 4 on 2 cores) at 1 ms a call,
    so no range is left open across other work; compute never holds them: compute + logged
    ep <= the step. Every rank has ep wait and transfer."""
    analysis, truth = measured
    steps = analysis.steps.set_index(["rank", "step"])
    for rank, t in truth.items():
        for step in PROFILED:
            calls = [c for c in t["a2a"] + t["gathers"] if c["step"] == step]
            logged = _ms(calls)
            row = steps.loc[(rank, step)]
            ep = row["ep_exposed"] + row["hidden_ep"]
            assert logged <= ep <= logged + 0.001 * len(calls), (rank, step, logged, ep)
            assert row["compute"] + logged <= row["time_s"], (rank, step)
            assert row["compute"] > 0
    ranks = {r["rank"]: r["mean"]["collectives"]["ep"] for r in analysis.to_json()["ranks"]}
    assert set(ranks) == set(truth)
    for rank, ep in ranks.items():
        assert ep["wait_s"] > 0 and ep["transfer_s"] > 0, (rank, ep)


@pytest.mark.slow
def test_every_exchange_is_tagged_forward_and_backward(measured):
    """One ep range per logged exchange, forward and backward alike, each call's own rows."""
    analysis, truth = measured
    ev = analysis.run.events
    for rank, t in truth.items():
        mine = ev[(ev["rank"] == rank) & (ev["kind"] == "ep") & ev["step"].isin(PROFILED)]
        names = mine["name"].astype(str)
        for backward in (False, True):
            logged = [c for c in t["a2a"] if c["step"] in PROFILED and c["backward"] == backward]
            tagged = names[names.str.contains("dir=bwd") == backward]
            tagged = tagged[~tagged.str.contains("what=counts")]
            assert len(tagged) == len(logged), (rank, backward)
        sends = sorted(n.split("send=")[1].split()[0] for n in names if "send=" in n)
        assert sends == sorted(",".join(map(str, c["send"])) for c in t["a2a"]
                               if c["step"] in PROFILED and c["dim"] == 2)
        assert (names.str.contains("what=counts")).sum() == sum(g["step"] in PROFILED for g in t["gathers"])
        experts = ev[(ev["rank"] == rank) & (ev["op"] == "expert") & ev["step"].isin(PROFILED)]
        assert len(experts) == 2 * sum(c["step"] in PROFILED for c in t["experts_calls"])  # forward + backward


# --------------------------------------------------------------------------------------
# The patches
# --------------------------------------------------------------------------------------
HOOKED = [(moe_layer.MoELayer, fn) for fn in ("preprocess", "dispatch", "routed_experts_compute", "combine")] + [
    (token_dispatcher, "all_to_all"), (token_dispatcher, "gather_from_sequence_parallel_region")]


def _originals():
    out = {(getattr(o, "__name__", o), fn): getattr(o, fn) for o, fn in HOOKED}
    out["_AllToAll", "backward"] = mappings._AllToAll.__dict__["backward"]
    return out


def test_remove_restores_the_originals():
    before = _originals()
    handle = integration.instrument()
    try:
        for (owner, fn), original in before.items():
            patched = _originals()[owner, fn]
            unwrapped = getattr(patched, "__func__", patched)
            assert patched is not original and unwrapped.__pptrace_original__ is getattr(original, "__func__", original)
        assert isinstance(mappings._AllToAll.__dict__["backward"], staticmethod)
    finally:
        handle.remove()
    assert _originals() == before


def test_a_megatron_without_the_moe_hooks_keeps_its_pipeline_hooks(monkeypatch):
    monkeypatch.delattr(moe_layer.MoELayer, "routed_experts_compute")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = integration.instrument()
    try:
        assert handle is not None and handle._moe is None
        assert len(caught) == 1 and "no moe_layer.MoELayer.routed_experts_compute" in str(caught[0].message)
        assert token_dispatcher.all_to_all is mappings.all_to_all  # nothing of the MoE patched
    finally:
        handle.remove()


def _layer(dispatcher):
    return SimpleNamespace(layer_number=1, token_dispatcher=dispatcher)


class _ExpertTensorParallel(token_dispatcher.MoEAlltoAllTokenDispatcher):
    """The alltoall dispatcher with expert tp 2 (its own constructor needs parallel state)."""

    def __init__(self):
        self.tp_size = 2

    def token_combine(self, hidden_states):
        return hidden_states * 2


@pytest.mark.parametrize("dispatcher, why", [
    (SimpleNamespace(token_combine=lambda x: x * 2), "not the alltoall token dispatcher"),
    (_ExpertTensorParallel(), "expert tensor parallelism"),
])
def test_other_dispatchers_are_refused_once_and_run_untouched(dispatcher, why):
    handle = integration.instrument()
    try:
        layer = _layer(dispatcher)
        with pytest.warns(UserWarning, match=f"not tagged .*{why}"):
            assert moe_layer.MoELayer.combine(layer, torch.ones(2)).tolist() == [2.0, 2.0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert moe_layer.MoELayer.combine(layer, torch.ones(2)).tolist() == [2.0, 2.0]
        assert not handle._moe.seen
    finally:
        handle.remove()


def test_a_failing_hook_stops_tagging_not_training(monkeypatch):
    handle = integration.instrument()
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(handle._moe, "_enter", broken)
        layer = _layer(SimpleNamespace(token_combine=lambda x: x + 1))
        with pytest.warns(UserWarning, match="MoE integration stopped tagging .*boom"):
            assert moe_layer.MoELayer.combine(layer, torch.zeros(1)).item() == 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning, not one per call
            assert moe_layer.MoELayer.combine(layer, torch.zeros(1)).item() == 1.0
    finally:
        handle.remove()
