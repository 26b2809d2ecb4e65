"""``pptrace.analyze()`` used the way a notebook uses it (issue 22): a path in, DataFrames with
the documented columns out, each table computed once, the document equal to ``analyze --json``,
figures that render, a what-if from the same object. On a synthetic GPipe run whose every
number is known (tests/tracegen.py: 1 ms forwards, 2 ms backwards, 50 µs links).
"""
from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go
import pytest

import pptrace
from pptrace.vocab import COMM_DIMS, PARTS
from hostile import pptrace as pptrace_cli
from tracegen import pipeline_run

P, M, FWD_S, BWD_S = 2, 4, 1e-3, 2e-3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out, _ = pipeline_run(tmp_path_factory.mktemp("nb") / "run", pp=P, microbatches=M, steps=(1, 2))
    return out


@pytest.fixture(scope="module")
def analysis(run_dir):
    return pptrace.analyze(run_dir, use_cache=False, progress=False)


def test_a_path_gives_an_analysis_with_dataframes(analysis):
    assert isinstance(analysis, pptrace.Analysis)
    assert "2 ranks (pp2)" in repr(analysis)
    for name in ("steps", "stages", "links", "collectives", "stragglers", "critical_path", "gpu", "passes"):
        assert isinstance(getattr(analysis, name), pd.DataFrame), name


def test_the_step_table_is_the_partition(analysis):
    steps = analysis.steps
    assert list(steps.columns) == ["rank", "step", "time_s", *PARTS, *(f"hidden_{d}" for d in COMM_DIMS)]
    assert sorted(zip(steps["rank"], steps["step"])) == [(r, s) for r in range(P) for s in (1, 2)]
    assert (steps[list(PARTS)].sum(axis=1) - steps["time_s"]).abs().max() < 1e-9
    # GPipe, balanced: every stage computes m (t_f + t_b) per step
    assert steps["compute"].to_numpy() == pytest.approx(M * (FWD_S + BWD_S), rel=1e-6)


def test_stages_and_links_carry_the_known_numbers(analysis):
    stages = analysis.stages
    assert {"stage", "bubble_s", "bubble_fraction", "theory_bubble_fraction", "t_fwd_s", "t_bwd_s"} <= set(stages)
    assert stages["t_fwd_s"].to_numpy() == pytest.approx(FWD_S, rel=1e-6)
    assert stages["t_bwd_s"].to_numpy() == pytest.approx(BWD_S, rel=1e-6)
    links = analysis.links
    assert {(int(s), int(d)) for s, d in zip(links["src"], links["dst"])} == {(0, 1), (1, 0)}
    assert links["count"].tolist() == [M, M]  # per step: one message per microbatch each way
    passes = analysis.passes
    assert len(passes) == P * 2 * M * 2 and set(passes["op"].astype(str)) == {"fwd", "bwd"}


def test_each_table_is_computed_once(analysis):
    assert analysis.steps is analysis.steps
    assert analysis.partitions is analysis.partitions
    assert analysis.to_json() is not analysis.to_json()  # each caller gets its own top level
    assert analysis.to_json()["ranks"] is analysis.to_json()["ranks"]  # built once


def test_to_json_is_the_cli_document(analysis, run_dir):
    cli = pptrace_cli("analyze", run_dir, "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(json.dumps(analysis.to_json())) == json.loads(cli.stdout)


def test_selection_of_ranks_and_steps(run_dir, analysis):
    one = pptrace.analyze(analysis.run, steps=[2], ranks=[1])
    assert set(one.steps["rank"]) == {1} and set(one.steps["step"]) == {2}
    doc = one.to_json()
    assert doc["run"]["steps"] == [2] and [r["rank"] for r in doc["ranks"]] == [1]
    missing = pptrace.analyze(analysis.run, steps=[2, 9]).to_json()
    assert any("requested steps [9] were not profiled" in w for w in missing["warnings"])


def test_figures_render_and_whatif_replays(analysis):
    figures = analysis.figures()
    assert {"timeline", "replay", "partition", "bubble", "p2p_links"} <= set(figures)
    assert all(isinstance(f, go.Figure) for f in figures.values())
    for fig in figures.values():
        fig.to_json()  # serialisable: what Jupyter's renderer does with it
    measured = analysis.whatif()
    assert measured is analysis.whatif()  # the replay as measured, once
    assert abs(measured["replay"]["error_fraction"]) < 0.05
    more = analysis.whatif(microbatches=2 * M)
    assert more["predicted"]["step_time_s"] > measured["predicted"]["step_time_s"]


def test_a_run_without_a_pipeline_says_why_it_has_no_replay(tmp_path):
    out, _ = pipeline_run(tmp_path / "run", pp=1, dp=2, microbatches=2, steps=(1,))
    a = pptrace.analyze(out, use_cache=False, progress=False)
    assert a.replay == (None, None)
    with pytest.raises(ValueError, match="no what-if replay"):
        a.whatif()
    assert "replay" not in a.figures()
