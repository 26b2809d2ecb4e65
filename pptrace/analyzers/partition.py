"""The step partition of DESIGN.md contract 3: each rank's step wall time W split into
compute, <dim>_exposed, pp_transfer, pp_bubble and other — summing exactly to W — plus
<dim>_hidden, the part of each dimension's communication that ran under compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from ..sweeps import budget_groups
from ..timeline.projection import gpu_extent
from ..timeline.intervals import Axes, Intervals, flat, partition, pieces_in_windows, union_by_group
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
    ranks, code = np.unique(sel["rank"].to_numpy(np.int64), return_inverse=True)
    return dict(zip(ranks.tolist(), union_by_group(len(ranks), code, start, end)))


#: breakdown_table's column of a step whose split of pipeline time needs a peer not loaded:
#: pp_bubble + pp_transfer together (those two are then NaN)
UNSPLIT = "pp_bubble_or_transfer"


class Partitions:
    """Every (rank, step) partition of a run at once, as whole arrays: row i is (rank[i],
    step[i]) over [start_ns[i], end_ns[i]), rows sorted by (rank, step); each part's
    intervals, every row's together, on the rows' private axes (timeline.intervals.Axes),
    so that a question about every row is one array operation (:meth:`totals`,
    :meth:`covered`). Iterating gives one :class:`StepPartition` per row, for notebooks and
    tests; the analyzers use the arrays."""

    def __init__(self, rank, step, start_ns, end_ns, axes: Axes, parts: dict, hidden: dict, unsplit_ns):
        self.rank, self.step = np.asarray(rank, np.int64), np.asarray(step, np.int64)
        self.start_ns, self.end_ns = np.asarray(start_ns, np.int64), np.asarray(end_ns, np.int64)
        self.axes, self.parts, self.hidden = axes, parts, hidden
        self.unsplit_ns = np.asarray(unsplit_ns, np.int64)

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def wall_ns(self) -> np.ndarray:
        return self.end_ns - self.start_ns

    def totals(self, part: str) -> np.ndarray:
        """Per row, ns of ``part``."""
        return self.axes.totals(self.parts[part])

    def covered(self, part: str, lo, hi) -> np.ndarray:
        """Per row, ns of ``part`` inside [lo[i], hi[i]) (aligned clocks)."""
        return self.axes.covered(self.parts[part], lo, hi)

    def intervals(self, part: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, starts, ends) of ``part`` on aligned clocks, by row, then time."""
        return self.axes.unplace(self.parts[part])

    def take(self, rows) -> "Partitions":
        """The partitions of ``rows`` (a mask over the rows), in their order."""
        keep = np.asarray(rows, bool)
        new_row = np.cumsum(keep) - 1
        axes = Axes(self.axes.lo, self.axes.stride, int(keep.sum()))
        parts = {}
        for name, placed in self.parts.items():
            row = self.axes.rows_of(placed)
            mine = keep[row]
            shift = (new_row[row[mine]] - row[mine]) * self.axes.stride
            parts[name] = Intervals(placed.starts[mine] + shift, placed.ends[mine] + shift)
        return Partitions(self.rank[keep], self.step[keep], self.start_ns[keep], self.end_ns[keep], axes, parts,
                          {dim: ns[keep] for dim, ns in self.hidden.items()}, self.unsplit_ns[keep])

    def __iter__(self):
        return iter(self._views)

    def __getitem__(self, i) -> StepPartition:
        return self._views[i]

    @cached_property
    def _views(self) -> list[StepPartition]:
        rows = {name: self.axes.split(placed) for name, placed in self.parts.items()}
        return [StepPartition(int(self.rank[i]), int(self.step[i]), int(self.start_ns[i]), int(self.end_ns[i]),
                              {name: sets[i] for name, sets in rows.items()},
                              {dim: int(ns[i]) for dim, ns in self.hidden.items()}, int(self.unsplit_ns[i]))
                for i in range(len(self))]


#: The ranks are swept a group at a time, each group's sets holding about this many intervals:
#: the sweep's temporaries (~100 bytes an interval) stay bounded whatever the run's size. On
#: a 32-rank MoE-sized GPU run (2.5 M kernels) one sweep of every rank took 243 MB.
SWEEP_INTERVALS = 1_000_000


def partition_run(run: Run, acts: dict | None = None, matched: MatchedPairs | None = None) -> Partitions:
    """Every (rank, profiled step) partition of the run: each rank's whole-run interval sets
    cut to its steps and swept in priority order, every (rank, step) on its own axis, the
    ranks a group at a time (SWEEP_INTERVALS; GPU ranks on their GPU timeline:
    timeline/windows.py says why)."""
    acts = acts if acts is not None else run.activities
    if matched is None:
        matched = match_pairs(run)
    absent = peer_not_loaded(matched.unmatched, run.requested)  # their wait/transfer split is unknown
    split = split_by_rank(*matched, kernels=any(a.gpu for a in acts.values()), unsplit=absent)
    keys = sorted(key for key in run.step_windows if key[0] in acts)
    rank = np.array([k[0] for k in keys], np.int64)
    step = np.array([k[1] for k in keys], np.int64)
    start = np.array([run.step_windows[k][0] for k in keys], np.int64)
    end = np.array([run.step_windows[k][1] for k in keys], np.int64)
    windows = run.pipeline_windows
    pipe = np.array([windows.get(int(s), (0, 0)) for s in step], np.int64).reshape(-1, 2)
    has_pipe = np.array([int(s) in windows for s in step], bool)
    n = len(keys)
    axes = Axes.over(n, int(start.min()) if n else 0, int(end.max()) if n else 0)
    untagged = untagged_p2p(run)
    unsplit = unsplit_by_rank(matched.unmatched, absent)

    def sweep(a: int, b: int) -> tuple[dict, dict, np.ndarray]:
        """The parts, hidden and unsplit ns of rows [a, b) (whole ranks), placed on ``axes``."""
        mine = set(rank[a:b].tolist())
        row = np.arange(a, b, dtype=np.int64)

        def cut(sets: dict) -> Intervals:
            """Each of these ranks' whole-run set cut to its steps, placed on their axes."""
            sets = {r: iv for r, iv in sets.items() if r in mine and len(iv)}
            if not sets or a == b:
                return Intervals.empty()
            win, lo, hi = pieces_in_windows(*flat(sets), rank[a:b], start[a:b], end[a:b])
            return axes.place(win + a, lo, hi)

        mine_acts = {r: act for r, act in acts.items() if r in mine}
        compute = cut({r: act.compute for r, act in mine_acts.items()})
        comm = {dim: cut({r: act.comm[dim] for r, act in mine_acts.items()}) for dim in COMM_DIMS}
        final = {dim: cut({r: act.step_final[dim] for r, act in mine_acts.items()}) for dim in COMM_DIMS}
        wait = cut({r: w for r, (w, _) in split.items()})
        transfer = cut({r: t for r, (_, t) in split.items()})
        # pipeline p2p that cannot pair (no peer tag; NCCL kernels of GPU ranks) counts as moving
        transfer = transfer | (cut(untagged) - wait) | (cut({r: act.p2p for r, act in mine_acts.items() if act.gpu}) - wait)
        piped = has_pipe[a:b]
        pipe_iv = axes.place(row[piped], np.maximum(pipe[a:b][piped, 0], start[a:b][piped]),
                             np.minimum(pipe[a:b][piped, 1], end[a:b][piped]))
        order = [("compute", compute)]
        for dim in COMM_DIMS:
            # The step-final collective blocks while other stages still run the pipeline: that is
            # bubble (contract 3); after the pipeline window it is this dimension's again.
            order.append((f"{dim}_exposed", comm[dim] | (final[dim] - pipe_iv)))
        # A wait outside the pipeline window waits on its peer's own work before its first
        # pass (set-up, data) or after the last: not the schedule's bubble, the rest (other).
        # A step without a window (no passes seen) keeps its waits as bubble.
        waits_in = pipe_iv | axes.place(row[~piped], start[a:b][~piped], end[a:b][~piped])
        order += [("pp_transfer", transfer), ("pp_bubble", (wait & waits_in) | pipe_iv)]
        parts = partition(axes.place(row, start[a:b], end[a:b]), order, rest="other")
        hidden = {dim: axes.totals((comm[dim] | final[dim]) & compute) for dim in COMM_DIMS}
        unsplit_ns = axes.totals(cut(unsplit) & parts["pp_bubble"]) if unsplit else np.zeros(n, np.int64)
        return parts, hidden, unsplit_ns

    swept = [sweep(a, b) for a, b in _rank_groups(rank, acts, SWEEP_INTERVALS)]
    hidden = {dim: sum(h[dim] for _, h, _ in swept) for dim in COMM_DIMS}
    unsplit_ns = sum(u for _, _, u in swept)
    # the groups' rows follow one another: their placed sets, joined, are sorted still. A part's
    # pieces are let go once joined, so that only one part is held twice at a time
    pieces = {name: [p.pop(name) for p, _, _ in swept] for name in list(swept[0][0])}
    del swept
    parts = {}
    for name in list(pieces):
        held = pieces.pop(name)
        parts[name] = Intervals(np.concatenate([iv.starts for iv in held]), np.concatenate([iv.ends for iv in held]))
        del held
    return Partitions(rank, step, start, end, axes, parts, hidden, unsplit_ns)


def _rank_groups(rank: np.ndarray, acts: dict, budget: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of whole ranks (``rank``: each row's, ascending), consecutive, each
    holding about ``budget`` intervals of its ranks' activity sets (a larger rank alone); one
    empty range for no rows."""
    firsts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]]) if len(rank) else np.zeros(0, np.int64)
    if len(firsts) < 2:
        return [(0, len(rank))]
    heads = firsts[budget_groups([_intervals(acts[int(r)]) for r in rank[firsts]], budget)]
    return list(zip(heads.tolist(), [*heads[1:].tolist(), len(rank)]))


def _intervals(act) -> int:
    return len(act.compute) + len(act.p2p) + sum(len(s) for s in (*act.comm.values(), *act.step_final.values()))


def breakdown_table(partitions: Partitions) -> pd.DataFrame:
    """One row per (rank, step): time_s, every part in seconds, UNSPLIT, and hidden_<dim>
    seconds. A step with p2p whose peer is not loaded has pp_bubble and pp_transfer NaN
    (unknown, not zero) and their sum in UNSPLIT (0 elsewhere; the column only where some
    step has one): the parts still add up."""
    table = pd.DataFrame({"rank": partitions.rank, "step": partitions.step, "time_s": partitions.wall_ns / 1e9})
    for name in PARTS:
        table[name] = partitions.totals(name) / 1e9
    unknown = partitions.unsplit_ns > 0
    table[UNSPLIT] = np.where(unknown, table["pp_bubble"] + table["pp_transfer"], 0.0)
    table.loc[unknown, ["pp_bubble", "pp_transfer"]] = np.nan
    for dim in COMM_DIMS:
        table[f"hidden_{dim}"] = partitions.hidden[dim] / 1e9
    if not unknown.any():  # a --ranks subset's column only
        table = table.drop(columns=UNSPLIT)
    return table
