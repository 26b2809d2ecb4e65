"""Issue 25 item 12: clocks that say nothing, and clocks hours apart.

A corrupt ``baseTimeNanoseconds`` ("x", true, 1e30) on one rank put that rank in 1970 and
refused the whole run as "traces from different runs ... 497460 h". The field and the file
are named in one warning and the rank is aligned from its events (its collectives and p2p).
A skew of hours on one rank is refused as two runs mixed; the refusal says how to go on,
``--assume-same-run``, which aligns that rank on its communication.

Synthetic GPipe runs (tracegen.pipeline_run) with a known timeline: the clean run's numbers
are the truth, and the damaged run's must match them within the clock bound pptrace reports."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

import pptrace
from pptrace.run import clocks
from pptrace.errors import TraceError
from pptrace.ingest.load import load_rank
from hostile import checksums, no_traceback, one_line_error, pptrace as run_pptrace
from tracegen import KINETO_BASE_NS, pipeline_run

HOURS = 3 * 3600 * 10**9 + 12_345_678  # a skew of three hours and some


def _analyze(run_dir, *extra) -> dict:
    r = run_pptrace("analyze", run_dir, "--json", *extra)
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _close(got, truth, tolerance_s: float, path: str = "") -> None:
    """Every number of ``truth`` within ``tolerance_s`` in ``got`` (the clock fields apart)."""
    if isinstance(truth, dict):
        assert set(got) == set(truth), path
        for key in truth:
            if key not in ("clock_offset_us", "clock_uncertainty_us", "warnings"):
                _close(got[key], truth[key], tolerance_s, f"{path}.{key}")
    elif isinstance(truth, list):
        assert len(got) == len(truth), path
        for i, (a, b) in enumerate(zip(got, truth)):
            _close(a, b, tolerance_s, f"{path}[{i}]")
    elif isinstance(truth, float) and not isinstance(truth, bool):
        assert abs(got - truth) <= tolerance_s, (path, got, truth)
    else:
        assert got == truth, (path, got, truth)


def _with_base(path, value: str) -> None:
    text = path.read_text()
    edited = re.sub(r'"baseTimeNanoseconds":\s*\d+', f'"baseTimeNanoseconds":{value}', text)
    assert edited != text
    path.write_text(edited)


@pytest.mark.parametrize("value, shown", [('"x"', '"x", not a number'), ("true", "true, not a number"),
                                          ("1e30", "1e+30, beyond any clock")])
def test_a_corrupt_base_time_is_named_and_its_rank_aligned_from_its_events(tmp_path, value, shown):
    truth = _analyze(pipeline_run(tmp_path / "clean", pp=2, gz=False)[0])
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False)
    _with_base(run_dir / "traces" / "rank1.json", value)
    before = checksums(run_dir)
    report = _analyze(run_dir)
    said = [w for w in report["warnings"] if "baseTimeNanoseconds" in w]
    assert len(said) == 1 and "rank1.json" in said[0] and shown in said[0], report["warnings"]
    assert "placed from its events" in said[0]
    assert not [w for w in report["warnings"] if "different runs" in w or "rank0.json" in w]
    rank1 = report["ranks"][1]
    bound_s = rank1["clock_uncertainty_us"] / 1e6
    assert 0 < bound_s < 100e-6
    # its recorded clock started at 0, not at Kineto's base: that far off, within the bound
    assert abs(rank1["clock_offset_us"] * 1e3 + KINETO_BASE_NS) <= rank1["clock_uncertainty_us"] * 1e3
    _close(report, truth, 2 * bound_s)
    assert report["pipeline"]["stages"] and len(report["p2p"]["links"]) == 2
    assert checksums(run_dir) == before


def test_a_skew_of_hours_is_refused_with_the_way_on_and_aligned_when_asked(tmp_path):
    truth = _analyze(pipeline_run(tmp_path / "clean", pp=2, gz=False)[0])
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, gz=False, skew_ns={1: HOURS})
    before = checksums(run_dir)
    line = one_line_error(run_pptrace("analyze", run_dir), "different runs", "rank1.json", "3.0 h after rank 0",
                          "--assume-same-run")
    assert "rank 0 (" not in line  # the odd rank is named, not the reference (two ranks: the later)
    report = _analyze(run_dir, "--assume-same-run")
    rank1 = report["ranks"][1]
    assert abs(rank1["clock_offset_us"] * 1e3 - HOURS) <= rank1["clock_uncertainty_us"] * 1e3 < 100_000
    _close(report, truth, 2 * rank1["clock_uncertainty_us"] / 1e6)
    (said,) = [w for w in report["warnings"] if "--assume-same-run" in w]
    assert "ranks [1]" in said and "3.0 h" in said
    # the same option on every command that loads a run, and in the library
    for command in (("whatif", "--json"), ("merge", "-o", tmp_path / "merged.json.gz"),
                    ("dashboard", "-o", tmp_path / "page.html")):
        r = run_pptrace(command[0], run_dir, *command[1:], "--assume-same-run")
        no_traceback(r)
        assert r.returncode == 0, (command, r.stderr[-2000:])
    analysis = pptrace.analyze(run_dir, assume_same_run=True, use_cache=False, progress=False)
    assert analysis.run.offsets_ns[1] == pytest.approx(HOURS, abs=100_000)
    # the placed rank's own clock is still the one its trace recorded, hours off (Run.raw_ns)
    recorded, _ = load_rank(run_dir / "traces" / "rank1.json")
    raw = analysis.run.raw_ns()[analysis.run.events["rank"].to_numpy() == 1]
    assert raw["raw_start_ns"].tolist() == recorded["start_ns"].tolist()
    with pytest.raises(TraceError, match="assume-same-run"):
        pptrace.analyze(run_dir, use_cache=False, progress=False)
    assert checksums(run_dir) == before


def test_a_skewed_rank_among_four_is_the_one_aligned(tmp_path):
    """Under --assume-same-run only the ranks hours from the others are moved; the rest keep
    their clocks (one host: offset 0)."""
    truth = _analyze(pipeline_run(tmp_path / "clean", pp=4, gz=False)[0])
    run_dir, _ = pipeline_run(tmp_path / "run", pp=4, gz=False, skew_ns={2: -HOURS})
    one_line_error(run_pptrace("analyze", run_dir), "rank2.json", "3.0 h before rank ", "--assume-same-run")
    report = _analyze(run_dir, "--assume-same-run")
    offsets = {r["rank"]: r["clock_offset_us"] for r in report["ranks"]}
    assert offsets[0] == offsets[1] == offsets[3] == 0
    assert abs(offsets[2] * 1e3 + HOURS) <= report["ranks"][2]["clock_uncertainty_us"] * 1e3
    _close(report, truth, 2 * report["ranks"][2]["clock_uncertainty_us"] / 1e6)


def test_each_ranks_median_start_is_exact_when_small_and_central_when_sampled():
    """clocks.place reads each rank's median start from at most MEDIAN_SAMPLE rows spread over
    them: exact for a rank with fewer, and for one with more a value near the middle of its
    starts, whatever order the rows come in."""
    rng = np.random.default_rng(0)
    sizes = [1, 2, 10, clocks.MEDIAN_SAMPLE, 50_000]
    rank = np.repeat(np.arange(len(sizes), dtype=np.int32) * 3, sizes)  # ids with gaps
    start = rng.integers(0, 10**12, len(rank))
    truth = pd.Series(start).groupby(rank).median().astype(np.int64)
    got = clocks._rank_medians(rank, start)
    assert got.index.tolist() == truth.index.tolist()
    small = truth.index[np.array(sizes) <= clocks.MEDIAN_SAMPLE]
    assert got[small].tolist() == truth[small].tolist()
    big = truth.index[-1]
    mine = np.sort(start[rank == big])
    assert 0.45 < np.searchsorted(mine, got[big]) / len(mine) < 0.55
    shuffled = rng.permutation(len(rank))
    again = clocks._rank_medians(rank[shuffled], start[shuffled])
    assert again[small].tolist() == truth[small].tolist()
    assert 0.45 < np.searchsorted(mine, again[big]) / len(mine) < 0.55
