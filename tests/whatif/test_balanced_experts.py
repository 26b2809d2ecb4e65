"""``whatif --balanced-experts``: every rank's expert time rescaled to its ep group's mean
tokens, and each MoE layer call's all-to-all moved with the new latest arrival.

Hand-built runs (every number known) for the rule itself and for what is refused; the
reference trainer in sleep mode for the acceptance: the prediction from an imbalanced run
against a real run of the same config without the imbalance, at dp 4 / ep 4 and inside a
1F1B pipeline (dp 2 / ep 2 / pp 2). The trainer runs are tests/trainer/test_ep_sleep.py's
configurations (tests/ep_runs.py), made once a session (conftest.ep_run).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pptrace
from ep_runs import M
from pptrace.cli import cli
from pptrace.run.build import load_run
from pptrace.topology import Layout
from pptrace.whatif.predict import measure, whatif
from tracegen import pipeline_run, run_from_docs, trace_doc

US = 1000  # ns


# -- the rule, on hand-built runs ----------------------------------------------------------
def _moe_run(tmp_path, calls, layout=Layout(dp=2, ep=2), tokens=True, extra=()):
    """One step, one forward pass per rank holding MoE layer calls; ``calls[rank]``: per
    call (dispatch start, expert start, expert end, combine start, tokens) in µs. Every
    combine ends at the group's latest combine start + 2 µs (an all-to-all ends for all at
    the last arrival). ``extra``: more ranges on every rank."""
    ends = [max(rank_calls[i][3] for rank_calls in calls.values()) + 2 for i in range(len(next(iter(calls.values()))))]
    docs = {}
    for rank, rank_calls in calls.items():
        ranges = [("ProfilerStep#1", 0, 1000), ("compute:fwd mb=0", 5, ends[-1] + 10)]
        for layer, ((dispatch, start, end, combine, n), done) in enumerate(zip(rank_calls, ends)):
            tag = f" tokens={n}" if tokens else ""
            ranges += [(f"ep:dispatch layer={layer} mb=0", dispatch, start - 1),
                       (f"compute:expert layer={layer} mb=0{tag}", start, end),
                       (f"ep:combine layer={layer} mb=0", combine, done)]
        ranges += [("compute:optimizer", ends[-1] + 20, ends[-1] + 30), *extra]
        docs[rank] = trace_doc(rank, layout.world_size, ranges, layout=layout)
    return run_from_docs(tmp_path, docs, layout, schedule="1f1b", microbatches=1)


def test_the_waits_the_hot_rank_caused_go_with_its_extra_expert_time(tmp_path):
    """Rank 1's experts got 90 tokens to rank 0's 30 (mean 60): rank 1 arrives at the combine
    60 µs after rank 0, which waits. Balanced, both compute 60 µs and arrive together, 30 µs
    before rank 1 did: the pass (either rank's) is 30 µs shorter, the wait gone."""
    run = _moe_run(tmp_path, {0: [(10, 20, 50, 52, 30)], 1: [(10, 20, 110, 112, 90)]})
    measured = measure(run, balanced_experts=True)
    assert np.allclose(measured.times.fwd - measured.balanced[0], 30e-6)
    assert measured.experts == pytest.approx({"layer_calls": 1, "max_over_mean_tokens": 1.5, "pass_time_saved_s": 30e-6})
    result = whatif(run, balanced_experts=True)
    assert result["changes"] == ["balanced_experts"] and result["predicted"]["balanced_experts"]
    assert result["predicted"]["step_time_s"] == pytest.approx(result["replay"]["step_time_s"] - 30e-6, abs=1e-9)


def test_each_layer_call_is_balanced_on_its_own(tmp_path):
    """Two calls in one pass, the hot rank changing between them: each saves what its own
    latest arrival moves (30 µs, then 20 µs: 40 and 80 tokens, mean 60 -> 60 µs each)."""
    run = _moe_run(tmp_path, {0: [(10, 20, 50, 52, 30), (120, 130, 170, 172, 40)],
                              1: [(10, 20, 110, 112, 90), (120, 130, 210, 212, 80)]})
    measured = measure(run, balanced_experts=True)
    assert np.allclose(measured.times.fwd - measured.balanced[0], 50e-6)


def test_a_wait_the_hot_rank_did_not_cause_stays(tmp_path):
    """Rank 0 (30 tokens) arrives last anyway, 70 µs of its own host work after its experts:
    balanced, its experts take 30 µs longer and the combine ends 30 µs later for both."""
    run = _moe_run(tmp_path, {0: [(10, 20, 50, 120, 30)], 1: [(10, 20, 110, 112, 90)]})
    measured = measure(run, balanced_experts=True)
    assert np.allclose(measured.balanced[0] - measured.times.fwd, 30e-6)


@pytest.mark.parametrize("case, said", [
    ("dense", "needs an expert-parallel run; this one has ep=1 and no compute:expert ranges"),
    ("ep1", "needs ep > 1"),
    ("no-experts", "the traces show no compute:expert ranges (ep=2)"),
    ("no-tokens", "carry no tokens= tag"),
    ("overlapped", "cannot predict this run: its all-to-alls are waited apart from their posts"),
])
def test_a_run_without_expert_parallel_work_is_refused(tmp_path, case, said):
    calls = {0: [(10, 20, 50, 52, 30)], 1: [(10, 20, 110, 112, 90)]}
    if case == "dense":
        run = load_run(pipeline_run(tmp_path / "run", pp=2, microbatches=2, steps=(1,))[0], progress=False)
    elif case == "ep1":
        run = _moe_run(tmp_path, calls, layout=Layout(dp=2))
    elif case == "no-experts":
        docs = {r: trace_doc(r, 2, [("ProfilerStep#1", 0, 100), ("compute:fwd mb=0", 5, 50)], layout=Layout(dp=2, ep=2))
                for r in (0, 1)}
        run = run_from_docs(tmp_path, docs, Layout(dp=2, ep=2), schedule="1f1b", microbatches=1)
    elif case == "no-tokens":
        run = _moe_run(tmp_path, calls, tokens=False)
    else:  # posted, then waited after the other half's experts (--ep-overlap)
        run = _moe_run(tmp_path, calls, extra=[("ep:wait op=combine layer=0 mb=0", 116, 118)])
    with pytest.raises(ValueError, match=r"--balanced-experts.*" + said.replace("(", r"\(").replace(")", r"\)")):
        whatif(run, balanced_experts=True)


def test_the_cli_refuses_a_run_without_experts_in_one_line(tmp_path):
    out, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=2, steps=(1,))
    result = CliRunner().invoke(cli, ["whatif", str(out), "--balanced-experts"])
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output, result.stderr
    assert "--balanced-experts needs an expert-parallel run" in result.stderr


# -- the acceptance, on the reference trainer ----------------------------------------------
#: what the issue asks of the prediction against the balanced run's measured step
WITHIN = 0.05


@pytest.fixture(scope="session")
def loaded(ep_run):
    """name -> (directory, loaded Run) of the shared MoE run ``name`` (tests/ep_runs.py)."""
    made = {}

    def get(name):
        if name not in made:
            out = ep_run(name)
            made[name] = out, load_run(out, progress=False)
        return made[name]

    return get


def _truth(out: Path) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (out / "truth").glob("rank*.json")}


def _sleeps_s(truth: dict) -> float:
    """The step the sleeps alone make (1F1B, free p2p): (m + p - 1) microbatch slots of the
    slowest rank's forward and backward, experts included."""
    pp = 1 + max(t["pp_rank"] for t in truth.values())

    def slot(t):
        e, layers = t["experts"], sum(len(x) for x in t["experts"]["layers"])
        return sum(t["sleeps_s"].values()) + layers * (e["fwd_s"] + e["bwd_s"])

    return (M + pp - 1) * max(slot(t) for t in truth.values())


def _check_against_the_balanced_run(hot, balanced) -> dict:
    """The issue's bar: the prediction from the hot run within WITHIN of the balanced run's
    measured step, plus the share of that step the balanced run paid beyond its sleeps (the
    rule of test_whatif_trainer's predictions, for the same reason: a run not yet made can
    only be told from another run's costs, and on this box 4 ranks share 2 cores with
    whatever else runs). Quiet, the two runs agree within 3%; with other suites on the box
    (load 4-8) 6-9% either way, as the hot or the balanced run drew the busier minutes. What
    the what-if itself moves is held to the truth within one run (_check_the_saving)."""
    (_, hot_run), (bal_dir, bal_run) = hot, balanced
    result = whatif(hot_run, balanced_experts=True)
    predicted = result["predicted"]["step_time_s"]
    actual = measure(bal_run).step_time_s
    sleeps = _sleeps_s(_truth(bal_dir))
    tolerance = WITHIN + max(actual - sleeps, 0.0) / actual
    assert predicted >= sleeps - 0.002, (predicted, sleeps)  # never faster than the sleeps
    assert abs(predicted / actual - 1) <= tolerance, (predicted, actual, tolerance, result["notes"])
    return result


def _check_the_saving(hot, result) -> None:
    """Within the hot run (no other run's noise in it): every rank's passes lose its ep
    group's injected excess, the hot rank's expert time beyond the group's mean (every MoE
    layer of every microbatch, forward and backward), within WITHIN; and the step loses it
    (m + p - 1) / m times, as 1F1B lasts m + p - 1 microbatch slots."""
    out, run = hot
    truth = _truth(out)
    group = run.layout.group_ranks("ep", 0)
    expert = [truth[r]["experts"]["fwd_s"] + truth[r]["experts"]["bwd_s"] for r in group]
    layers = sum(len(x) for x in truth[group[0]]["experts"]["layers"])
    injected = M * layers * (max(expert) - np.mean(expert))
    saved = result["predicted"]["experts"]["pass_time_saved_s"]
    assert saved == pytest.approx(injected, rel=WITHIN), (saved, injected)
    slots = (M + run.layout.pp - 1) / M
    step_saved = result["replay"]["step_time_s"] - result["predicted"]["step_time_s"]
    assert step_saved == pytest.approx(slots * saved, rel=WITHIN), (step_saved, slots * saved)


@pytest.mark.slow
def test_balanced_experts_predicts_the_run_without_the_imbalance(loaded):
    hot = loaded("ep-dp4-hot")
    result = _check_against_the_balanced_run(hot, loaded("ep-dp4"))
    _check_the_saving(hot, result)
    assert result["predicted"]["experts"]["max_over_mean_tokens"] == pytest.approx(2.0, rel=0.02)
    assert result["changes"] == ["balanced_experts"] and result["comparison"] == "step_time"


#: how far apart two quiet runs of one config come on this box (the step of ep-dp4 made twice:
#: within 3%), the margin for the other run's noise on either side of the bracket below
RUN_TO_RUN = 0.03


def _after_expert_calls_s(truth: dict) -> float:
    """Per step, the busiest rank's time in the all-to-alls that follow its experts (the
    first all-to-all call of the rank's truth that starts after each expert sleep ends),
    mean over the steps logged."""
    per_rank = []
    for t in truth.values():
        e, steps = t["experts"], []
        for step, calls in e["calls"].items():
            starts = np.array([c[0] for c in calls], np.int64)
            ends = np.array([c[1] for c in calls], np.int64)
            after = np.searchsorted(starts, [c[1] for c in e["compute"][step]])
            after = after[after < len(starts)]
            steps.append(float((ends[after] - starts[after]).sum()) / 1e9)
        per_rank.append(np.mean(steps))
    return max(per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep-dp4", "ep-dp4-light"])
def test_the_prediction_is_a_lower_bound_short_by_at_most_the_all_to_alls_after_the_experts(loaded, name):
    """The accuracy the README states, against a real balanced run of the same config (dp 4
    / ep 4, no pipeline). The prediction keeps each MoE layer call's all-to-all after the
    experts at its cost after the last arrival as the imbalanced run measured it: there the
    early ranks had swapped their rows among themselves before the late one came, so only
    its share was left; balanced, every rank arrives at once and the whole exchange comes
    after. So the bracket: upper bound, the balanced run's measured step (the prediction
    leaves cost out, it adds none), lower bound, that step less the busiest rank's time in
    the all-to-alls that follow its experts in the balanced run (truth ``calls`` after
    ``compute``: the most the prediction can leave out there, were those calls free), each
    widened by RUN_TO_RUN for the other run's noise. ep-dp4-light (50 µs/token, ~10 ms an
    expert call) is the issue-42 config, measured 5-9% low on three pairings."""
    (_, hot_run), (bal_dir, bal_run) = loaded(f"{name}-hot"), loaded(name)
    predicted = whatif(hot_run, balanced_experts=True)["predicted"]["step_time_s"]
    actual = measure(bal_run).step_time_s
    after = _after_expert_calls_s(_truth(bal_dir))
    assert 0 < after < actual / 2, (after, actual)
    low, high = actual - after - RUN_TO_RUN * actual, actual * (1 + RUN_TO_RUN)
    assert low <= predicted <= high, (predicted, low, high, actual, after)


@pytest.mark.slow
def test_balanced_experts_inside_a_pipeline(loaded):
    """dp 2 / ep 2 / pp 2, 1F1B: each stage's passes carry their group's expert time and
    all-to-all waits; rescaled, the pipeline is replayed with them."""
    hot = loaded("ep-pp2-hot")
    result = _check_against_the_balanced_run(hot, loaded("ep-pp2"))
    _check_the_saving(hot, result)
    assert result["predicted"]["experts"]["max_over_mean_tokens"] == pytest.approx(1.5, rel=0.02)


@pytest.mark.slow
def test_a_balanced_run_is_predicted_as_it_ran(loaded):
    """Equal tokens everywhere: nothing moves, the prediction is the replay."""
    result = whatif(loaded("ep-dp4")[1], balanced_experts=True)
    assert result["predicted"]["experts"]["pass_time_saved_s"] == 0
    assert result["predicted"]["step_time_s"] == pytest.approx(result["replay"]["step_time_s"], rel=1e-9)


@pytest.mark.slow
def test_the_cli_and_the_analysis_give_the_prediction(loaded):
    out, run = loaded("ep-dp4-hot")
    expected = whatif(run, balanced_experts=True)["predicted"]["step_time_s"]
    document = json.loads(CliRunner().invoke(cli, ["whatif", str(out), "--balanced-experts", "--json"]).stdout)
    assert document["predicted"]["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert document["changes"] == ["balanced_experts"]
    assert pptrace.analyze(run).whatif(balanced_experts=True)["predicted"]["step_time_s"] == pytest.approx(
        expected, rel=1e-9)
    table = CliRunner().invoke(cli, ["whatif", str(out), "--balanced-experts"], env={"COLUMNS": "200"}).stdout
    assert "1f1b m=4 balanced-experts" in table and "balanced experts: 16 MoE layer calls a step" in table, table
