"""Host ranges -> their GPU-side extent.

On a GPU a ``pp:send_fwd`` range on the host lasts as long as it takes to *launch* the NCCL
kernel; the transfer itself runs later on a stream. Kineto projects every record_function
range onto the streams its GPU work ran on (``gpu_user_annotation``, same "External id"),
and that projection is when the send really happened. Pairing sends with recvs on these
extents gives wait and transfer on the GPU timeline.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweeps import isin
from ..vocab import COMM_CATEGORIES

#: What a timeline draws: the passes, p2p, every dimension's communication, and waits.
DRAWN_CATEGORIES = ("compute", "p2p", *COMM_CATEGORIES, "wait")
KERNEL_CATEGORIES = ("kernel_compute", "kernel_comm")


def drawn_ranges(events: pd.DataFrame, steps=None) -> pd.DataFrame:
    """The ranges of ``steps`` (None: all) a timeline draws, each where its work ran as the
    step partition sees it: on a GPU trace its device extent (:func:`gpu_extent`), the
    gpu_user_annotation copies of host ranges left out. A trace with no such ranges (a
    plain GPU trace) draws its kernels (KERNEL_CATEGORIES) instead, so the page is still a
    timeline."""
    # masks first, one copy of the rows kept: a copy of the table per filter was most of the cost
    in_steps = np.ones(len(events), bool) if steps is None else isin(events["step"], steps)
    mask = in_steps & isin(events["category"], DRAWN_CATEGORIES)
    if "gpu_annotation" in events.columns:
        mask &= ~events["gpu_annotation"].astype(bool).to_numpy()
    drawn = events[mask]
    if drawn.empty:
        return events[in_steps & isin(events["category"], KERNEL_CATEGORIES)].copy()
    start, end, projected = gpu_extent(events, drawn)
    return drawn.assign(start_ns=start, end_ns=end, dur_ns=np.where(projected, end - start, drawn["dur_ns"]))


#: The columns :func:`gpu_extent` reads of its rows: a caller selecting rows for it needs no others.
EXTENT_COLUMNS = ("rank", "start_ns", "end_ns", "external_id", "correlation")


def gpu_extent(events: pd.DataFrame, rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start_ns, end_ns, projected) for ``rows`` (host ranges, a subset of ``events``,
    with at least EXTENT_COLUMNS):
    the union span of their gpu_user_annotation projections where they have one (same rank
    and External id), else of the NCCL kernel with their correlation (same rank), else
    their own times."""
    start = rows["start_ns"].to_numpy(np.int64).copy()
    end = rows["end_ns"].to_numpy(np.int64).copy()
    found = np.zeros(len(rows), bool)
    if "gpu_annotation" not in events.columns or rows.empty:
        return start, end, found
    ann = events.loc[events["gpu_annotation"].to_numpy() & events["external_id"].notna().to_numpy(),
                     ["rank", "external_id", "start_ns", "end_ns"]]
    _take(ann, "external_id", rows, start, end, found)
    # NCCL send/recv ops of plain traces (nccl.infer_nccl_p2p) carry their kernel's
    # correlation: Kineto projects no range around them, the kernel is their extent
    if {"correlation", "is_nccl"} <= set(events.columns) and (~found).any() and rows["correlation"].notna().any():
        _take(events.loc[events["is_nccl"].to_numpy() & events["correlation"].notna().to_numpy(),
                         ["rank", "correlation", "start_ns", "end_ns"]],
              "correlation", rows, start, end, found)
    return start, end, found


def _take(gpu: pd.DataFrame, key: str, rows: pd.DataFrame, start, end, found) -> None:
    """Rows not yet found whose (rank, key) has GPU events: their union span (in place)."""
    if gpu.empty:
        return
    span = gpu.groupby(["rank", key], observed=True).agg(s=("start_ns", "min"), e=("end_ns", "max"))
    # positions, not reindex: a miss would turn the columns to float64, which rounds
    # epoch nanoseconds by up to 128 ns
    at = span.index.get_indexer(pd.MultiIndex.from_arrays([rows["rank"].to_numpy(), rows[key].to_numpy()]))
    hit = (at >= 0) & ~found
    start[hit] = span["s"].to_numpy(np.int64)[at[hit]]
    end[hit] = span["e"].to_numpy(np.int64)[at[hit]]
    found |= hit
