"""Expert parallelism in sleep mode, against its known truth: the reference trainer at dp 4 /
ep 4 (8 experts, top-2, 2 MoE layers), each expert sleeping 200 us per token it got (twice
that in backward), balanced and with ep rank 2's experts given twice the mean tokens
(``--moe-imbalance 2:2.0``). The truth (truth/rank{r}.json ``experts``) says how many
tokens each rank's experts got, so the cost of the imbalance is known exactly: every
other rank waits in the all-to-alls for rank 2's extra expert time."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import pptrace
from ep_runs import FACTOR, HOT, M, RUNS, train

pytestmark = pytest.mark.slow

STEPS = ("1", "2")


@pytest.fixture(scope="module")
def runs(ep_run):
    """name -> (directory, its Analysis) of the shared dp4 / ep4 runs (tests/ep_runs.py)."""
    return {name: (ep_run(shared), pptrace.analyze(ep_run(shared), progress=False))
            for name, shared in (("balanced", "ep-dp4"), ("hot", "ep-dp4-hot"))}


def _truth(out: Path) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (out / "truth").glob("rank*.json")}


def _expert_s(truth: dict) -> float:
    """A rank's expert sleeps per step: every MoE layer of every microbatch, fwd and bwd."""
    e = truth["experts"]
    return M * sum(len(layers) for layers in e["layers"]) * (e["fwd_s"] + e["bwd_s"])


def test_the_hot_ranks_experts_got_factor_times_the_mean(runs):
    truth = _truth(runs["hot"][0])
    tokens = {r: t["experts"]["tokens"] for r, t in truth.items()}
    mean = sum(tokens.values()) / len(tokens)
    assert tokens[HOT] == pytest.approx(FACTOR * mean, rel=0.02)


def test_ep_wait_per_rank_is_the_injected_expert_time_difference(runs):
    """Each rank waits, per step, for the hot rank's extra expert time over its own (the
    wait is measured from arrivals: the hot rank's own wait is the noise floor it is read
    against)."""
    out, analysis = runs["hot"]
    truth = _truth(out)
    waits = analysis.rank_collectives.query("dim == 'ep'").set_index("rank")["wait_s"]
    hot_s = _expert_s(truth[HOT])
    for rank, t in truth.items():
        if rank == HOT:
            continue
        want = hot_s - _expert_s(t)
        got = waits[rank] - waits[HOT]
        assert abs(got - want) <= max(0.10 * want, 0.003), (rank, got, want, waits.to_dict())


def test_the_culprit_is_the_overloaded_rank_and_nobody_when_balanced(runs):
    hot = runs["hot"][1].stragglers
    assert len(hot) and int(hot.iloc[0]["rank"]) == HOT, hot
    assert set(hot["rank"].astype(int)) == {HOT}, hot  # never the waiters
    assert runs["balanced"][1].stragglers.empty, runs["balanced"][1].stragglers


@pytest.mark.parametrize("name", ["balanced", "hot"])
def test_compute_is_the_sleeps_and_ep_is_exposed(runs, name):
    """Compute lies between each rank's logged sleeps (passes and experts) and its logged
    passes less its all-to-all calls: the host's own work in a pass is compute (on this box
    ~1 ms around each call, +5% quiet, +17% under CI's two workers: no margin on the sleeps
    alone holds). The all-to-alls run with nothing under them: exposed."""
    out, analysis = runs[name]
    truth = _truth(out)
    steps = analysis.steps
    for rank, t in truth.items():
        mine = steps[steps["rank"] == rank].set_index("step")
        sleeps = M * (t["sleeps_s"]["fwd"] + t["sleeps_s"]["bwd_input"] + t["sleeps_s"]["bwd_weight"]) + _expert_s(t)
        for step in STEPS:
            passes = sum(end - start for _, _, _, start, end in t["steps"][step]) / 1e9
            calls = sum(end - start for start, end in t["experts"]["calls"][step]) / 1e9
            compute = mine.loc[int(step), "compute"]
            assert 0.99 * sleeps <= compute <= passes - calls + 0.002, (rank, step, sleeps, compute, passes - calls)
        assert (mine["ep_exposed"] > 0).all() and (mine["hidden_ep"] == 0).all()
    report = analysis.to_json()
    assert report["run"]["layout"]["ep"] == 4
    assert {r["describe"] for r in report["ranks"]} == {f"dp{i} ep{i}" for i in range(4)}


def test_expert_load_names_the_hot_rank_and_what_it_cost(runs):
    """Tokens per rank per step as the truth routed them; the hot rank at FACTOR x the mean,
    the only one marked; its cost = the others' ep wait beyond its own (the wait test's
    truth), within 10%; a balanced run has no hottest rank and no cost."""
    out, analysis = runs["hot"]
    truth = _truth(out)
    load = analysis.experts.set_index("rank")
    for rank, t in truth.items():
        e = t["experts"]
        assert load.loc[rank, "tokens"] == e["tokens"] * M * sum(len(x) for x in e["layers"]), rank
    assert load.loc[HOT, "share_of_mean"] == pytest.approx(FACTOR, rel=0.02)
    assert load.index[load["hottest"]].tolist() == [HOT]
    want = sum(_expert_s(truth[HOT]) - _expert_s(t) for r, t in truth.items() if r != HOT) / (len(truth) - 1)
    assert load.loc[HOT, "wait_cost_s"] == pytest.approx(want, rel=0.10)
    report = analysis.to_json()
    assert [e["rank"] for e in report["experts"] if e["hottest"]] == [HOT]
    balanced = runs["balanced"][1].experts
    assert not balanced["hottest"].any() and (balanced["wait_cost_s"] == 0).all()
    assert balanced["share_of_mean"].tolist() == pytest.approx([1.0] * 4)


def test_the_pair_matrix_is_the_routed_splits_and_the_waits_fall_on_the_hot_rank(runs):
    """Per step, src sends dst its routed share in each forward and backward dispatch and
    dst's share of what it got back in each combine: 2 x calls x (sent[src->dst] +
    sent[dst->src]) rows; each waiter's ep wait is almost all on the hot rank, and a rank's
    pair waits sum to its ep wait. Tokens per expert: the rank's tokens over its 2 experts."""
    from pptrace.analyzers.ep_pairs import pair_means

    out, analysis = runs["hot"]
    truth = _truth(out)
    calls = M * sum(len(x) for x in truth[0]["experts"]["layers"])
    pairs = pair_means(analysis.ep_pairs, len(STEPS)).set_index(["src", "dst"])
    sent = {r: t["experts"]["sent"] for r, t in truth.items()}  # ep rank = rank at dp 4 / ep 4
    for src in truth:
        for dst in truth:
            if src != dst:
                assert pairs.loc[(src, dst), "tokens"] == 2 * calls * (sent[src][dst] + sent[dst][src]), (src, dst)
    waits = analysis.rank_collectives.query("dim == 'ep'").set_index("rank")["wait_s"]
    for src in truth:
        mine = pairs.xs(src, level="src")["wait_s"]
        assert mine.sum() == pytest.approx(waits[src], rel=1e-6, abs=1e-9)
        if src != HOT:
            assert mine[HOT] >= 0.95 * waits[src], (src, mine.to_dict())
    per_expert = analysis.expert_tokens.groupby(["rank", "expert"])["tokens"].mean()
    for rank, t in truth.items():
        for local in range(2):
            assert per_expert[(rank, 2 * rank + local)] == t["experts"]["tokens"] * calls // 2
    assert analysis.to_json()["ep"]["unmeasured_ranks"] == []


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_ep_inside_a_pipeline(tmp_path, schedule, ep_run):
    """dp 2 / ep 2 / pp 2: each stage's two ranks form an ep group, ep rank 1's experts get
    1.5x the mean; within each group the other rank's ep wait beyond the hot one's is its
    expert-time deficit (the passes around it are the pipeline's)."""
    # 1F1B is the what-if tests' shared run; interleaved is this test's own
    out = (ep_run("ep-pp2-hot") if schedule == "1f1b" else
           train(tmp_path / "run", [*RUNS["ep-pp2-hot"], "--schedule", schedule, "--vpp", "2"]))
    analysis = pptrace.analyze(out, progress=False)
    truth = _truth(out)
    layout = analysis.run.layout
    assert (layout.pp, layout.dp, layout.ep) == (2, 2, 2)
    waits = analysis.rank_collectives.query("dim == 'ep'").set_index("rank")["wait_s"]
    hot = {r for r, t in truth.items() if t["experts"]["ep_rank"] == 1}
    assert analysis.experts.query("hottest")["rank"].astype(int).tolist() == sorted(hot)
    for rank in set(truth) - hot:
        mate = next(r for r in layout.group_ranks("ep", rank) if r != rank)
        want = _expert_s(truth[mate]) - _expert_s(truth[rank])
        got = waits[rank] - waits[mate]
        assert abs(got - want) <= max(0.10 * want, 0.003), (schedule, rank, got, want)


def test_the_expert_table_and_its_legend_are_printed(runs):
    from click.testing import CliRunner

    from pptrace.cli import cli
    from pptrace.export.report import LEGEND

    out = CliRunner().invoke(cli, ["analyze", str(runs["hot"][0]), "--explain"]).output
    assert "Expert load (per step)" in out and "2 (hottest)" in out
    text = " ".join(out.split())
    assert all(" ".join(long.split()) in text for _, _, long in LEGEND["experts"][1])
