"""Issue 15, metadata and events that lie (items 7, 10, 11, 14): the real ``pptrace`` command on
a GPipe run of known layout and bubble (tracegen.pipeline_run: pp=4, 8 microbatches, steps
2-3), corrupted one way at a time. A claim the traces contradict gives the clean run's numbers
and one warning naming the claim and the evidence; an impossible event is dropped and counted
in one warning per file; what cannot be answered is one error line. Trace files are never
modified and no traceback or RuntimeWarning reaches stderr.
"""
from __future__ import annotations

import gzip
import json
import resource
import shutil

import pytest

from hostile import checksums, no_traceback, one_line_error, pptrace, stderr_lines
from tracegen import RankTrace, pipeline_run

PP, MB, STEPS = 4, 8, (2, 3)
#: the report's numbers; "run" holds what the block said, which a corrected claim changes
NUMBERS = ("pipeline", "ranks", "p2p", "collectives", "critical_path", "stragglers")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(the clean run's directory, its report)."""
    out, _ = pipeline_run(tmp_path_factory.mktemp("clean") / "run", pp=PP, microbatches=MB, steps=STEPS)
    r = pptrace("analyze", out, "--json")
    assert r.returncode == 0 and not stderr_lines(r), r.stderr
    report = json.loads(r.stdout)
    assert report["warnings"] == [] and report["pipeline"]["pp"] == PP
    return out, report


def _copy(clean_dir, dst):
    shutil.copytree(clean_dir / "traces", dst / "traces", ignore=shutil.ignore_patterns(".pptrace-cache"))
    return dst


def _rewrite(run_dir, rank, change):
    """Apply ``change(doc)`` to rank's trace document (json: NaN and Infinity may be written)."""
    path = run_dir / "traces" / f"rank{rank}.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    change(doc)
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))


def _claim(pg_config=None, **fields):
    """A change that rewrites the pptrace block's fields (and distributedInfo's pg_config)."""
    def change(doc):
        doc["pptrace"].update(fields)
        if pg_config is not None:
            doc["distributedInfo"]["pg_config"] = pg_config
    return change


def _analyze(run_dir, *args):
    """(report, result) of ``pptrace analyze --json``: exit 0, nothing on stderr, files unchanged."""
    before = checksums(run_dir)
    r = pptrace("analyze", run_dir, "--json", *args)
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    assert stderr_lines(r) == [], r.stderr  # warnings go in the JSON; no RuntimeWarning leaks
    assert checksums(run_dir) == before
    return json.loads(r.stdout), r


def _numbers(report):
    return {k: report[k] for k in NUMBERS}


def _theory(report) -> list:
    pipe = report["pipeline"]
    return [pipe["theory_bubble_fraction"], pipe["theory_step_s"], *(s["theory_bubble_s"] for s in pipe["stages"])]


def _without_theory(report) -> dict:
    """The report less its theory (and the schedule it names)."""
    report = json.loads(json.dumps(report))
    pipe = report["pipeline"]
    for part in (pipe, *pipe["stages"]):
        for key in [k for k in part if k.startswith("theory")]:
            del part[key]
    pipe["schedule"] = None
    return report


# -------------------------------------------------------------------------------------------
# 7: ranks and world sizes no run can have are not believed (and nothing of their size is built)
# -------------------------------------------------------------------------------------------
def _limit_memory():
    # a world of 10^9 ranks materialised anywhere would need GBs; the run needs a few hundred MB
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _plain_dp_run(out, names):
    """Four dp ranks without pptrace block or distributedInfo, written under ``names``."""
    for rank, name in enumerate(names):
        t = RankTrace(rank, world_size=4, pptrace_block=False, distributed=False)
        t.step(1, 0, 1000)
        t.region("compute:fwd", 10, 500, mb=0)
        t.write(out / "traces" / name)
    return out


@pytest.mark.parametrize("case", ["block_dp_1e9", "block_rank_1e9", "name_rank_1e9", "dist_world_1e9"])
def test_item7_huge_ranks_and_worlds_are_not_believed(clean, tmp_path, case):
    clean_dir, clean_report = clean
    run = tmp_path / "run"
    if case == "name_rank_1e9":
        _plain_dp_run(run, ["rank0.json.gz", "rank1.json.gz", "rank2.json.gz", "rank1000000000.json.gz"])
        expect, ranks = ["rank 1000000000 is beyond any run", "rank1000000000.json.gz"], [0, 1, 2]
    else:
        _copy(clean_dir, run)
        if case == "block_dp_1e9":
            for r in range(PP):
                _rewrite(run, r, _claim(layout={"tp": 1, "cp": 1, "pp": PP, "dp": 10**9}, world_size=4 * 10**9))
            expect = ["layout tp1 cp1 pp4 dp1000000000 says 4000000000 ranks", "using world size 4"]
        elif case == "block_rank_1e9":
            _rewrite(run, 2, _claim(rank=10**9))
            expect = ["rank 1000000000 in its metadata is beyond any run", "using rank 2 from its distributedInfo"]
        else:
            for r in range(PP):
                _rewrite(run, r, lambda doc: doc["distributedInfo"].update(world_size=10**9))
            expect = ["distributedInfo's world_size says 1000000000 ranks", "using world size 4"]
        ranks = list(range(PP))
    before = checksums(run)
    r = pptrace("analyze", run, "--json", timeout=60, preexec_fn=_limit_memory)
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    assert stderr_lines(r) == [], r.stderr
    assert checksums(run) == before
    report = json.loads(r.stdout)
    assert report["run"]["ranks"] == ranks and report["run"]["world_size"] == len(ranks)
    hits = [w for w in report["warnings"] if all(e in w for e in expect)]
    assert len(hits) == 1, report["warnings"]
    if case != "name_rank_1e9":  # the claim not believed, the clean run's numbers
        assert _numbers(report) == _numbers(clean_report)


# -------------------------------------------------------------------------------------------
# 10: a pptrace block that contradicts the traces is corrected from them, with a warning
# -------------------------------------------------------------------------------------------
LIES = {
    # name: (block fields, [words of each expected warning: one per contradiction])
    "tp1_pp2_dp2": ({"layout": {"tp": 1, "cp": 1, "pp": 2, "dp": 2}},
                    [["layout tp1 cp1 pp2 dp2", "rank 0 exchanges p2p with rank 1", "using tp1 cp1 pp4 dp1",
                      "0 -> 1 -> 2 -> 3"]]),
    "tp2_pp2": ({"layout": {"tp": 2, "cp": 1, "pp": 2, "dp": 1}},
                [["layout tp2 cp1 pp2 dp1", "not a pipeline neighbour", "using tp1 cp1 pp4 dp1"]]),
    # Megatron names its groups in distributedInfo: the pipeline group is the evidence
    "pp2_dp2_pg_config": ({"layout": {"tp": 1, "cp": 1, "pp": 2, "dp": 2},
                           "pg_config": [{"pg_name": "1", "pg_desc": "PIPELINE_MODEL_PARALLEL_GROUP", "pg_size": 4,
                                          "ranks": [0, 1, 2, 3]}]},
                          [["layout tp1 cp1 pp2 dp2", "pg_config puts rank 0 in the pp group [0, 1, 2, 3]",
                            "using tp1 cp1 pp4 dp1", "pipeline process group"]]),
    "microbatches_4": ({"microbatches": 4}, [["says 4 microbatches", "8 distinct microbatches", "using 8"]]),
    "interleaved_vpp2": ({"schedule": "interleaved", "vpp": 2},
                         [["says vpp 2", "1 model chunk per rank", "using 1"],
                          ["says schedule 'interleaved'", "is gpipe's", "using gpipe"]]),
    "world_size_2": ({"world_size": 2}, [["world_size says 2 ranks", "rank 3 is here", "using world size 4"]]),
    "microbatches_0": ({"microbatches": 0}, [["microbatches 0, not a positive count", "using 8"]]),
    # not a contradiction: the name is kept and the theory replays the measured order
    "unknown_schedule": ({"schedule": "zigzag"}, [["'zigzag'", "does not know", "replay of the measured order",
                                                   "the order of gpipe"]]),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_item10_metadata_that_lies_is_corrected_from_the_traces(clean, tmp_path, lie):
    clean_dir, clean_report = clean
    fields, expected = LIES[lie]
    run = _copy(clean_dir, tmp_path / "run")
    for rank in range(PP):
        _rewrite(run, rank, _claim(**fields))
    report, _ = _analyze(run)
    assert report["run"]["layout"] == clean_report["run"]["layout"] and report["run"]["microbatches"] == MB
    if lie == "unknown_schedule":  # the replay of GPipe's order is GPipe's closed form, to rounding
        assert report["run"]["schedule"] == "zigzag"
        assert report["pipeline"]["theory_source"] == "replay of the measured action order"
        assert _theory(report) == pytest.approx(_theory(clean_report), rel=1e-9)
        report, clean_report = _without_theory(report), _without_theory(clean_report)
    else:
        assert report["run"]["schedule"] == "gpipe"
    assert _numbers(report) == _numbers(clean_report)
    assert len(report["warnings"]) == len(expected), report["warnings"]
    for words in expected:
        assert any(all(w in line for w in words) for line in report["warnings"]), (words, report["warnings"])


# -------------------------------------------------------------------------------------------
# 11: impossible events are dropped and counted, never clamped nor used to judge the run
# -------------------------------------------------------------------------------------------
def _add(*events):
    """A change appending X events on the main thread; ``at`` is µs after rank's first step."""
    def change(doc):
        step = next(e for e in doc["traceEvents"] if str(e.get("name")).startswith("ProfilerStep#"))
        for e in events:
            e = {"ph": "X", "cat": "user_annotation", "pid": step["pid"], "tid": step["tid"], "args": {}, **e}
            if "at" in e:
                e["ts"] = step["ts"] + e.pop("at")
            doc["traceEvents"].append(e)
    return change


BAD_EVENTS = {
    # name: (rank, change, words of its one warning)
    "compute_durations": (1, _add({"name": "compute:fwd mb=0", "at": 1500, "dur": -5000.0},
                                  {"name": "compute:bwd mb=1", "at": 1600},
                                  {"name": "compute:fwd mb=2", "at": 1700, "dur": float("nan")},
                                  {"name": "compute:fwd mb=3", "at": 1800, "dur": "NaN"}),
                          ["rank1.json.gz: 4 events dropped", "3 without a usable duration", "1 with a negative"]),
    "profiler_steps": (2, _add({"name": "ProfilerStep#2", "at": 5, "dur": float("inf")},
                               {"name": "ProfilerStep#3", "at": 7, "dur": -1.0},
                               {"name": "ProfilerStep#4", "at": 9}),
                       ["rank2.json.gz: 3 events dropped", "2 without a usable duration", "1 with a negative",
                        "of which 3 ProfilerStep ranges"]),
    "absurd_timestamps": (0, _add({"name": "aten::mm", "ts": 1e30, "dur": 1.0},
                                  {"name": "aten::mm", "ts": -1e12, "dur": 1.0},
                                  {"name": "aten::add", "at": 100, "dur": 1e14},
                                  {"name": "aten::add", "ts": float("-inf"), "dur": 1.0}),
                          ["rank0.json.gz: 4 events dropped", "2 without a usable timestamp",
                           "2 far outside the rank's other events"]),
}


@pytest.mark.parametrize("case", sorted(BAD_EVENTS))
def test_item11_impossible_events_are_dropped_and_counted(clean, tmp_path, case):
    clean_dir, clean_report = clean
    rank, change, words = BAD_EVENTS[case]
    run = _copy(clean_dir, tmp_path / "run")
    _rewrite(run, rank, change)
    report, _ = _analyze(run)
    assert _numbers(report) == _numbers(clean_report)
    assert report["run"]["steps"] == list(STEPS)
    assert len(report["warnings"]) == 1 and all(w in report["warnings"][0] for w in words), report["warnings"]


def test_item11_a_lost_step_or_no_common_step(clean, tmp_path):
    """A rank whose ProfilerStep#2 has an impossible duration: step 3 alone, with the numbers
    of the clean run's step 3; every step lost on one rank: one error line, no numbers."""
    clean_dir, _ = clean
    run = _copy(clean_dir, tmp_path / "one")

    def bad_step(n, dur):
        def change(doc):
            for e in doc["traceEvents"]:
                if e.get("name") == f"ProfilerStep#{n}":
                    if dur is None:
                        e.pop("dur")
                    else:
                        e["dur"] = dur
        return change

    _rewrite(run, 1, bad_step(2, -1.0))
    report, _ = _analyze(run)
    step3, _ = _analyze(clean_dir, "--steps", "3")
    assert report["run"]["steps"] == [3]
    assert _numbers(report) == _numbers(step3)
    assert any("rank1.json.gz: 1 event dropped" in w and "ProfilerStep" in w for w in report["warnings"])
    assert not any("step -1" in w for w in report["warnings"]), report["warnings"]

    run = _copy(clean_dir, tmp_path / "none")
    _rewrite(run, 1, bad_step(2, float("inf")))
    _rewrite(run, 1, bad_step(3, None))
    before = checksums(run)
    r = pptrace("analyze", run, "--json")
    one_line_error(r, "no profiled step is common to all ranks", "rank 1: none", "rank1.json.gz")
    assert not r.stdout.strip()
    assert checksums(run) == before


# -------------------------------------------------------------------------------------------
# 14: --steps a step that was not profiled, --ranks a subset
# -------------------------------------------------------------------------------------------
def test_item14_steps_not_profiled_and_ranks_not_requested(clean, tmp_path):
    clean_dir, clean_report = clean
    before = checksums(clean_dir)
    r = pptrace("analyze", clean_dir, "--steps", "99")
    one_line_error(r, "step 99 was not profiled (profiled: 2, 3)")
    assert "call prof.step()" not in r.stdout + r.stderr and not r.stdout.strip()

    report, _ = _analyze(clean_dir, "--steps", "2,99")
    assert report["run"]["steps"] == [2]
    assert [w for w in report["warnings"] if "99" in w] == ["requested step 99 was not profiled (profiled: 2, 3)"]

    report, _ = _analyze(clean_dir, "--ranks", "0,3")
    assert report["run"]["ranks"] == [0, 3]
    assert not any("have no trace" in w or "no usable trace" in w for w in report["warnings"]), report["warnings"]
    assert checksums(clean_dir) == before
