"""Sets of half-open time intervals [start, end) in integer nanoseconds, as sorted disjoint
numpy arrays. The step partition is a sweep of such sets in priority order, so exactness
(int64, no floats) is what makes the parts sum to the step time to the nanosecond.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sweeps import ascending, running_max


@dataclass(frozen=True)
class Intervals:
    """Disjoint, sorted, non-empty intervals; build with :func:`union` or :meth:`empty`."""

    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def empty(cls) -> "Intervals":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))

    @classmethod
    def span(cls, start: int, end: int) -> "Intervals":
        return union([start], [end])

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def total(self) -> int:
        return int((self.ends - self.starts).sum())

    def covered(self, starts, ends) -> np.ndarray:
        """Per query [start, end): how much of it the set covers (vectorised)."""
        ends, starts = np.asarray(ends, np.int64), np.asarray(starts, np.int64)
        if not len(self):
            return np.zeros(np.broadcast(starts, ends).shape, np.int64)
        done = np.r_[0, np.cumsum(self.ends - self.starts)]  # length of the first k intervals
        return self._covered_before(ends, done) - self._covered_before(starts, done)

    def _covered_before(self, t: np.ndarray, done: np.ndarray) -> np.ndarray:
        """Per time t: the set's length before t."""
        k = np.searchsorted(self.starts, t, side="right")  # intervals starting at or before t
        last = np.maximum(k - 1, 0)
        partial = np.clip(t - self.starts[last], 0, self.ends[last] - self.starts[last])
        return np.where(k > 0, done[last] + partial, 0)

    def clip(self, start: int, end: int) -> "Intervals":
        """The part inside [start, end): two binary searches, so that clipping a whole
        run's set to each step costs nothing like a sweep of the set."""
        if end <= start:
            return Intervals.empty()
        i = int(np.searchsorted(self.ends, start, side="right"))  # first ending after start
        j = int(np.searchsorted(self.starts, end, side="left"))   # past the last starting before end
        if i >= j:
            return Intervals.empty()
        starts, ends = self.starts[i:j].copy(), self.ends[i:j].copy()
        starts[0], ends[-1] = max(starts[0], start), min(ends[-1], end)
        return Intervals(starts, ends)

    def __or__(self, other: "Intervals") -> "Intervals":
        return union(np.concatenate([self.starts, other.starts]),
                     np.concatenate([self.ends, other.ends]))

    def __and__(self, other: "Intervals") -> "Intervals":
        return intersect(self, other)

    def __sub__(self, other: "Intervals") -> "Intervals":
        return subtract(self, other)


def union(starts, ends) -> Intervals:
    """Merge possibly overlapping intervals; empty and inverted ones are dropped."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if len(starts) == 0:
        return Intervals.empty()
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    # A new run begins where an interval starts strictly after everything before it ended.
    new_run = np.ones(len(starts), bool)
    new_run[1:] = starts[1:] > reach[:-1]
    run_id = np.cumsum(new_run) - 1
    out_starts = starts[new_run]
    out_ends = np.zeros(len(out_starts), np.int64)
    np.maximum.at(out_ends, run_id, reach)
    return Intervals(out_starts, out_ends)


def merged_by_group(group, starts, ends) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``union`` of each group's intervals, all groups in one sort, flat: (group, starts,
    ends) of the merged intervals, sorted by group, then time."""
    group, starts, ends = (np.asarray(a, np.int64) for a in (group, starts, ends))
    keep = ends > starts
    if not keep.all():  # kernels mostly have a length: then no three copies
        group, starts, ends = group[keep], starts[keep], ends[keep]
    del keep
    if not ascending(group, starts):  # a rank's kernels mostly do: then no sort, no three gathers
        order = np.lexsort((starts, group))
        group, starts, ends = group[order], starts[order], ends[order]
    reach = running_max(group, ends)  # restarts with each group
    new_run = np.ones(len(starts), bool)
    new_run[1:] = (group[1:] != group[:-1]) | (starts[1:] > reach[:-1])
    last = np.flatnonzero(np.append(new_run[1:], True)[:len(starts)])  # each run's last interval
    return group[new_run], starts[new_run], reach[last]


def union_by_group(n_groups: int, group, starts, ends) -> list[Intervals]:
    """``union`` of the intervals of each group 0 .. n_groups-1 (a list, one per group),
    all groups in one sort."""
    group, starts, ends = merged_by_group(group, starts, ends)
    cuts = np.cumsum(np.bincount(group, minlength=n_groups))[:-1]
    return [Intervals(s, e) for s, e in zip(np.split(starts, cuts), np.split(ends, cuts))]


def private_axes(keys, starts, ends) -> np.ndarray:
    """Per row, an offset that moves each key's times onto an axis of its own: after
    adding it, intervals of different keys lie apart (never touching), so that one union,
    intersection or ``covered`` over all keys at once gives each key's own answer. Keys are
    laid out in sorted order, each a span of all the times given (plus one) apart: the
    rows of :class:`Axes` (below) are the sorted keys."""
    keys, starts, ends = (np.asarray(a, np.int64) for a in (keys, starts, ends))
    if not len(keys):
        return np.zeros(0, np.int64)
    uniq, index = np.unique(keys, return_inverse=True)
    axes = Axes.over(len(uniq), int(starts.min()), int(max(ends.max(), starts.max())))
    return index.astype(np.int64) * axes.stride - axes.lo


@dataclass(frozen=True)
class Axes:
    """``n`` private time axes, one per row (a rank's step, say): row r's time t lies at
    ``r * stride + t - lo``. Sets of many rows placed on them never touch one another, so
    one union, subtraction or intersection of two placed sets is every row's own, and a
    row's part of a placed set is one slice of it: a sweep per row becomes one sweep."""

    lo: int
    stride: int
    n: int

    @classmethod
    def over(cls, n: int, lo: int, hi: int) -> "Axes":
        """Axes for ``n`` rows whose times all lie in [lo, hi]."""
        stride = int(hi) - int(lo) + 1
        if stride * max(n, 1) >= 2**62:
            raise ValueError(f"times span {stride} ns: too long for {n} private axes in int64")
        return cls(int(lo), stride, int(n))

    def place(self, row, starts, ends) -> Intervals:
        """Intervals of rows ``row`` (sorted by row, then time; disjoint within a row) on
        their rows' axes; empty ones dropped."""
        row, starts, ends = (np.asarray(a, np.int64) for a in (row, starts, ends))
        keep = ends > starts
        shift = row[keep] * self.stride - self.lo
        return Intervals(starts[keep] + shift, ends[keep] + shift)

    def rows_of(self, placed: Intervals) -> np.ndarray:
        return placed.starts // self.stride

    def totals(self, placed: Intervals) -> np.ndarray:
        """Per row, the placed set's length there (int64 ns; exact below 2**53 per row)."""
        lengths = (placed.ends - placed.starts).astype(np.float64)
        return np.bincount(self.rows_of(placed), weights=lengths, minlength=self.n).astype(np.int64)

    def covered(self, placed: Intervals, lo, hi) -> np.ndarray:
        """Per row r, how much of [lo[r], hi[r]) the placed set covers there (times on the
        rows' own clocks, each cut to [self.lo, self.lo + stride))."""
        return self.covered_at(placed, np.arange(self.n, dtype=np.int64), lo, hi)

    def covered_at(self, placed: Intervals, row, lo, hi) -> np.ndarray:
        """Per query i, how much of [lo[i], hi[i]) the placed set covers on row ``row[i]``."""
        shift = np.asarray(row, np.int64) * self.stride
        top = self.stride - 1
        q_lo = np.clip(np.asarray(lo, np.int64) - self.lo, 0, top) + shift
        q_hi = np.clip(np.asarray(hi, np.int64) - self.lo, 0, top) + shift
        return placed.covered(q_lo, np.maximum(q_hi, q_lo))

    def unplace(self, placed: Intervals) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, starts, ends) on the rows' own clocks, sorted by row, then time."""
        row = self.rows_of(placed)
        shift = row * self.stride - self.lo
        return row, placed.starts - shift, placed.ends - shift

    def split(self, placed: Intervals) -> list[Intervals]:
        """Each row's part of the placed set, on its own clock: one Intervals per row."""
        cuts = self.slices(placed)[1:-1]
        row, starts, ends = self.unplace(placed)
        return [Intervals(s, e) for s, e in zip(np.split(starts, cuts), np.split(ends, cuts))]

    def slices(self, placed: Intervals) -> np.ndarray:
        """Row r's intervals are placed[bounds[r]:bounds[r + 1]] (n + 1 bounds)."""
        return np.searchsorted(self.rows_of(placed), np.arange(self.n + 1), side="left")


def pieces_in_windows(group, starts, ends, w_group, w_start, w_end):
    """Every window's part of its group's set (``Intervals.clip`` for many windows of many
    groups in one search): the intervals of each group (sorted, disjoint within it; groups
    ascending, ids >= 0) cut to each window [w_start, w_end) of that group -> (window index,
    starts, ends), by window in the order given, then time."""
    group, starts, ends, w_group, w_start, w_end = (
        np.asarray(a, np.int64) for a in (group, starts, ends, w_group, w_start, w_end))
    if not len(starts) or not len(w_start):
        return (np.zeros(0, np.int64),) * 3
    lo = min(int(starts.min()), int(w_start.min()))
    hi = max(int(ends.max()), int(w_end.max()))
    axes = Axes.over(int(max(group.max(), w_group.max())) + 1, lo, hi)
    s_off, w_off = group * axes.stride - lo, w_group * axes.stride - lo
    # on a group's own axis: the first interval ending after the window starts, and the
    # first starting at or after its end
    first = np.searchsorted(ends + s_off, w_start + w_off, side="right")
    stop = np.searchsorted(starts + s_off, w_end + w_off, side="left")
    count = np.where(w_end > w_start, np.maximum(stop - first, 0), 0)  # an empty window holds nothing
    window = np.repeat(np.arange(len(w_start), dtype=np.int64), count)
    at = np.repeat(first, count) + np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    return window, np.maximum(starts[at], w_start[window]), np.minimum(ends[at], w_end[window])


def flat(sets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group, starts, ends) of ``sets`` ({group id: Intervals}), groups ascending."""
    keys = sorted(sets)
    counts = np.array([len(sets[k]) for k in keys], np.int64)
    group = np.repeat(np.asarray(keys, np.int64), counts)
    starts = np.concatenate([np.zeros(0, np.int64), *(sets[k].starts for k in keys)])
    ends = np.concatenate([np.zeros(0, np.int64), *(sets[k].ends for k in keys)])
    return group, starts.astype(np.int64), ends.astype(np.int64)


def _bounds(s: Intervals) -> np.ndarray:
    """starts[0], ends[0], starts[1], ...: non-decreasing, since the set is sorted and disjoint."""
    out = np.empty(2 * len(s), np.int64)
    out[0::2], out[1::2] = s.starts, s.ends
    return out


def segments(sets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The elementary segments between all the bounds of ``sets`` (at most 63) and, per
    segment, which sets it lies in: bit k of ``member`` for ``sets[k]`` -> (lo, hi, member).
    Any boolean combination of the sets is then a mask over the segments (``from_segments``),
    so many set operations over the same sets cost one sweep."""
    if len(sets) > 63:
        raise ValueError(f"{len(sets)} sets: at most 63 fit the membership bits")
    bits = np.uint8 if len(sets) <= 8 else np.uint16 if len(sets) <= 16 else np.uint32 if len(sets) <= 32 else np.uint64
    bounds = np.concatenate([np.zeros(0, np.int64), *(_bounds(s) for s in sets)])
    # each set's bounds are already sorted (_bounds): a stable sort (timsort) merges the
    # runs, where sorting every start and end from scratch was n log n
    order = np.argsort(bounds, kind="stable")
    points = bounds[order]
    del bounds  # large inputs: hold as few whole copies at once as can be
    # every bound toggles its set: a start enters, an end leaves, and where two intervals
    # touch the two bounds cancel; a segment's sets are the toggles up to its start
    bit = np.left_shift(np.ones(1, bits), np.arange(len(sets), dtype=bits))
    member = np.repeat(bit, [2 * len(s) for s in sets])[order]
    del order
    member = np.bitwise_xor.accumulate(member)
    last = np.r_[points[1:] != points[:-1], True] if len(points) else np.zeros(0, bool)
    points, member = points[last], member[last]
    return points[:-1], points[1:], member[:-1]


def from_segments(lo: np.ndarray, hi: np.ndarray, keep: np.ndarray) -> Intervals:
    """The set made of the segments ``keep`` selects (``segments``' lo and hi: sorted and
    disjoint already, so touching ones are only joined, as union() joins them)."""
    lo, hi = lo[keep], hi[keep]
    if not len(lo):
        return Intervals.empty()
    first = np.r_[True, lo[1:] != hi[:-1]]
    return Intervals(lo[first], hi[np.r_[first[1:], True]])


def gaps_per_window(w_start, w_end, busy: Intervals):
    """Per window (sorted, disjoint, possibly touching: steps): the parts ``busy`` leaves
    free, as maximal runs that never cross into the next window -> (window index, starts,
    ends). ``Intervals.span(start, end) - busy`` for every window in one sweep."""
    w_start, w_end = np.asarray(w_start, np.int64), np.asarray(w_end, np.int64)
    # not union(): touching windows stay apart
    lo, hi, member = segments([Intervals(w_start, w_end), busy])
    free = member == 1  # in a window, not busy
    lo, hi = lo[free], hi[free]
    win = np.searchsorted(w_start, lo, side="right") - 1
    if not len(lo):
        return win, lo, hi
    first = np.ones(len(lo), bool)  # consecutive free segments of one window form one gap
    first[1:] = (lo[1:] != hi[:-1]) | (win[1:] != win[:-1])
    return win[first], lo[first], hi[np.append(first[1:], True)]


def intersect(a: Intervals, b: Intervals) -> Intervals:
    lo, hi, member = segments([a, b])
    return from_segments(lo, hi, member == 3)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    lo, hi, member = segments([a, b])
    return from_segments(lo, hi, member == 1)


def partition(window, parts: list[tuple[str, Intervals]], rest: str):
    """Sweep ``parts`` in priority order over ``window`` (Intervals, or one (start, end)):
    each part keeps what no earlier part took. Returns {name: Intervals}; ``rest`` gets what
    nobody took, so the totals sum to the window's length exactly. Placed on Axes, one call
    sweeps every row's window at once; all parts are one sweep (``segments``)."""
    window = window if isinstance(window, Intervals) else Intervals.span(*window)
    lo, hi, member = segments([window, *(intervals for _, intervals in parts)])
    names = list(dict.fromkeys(name for name, _ in parts))  # a name given twice owns both parts
    # each segment's label: the name of the first part over it, ``rest`` (len(names)) inside
    # the window where none is, len(names) + 1 outside; read from a table of every membership
    # value where there are few (one pass), else part by part
    claim = np.array([names.index(name) for name, _ in parts] + [len(names)], np.int64)
    if member.dtype.itemsize <= 2:
        value = np.arange(1 << (8 * member.dtype.itemsize), dtype=np.int64)
        taken = value >> 1
        first = np.where(taken > 0, np.log2(np.maximum(taken & -taken, 1)).astype(np.int64), len(parts))
        first = np.minimum(first, len(parts))  # (bits past the parts never occur)
        label = np.where(value & 1, claim[first], len(names) + 1).astype(np.int8)[member]
    else:
        first = np.full(len(lo), len(parts), np.int64)
        for k in range(len(parts) - 1, -1, -1):
            first[((member >> (k + 1)) & 1).astype(bool)] = k
        label = np.where(member & 1, claim[first], len(names) + 1)
    order = np.argsort(label, kind="stable")  # small ints: a radix sort, time order kept within a label
    cuts = np.searchsorted(label[order], np.arange(len(names) + 2))
    return {name: from_segments(lo[order[cuts[i]:cuts[i + 1]]], hi[order[cuts[i]:cuts[i + 1]]], slice(None))
            for i, name in enumerate([*names, rest])}
