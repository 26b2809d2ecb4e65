"""Issue 25, items 3, 5 and 6: what a damaged or unusual trace holds never loses the run or a
rank to an internal error, nor gives a wrong number. A cut (a rank that died while writing)
drops the step it lands in for that rank, the same in a .json and in a .gz. Ranges written as B/E event pairs (legal Chrome trace format)
give the numbers of the same ranges as complete events; a file name that is not UTF-8, a
lone surrogate escape in an event name, a layout claim of the wrong type, a symlink loop
among the traces: the run is analysed, the bad file or field named in one line.

Every check runs the real command (tests/hostile.py) on a GPipe run of known numbers
(tracegen.pipeline_run) and checks that the trace files are left as they were."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import zlib

import pytest

from hostile import checksums, no_traceback, pptrace
from tracegen import pipeline_run


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The run, and its --json document."""
    run, _ = pipeline_run(tmp_path_factory.mktemp("clean") / "run", pp=2, microbatches=4, steps=(1, 2))
    result = pptrace("analyze", run, "--json")
    assert result.returncode == 0, result.stderr
    return run, json.loads(result.stdout)


def _copy(clean, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(clean[0], run, ignore=shutil.ignore_patterns(".pptrace-cache"))
    return run


def _rewrite(path, change) -> None:
    doc = json.loads(gzip.decompress(path.read_bytes()))
    path.write_bytes(gzip.compress(json.dumps(change(doc)).encode()))


def _analyzed(run) -> tuple[dict, list]:
    """(the --json document, its warnings) of a command that must succeed without a traceback."""
    before = checksums(run)
    result = pptrace("analyze", run, "--json")
    no_traceback(result)
    assert result.returncode == 0, result.stderr
    assert checksums(run) == before
    doc = json.loads(result.stdout)
    return doc, doc["warnings"]


def _parts(doc) -> dict:
    return {r["rank"]: r["mean"]["breakdown_s"] for r in doc["ranks"]}


def _as_begin_end(doc: dict) -> dict:
    """Every range (user annotation) as a B event and an E event, the E's after all X's: a
    pair may lie far apart in the file, as an exporter writing ends as they come does."""
    events, ends = [], []
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation":
            events.append({**{k: v for k, v in e.items() if k != "dur"}, "ph": "B"})
            ends.append({"ph": "E", "pid": e["pid"], "tid": e["tid"], "ts": e["ts"] + e["dur"]})
        else:
            events.append(e)
    return {**doc, "traceEvents": events + sorted(ends, key=lambda e: e["ts"])}


def test_begin_end_events_give_the_numbers_of_complete_ones(clean, tmp_path):
    run = _copy(clean, tmp_path)
    for path in (run / "traces").glob("*.json.gz"):
        _rewrite(path, _as_begin_end)
    doc, warnings = _analyzed(run)
    assert _parts(doc) == _parts(clean[1])
    assert doc["pipeline"]["stages"] == clean[1]["pipeline"]["stages"]
    assert not warnings


def test_an_unpaired_begin_or_end_is_left_out_and_counted(clean, tmp_path):
    run = _copy(clean, tmp_path)

    def damaged(doc):
        doc = _as_begin_end(doc)
        doc["traceEvents"].append({"ph": "E", "pid": 10**6, "tid": 10**6, "ts": 1.0})  # closes nothing
        return doc

    _rewrite(run / "traces" / "rank1.json.gz", damaged)
    doc, warnings = _analyzed(run)
    assert _parts(doc) == _parts(clean[1])
    assert warnings == [f"{run}/traces/rank1.json.gz: 1 begin/end (B/E) events without their other half left out"]


def test_a_file_name_that_is_not_utf8_is_named_and_the_rest_analysed(clean, tmp_path):
    run = _copy(clean, tmp_path)
    os.rename(run / "traces" / "rank1.json.gz", os.fsencode(run / "traces") + b"/rank1\xff.json.gz")
    doc, warnings = _analyzed(run)
    assert [r["rank"] for r in doc["ranks"]] == [0]
    assert any("rank1\\xff.json.gz: the file name is not UTF-8 text; rename it" in w for w in warnings), warnings
    info = pptrace("info", run)
    no_traceback(info)
    assert info.returncode == 0 and "rank1\\xff.json.gz" in info.stdout + info.stderr


def test_a_lone_surrogate_in_an_event_name_keeps_the_rank(clean, tmp_path):
    run = _copy(clean, tmp_path)
    path = run / "traces" / "rank1.json.gz"

    def odd(doc):  # json writes the lone surrogate as the escape \\ud800, as a broken exporter does
        first = next(e for e in doc["traceEvents"] if e.get("name", "").startswith("compute:fwd"))
        return {**doc, "traceEvents": doc["traceEvents"] + [{**first, "name": "\ud800odd", "dur": 1}]}

    _rewrite(path, odd)
    assert b"\\ud800odd" in gzip.decompress(path.read_bytes())
    doc, warnings = _analyzed(run)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert _parts(doc) == _parts(clean[1])
    assert warnings == [f"{path}: 1 event names or categories hold a lone surrogate escape "
                        "(\\ud800 ...: no text can hold one); shown as U+FFFD"]


@pytest.mark.parametrize("pp", [[2], "2", 2.5, None])
def test_a_layout_claim_of_the_wrong_type_is_named_and_the_pipeline_found(clean, tmp_path, pp):
    run = _copy(clean, tmp_path)
    for path in (run / "traces").glob("*.json.gz"):
        _rewrite(path, lambda doc: {**doc, "pptrace": {**doc["pptrace"], "layout": {**doc["pptrace"]["layout"], "pp": pp}}})
    doc, warnings = _analyzed(run)
    assert doc["run"]["layout"]["pp"] == 2  # from the chain of first sends
    bad = [w for w in warnings if "the pptrace block has a bad layout" in w]
    assert len(bad) == 2 and all("Layout.pp must be a positive integer" in w for w in bad), warnings
    info = pptrace("info", run)
    no_traceback(info)
    assert info.returncode == 0


def test_a_symlink_loop_among_the_traces_is_named_and_the_rest_analysed(clean, tmp_path):
    run = _copy(clean, tmp_path)
    os.symlink("rank8.json", run / "traces" / "rank9.json")
    os.symlink("rank9.json", run / "traces" / "rank8.json")
    doc, warnings = _analyzed(run)
    assert _parts(doc) == _parts(clean[1])
    assert sum("Too many levels of symbolic links" in w for w in warnings) == 2, warnings


def _cut_in_step_2(doc: dict) -> bytes:
    """The document's text with its events in time order (as Kineto writes a step's ranges
    after its ProfilerStep), cut inside the first event that starts past the middle of step 2."""
    events = sorted(doc["traceEvents"], key=lambda e: e.get("ts", 0))
    head = json.dumps({k: v for k, v in doc.items() if k != "traceEvents"})[:-1] + ', "traceEvents": [\n'
    lines = [json.dumps(e) for e in events]
    step2 = next(e for e in events if e.get("name") == "ProfilerStep#2")
    i = next(i for i, e in enumerate(events) if e.get("ts", 0) > step2["ts"] + step2["dur"] / 2)
    at = len(head) + sum(len(line) + 2 for line in lines[:i]) + len(lines[i]) // 2
    return (head + ", ".join(lines) + "\n]}").encode()[:at]


def _gzip_cut(data: bytes) -> bytes:
    """``data`` as a .gz whose writer died: every byte inflates, the stream never ends."""
    out = zlib.compressobj(6, zlib.DEFLATED, 31)
    return out.compress(data) + out.flush(zlib.Z_SYNC_FLUSH)


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_a_cut_inside_a_step_leaves_that_step_out_for_that_rank(clean, tmp_path, suffix):
    """The step a cut lands in read as a step of 8 ms compute and 7 ms bubble (12 and 3 in
    truth); now it is left out for that rank, with one line, and the whole step before it
    has the clean run's numbers; a .gz cut the same way salvages the same events (it lost
    the whole rank)."""
    run = _copy(clean, tmp_path)
    path = run / "traces" / "rank1.json.gz"
    cut = _cut_in_step_2(json.loads(gzip.decompress(path.read_bytes())))
    path.unlink()
    (run / "traces" / f"rank1{suffix}").write_bytes(_gzip_cut(cut) if suffix.endswith(".gz") else cut)
    doc, warnings = _analyzed(run)
    assert doc["run"]["steps"] == [1]
    clean_step1 = {r["rank"]: r["steps"][0]["breakdown_s"] for r in clean[1]["ranks"]}
    assert {r["rank"]: r["steps"][0]["breakdown_s"] for r in doc["ranks"]} == clean_step1
    name = f"{run}/traces/rank1{suffix}"
    assert any(w.startswith(f"{name}: truncated trace") for w in warnings), warnings
    assert f"{name}: the cut lands in step 2: left out for this rank (what it ran after the cut is lost)" in warnings


def test_a_cut_that_leaves_no_whole_step_skips_the_rank_in_one_line(clean, tmp_path):
    run = _copy(clean, tmp_path)
    path = run / "traces" / "rank1.json.gz"
    text = gzip.decompress(path.read_bytes())  # tracegen writes the ProfilerStep marks last
    path.write_bytes(_gzip_cut(text[: text.index(b"ProfilerStep#")]))
    doc, warnings = _analyzed(run)
    assert [r["rank"] for r in doc["ranks"]] == [0]
    assert f"skipped: {path}: truncated trace (the rank died while writing it?), and the cut leaves no whole " \
           "profiled step; re-copy the file or re-profile the run" in warnings
