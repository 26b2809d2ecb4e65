"""The step partition's compute split by pass type: per (rank, step), how much of the rank's
``compute`` (contract 3) ran inside its forward, backward, input-gradient and weight-gradient
passes, and the rest (``other``: the optimizer, unannotated compute). The parts sum to the
partition's compute to the nanosecond, so a comparison of two runs (``pptrace diff``) can say
which pass a change of compute came from without leaving a remainder.

A last stage's loss (``compute:loss``) counts as its microbatch's forward, as it does in
``microbatch_times`` (Megatron's forward_step computes it). On GPU traces a pass is where the
kernels it launched ran (``projection.gpu_extent``), the timeline the partition's compute is on.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweeps import isin
from ..timeline.intervals import merged_by_group
from ..timeline.projection import EXTENT_COLUMNS, gpu_extent
from ..vocab import BWD, BWD_INPUT, BWD_WEIGHT, FWD, LOSS

#: the pass types, in the order of the columns
PASS_KINDS = (FWD, BWD, BWD_INPUT, BWD_WEIGHT)
COLUMNS = ("rank", "step", *PASS_KINDS, "other")
_KIND_OF = {FWD: 0, LOSS: 0, BWD: 1, BWD_INPUT: 2, BWD_WEIGHT: 3}


def compute_by_pass(run, partitions) -> pd.DataFrame:
    """One row per partition (rank, step): seconds of its compute inside each pass type
    (``fwd``, ``bwd``, ``bwd_input``, ``bwd_weight``) and ``other``; the row sums to the
    partition's compute."""
    n, k = len(partitions), len(PASS_KINDS)
    if not n:
        return pd.DataFrame(columns=list(COLUMNS))
    ev = run.events
    sel = ev.loc[(ev["category"] == "compute").to_numpy() & (ev["lane_kind"] == "host").to_numpy()
                 & ~ev["gpu_annotation"].to_numpy() & isin(ev["op"], _KIND_OF) & (ev["step"] >= 0).to_numpy(),
                 ["step", "op", *(c for c in EXTENT_COLUMNS if c in ev.columns)]]  # not every column's rows
    start, end, _ = gpu_extent(ev, sel)
    index = pd.MultiIndex.from_arrays([partitions.rank, partitions.step])
    at = index.get_indexer(pd.MultiIndex.from_arrays([sel["rank"].to_numpy(np.int64), sel["step"].to_numpy(np.int64)]))
    mine = at >= 0
    part, start, end = at[mine].astype(np.int64), start[mine], end[mine]
    kind = sel["op"].astype(str).map(_KIND_OF).to_numpy(np.int64)[mine]
    # each pass cut to its partition's step and put on that partition's axis, where the
    # partition's compute lies: one `covered` answers every partition
    lo, hi = partitions.start_ns[part], partitions.end_ns[part]
    shift = part * partitions.axes.stride - partitions.axes.lo
    start, end = np.clip(start, lo, hi) + shift, np.clip(end, lo, hi) + shift
    # a pass type's ranges of one partition merged first (a loss inside its forward counts once)
    group, q_start, q_end = merged_by_group(part * k + kind, start, end)
    inside = np.bincount(group, weights=partitions.parts["compute"].covered(q_start, q_end),
                         minlength=n * k).reshape(n, k)
    total = partitions.totals("compute").astype(np.float64)
    out = pd.DataFrame(inside / 1e9, columns=list(PASS_KINDS))
    out["other"] = (total - inside.sum(axis=1)) / 1e9
    out.insert(0, "step", partitions.step)
    out.insert(0, "rank", partitions.rank)
    return out
