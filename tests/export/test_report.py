"""build_report / print_report: the contract-4 document and the terminal tables, on the
synthetic pipeline (known numbers), through load_run, and on every real GPU trace in
tests/data/hta-gpu (partial data must give warnings, never a crash)."""
from __future__ import annotations

import gzip

import orjson
import pytest
from rich.console import Console

from pptrace.analysis import SCHEMA
from pptrace.export.report import build_report, print_report
from pptrace.topology import Layout
from conftest import FIXTURES
from tracegen import STAGE0, STAGE1, run_from_docs, trace_doc

BREAKDOWN = {"compute", "pp_bubble", "pp_transfer", "tp_exposed", "cp_exposed", "dp_exposed", "ep_exposed", "other"}


def _check_contract(report: dict) -> None:
    """Every contract-4 field is there, with the documented types; strict JSON."""
    orjson.dumps(report)  # raises on NaN / numpy leftovers
    assert report["schema"] == SCHEMA
    run = report["run"]
    assert {"world_size", "layout", "schedule", "microbatches", "vpp", "steps"} <= set(run)
    assert set(run["layout"]) >= {"tp", "cp", "pp", "dp", "order"}
    for rank in report["ranks"]:
        assert {"rank", "coords", "clock_offset_us", "steps"} <= set(rank)
        for step in rank["steps"]:
            assert set(step["breakdown_s"]) == BREAKDOWN
            assert set(step["hidden_s"]) == {"tp", "cp", "dp", "ep"}
            assert sum(step["breakdown_s"].values()) == pytest.approx(step["time_s"], rel=1e-9, abs=1e-12)
    pipe = report["pipeline"]
    assert {"stages", "bubble_fraction", "theory_bubble_fraction"} <= set(pipe)
    for stage in pipe["stages"]:
        assert {"stage", "bubble_s", "bubble_fraction", "theory_bubble_fraction", "t_fwd_s", "t_bwd_s"} <= set(stage)
    assert {"pairs", "wait_s", "transfer_s", "links"} <= set(report["p2p"])
    for link in report["p2p"]["links"]:
        assert {"src", "dst", "count", "bytes", "wait_s", "transfer_s"} <= set(link)
    for s in report["stragglers"]:
        assert {"rank", "metric", "slowdown", "cost_s"} <= set(s)
    assert all(isinstance(w, str) for w in report["warnings"])


def test_report_on_synthetic_pipeline(scenario_run):
    report = build_report(scenario_run)
    _check_contract(report)
    assert report["run"]["world_size"] == 2 and report["run"]["steps"] == [1]
    r0 = report["ranks"][0]
    assert r0["coords"] == {"tp": 0, "cp": 0, "pp": 0, "dp": 0}
    assert round(r0["steps"][0]["breakdown_s"]["pp_bubble"] * 1e6) == 65
    stages = report["pipeline"]["stages"]
    assert [round(s["bubble_s"] * 1e6) for s in stages] == [65, 62]
    # per-step means (one step): 4 pairs, waits 25+36+22, transfers 8+3+5+4
    p2p = report["p2p"]
    assert p2p["pairs"] == 4 and round(p2p["wait_s"] * 1e6) == 83 and round(p2p["transfer_s"] * 1e6) == 20
    assert report["warnings"] == []


def test_report_says_what_bounded_each_step(scenario_run):
    """The cross-rank critical path, one entry per step: its parts add up to its length,
    which cannot exceed the step (260 µs), and the terminal shows its line."""
    report = build_report(scenario_run)
    (bound,) = report["critical_path"]
    assert bound["step"] == 1 and bound["step_time_s"] == pytest.approx(260e-6)
    parts = bound["compute_s"] + bound["p2p_s"] + bound["comm_s"] + bound["other_s"]
    assert parts == pytest.approx(bound["length_s"]) and 0 < bound["length_s"] <= 260e-6 + 1e-12
    # both stages' passes are on the path: 2 fwd + 2 bwd of each, less what overlaps
    assert bound["ranks"] == [0, 1] and bound["compute_s"] >= 160e-6
    console = Console(record=True, width=220)
    print_report(report, console)
    assert "critical path step 1 bound by" in console.export_text()


def test_report_selects_ranks_and_steps(scenario_run):
    report = build_report(scenario_run, steps=[1, 7], ranks=[1])
    assert [r["rank"] for r in report["ranks"]] == [1]
    # the pipeline window still spans both stages: rank 1's numbers do not change
    assert round(report["ranks"][0]["steps"][0]["breakdown_s"]["pp_bubble"] * 1e6) == 62
    assert any("[7]" in w and "not profiled" in w for w in report["warnings"])


def test_print_report_shows_every_view(scenario_run):
    console = Console(record=True, width=220)
    print_report(build_report(scenario_run), console)
    text = console.export_text()
    for title in ("Pipeline bubble per stage", "Step time per rank", "Pipeline p2p links", "No persistent straggler"):
        assert title in text
    assert "│   0.06 │ 25.0% │" in text  # stage 0: its 65 µs bubble in ms, 65 / 260 of the step


@pytest.mark.parametrize("block_last", [False, True], ids=["block-first", "block-after-events"])
def test_report_through_load_run(tmp_path, block_last):
    """The same traces as a run directory, loaded, aligned and matched by pptrace.run,
    with the pptrace block before the events (pptrace's writer) or after them (Kineto writes
    its own top-level metadata after traceEvents): the same layout and the same per-stage
    bubble as the hand-built view (65 and 62 µs) either way."""
    from pptrace.run.build import load_run

    layout = Layout(pp=2)
    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    for rank, ranges in ((0, STAGE0), (1, STAGE1)):
        doc = trace_doc(rank, 2, ranges, layout=layout)
        # one host: one clock, so the loaded run is the hand-built run, offsets 0
        doc["pptrace"].update(schedule="1f1b", microbatches=2, steps=[1], hostname="node0")
        block = doc.pop("pptrace")
        doc = {**doc, "pptrace": block} if block_last else {"pptrace": block, **doc}
        assert (list(doc).index("pptrace") > list(doc).index("traceEvents")) == block_last
        (traces / f"rank{rank}.json.gz").write_bytes(gzip.compress(orjson.dumps(doc)))
    run = load_run(tmp_path / "run")
    assert (run.layout.pp, run.layout.dp) == (2, 1)
    report = build_report(run)
    _check_contract(report)
    assert report["run"]["layout"]["pp"] == 2 and report["run"]["schedule"] == "1f1b"
    assert report["p2p"]["pairs"] == 4
    assert [len(r["steps"]) for r in report["ranks"]] == [1, 1]
    assert [r["coords"]["pp"] for r in report["ranks"]] == [0, 1]
    assert [round(s["bubble_s"] * 1e6) for s in report["pipeline"]["stages"]] == [65, 62]


def test_missing_rank_gives_partial_results_and_warnings(tmp_path):
    """Stage 1's trace is missing: stage 0 is still partitioned, with warnings."""
    layout = Layout(pp=2)
    report = build_report(run_from_docs(tmp_path, {0: trace_doc(0, 2, STAGE0, layout=layout)}, layout))
    _check_contract(report)
    assert [r["rank"] for r in report["ranks"]] == [0]
    assert any("no matching peer" in w for w in report["warnings"])
    assert any("ranks [1]" in w and "no trace" in w for w in report["warnings"])
    # unmatched p2p cannot be split: it all counts as transfer, never as invented bubble
    step = report["ranks"][0]["steps"][0]["breakdown_s"]
    assert round(step["pp_transfer"] * 1e6) == 10 + 2 + 42 + 28


@pytest.mark.parametrize("trace", sorted(p.name for p in FIXTURES.glob("*.json.gz")))
def test_report_on_real_gpu_traces(trace):
    from pptrace.run.build import load_run

    run = load_run(FIXTURES / trace, use_cache=False)
    report = build_report(run)
    _check_contract(report)
    # each fixture is one rank of a bigger job, or lacks pptrace ranges: always something to say
    assert report["warnings"], trace
    assert any("without pptrace ranges" in w for w in report["warnings"])
    stepped = [r for r in report["ranks"] if r["steps"]]
    assert stepped, "every fixture has ProfilerStep ranges"
    console = Console(record=True, width=200)
    print_report(report, console)
    assert "Step time per rank" in console.export_text()
