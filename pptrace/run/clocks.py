"""Ranks whose clocks say nothing: a corrupt ``baseTimeNanoseconds`` ("x", true, 1e30 put a
rank in 1970), or, under ``--assume-same-run``, a clock hours off the others'. Such a rank is
placed near the others before alignment (the median of its events' starts on theirs) and then
aligned from its communication alone (align.estimate_offsets' ``free`` ranks); its offset is
reported from its own recorded clock. Without the option, traces hours apart are refused as
two runs mixed, and the refusal says how to go on.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..errors import TraceError
from ..sweeps import ascending
from .align import offsets_per_row

#: Ranks of one run start their profiled window within seconds of each other; traces whose
#: first events lie further apart than this come from different runs.
MAX_START_SPREAD_NS = 600 * 10**9


def place(events, metas, assume_same_run: bool, warnings: list) -> dict:
    """The ranks whose clocks say nothing, placed near the others: rank -> the ns added to
    its times (in place in ``events``), for align.estimate_offsets to align them from their
    communication (``free``). Those are the ranks whose baseTimeNanoseconds is corrupt and,
    under ``assume_same_run``, those whose events lie hours from the others'; without it,
    traces hours apart are refused as different runs. Each rank is placed by the median of
    its events' starts (of MEDIAN_SAMPLE of them spread over its rows where it has more),
    which a few corrupt timestamps cannot move: on the median of the others' (one run's
    ranks profile the same window); the rank furthest off is named."""
    if events.empty:
        return {}
    mid = _rank_medians(events["rank"].to_numpy(), events["start_ns"].to_numpy(np.int64))
    free = {r for r in mid.index if metas[r].get("clock_unknown")}
    known = mid[[r for r in mid.index if r not in free]]
    if len(known) > 1 and known.max() - known.min() > MAX_START_SPREAD_NS:
        ref = int(known.sort_values(kind="stable").index[(len(known) - 1) // 2])  # two: the earlier
        off = (known - known[ref]).abs()
        if not assume_same_run:
            odd = int(off.idxmax())
            raise TraceError(
                f"traces from different runs: rank {odd} ({metas[odd]['path']}) ran {off[odd] / 3.6e12:.1f} h "
                f"{'after' if known[odd] > known[ref] else 'before'} rank {ref}; keep one run's traces per "
                "directory, or if they are one run whose clocks disagree, give --assume-same-run (aligns the "
                "ranks on their collectives and p2p)"
            )
        skewed = sorted(int(r) for r in off.index[(off > MAX_START_SPREAD_NS // 2).to_numpy()])
        warnings.append(
            f"--assume-same-run: the clocks of ranks {skewed} are up to {off.max() / 3.6e12:.1f} h from rank "
            f"{ref}'s; they are aligned on their collectives and p2p")
        free.update(skewed)
    anchors = mid[[r for r in mid.index if r not in free]]
    if not free or anchors.empty and len(free) < 2:
        return {}
    target = int(anchors.median()) if not anchors.empty else int(mid[min(free)])
    shift = {int(r): target - int(mid[r]) for r in sorted(free)}
    added = pd.DataFrame({"rank": list(shift), "offset_ns": list(shift.values())})
    per_row = offsets_per_row(events["rank"].to_numpy(), added)
    for column in ("start_ns", "end_ns"):  # a Series, not copied as an ndarray would be (align.apply_offsets)
        events[column] = pd.Series(events[column].to_numpy(np.int64) + per_row, index=events.index, copy=False)
    return shift


#: rows of a rank whose starts give its median (evenly spaced over its rows): ample to place
#: a clock hours off, and a fixed cost however many rows the rank has
MEDIAN_SAMPLE = 1025


def _rank_medians(rank: np.ndarray, start: np.ndarray) -> pd.Series:
    """rank -> the median start of its rows; of MEDIAN_SAMPLE rows evenly spaced over them
    where it has more. The exact median of every row (a groupby over all of them) cost 0.2 s,
    and 1-2 s of first-touched memory, of a cached 1,024-rank load, for a placement that only
    has to land within seconds."""
    if not ascending(rank):  # the loader's tables come rank by rank
        order = np.argsort(rank, kind="stable")
        rank, start = rank[order], start[order]
    first = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    size = np.diff(np.r_[first, len(rank)])
    taken = np.minimum(size, MEDIAN_SAMPLE)
    group = np.repeat(np.arange(len(first)), taken)
    nth = np.arange(taken.sum()) - np.repeat(np.cumsum(taken) - taken, taken)
    spacing = np.where(size > MEDIAN_SAMPLE, (size - 1) / (MEDIAN_SAMPLE - 1), 1.0)
    rows = first[group] + np.rint(nth * spacing[group]).astype(np.int64)
    mid = pd.Series(start[rows]).groupby(group).median().to_numpy()
    return pd.Series(mid.astype(np.int64), index=pd.Index(rank[first].astype(np.int64), name="rank"))


def placed_offsets(offsets, shift: dict):
    """The offsets of a run whose ``shift`` ranks were placed before alignment (:func:`place`):
    each rank's offset counts from its own recorded clock again, so that recorded time minus
    offset stays the aligned time (Run.raw_ns; clock_offset_us says how far off it was)."""
    if not shift:
        return offsets
    per_rank = pd.Series(shift)
    offsets = offsets.copy()
    offsets["offset_ns"] = (offsets["offset_ns"].to_numpy(np.int64)
                            - per_rank.reindex(offsets["rank"].to_numpy()).fillna(0).to_numpy(np.int64))
    return offsets
