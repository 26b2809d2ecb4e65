"""The cross-rank critical path on synthetic runs with exact timing (tests/tracegen.py)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pptrace.analyzers.critical_path import critical_path, step_bounds
from pptrace.run.build import load_run
from tracegen import pipeline_run

FWD_US, BWD_US = 1000.0, 2000.0


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory):
    out, _ = pipeline_run(tmp_path_factory.mktemp("cp"), pp=3, microbatches=4, steps=(1, 2),
                          fwd_us=FWD_US, bwd_us=BWD_US, skew_ns={1: 3_000_000, 2: -2_000_000})
    return load_run(out, progress=False)


@pytest.mark.parametrize("step", [1, 2])
def test_gpipe_path_computes_m_plus_p_minus_1_slots(gpipe, step):
    path = critical_path(gpipe, step)
    p, m = 3, 4
    assert path.stages == [0, 1, 2]
    compute = path.segments.loc[path.segments["phase"].str.startswith("compute:"), "dur_ns"].sum()
    assert compute == pytest.approx((m + p - 1) * (FWD_US + BWD_US) * 1e3, rel=0.01)
    # the last stage runs every forward on the path, the first stage every backward
    by = path.by_rank_phase.set_index(["rank", "phase"])["time_s"]
    assert by[(2, "compute:fwd")] == pytest.approx(m * FWD_US / 1e6)
    assert by[(0, "compute:bwd")] == pytest.approx(m * BWD_US / 1e6)


def test_segments_tile_the_step_without_gaps(gpipe):
    path = critical_path(gpipe, 1)
    seg = path.segments
    assert (seg["end_ns"].to_numpy()[:-1] == seg["start_ns"].to_numpy()[1:]).all()
    assert path.length_s == pytest.approx(path.span_s, rel=1e-9)
    assert path.length_s == pytest.approx(path.step_time_s, rel=0.02)
    assert path.by_rank_phase["fraction"].sum() == pytest.approx(1.0)
    assert np.all(seg["dur_ns"] > 0)


def test_unprofiled_step_is_a_clear_error(gpipe):
    with pytest.raises(ValueError, match="step 7 was not profiled"):
        critical_path(gpipe, 7)


def test_step_bounds_say_what_bounded_each_step(gpipe, tmp_path):
    bounds = step_bounds(gpipe)
    assert [b["step"] for b in bounds] == [1, 2]
    for b, step in zip(bounds, (1, 2)):
        path = critical_path(gpipe, step)
        assert b["length_s"] == path.length_s and b["stages"] == [0, 1, 2] and b["ranks"] == [0, 1, 2]
        parts = b["compute_s"] + b["p2p_s"] + b["comm_s"] + b["other_s"]
        assert parts == pytest.approx(b["length_s"], rel=1e-9)
        assert b["compute_s"] == pytest.approx((4 + 3 - 1) * (FWD_US + BWD_US) / 1e6, rel=0.01)
        assert b["summary"].startswith(f"step {step} bound by compute")
    # no pipeline, nothing to say; a step without its ProfilerStep range is left out
    out, _ = pipeline_run(tmp_path / "dp", pp=1, dp=2, microbatches=2, steps=(1,))
    assert step_bounds(load_run(out, progress=False)) == []
    ev = gpipe.events
    partial = replace(gpipe, events=ev[~((ev["category"] == "step") & (ev["step"] == 2)).to_numpy()])
    assert [b["step"] for b in step_bounds(partial)] == [1]


def test_collective_partners_are_searched_not_listed_pairwise(tmp_path):
    """A collective of n ranks (n > _PAIRWISE_MAX) is n member rows the walk searches, not
    n*(n-1) partner entries (a global all-reduce of 1,024 ranks was 1M entries a step); and
    the partner the search finds is the one the pairwise list gave: the latest other member
    at or before t, of a tie the first in partner order (p2p peers, then by instance and
    member position). The dp replicas arrive together: ties everywhere."""
    from pptrace.analyzers.critical_path import _PAIRWISE_MAX, _graph, _latest_partner, _main_rows

    out, _ = pipeline_run(tmp_path, pp=2, dp=20, microbatches=2, steps=(1,), fwd_us=FWD_US, bwd_us=BWD_US)
    run = load_run(out, progress=False)
    g = _graph(_main_rows(run), run.pairs, run.collectives)
    members = len(run.collectives)
    assert members == 40 > _PAIRWISE_MAX and len(g.ref_rank) == members and len(g.inst_t) == members
    assert len(g.wait_t) == 2 * len(run.pairs)  # p2p peers only: no member listed against another
    n_units = len(g.ref_at) - 1
    tried = 0
    for unit in range(n_units):
        for r in range(g.ref_at[unit], g.ref_at[unit + 1]):
            lo, hi = g.inst_at[g.ref_inst[r]], g.inst_at[g.ref_inst[r] + 1]
            times = sorted(set(g.inst_t[lo:hi]))
            for t in [times[0] - 1, *times, *(x + 1 for x in times)]:
                # the pairwise list: every other member of each of the unit's instances, and its p2p peers
                listed = [(g.wait_t[p], g.wait_key[p], g.wait_rank[p])
                          for p in range(g.wait_at[unit], g.wait_at[unit + 1]) if g.wait_t[p] <= t]
                for rr in range(g.ref_at[unit], g.ref_at[unit + 1]):
                    a, b = g.inst_at[g.ref_inst[rr]], g.inst_at[g.ref_inst[rr] + 1]
                    listed += [(g.inst_t[q], (*g.ref_key[rr], g.inst_pos[q]), g.inst_rank[q])
                               for q in range(a, b) if g.inst_rank[q] != g.ref_rank[rr] and g.inst_t[q] <= t]
                want = None
                if listed:
                    latest = max(x[0] for x in listed)
                    first = min((x for x in listed if x[0] == latest), key=lambda x: x[1])
                    want = (first[0], first[2])
                assert _latest_partner(g, unit, t) == want
                tried += 1
    assert tried > members  # every member's unit, at every arrival and beside it


@pytest.mark.parametrize("seed", range(12))
def test_step_bounds_largest_is_the_frames_first_row(seed):
    """step_bounds names the largest (rank, stage, phase) without building the path's
    frames: on random walks with many equal sums (ties; more groups than numpy's quicksort
    sorts by insertion), the same one as CriticalPath.by_rank_phase's first row, and the
    same fraction and stages."""
    from types import SimpleNamespace

    from pptrace.analyzers.critical_path import _bound, _largest, _path, _Walk

    rng = np.random.default_rng(seed)
    phases = ["compute:fwd", "compute:bwd", "pp:transfer", "other", "dp:all_reduce", "compute:wgrad"]
    n = int(rng.integers(1, 120))
    segments, t = [], 0
    for _ in range(n):
        dur = int(rng.choice([1_000, 2_000, 3_000, 1_500_000]))
        rank = int(rng.integers(0, 8))
        segments.append((rank, rank % 4, phases[int(rng.integers(len(phases)))], t, t + dur, dur))
        t += dur
    none = np.zeros(0, np.int64)
    walk = _Walk(step=3, segments=segments, span_ns=t, step_time_s=t / 1e9,
                 graph=SimpleNamespace(p2p_step=none, p2p_exchange=none, p2p_index=none))
    path = _path(walk)
    top = path.by_rank_phase.iloc[0]
    rank, phase, ns = _largest(*walk.arrays())
    assert (rank, phase) == (int(top["rank"]), top["phase"])
    assert ns / 1e9 / path.length_s == top["fraction"]
    bound = _bound(walk)
    assert bound["stages"] == path.stages and bound["length_s"] == path.length_s
    assert f"largest: rank {rank} {phase} {top['fraction']:.0%}" in bound["summary"]
