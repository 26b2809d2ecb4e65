"""The GPU timeline of each rank: step windows on the GPU, busy/idle, overlap of NCCL
kernels with compute kernels, memcpy kept apart, and the launch-bound diagnosis.

**Step windows.** A GPU step is the span from the first to the last GPU activity (kernel,
memcpy, memset) *launched inside* ``ProfilerStep#N`` (the loader gives GPU work the step
of its launch call), cut where the next step's first activity starts so that steps never
overlap. Not the CPU ProfilerStep range: the GPU runs behind the host, so the CPU range
would hand the tail of step N's kernels to step N+1 and count the GPU as idle while the
host queues work ahead. The time between two steps' GPU work (host-side data loading,
the profiler's step boundary) belongs to no step; HTA's whole-trace span counts it idle.

**Launch-bound.** An idle gap of the GPU inside a step is *launch-bound* when the work
that ends it was submitted (its cudaLaunch* call ended) after the gap began: the GPU had
run dry and waited for the host. Gaps whose next work was already queued wait on a
dependency (an event, another stream) instead. ``host_launching`` is the part of the
launch-bound gaps in which the host was inside a CUDA runtime/driver call.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..timeline.intervals import Intervals, from_segments, gaps_per_window, private_axes, segments, union
from ..timeline.windows import GPU_ACTIVITY, gpu_step_windows

#: a step is flagged launch-bound when at least this share of its GPU idle time is
#: launch-bound and idle is at least IDLE_FLAG of the step
LAUNCH_SHARE, IDLE_FLAG = 0.5, 0.1


def is_launch_bound(idle, span, launch_bound):
    """A step (or a rank's mean step) of GPU ``span`` with ``idle`` time, ``launch_bound`` of it
    waiting for the host: flagged by LAUNCH_SHARE and IDLE_FLAG (any one unit of time).
    Scalars give a bool, arrays a mask."""
    idle, span, launch_bound = np.asarray(idle), np.asarray(span), np.asarray(launch_bound)
    flagged = (idle >= IDLE_FLAG * span) & (launch_bound >= LAUNCH_SHARE * idle) & (idle > 0)
    return bool(flagged) if flagged.ndim == 0 else flagged


COLUMNS = (
    "rank", "step", "start_ns", "end_ns", "time_s", "busy_s", "compute_s", "comm_s",
    "overlap_s", "overlap_pct", "comm_exposed_s", "memcpy_s", "memcpy_exposed_s", "idle_s",
    "launch_bound_s", "host_launching_s", "launch_bound",
)


def _launch_ends(rank, corr, linked, start, end, calls, work) -> pd.Series:
    """GPU activity start -> earliest end of the launch calls of the activities starting
    then (a gap is launch-bound only if none of them was queued before it began). Times on
    the ranks' own axes; a correlation id means something only on its own rank."""
    calls, work = calls & linked, work & linked
    launch = pd.Series(end[calls], index=pd.MultiIndex.from_arrays([rank[calls], corr[calls]]))
    launch = launch[~launch.index.duplicated()]
    ends = launch.reindex(pd.MultiIndex.from_arrays([rank[work], corr[work]])).to_numpy()
    table = pd.DataFrame({"start": start[work], "launch_end": ends}).dropna()
    return table.groupby("start")["launch_end"].min()


def gpu_timeline(events: pd.DataFrame, steps=None) -> pd.DataFrame:
    """One row per (rank, step) with GPU work: see COLUMNS (seconds; overlap in % of the
    NCCL kernel time that ran under compute kernels).

    All ranks at once: each rank's times move onto an axis of its own (intervals.py
    ``private_axes``), so one union, intersection or sweep serves every rank, and each
    window's share of a set is read with ``covered``."""
    windows = gpu_step_windows(events, steps)
    if not windows:
        return pd.DataFrame(columns=list(COLUMNS))
    keys = sorted(windows)
    w_rank = np.array([r for r, _ in keys], np.int64)
    w_step = np.array([s for _, s in keys], np.int64)
    w_start = np.array([windows[k].start_ns for k in keys], np.int64)
    w_end = np.array([windows[k].end_ns for k in keys], np.int64)
    # the GPU's work and the host's launch calls only: arrays over every row of a GPU
    # trace's table were most of this analysis' memory
    category = events["category"]
    is_work = category.isin(list(GPU_ACTIVITY)).to_numpy()
    is_call = (events["lane_kind"] == "host").to_numpy() & (category == "runtime").to_numpy()
    rows = np.flatnonzero(is_work | is_call)
    is_work, is_call = is_work[rows], is_call[rows]
    ranks = events["rank"].to_numpy(np.int64)[rows]
    start, end = events["start_ns"].to_numpy(np.int64)[rows], events["end_ns"].to_numpy(np.int64)[rows]
    offset = private_axes(np.concatenate([ranks, w_rank]), np.concatenate([start, w_start]),
                          np.concatenate([end, w_end]))
    shift, w_shift = offset[:len(ranks)], offset[len(ranks):]
    ws, we = w_start + w_shift, w_end + w_shift
    start += shift
    end += shift

    def of(mask) -> Intervals:
        return union(start[mask], end[mask])

    def category_is(name: str) -> np.ndarray:
        return (category == name).to_numpy()[rows]

    compute = of(category_is("kernel_compute"))
    comm = of(category_is("kernel_comm"))
    memcpy = of(category_is("memcpy"))
    # one sweep of the three sets answers every combination below (bit 1 compute, 2 comm, 4 memcpy)
    lo, hi, member = segments([compute, comm, memcpy])
    busy = from_segments(lo, hi, member != 0)
    runtime = of(is_call)
    correlation = events["correlation"].iloc[rows]
    launch_end = _launch_ends(ranks, correlation.to_numpy(np.int64, na_value=0), correlation.notna().to_numpy(),
                              start, end, is_call, is_work)

    def within(s: Intervals) -> np.ndarray:
        return s.covered(ws, we)

    def where(keep: np.ndarray) -> np.ndarray:
        return within(from_segments(lo, hi, keep))

    c, m, mem, b = within(compute), within(comm), within(memcpy), within(busy)
    overlap = where((member & 3) == 3)
    g_win, g_start, g_end = gaps_per_window(ws, we, busy)
    bound = np.zeros(len(g_win), bool)
    if len(g_win) and len(launch_end):
        ends = launch_end.reindex(g_end).to_numpy(dtype=float)
        bound = ~np.isnan(ends) & (ends > g_start)
    waiting = union(g_start[bound], g_end[bound])
    idle = np.zeros(len(keys), np.int64)
    np.add.at(idle, g_win, g_end - g_start)
    waited = within(waiting)
    window = w_end - w_start
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(m > 0, 100.0 * overlap / np.where(m > 0, m, 1), np.nan)
    table = pd.DataFrame({
        "rank": w_rank, "step": w_step, "start_ns": w_start, "end_ns": w_end, "time_s": window / 1e9,
        "busy_s": b / 1e9, "compute_s": c / 1e9, "comm_s": m / 1e9,
        "overlap_s": overlap / 1e9,
        "overlap_pct": pct if (m > 0).any() else np.full(len(keys), None, object),
        "comm_exposed_s": where((member & 3) == 2) / 1e9, "memcpy_s": mem / 1e9,
        "memcpy_exposed_s": where(member == 4) / 1e9, "idle_s": idle / 1e9,
        "launch_bound_s": waited / 1e9, "host_launching_s": within(waiting & runtime) / 1e9,
        "launch_bound": is_launch_bound(idle, window, waited),
    })
    return table[list(COLUMNS)]
