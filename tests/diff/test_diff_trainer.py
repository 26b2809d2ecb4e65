"""`pptrace diff` on reference-trainer runs whose differences are known (sleep mode): one rank
delayed, fewer microbatches, a longer forward, another schedule, a re-run of the same config,
and a run against itself. The shared base is sleep_runs' 1F1B run (p 4, m 8, forward 10 ms,
backward 10 + 10 ms); the variants differ from it in one setting each."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import sleep_runs
from conftest import shared_run
from pptrace.cli import GATE_FAILED, cli

pytestmark = pytest.mark.slow
#: this module's own variants of the base (sleep_runs.COMMON + RUNS["1f1b"] + these)
#: the delay is this module's own, three times sleep_runs' (5 ms): on a loaded 2-core box a
#: 345 ms step spreads by up to 20 ms step to step, and the signal must stand clear of that
VARIANTS = {"rerun": [], "m4": ["--microbatches", "4"], "fwd12": ["--fwd-ms", "12"],
            "delay": ["--delay", "2:fwd:15"]}
SHARED = {"base": "1f1b", "interleaved": "interleaved"}


def _train(out: Path, extra: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-m", "instrumented_model.train", *sleep_runs.COMMON,
                           *sleep_runs.RUNS["1f1b"], *extra, "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def runs(sleep_run, tmp_path_factory) -> dict:
    """name -> (run directory, its analysis.json as pptrace analyze --json wrote it)."""
    import pptrace

    dirs = {name: sleep_run(key) for name, key in SHARED.items()}
    dirs.update({name: shared_run(tmp_path_factory, f"diff-{name}", lambda out, e=extra: _train(out, e))
                 for name, extra in VARIANTS.items()})
    home = tmp_path_factory.mktemp("analyses")
    out = {}
    for name, path in dirs.items():
        doc = home / f"{name}.json"
        doc.write_text(json.dumps(pptrace.analyze(path, progress=False).to_json()))
        out[name] = (path, doc)
    return out


def _diff(runs, a, b, *gates):
    import pptrace

    return pptrace.diff(runs[a][1], runs[b][1], gates=gates)


def _truth(run: Path) -> dict:
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in (run / "truth").glob("rank*.json")}


def _truth_per_step(run: Path):
    """Per rank, mean over the profiled steps of: its forward sleep time, and its idle time in
    the pipeline window (first pass start to last pass end over all ranks, less its passes)."""
    truths = _truth(run)
    fwd, idle = {r: [] for r in truths}, {r: [] for r in truths}
    for step in sleep_runs.PROFILED:
        passes = {r: np.array([(a[3], a[4]) for a in t["steps"][str(step)]], dtype=np.int64) for r, t in truths.items()}
        lo = min(p[:, 0].min() for p in passes.values())
        hi = max(p[:, 1].max() for p in passes.values())
        for r, t in truths.items():
            fwd[r].append(sum(a[4] - a[3] for a in t["steps"][str(step)] if a[0] == "fwd") / 1e9)
            idle[r].append((hi - lo - (passes[r][:, 1] - passes[r][:, 0]).sum()) / 1e9)
    return {r: np.mean(v) for r, v in fwd.items()}, {r: np.mean(v) for r, v in idle.items()}


def test_a_run_against_itself_is_all_zeros(runs):
    doc = _diff(runs, "base", "base", "step>+3%")
    changes = [doc["step"], *doc["waterfall"]["items"], *(i for s in doc["stages"] for i in s["waterfall"]["items"])]
    assert all(c["delta_s"] == 0 and c["significant"] is False for c in changes)
    assert doc["verdict"]["status"] == "pass" and doc["stragglers"]["appeared"] == []


def _window_per_step(run: Path) -> float:
    """The pipeline window (first pass start to last pass end over all ranks), mean over the
    profiled steps, as the trainer's pass log has it (seconds)."""
    truths, spans = _truth(run), []
    for step in sleep_runs.PROFILED:
        passes = np.array([(a[3], a[4]) for t in truths.values() for a in t["steps"][str(step)]], dtype=np.int64)
        spans.append((passes[:, 1].max() - passes[:, 0].min()) / 1e9)
    return float(np.mean(spans))


def test_a_rerun_of_the_same_config_has_no_significant_change(runs):
    doc = _diff(runs, "base", "rerun")
    assert doc["setup"]["changes"] == [], doc["setup"]
    # The two runs were recorded minutes apart; on a box the suite loads, one can be slower
    # throughout, and then the pass logs say so too: the diff must tell that change as it is
    # (its size, within 10%), and no change where the logs have none.
    base, rerun = _window_per_step(runs["base"][0]), _window_per_step(runs["rerun"][0])
    if abs(rerun - base) > 0.01 * base:
        assert doc["step"]["delta_s"] == pytest.approx(rerun - base, rel=0.10, abs=0.002), (doc["summary"], base, rerun)
        return
    assert doc["step"]["significant"] is False, doc["summary"]
    assert doc["verdict"]["status"] == "unchanged"
    result = CliRunner().invoke(cli, ["diff", str(runs["base"][1]), str(runs["rerun"][1]), "--gate", "step>+3%"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].startswith("PASS: step")


def test_a_delayed_rank_is_named_with_the_bubble_it_causes(runs):
    """Rank 2 (stage 2) sleeps 15 ms more in each of its 8 forwards. The diff puts 120 ms of
    forward compute on stage 2 and the bubble on the others that the trainer's own pass log
    shows (idle in the pipeline window), each within 10%."""
    doc = _diff(runs, "base", "delay", "step>+3%")
    (fwd_b, idle_b), (fwd_d, idle_d) = _truth_per_step(runs["base"][0]), _truth_per_step(runs["delay"][0])
    stages = {s["stage"]: {i["item"]: i for i in s["waterfall"]["items"]} for s in doc["stages"]}
    truth_fwd = fwd_d[2] - fwd_b[2]  # 8 x 15 ms = 120 ms, and what a loaded box added to the sleeps
    assert stages[2]["compute_fwd"]["delta_s"] == pytest.approx(truth_fwd, rel=0.10)
    assert stages[2]["compute_fwd"]["significant"]
    for stage in (0, 1, 3):
        # the truth's idle is the window less the passes: bubble, and the p2p and host gaps beside it
        waiting = sum(stages[stage][k]["delta_s"] for k in ("pp_bubble_schedule", "pp_bubble_latency",
                                                             "pp_transfer", "other"))
        assert waiting == pytest.approx(idle_d[stage] - idle_b[stage], rel=0.10), stage
        assert stages[stage]["pp_bubble_schedule"]["delta_s"] > 0.5 * truth_fwd
        # the others' forwards as their own pass logs have them (a loaded box moves them a little)
        assert stages[stage]["compute_fwd"]["delta_s"] == pytest.approx(fwd_d[stage] - fwd_b[stage],
                                                                       abs=0.1 * truth_fwd), stage
    assert [(s["rank"], s["metric"]) for s in doc["stragglers"]["appeared"]] == [(2, "compute")]
    told = "\n".join(doc["explanation"])
    # the waiting stages name stage 2 (beside any other whose compute a loaded box grew)
    assert "stage 2: forward +" in told and re.search(r"waiting for stages? [\d, ]*\b2\b", told), told
    result = CliRunner().invoke(cli, ["diff", str(runs["base"][1]), str(runs["delay"][1]), "--gate", "step>+3%"])
    assert result.exit_code == GATE_FAILED, result.output
    assert result.output.strip().splitlines()[-1].startswith("FAIL: step +")


def _as_theory_says(stage: dict) -> None:
    """The bubble the schedule causes moved as the schedule's theory (from the measured pass
    times) says: within 10% of the theory's bubble, or the diff's own noise where that is wider
    (a loaded box stretches passes and gaps)."""
    items = {i["item"]: i for i in stage["waterfall"]["items"]}
    moved, theory = items["pp_bubble_schedule"], stage["pipeline"]["theory_bubble_s"]
    slack = max(0.10 * theory["base"], 3 * (moved["noise_s"] or 0.0))
    assert abs(moved["delta_s"] - theory["delta"]) <= slack, (stage["stage"], moved, theory)


def test_fewer_microbatches_change_the_bubble_as_theory_says(runs):
    doc = _diff(runs, "base", "m4")
    assert {c["what"]: (c["base"], c["new"]) for c in doc["setup"]["changes"]} == {"microbatches": (8, 4)}
    theory = doc["pipeline"]["theory_bubble_fraction"]
    assert theory["delta"] == pytest.approx(3 / 7 - 3 / 11, rel=0.05)  # 1F1B: (p-1)/(m+p-1)
    (fwd_b, _), (fwd_n, _) = _truth_per_step(runs["base"][0]), _truth_per_step(runs["m4"][0])
    for stage in doc["stages"]:
        items = {i["item"]: i for i in stage["waterfall"]["items"]}
        _as_theory_says(stage)  # in seconds the bubble stays (p-1)(t_f+t_b)
        # 4 forwards fewer, as the two runs' pass logs have them (a share of the step would
        # also move with whatever latency and host time a loaded box adds to one run)
        rank = stage["ranks"]["base"][0]
        assert items["compute_fwd"]["delta_s"] == pytest.approx(fwd_n[rank] - fwd_b[rank], rel=0.10), stage["stage"]
    assert any(line.startswith("pipeline: bubble") for line in doc["explanation"]), doc["explanation"]


def test_a_longer_forward_is_compute_and_the_theory_bubble(runs):
    """--fwd-ms 12 instead of 10: every stage's forward compute +20% (as the trainer's pass
    log has it: a loaded box stretches sleeps), its schedule bubble as the theory with the
    measured pass times says ((p-1) x 2 ms = +6 ms on an idle box)."""
    doc = _diff(runs, "base", "fwd12", "compute_fwd>+10%")
    (fwd_b, _), (fwd_n, _) = _truth_per_step(runs["base"][0]), _truth_per_step(runs["fwd12"][0])
    for stage in doc["stages"]:
        items = {i["item"]: i for i in stage["waterfall"]["items"]}
        rank = stage["ranks"]["base"][0]
        assert items["compute_fwd"]["fraction"] == pytest.approx(fwd_n[rank] / fwd_b[rank] - 1, rel=0.10), stage
        _as_theory_says(stage)
    assert doc["verdict"]["status"] == "fail"  # the forward is 20% longer: the gate's 10% is exceeded


def test_1f1b_against_interleaved(runs):
    doc = _diff(runs, "base", "interleaved")
    assert {c["what"] for c in doc["setup"]["changes"]} == {"schedule", "vpp"}
    for stage in doc["stages"]:
        theory = stage["pipeline"]["theory_bubble_s"]
        # interleaved with v chunks: (p-1)(t_f+t_b)/v, half of 1F1B's on balanced stages (a stage
        # the loaded box slowed adds its excess to the others' theory)
        assert theory["new"] < 0.75 * theory["base"], theory
        _as_theory_says(stage)
    assert doc["parts"]["pp_bubble"]["delta_s"] < 0
    assert any("stage contents: vpp 1 -> 2" in n for n in doc["setup"]["not_comparable"])


def test_cli_json_html_and_run_directories(runs, tmp_path):
    html = tmp_path / "diff.html"
    result = CliRunner().invoke(cli, ["diff", str(runs["base"][0]), str(runs["delay"][1]), "--json",
                                      "--html", str(html)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "pptrace.diff/1" and doc["verdict"]["status"] in ("slower", "unchanged")
    assert doc["base"]["label"] == str(runs["base"][0]) and html.stat().st_size > 1_000_000  # plotly inline
    table = CliRunner().invoke(cli, ["diff", str(runs["base"][1]), str(runs["delay"][1])], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "compute: forward" in table.output and "pp bubble: schedule" in table.output
    assert table.output.strip().splitlines()[-1] == doc["verdict"]["line"]
