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

from ..timeline.intervals import Intervals, merged_by_group, private_axes
from ..timeline.projection import gpu_extent
from ..vocab import BWD, BWD_INPUT, BWD_WEIGHT, FWD, LOSS

#: the pass types, in the order of the columns
PASS_KINDS = (FWD, BWD, BWD_INPUT, BWD_WEIGHT)
COLUMNS = ("rank", "step", *PASS_KINDS, "other")
_KIND_OF = {FWD: 0, LOSS: 0, BWD: 1, BWD_INPUT: 2, BWD_WEIGHT: 3}


def compute_by_pass(run, partitions: list) -> pd.DataFrame:
    """One row per partition (rank, step): seconds of its compute inside each pass type
    (``fwd``, ``bwd``, ``bwd_input``, ``bwd_weight``) and ``other``; the row sums to the
    partition's compute."""
    n, k = len(partitions), len(PASS_KINDS)
    if not n:
        return pd.DataFrame(columns=list(COLUMNS))
    ev = run.events
    sel = ev[(ev["category"] == "compute").to_numpy() & (ev["lane_kind"] == "host").to_numpy()
             & ~ev["gpu_annotation"].to_numpy() & ev["op"].isin(list(_KIND_OF)).to_numpy()
             & (ev["step"] >= 0).to_numpy()]
    start, end, _ = gpu_extent(ev, sel)
    index = pd.Series(np.arange(n), index=pd.MultiIndex.from_arrays(
        [[p.rank for p in partitions], [p.step for p in partitions]]))
    at = index.index.get_indexer(pd.MultiIndex.from_arrays([sel["rank"].to_numpy(np.int64),
                                                            sel["step"].to_numpy(np.int64)]))
    mine = at >= 0
    part, start, end = at[mine].astype(np.int64), start[mine], end[mine]
    kind = sel["op"].astype(str).map(_KIND_OF).to_numpy(np.int64)[mine]
    # every partition's compute on an axis of its own: one `covered` answers all of them
    counts = np.array([len(p.parts["compute"]) for p in partitions], dtype=np.int64)
    c_part = np.repeat(np.arange(n, dtype=np.int64), counts)
    c_start = np.concatenate([np.zeros(0, np.int64), *(p.parts["compute"].starts for p in partitions)])
    c_end = np.concatenate([np.zeros(0, np.int64), *(p.parts["compute"].ends for p in partitions)])
    shift = private_axes(np.r_[c_part, part], np.r_[c_start, start], np.r_[c_end, end])
    compute = Intervals(c_start + shift[:len(c_part)], c_end + shift[:len(c_part)])
    # a pass type's ranges of one partition merged first (a loss inside its forward counts once)
    group, q_start, q_end = merged_by_group(part * k + kind, start + shift[len(c_part):], end + shift[len(c_part):])
    inside = np.bincount(group, weights=compute.covered(q_start, q_end), minlength=n * k).reshape(n, k)
    total = np.array([p.parts["compute"].total for p in partitions], dtype=np.float64)
    out = pd.DataFrame(inside / 1e9, columns=list(PASS_KINDS))
    out["other"] = (total - inside.sum(axis=1)) / 1e9
    out.insert(0, "step", [p.step for p in partitions])
    out.insert(0, "rank", [p.rank for p in partitions])
    return out
