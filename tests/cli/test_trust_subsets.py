"""Issue 25 item 13: a ``--ranks`` subset reports the kept ranks' numbers as the full run does
wherever those ranks alone measure them, and what needs a peer that is not loaded as unknown.

``--ranks 0,3`` on a 4-stage run moved rank 0's 139 ms of bubble into 155 ms of "transfer"
(a recv whose send is not loaded cannot be split into waiting and moving) and printed a theory
of 100% for the stages it did not load. Built from the reference trainer's 4-stage 1F1B sleep
run (tests/sleep_runs.py), whose full analysis is the truth for every kept rank.

The pipeline window runs from the first pass to the last across *all* stages (DESIGN
contract 3): without some stages it spans the loaded ones only, so a kept rank's idle time
between the two windows' edges moves from bubble to other (the first stage's first forward
starts the whole window, the last backward ends it). That shift is bounded here by how far the edges
moved; every other number is the full run's to the nanosecond."""
from __future__ import annotations

import json

import pytest

from hostile import checksums, no_traceback, pptrace
from pptrace.run.build import load_run
from pptrace.vocab import COMM_DIMS

pytestmark = pytest.mark.slow

EXACT = ("time_s", "compute", *(f"{d}_exposed" for d in COMM_DIMS))


@pytest.fixture(scope="module")
def full(sleep_run):
    run_dir = sleep_run("1f1b")
    return run_dir, _analyze(run_dir)


def _window_shift(run_dir, ranks) -> dict:
    """step -> s by which the loaded stages' pipeline window is shorter than all stages'."""
    whole = load_run(run_dir, progress=False).pipeline_windows
    part = load_run(run_dir, ranks=ranks, progress=False).pipeline_windows
    shift = {s: (part[s].start_ns - whole[s].start_ns + whole[s].end_ns - part[s].end_ns) / 1e9 for s in whole}
    assert all(v >= 0 for v in shift.values()) and max(shift.values()) < 0.05, shift
    return shift


def _analyze(run_dir, *extra) -> dict:
    r = pptrace("analyze", run_dir, "--json", *extra)
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _steps(report: dict) -> dict:
    """(rank, step) -> that step's entry: time_s, breakdown_s, hidden_s."""
    return {(r["rank"], s["step"]): s for r in report["ranks"] for s in r["steps"]}


def _same_where_measurable(sub: dict, truth: dict, split_known: bool, edge_s: float) -> None:
    edge_s += 1e-9
    for name in EXACT:
        got = sub["time_s"] if name == "time_s" else sub["breakdown_s"][name]
        want = truth["time_s"] if name == "time_s" else truth["breakdown_s"][name]
        assert got == pytest.approx(want, abs=1e-9), name
    assert sub["hidden_s"] == pytest.approx(truth["hidden_s"], abs=1e-9)
    got, want = sub["breakdown_s"], truth["breakdown_s"]
    pipeline = want["pp_bubble"] + want["pp_transfer"]
    if split_known:
        assert got["pp_transfer"] == pytest.approx(want["pp_transfer"], abs=1e-9)
        assert got["pp_bubble"] == pytest.approx(want["pp_bubble"], abs=edge_s)
        assert got["pp_bubble_or_transfer"] == 0
        mine = got["pp_bubble"] + got["pp_transfer"]
    else:  # unknown, not zero and not transfer; the two together are known
        assert got["pp_bubble"] is None and got["pp_transfer"] is None
        assert got["pp_bubble_or_transfer"] == pytest.approx(pipeline, abs=edge_s) and pipeline > 0.02
        mine = got["pp_bubble_or_transfer"]
    assert got["other"] == pytest.approx(want["other"], abs=edge_s)
    assert mine + got["other"] == pytest.approx(pipeline + want["other"], abs=1e-9)  # the edge moves, nothing else


def test_the_first_and_last_stage_alone(full, tmp_path):
    run_dir, truth = full
    before = checksums(run_dir)
    report = _analyze(run_dir, "--ranks", "0,3")
    assert [r["rank"] for r in report["ranks"]] == [0, 3]
    steps, truth_steps = _steps(report), _steps(truth)
    assert sorted(steps) == sorted(k for k in truth_steps if k[0] in (0, 3)) and len(steps) == 16
    shift = _window_shift(run_dir, [0, 3])
    for key, entry in steps.items():
        _same_where_measurable(entry, truth_steps[key], split_known=False, edge_s=shift[key[1]])
    # the stages loaded, with what they measure alone; bubble and theory need the others
    stages = {s["stage"]: s for s in report["pipeline"]["stages"]}
    assert sorted(stages) == [0, 3]
    for stage, s in stages.items():
        whole = truth["pipeline"]["stages"][stage]
        assert (s["t_fwd_s"], s["t_bwd_s"], s["step_s"]) == pytest.approx((whole["t_fwd_s"], whole["t_bwd_s"], whole["step_s"]))
        assert s["bubble_s"] is None and s["theory_bubble_s"] is None and s["theory_bubble_fraction"] is None
    pipe = report["pipeline"]
    assert pipe["bubble_fraction"] is None and pipe["theory_bubble_fraction"] is None
    assert "stages [1, 2]" in pipe["theory_unknown"] and report["critical_path"] == []
    # said once, as what it is
    said = [w for w in report["warnings"] if "peer not loaded" in w]
    assert len(said) == 1 and "ranks [1, 2]" in said[0] and "unknown" in said[0], report["warnings"]
    assert not [w for w in report["warnings"] if "counts as pp_transfer" in w or "no matching recv" in w]
    assert len(report["warnings"]) == 1, report["warnings"]
    # and in the tables: no 100% theory, the unknown parts shown as unknown
    r = pptrace("analyze", run_dir, "--ranks", "0,3")
    assert r.returncode == 0 and "100.0%" not in r.stdout and "pp bubble or transfer" in r.stdout
    assert "theory: unknown (it needs the pass times of stages [1, 2]" in r.stdout
    assert r.stdout.count("peer not loaded") == 1
    assert checksums(run_dir) == before


def test_a_rank_whose_peers_are_all_loaded_keeps_its_split(full):
    """--ranks 0,1: rank 0's only peer is loaded: its wait/transfer split, its stage's bubble
    and its links are the full run's; rank 1's sends to rank 2 make its split unknown."""
    run_dir, truth = full
    report = _analyze(run_dir, "--ranks", "0,1")
    truth_steps, shift = _steps(truth), _window_shift(run_dir, [0, 1])
    for (rank, step), entry in _steps(report).items():
        _same_where_measurable(entry, truth_steps[(rank, step)], split_known=rank == 0, edge_s=shift[step])
    stages = {s["stage"]: s for s in report["pipeline"]["stages"]}
    assert sorted(stages) == [0, 1] and stages[1]["bubble_s"] is None
    assert stages[0]["bubble_s"] == pytest.approx(truth["pipeline"]["stages"][0]["bubble_s"],
                                                  abs=sum(shift.values()) / len(shift) + 1e-9)
    assert report["p2p"]["links"] == [link for link in truth["p2p"]["links"] if {link["src"], link["dst"]} == {0, 1}]
    (said,) = [w for w in report["warnings"] if "peer not loaded" in w]
    assert "ranks [1]" in said and "ranks [2]" in said
