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


def gpu_extent(events: pd.DataFrame, rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start_ns, end_ns, projected) for ``rows`` (host ranges, a subset of ``events``):
    the union span of their gpu_user_annotation projections where they have one (same rank
    and External id), else their own times."""
    start = rows["start_ns"].to_numpy(np.int64).copy()
    end = rows["end_ns"].to_numpy(np.int64).copy()
    found = np.zeros(len(rows), bool)
    if "gpu_annotation" not in events.columns or rows.empty:
        return start, end, found
    ann = events[events["gpu_annotation"].to_numpy() & events["external_id"].notna().to_numpy()]
    if ann.empty:
        return start, end, found
    span = ann.groupby(["rank", "external_id"], observed=True).agg(s=("start_ns", "min"), e=("end_ns", "max"))
    keys = pd.MultiIndex.from_arrays([rows["rank"].to_numpy(), rows["external_id"].to_numpy()])
    got = span.reindex(keys)
    found = got["s"].notna().to_numpy()
    start[found] = got["s"].to_numpy()[found].astype(np.int64)
    end[found] = got["e"].to_numpy()[found].astype(np.int64)
    return start, end, found
