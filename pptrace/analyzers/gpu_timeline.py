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
from ..sweeps import ascending

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


#: rows of GPU work and launch calls swept at once: whole ranks are taken together up to
#: about this many, so the sweep's memory stays bounded however many ranks a run has
CHUNK_ROWS = 1 << 18


def gpu_timeline(events: pd.DataFrame, steps=None) -> pd.DataFrame:
    """One row per (rank, step) with GPU work: see COLUMNS (seconds; overlap in % of the
    NCCL kernel time that ran under compute kernels).

    Many ranks at once: each rank's times move onto an axis of its own (intervals.py
    ``private_axes``), so one union, intersection or sweep serves every rank, and each
    window's share of a set is read with ``covered``; ranks are taken CHUNK_ROWS rows at a
    time."""
    windows = gpu_step_windows(events, steps)
    if not windows:
        return pd.DataFrame(columns=list(COLUMNS))
    keys = sorted(windows)
    w_rank = np.array([r for r, _ in keys], np.int64)
    w_step = np.array([s for _, s in keys], np.int64)
    w_start = np.array([windows[k].start_ns for k in keys], np.int64)
    w_end = np.array([windows[k].end_ns for k in keys], np.int64)
    # the GPU's work and the host's launch calls only, told apart by the codes of the
    # category column (its own array) and not by a mask per kind: arrays over every row of
    # a GPU trace's table were most of this analysis' memory
    category = events["category"]
    if isinstance(category.dtype, pd.CategoricalDtype):
        codes, names = category.cat.codes.to_numpy(), category.cat.categories
    else:  # a hand-built frame
        codes, names = pd.factorize(category)
        names = pd.Index(names)
    code_of = {name: names.get_loc(name) if name in names else -2 for name in (*GPU_ACTIVITY, "runtime")}
    is_call = (codes == code_of["runtime"]) & (events["lane_kind"] == "host").to_numpy()
    rows = np.flatnonzero(np.isin(codes, [code_of[name] for name in GPU_ACTIVITY]) | is_call)
    is_call, ranks = is_call[rows], events["rank"].to_numpy()[rows]
    if not ascending(ranks):  # the loader's table comes rank by rank
        by_rank = np.argsort(ranks, kind="stable")
        rows, ranks, is_call = rows[by_rank], ranks[by_rank], is_call[by_rank]
    code = codes[rows]
    # cut between ranks, about CHUNK_ROWS rows apart
    first = np.searchsorted(ranks, w_rank[np.r_[True, w_rank[1:] != w_rank[:-1]]])
    cuts = [0, *first[np.r_[False, np.diff(first // CHUNK_ROWS) > 0]].tolist(), len(rows)]
    columns = {"start": events["start_ns"].to_numpy(np.int64), "end": events["end_ns"].to_numpy(np.int64),
               "correlation": events["correlation"]}
    # each chunk's windows: those of its ranks (the windows tile as the rows do)
    w_cuts = [0, *np.searchsorted(w_rank, ranks[cuts[1:-1]]).tolist(), len(w_rank)]
    parts = [_sweep(columns, rows[a:b], ranks[a:b], code[a:b], is_call[a:b], code_of,
                    w_rank[c:d], w_start[c:d], w_end[c:d])
             for a, b, c, d in zip(cuts[:-1], cuts[1:], w_cuts[:-1], w_cuts[1:])]
    got = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
    window = w_end - w_start
    m = got["comm"]
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(m > 0, 100.0 * got["overlap"] / np.where(m > 0, m, 1), np.nan)
    table = pd.DataFrame({
        "rank": w_rank, "step": w_step, "start_ns": w_start, "end_ns": w_end, "time_s": window / 1e9,
        "busy_s": got["busy"] / 1e9, "compute_s": got["compute"] / 1e9, "comm_s": m / 1e9,
        "overlap_s": got["overlap"] / 1e9,
        "overlap_pct": pct if (m > 0).any() else np.full(len(keys), None, object),
        "comm_exposed_s": got["comm_exposed"] / 1e9, "memcpy_s": got["memcpy"] / 1e9,
        "memcpy_exposed_s": got["memcpy_exposed"] / 1e9, "idle_s": got["idle"] / 1e9,
        "launch_bound_s": got["waited"] / 1e9, "host_launching_s": got["host_launching"] / 1e9,
        "launch_bound": is_launch_bound(got["idle"], window, got["waited"]),
    })
    return table[list(COLUMNS)]


def _sweep(columns: dict, rows: np.ndarray, ranks: np.ndarray, code: np.ndarray, is_call: np.ndarray,
           code_of: dict, w_rank, w_start, w_end) -> dict:
    """ns of each measure in each window (w_*: windows of the ranks ``rows`` belong to, and
    maybe of ranks without rows), from the GPU work and launch calls ``rows`` of ``columns``
    (``code``: their category's, ``code_of`` a category's code; ``is_call``: which are calls)."""
    start, end = columns["start"][rows], columns["end"][rows]
    offset = private_axes(np.concatenate([ranks, w_rank]), np.concatenate([start, w_start]),
                          np.concatenate([end, w_end]))
    shift, w_shift = offset[:len(ranks)], offset[len(ranks):]
    ws, we = w_start + w_shift, w_end + w_shift
    start += shift
    end += shift

    def of(mask) -> Intervals:
        return union(start[mask], end[mask])

    compute = of(code == code_of["kernel_compute"])
    comm = of(code == code_of["kernel_comm"])
    memcpy = of(code == code_of["memcpy"])
    # one sweep of the three sets answers every combination below (bit 1 compute, 2 comm, 4 memcpy)
    lo, hi, member = segments([compute, comm, memcpy])
    busy = from_segments(lo, hi, member != 0)
    runtime = of(is_call)
    correlation = columns["correlation"].iloc[rows]
    launch_end = _launch_ends(ranks, correlation.to_numpy(np.int64, na_value=0), correlation.notna().to_numpy(),
                              start, end, is_call, ~is_call)  # a row is work or a call

    def within(s: Intervals) -> np.ndarray:
        return s.covered(ws, we)

    def where(keep: np.ndarray) -> np.ndarray:
        return within(from_segments(lo, hi, keep))

    g_win, g_start, g_end = gaps_per_window(ws, we, busy)
    bound = np.zeros(len(g_win), bool)
    if len(g_win) and len(launch_end):
        ends = launch_end.reindex(g_end).to_numpy(dtype=float)
        bound = ~np.isnan(ends) & (ends > g_start)
    waiting = union(g_start[bound], g_end[bound])
    idle = np.zeros(len(ws), np.int64)
    np.add.at(idle, g_win, g_end - g_start)
    return {"compute": within(compute), "comm": within(comm), "memcpy": within(memcpy), "busy": within(busy),
            "overlap": where((member & 3) == 3), "comm_exposed": where((member & 3) == 2),
            "memcpy_exposed": where(member == 4), "idle": idle, "waited": within(waiting),
            "host_launching": within(waiting & runtime)}
