"""Issue 42 item 6: a trace without ProfilerStep#N ranges (a bare ``torch.profiler.profile()``
block, no ``prof.step()``) is analysed as one step, step 0, spanning each rank's whole trace,
with a warning naming the ranks (run/whole_trace.py)."""
from __future__ import annotations

import gzip
import json
import math
import shutil

import pytest

from bare_profile_run import record
from hostile import pptrace, stderr_lines
from tracegen import pipeline_run

S = 1e-9


def _report(run_dir) -> dict:
    r = pptrace("analyze", run_dir, "--json")
    assert r.returncode == 0 and not stderr_lines(r), r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """(run directory, each rank's log) of tests/bare_profile_run.py on 2 real gloo ranks."""
    import box

    out = tmp_path_factory.mktemp("bare") / "run"
    with box.alone():
        logs = record(out)
    return out, logs


def test_bare_profile_block_is_one_step(bare):
    """Each rank's one step against what it logged with time.time_ns. The main thread records
    nothing but the benchmark's ranges (and the c10d op inside the all-reduce's), so the step
    spans the first range to the last: its wall lies between the span of the ranges timed just
    inside them (lower) and just outside them (upper). compute is the compute:* ranges:
    between the sum of their inside and outside timings; dp_exposed is the dp:all_reduce
    range (no compute under it): between its inside and outside timing. The parts add up."""
    run_dir, logs = bare
    report = _report(run_dir)
    assert report["run"]["steps"] == [0] and "steps" in report["run"]["inferred"]
    assert any(w.startswith("ranks [0, 1] have no ProfilerStep#N range") and "one step" in w
               for w in report["warnings"]), report["warnings"]
    assert not any("not partitioned" in w for w in report["warnings"])
    for entry, log in zip(report["ranks"], logs):
        assert entry["rank"] == log["rank"]
        (step,) = entry["steps"]
        parts = step["breakdown_s"]
        ranges = log["ranges"]

        def spans(kind, which):
            return [r[which] for r in ranges if r["name"].startswith(kind)]

        inner, outer = spans("", "inner"), spans("", "outer")
        assert (inner[-1][1] - inner[0][0]) * S <= step["time_s"] <= (outer[-1][1] - outer[0][0]) * S
        for part, kind in (("compute", "compute:"), ("dp_exposed", "dp:")):
            lo = sum(e - s for s, e in spans(kind, "inner")) * S
            hi = sum(e - s for s, e in spans(kind, "outer")) * S
            assert lo <= parts[part] <= hi, (log["rank"], part, lo, parts[part], hi)
        assert sum(parts.values()) == pytest.approx(step["time_s"], abs=1e-9)


def _strip_steps(src, dst, ranks=None):
    """dst: src's trace files with the ProfilerStep#N rows removed (of ``ranks``; None: all)."""
    dst.mkdir(parents=True)
    for path in sorted(src.glob("*.json.gz")):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        if ranks is None or any(f"rank{r}." in path.name for r in ranks):
            doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep#")]
        (dst / path.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    return dst


def _sum(steps, field):
    total: dict = {}
    for s in steps:
        for k, v in s[field].items():
            total[k] = total.get(k, 0.0) + (v or 0.0)
    return total


def test_gpu_trace_without_steps_is_their_sum(hta_fixtures, tmp_path):
    """HTA's one-GPU trace (ProfilerStep#101-105) with its ProfilerStep rows stripped: one step
    whose window is the span of the GPU's activity (first kernel/memcpy start to the last
    end, read from the trace), whose compute, communication and hidden time are the five
    steps' sums (every kernel was launched inside a step), and whose other is theirs plus the
    GPU's idle gaps between the steps' windows (the wall's excess over the steps')."""
    name = "single_gpu_world1_rank0.json.gz"
    stepped = tmp_path / "stepped"
    stepped.mkdir()
    shutil.copy(hta_fixtures / name, stepped / name)
    bare = _strip_steps(stepped, tmp_path / "bare")
    with_steps, without = _report(stepped), _report(bare)
    assert [s["step"] for s in with_steps["ranks"][0]["steps"]] == [101, 102, 103, 104, 105]
    assert without["run"]["steps"] == [0] and any("ranks [0] have no ProfilerStep#N" in w for w in without["warnings"])
    (one,) = without["ranks"][0]["steps"]
    doc = json.loads(gzip.decompress((bare / name).read_bytes()))
    gpu = [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    end_us = max(e["ts"] + e["dur"] for e in gpu)
    # epoch µs as float64 (~1.7e15) hold ~0.25 µs: the two ends are known to one ulp each
    assert one["time_s"] == pytest.approx((end_us - min(e["ts"] for e in gpu)) * 1e-6, abs=2 * math.ulp(end_us) * 1e-6)
    steps = with_steps["ranks"][0]["steps"]
    parts, summed = one["breakdown_s"], _sum(steps, "breakdown_s")
    gaps = one["time_s"] - sum(s["time_s"] for s in steps)
    assert gaps > 0
    for part, value in parts.items():
        want = summed[part] + (gaps if part == "other" else 0.0)
        assert value == pytest.approx(want, abs=1e-9), part
    assert one["hidden_s"] == pytest.approx(_sum(steps, "hidden_s"), abs=1e-9)


def test_mixed_run_is_analysed_whole_everywhere(tmp_path):
    """A 4-stage GPipe run (tracegen, steps 2-3) where only rank 1 lost its ProfilerStep rows
    reads as the run with every rank's rows stripped: each rank one step, the whole trace; the
    warning names the unmarked rank and the marked ones with their steps. Its one step holds
    the two steps' compute, and the pipeline window spans both steps' pipelines."""
    src, _ = pipeline_run(tmp_path / "run", pp=4, microbatches=4, steps=(2, 3))
    stepped = _report(src)
    mixed = _report(_strip_steps(src / "traces", tmp_path / "mixed" / "traces", ranks=[1]).parent)
    bare = _report(_strip_steps(src / "traces", tmp_path / "bare" / "traces").parent)
    warning = next(w for w in mixed["warnings"] if "ProfilerStep#N" in w)
    assert warning.startswith("ranks [1] have no ProfilerStep#N range") and "ranks [0, 2, 3] marked steps [2, 3]" in warning
    assert any(w.startswith("ranks [0, 1, 2, 3] have no ProfilerStep#N range") for w in bare["warnings"])
    for key in ("ranks", "pipeline", "p2p", "collectives"):
        assert mixed[key] == bare[key], key
    for one, two in zip(bare["ranks"], stepped["ranks"]):
        assert [s["step"] for s in one["steps"]] == [0] and [s["step"] for s in two["steps"]] == [2, 3]
        assert one["steps"][0]["breakdown_s"]["compute"] == pytest.approx(
            sum(s["breakdown_s"]["compute"] for s in two["steps"]), abs=1e-9)
    assert bare["pipeline"]["stages"] and len(bare["critical_path"]) == 1


def test_cli_says_it_and_exits_0(bare):
    """``pptrace analyze`` (the tables) on the bare run: exit 0, the one step of each rank in
    the step table, the warning naming both ranks, nothing on stderr."""
    run_dir, _ = bare
    r = pptrace("analyze", run_dir)
    assert r.returncode == 0 and not stderr_lines(r), r.stderr
    text = " ".join(r.stdout.split())  # the console wraps long lines
    assert "steps [0]" in text and "not partitioned" not in text
    assert "warning: ranks [0, 1] have no ProfilerStep#N range (traced without prof.step()): the whole trace of each is " \
           "analysed as one step, step 0" in text
    assert "│ 0 │ dp0 │" in text and "│ 1 │ dp1 │" in text
