"""The diff's decomposition, noise rule, set-up checks and gate on hand-built analysis documents
(tests/diff/docs.py): every number known, the waterfall's sums exact."""
from __future__ import annotations

import math

import pytest

from diff_docs import cell, document
from pptrace.diff import diff, parse_gate
from pptrace.errors import TraceError
from pptrace.topology import Layout

JITTER = (0.0, 0.0004, -0.0004, 0.0002)  # per step: the runs' own noise, seconds


def _base(rank, stage, step):
    return cell(fwd=0.010 + JITTER[step - 1], bwd=0.020, schedule=0.005 + 0.001 * stage, latency=0.001)


def test_waterfall_sums_exactly_and_names_each_change():
    def new(rank, stage, step):  # stage 1's backward +3 ms, its bubble -1 ms; dp exposed +2 ms everywhere
        c = _base(rank, stage, step)
        c["compute_s"]["bwd"] += 0.003 * (stage == 1)
        c["schedule"] -= 0.001 * (stage == 1)
        c["dp_exposed"] = 0.002
        return c

    doc = diff(document(_base), document(new))
    fall = doc["waterfall"]
    items = {i["item"]: i for i in fall["items"]}
    assert math.fsum([*(i["delta_s"] for i in fall["items"]), fall["unexplained_s"]]) == pytest.approx(
        doc["step"]["delta_s"], abs=1e-15)
    assert abs(fall["unexplained_s"]) < 1e-12
    assert doc["step"]["delta_s"] == pytest.approx(0.0015 - 0.0005 + 0.002, abs=1e-12)  # means over both stages
    assert items["compute_bwd"]["delta_s"] == pytest.approx(0.0015) and items["compute_bwd"]["significant"]
    assert items["dp_exposed"]["delta_s"] == pytest.approx(0.002) and items["dp_exposed"]["significant"]
    assert items["compute_fwd"]["delta_s"] == pytest.approx(0.0) and not items["compute_fwd"]["significant"]
    s1 = {i["item"]: i for i in doc["stages"][1]["waterfall"]["items"]}
    assert s1["compute_bwd"]["delta_s"] == pytest.approx(0.003) and s1["pp_bubble_schedule"]["delta_s"] == pytest.approx(-0.001)
    for stage in doc["stages"]:
        w = stage["waterfall"]
        assert w["base_s"] + math.fsum(i["delta_s"] for i in w["items"]) + w["unexplained_s"] == pytest.approx(
            w["new_s"], abs=1e-15)
    assert any("stage 1: backward +3.0 ms" in s for s in doc["explanation"]), doc["explanation"]


def test_a_run_against_itself_is_all_zeros():
    doc = diff(document(_base), document(_base), gates=["step>+0%", "pp_bubble>+0ms"])
    every = [doc["step"], *doc["waterfall"]["items"], *(i for s in doc["stages"] for i in s["waterfall"]["items"])]
    assert all(c["delta_s"] == 0 and c["significant"] is False for c in every)
    assert doc["verdict"]["status"] == "pass" and doc["setup"]["changes"] == []
    assert "no part of the step changed beyond noise" in doc["explanation"]


def test_noise_decides_significance():
    """A shift inside 3 pooled spreads is noise; beyond, it is a change (the spread here: the
    per-step jitter, 1.4826 x its MAD)."""
    def shifted(by):
        return lambda rank, stage, step: cell(fwd=0.010 + JITTER[step - 1] + by, bwd=0.020)

    base = document(shifted(0.0))
    small, large = diff(base, document(shifted(0.0002))), diff(base, document(shifted(0.003)))
    noise = small["step"]["noise_s"]
    # each rank's steps around its median (0.1 ms): -0.1, 0.3, -0.5, 0.1 ms; their MAD 0.2 ms
    assert noise == pytest.approx(1.4826 * 0.0002, rel=1e-6)
    assert small["step"]["significant"] is False and large["step"]["significant"] is True
    assert small["verdict"]["status"] == "unchanged" and large["verdict"]["status"] == "slower"


def test_gate_threshold_and_noise():
    slower = document(lambda r, s, step: cell(fwd=0.010 + JITTER[step - 1] + 0.004, bwd=0.020))
    base = document(lambda r, s, step: cell(fwd=0.010 + JITTER[step - 1], bwd=0.020))
    doc = diff(base, slower, gates=["step>+3%", "compute_fwd>+10ms", "stage1.pp_bubble>+1ms"])
    failed = {g["spec"]: g["failed"] for g in doc["verdict"]["gates"]}
    assert failed == {"step>+3%": True, "compute_fwd>+10ms": False, "stage1.pp_bubble>+1ms": False}
    assert doc["verdict"]["status"] == "fail" and doc["verdict"]["line"].startswith("FAIL: step +4.0 ms")
    # beyond the threshold but within noise: passes
    jittery = document(lambda r, s, step: cell(fwd=0.010 + 10 * JITTER[step - 1], bwd=0.020))
    near = document(lambda r, s, step: cell(fwd=0.011 + 10 * JITTER[step - 1], bwd=0.020))
    result = diff(jittery, near, gates=["step>+1%"])["verdict"]
    assert result["status"] == "pass" and result["gates"][0]["worse_than_threshold"], result


@pytest.mark.parametrize("spec, why", [("step>3", "is not a gate"), ("stp>+3%", "unknown metric 'stp'"),
                                       ("step<+3%", "is not a gate"), ("step>+x%", "is not a gate")])
def test_bad_gate_specs(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_gate(spec)


def test_parsed_gates():
    g = parse_gate("stage2.dp_exposed > +10%")
    assert (g.metric, g.stage, g.relative, g.threshold) == ("dp_exposed", 2, True, pytest.approx(0.10))
    assert parse_gate("pp_bubble>+5ms").threshold == pytest.approx(0.005)
    assert parse_gate("step>+250us").threshold == pytest.approx(0.00025)


def test_no_common_dims_is_refused():
    pp = document(lambda r, s, step: cell(), layout=Layout(pp=2))
    dp = document(lambda r, s, step: cell(schedule=0.0, latency=0.0), layout=Layout(dp=2))
    with pytest.raises(TraceError, match="no parallel dimension in common"):
        diff(pp, dp)


def test_other_layouts_compare_per_stage_and_dim():
    base = document(lambda r, s, step: cell(), layout=Layout(pp=2))
    new = document(lambda r, s, step: cell(fwd=0.012), layout=Layout(pp=2, dp=2))
    doc = diff(base, new)
    assert doc["setup"]["comparable"] == {"ranks": False, "stages": True, "dims": ["pp"]}
    assert doc["ranks"] == [] and [s["stage"] for s in doc["stages"]] == [0, 1]
    assert any(c["what"] == "layout" and c["new"] == "pp2 dp2" for c in doc["setup"]["changes"])
    assert any(n.startswith("dp: only") for n in doc["setup"]["not_comparable"])
    deeper = document(lambda r, s, step: cell(), layout=Layout(pp=4))
    doc = diff(base, deeper)
    assert doc["stages"] == [] and any(n.startswith("stages: pp 2 -> 4") for n in doc["setup"]["not_comparable"])
    assert doc["step"]["delta_s"] == pytest.approx(0.0, abs=1e-12)  # the run's means still compare


def test_setup_changes_and_theory():
    base = document(_base, microbatches=4, theory=0.005)
    new = document(lambda r, s, step: cell(fwd=0.010 + JITTER[step - 1], schedule=0.015 + 0.001 * s),
                   microbatches=2, theory=0.015, versions={"torch": "2.14.0", "pptrace": "0.1.0"})
    doc = diff(base, new)
    changed = {c["what"]: (c["base"], c["new"]) for c in doc["setup"]["changes"]}
    assert changed == {"microbatches": (4, 2), "torch": ("2.13.0", "2.14.0")}
    assert [s["pipeline"]["theory"] for s in doc["stages"]] == ["as expected", "as expected"]
    worse = diff(base, document(lambda r, s, step: cell(fwd=0.010 + JITTER[step - 1], schedule=0.025), theory=0.015))
    assert [s["pipeline"]["theory"] for s in worse["stages"]] == ["above theory", "above theory"]


def test_stragglers_that_appeared_and_went():
    s = {"rank": 1, "metric": "compute", "slowdown": 0.2, "cost_s": 0.004, "evidence": "late"}
    doc = diff(document(_base), document(_base, stragglers=[s]))
    assert [r["rank"] for r in doc["stragglers"]["appeared"]] == [1] and doc["stragglers"]["disappeared"] == []
    assert any(line.startswith("straggler appeared: rank 1") for line in doc["explanation"])
    back = diff(document(_base, stragglers=[s]), document(_base))
    assert [r["rank"] for r in back["stragglers"]["disappeared"]] == [1]


def test_typical_step_timelines():
    slow_step = document(lambda r, s, step: cell(fwd=0.010 + 0.004 * (step == 4)))
    doc = diff(slow_step, slow_step)
    assert doc["timelines"]["base"]["step"] in (1, 2, 3)
    passes = doc["timelines"]["base"]["passes"]
    assert {(p["stage"], p["op"]) for p in passes} == {(s, op) for s in (0, 1) for op in ("fwd", "bwd")}


def test_pptrace_diff_is_callable_whichever_import_came_first(tmp_path):
    """``pptrace.diff`` names both the function and the package (Python binds a subpackage's
    name on its parent when it is imported): either way it answers ``pptrace.diff(a, b)``."""
    import json
    import subprocess
    import sys

    path = tmp_path / "a.json"
    path.write_text(json.dumps(document(_base)))
    for first in ("import pptrace", "import pptrace.diff.gate; import pptrace"):
        code = f"{first}; print(pptrace.diff({str(path)!r}, {str(path)!r})['verdict']['status'])"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.stdout.strip() == "unchanged", (first, done.stderr[-500:])
