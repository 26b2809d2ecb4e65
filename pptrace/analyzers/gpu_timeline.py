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

from ..ingest.intervals import Intervals, union
from ..ingest.windows import GPU_ACTIVITY, gpu_step_windows

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


def _iv(rows: pd.DataFrame) -> Intervals:
    return union(rows["start_ns"].to_numpy(np.int64), rows["end_ns"].to_numpy(np.int64))


def _launch_ends(ev: pd.DataFrame, work: pd.DataFrame) -> pd.Series:
    """GPU activity start -> earliest end of the launch calls of the activities starting
    then (a gap is launch-bound only if none of them was queued before it began)."""
    host = ev[(ev["lane_kind"] == "host").to_numpy() & (ev["category"] == "runtime").to_numpy()
              & ev["correlation"].notna().to_numpy()]
    launch = pd.Series(host["end_ns"].to_numpy(np.int64), index=host["correlation"].to_numpy(np.int64))
    launch = launch[~launch.index.duplicated()]
    linked = work[work["correlation"].notna()]
    ends = launch.reindex(linked["correlation"].to_numpy(np.int64)).to_numpy()
    table = pd.DataFrame({"start": linked["start_ns"].to_numpy(np.int64), "launch_end": ends}).dropna()
    return table.groupby("start")["launch_end"].min()


def rank_timeline(ev: pd.DataFrame, rank: int, windows: dict) -> list[dict]:
    """GPU timeline rows of one rank for its (rank, step) windows."""
    cat = ev["category"]
    compute = _iv(ev[cat == "kernel_compute"])
    comm = _iv(ev[cat == "kernel_comm"])
    memcpy = _iv(ev[cat == "memcpy"])
    busy = compute | comm | memcpy
    work = ev[cat.isin(list(GPU_ACTIVITY)).to_numpy()]
    launch_end = _launch_ends(ev, work)
    runtime = _iv(ev[(ev["lane_kind"] == "host").to_numpy() & (cat == "runtime").to_numpy()])
    rows = []
    for (r, step), (start, end) in sorted(windows.items()):
        if r != rank:
            continue
        clip = lambda iv: iv.clip(start, end)  # noqa: E731
        c, m, mem, b = clip(compute), clip(comm), clip(memcpy), clip(busy)
        gaps = Intervals.span(start, end) - b
        bound = np.zeros(len(gaps), bool)
        if len(gaps) and len(launch_end):
            ends = launch_end.reindex(gaps.ends).to_numpy(dtype=float)
            bound = ~np.isnan(ends) & (ends > gaps.starts)
        waiting = union(gaps.starts[bound], gaps.ends[bound])
        overlap = (m & c).total
        idle, window = gaps.total, end - start
        rows.append({
            "rank": rank, "step": step, "start_ns": start, "end_ns": end, "time_s": window / 1e9,
            "busy_s": b.total / 1e9, "compute_s": c.total / 1e9, "comm_s": m.total / 1e9,
            "overlap_s": overlap / 1e9, "overlap_pct": 100.0 * overlap / m.total if m.total else None,
            "comm_exposed_s": (m - c).total / 1e9, "memcpy_s": mem.total / 1e9,
            "memcpy_exposed_s": (mem - c - m).total / 1e9, "idle_s": idle / 1e9,
            "launch_bound_s": waiting.total / 1e9, "host_launching_s": (waiting & runtime).total / 1e9,
            "launch_bound": is_launch_bound(idle, window, waiting.total),
        })
    return rows


def gpu_timeline(events: pd.DataFrame, steps=None) -> pd.DataFrame:
    """One row per (rank, step) with GPU work: see COLUMNS (seconds; overlap in % of the
    NCCL kernel time that ran under compute kernels)."""
    windows = gpu_step_windows(events, steps)
    rows = []
    for rank in sorted({r for r, _ in windows}):
        rows += rank_timeline(events[(events["rank"] == rank).to_numpy()], rank, windows)
    return pd.DataFrame(rows, columns=list(COLUMNS))
