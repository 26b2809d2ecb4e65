"""Merged Perfetto/Chrome trace: structure checks a trace viewer relies on."""
from __future__ import annotations

import gzip
import json

import pytest

from pptrace.export.perfetto import merge_run
from pptrace.run.build import load_run
from tracegen import pipeline_run


def _check_structure(doc, run):
    events = doc["traceEvents"]
    named_pids = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_tids = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(run.events)
    assert {e["pid"] for e in slices} == set(named_pids) == set(run.ranks)
    assert {(e["pid"], e["tid"]) for e in slices} <= set(named_tids)
    for rank in run.ranks:
        assert named_pids[rank] == run.describe(rank)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(ends) and len(starts) == len(run.pairs) > 0
    for fid, s in starts.items():
        f = ends[fid]
        assert f["bp"] == "e" and f["ts"] >= s["ts"]
        # both ends sit inside a slice of their thread (viewers bind flows to slices)
        for end in (s, f):
            assert any(x["pid"] == end["pid"] and x["tid"] == end["tid"] and x["ts"] <= end["ts"] <= x["ts"] + x["dur"]
                       for x in slices)
    assert min(e["ts"] for e in slices) == 0


def test_merge_synthetic(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2, skew_ns={1: 3_000_000})
    run = load_run(run_dir, use_cache=False)
    out = merge_run(run, tmp_path / "merged.json.gz")
    doc = json.loads(gzip.decompress(out.read_bytes()))
    _check_structure(doc, run)
    assert "rank 3 · pp1 dp1" in {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    plain = merge_run(run, tmp_path / "merged.json")
    assert json.loads(plain.read_text())["traceEvents"] == doc["traceEvents"]


@pytest.mark.slow
def test_merge_real_gloo(gloo_run, tmp_path):
    run = load_run(gloo_run, use_cache=False)
    doc = json.loads(gzip.decompress(merge_run(run, tmp_path / "m.json.gz").read_bytes()))
    _check_structure(doc, run)
    lanes = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert "main" in lanes and any("pt_gloo_runloop" in lane for lane in lanes)
