"""The step partition of DESIGN.md contract 3: each rank's step wall time W split into
compute, <dim>_exposed, pp_transfer, pp_bubble and other — summing exactly to W — plus
<dim>_hidden, the part of each dimension's communication that ran under compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..timeline.projection import gpu_extent
from ..timeline.activity import Activity
from ..timeline.intervals import Intervals, partition, union
from ..timeline.windows import Window
from .p2p import MatchedPairs, match_pairs, peer_not_loaded, split_by_rank, unsplit_by_rank
from ..run.model import Run
from ..vocab import COMM_DIMS, PARTS


@dataclass(frozen=True)
class StepPartition:
    rank: int
    step: int
    start_ns: int
    end_ns: int
    parts: dict           # part -> Intervals (disjoint, together exactly [start, end))
    hidden: dict          # dim -> ns of that dim's communication under compute
    #: ns of p2p whose peer is not loaded: its wait and transfer cannot be told apart, so the
    #: step's pp_bubble and pp_transfer are unknown (their sum is known: UNSPLIT)
    unsplit_ns: int = 0

    @property
    def wall_ns(self) -> int:
        return self.end_ns - self.start_ns


def untagged_p2p_rows(events: pd.DataFrame) -> np.ndarray:
    """Mask of the host pipeline p2p ranges without a peer (Megatron's own names carry none)."""
    return ((events["category"] == "p2p").to_numpy() & (events["lane_kind"] == "host").to_numpy()
            & ~events["gpu_annotation"].to_numpy() & events["peer"].isna().to_numpy())


def untagged_p2p(run: Run) -> dict:
    """rank -> Intervals of pipeline p2p ranges without a peer: they cannot pair, so like
    unmatched ranges they count as pp_transfer."""
    ev = run.events
    sel = ev[untagged_p2p_rows(ev)]
    if sel.empty:
        return {}
    start, end, _ = gpu_extent(ev, sel)
    ranks = sel["rank"].to_numpy()
    return {int(r): union(start[ranks == r], end[ranks == r]) for r in np.unique(ranks)}


#: breakdown_table's column of a step whose split of pipeline time needs a peer not loaded:
#: pp_bubble + pp_transfer together (those two are then NaN)
UNSPLIT = "pp_bubble_or_transfer"


def partition_step(act: Activity, step: int, window: Window, pipe: Window | None,
                   p2p_wait: Intervals, p2p_transfer: Intervals, unsplit: Intervals | None = None) -> StepPartition:
    start, end = window
    pipe_iv = Intervals.span(*pipe) if pipe else Intervals.empty()
    # the rank's whole-run sets cut to this step first: every operation below is then on
    # one step's intervals
    compute = act.compute.clip(start, end)
    comm = {dim: act.comm[dim].clip(start, end) for dim in COMM_DIMS}
    final = {dim: act.step_final[dim].clip(start, end) for dim in COMM_DIMS}
    order = [("compute", compute)]
    for dim in COMM_DIMS:
        # The step-final collective blocks while other stages still run the pipeline: that is
        # bubble (contract 3); after the pipeline window it is this dimension's again.
        order.append((f"{dim}_exposed", comm[dim] | (final[dim] - pipe_iv)))
    order += [("pp_transfer", p2p_transfer.clip(start, end)), ("pp_bubble", p2p_wait.clip(start, end) | pipe_iv)]
    parts = partition((start, end), order, rest="other")
    hidden = {dim: ((comm[dim] | final[dim]) & compute).total for dim in COMM_DIMS}
    unsplit_ns = (unsplit.clip(start, end) & parts["pp_bubble"]).total if unsplit is not None else 0
    return StepPartition(act.rank, step, start, end, parts, hidden, unsplit_ns)


def partition_run(run: Run, acts: dict | None = None, matched: MatchedPairs | None = None) -> list[StepPartition]:
    """Every (rank, profiled step) partition of the run."""
    acts = acts if acts is not None else run.activities
    if matched is None:
        matched = match_pairs(run)
    absent = peer_not_loaded(matched.unmatched, run.requested)  # their wait/transfer split is unknown
    split = split_by_rank(*matched, kernels=any(a.gpu for a in acts.values()), unsplit=absent)
    unsplit = unsplit_by_rank(matched.unmatched, absent)
    windows = run.pipeline_windows
    untagged = untagged_p2p(run)
    out = []
    # GPU ranks are partitioned on their GPU timeline (timeline/windows.py says why)
    for (rank, step), window in sorted(run.step_windows.items()):
        act = acts.get(rank)
        if act is None:
            continue
        wait, transfer = split.get(rank, (Intervals.empty(), Intervals.empty()))
        if rank in untagged:
            transfer = transfer | (untagged[rank] - wait)
        if act.gpu:
            transfer = transfer | (act.p2p - wait)
        out.append(partition_step(act, step, window, windows.get(step), wait, transfer, unsplit.get(rank)))
    return out


def breakdown_table(partitions: list[StepPartition]) -> pd.DataFrame:
    """One row per (rank, step): time_s, every part in seconds, UNSPLIT, and hidden_<dim>
    seconds. A step with p2p whose peer is not loaded has pp_bubble and pp_transfer NaN
    (unknown, not zero) and their sum in UNSPLIT (0 elsewhere; the column only where some
    step has one): the parts still add up."""
    rows = []
    for p in partitions:
        row = {"rank": p.rank, "step": p.step, "time_s": p.wall_ns / 1e9}
        row.update({name: p.parts[name].total / 1e9 for name in PARTS})
        row[UNSPLIT] = 0.0
        if p.unsplit_ns:
            row[UNSPLIT] = row["pp_bubble"] + row["pp_transfer"]
            row["pp_bubble"] = row["pp_transfer"] = np.nan
        row.update({f"hidden_{d}": p.hidden[d] / 1e9 for d in COMM_DIMS})
        rows.append(row)
    unsplit = [UNSPLIT] if any(p.unsplit_ns for p in partitions) else []  # a --ranks subset's column only
    columns = ["rank", "step", "time_s", *PARTS, *unsplit, *(f"hidden_{d}" for d in COMM_DIMS)]
    return pd.DataFrame(rows, columns=columns)
