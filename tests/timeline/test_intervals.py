"""Interval sets of many rows at once (timeline/intervals.py: Axes, pieces_in_windows): each
answer against the same question asked of one row's Intervals at a time, on random sets, and
by hand where the edges are (touching windows, empty and inverted windows, a set reaching
past its last window)."""
from __future__ import annotations

import numpy as np
import pytest

from pptrace.timeline.intervals import Axes, Intervals, flat, partition, pieces_in_windows, union, union_by_group

T0 = 1_700_000_000_000_000_000  # epoch ns, as traces have them: offsets must not lose a bit


def _random_set(rng, lo, hi, n) -> Intervals:
    starts = rng.integers(lo, hi, n)
    return union(starts, starts + rng.integers(1, (hi - lo) // 8 + 2, n))


def test_pieces_in_windows_by_hand():
    sets = {0: union([T0 + 0, T0 + 10], [T0 + 5, T0 + 30]), 2: union([T0 + 3], [T0 + 4])}
    # rank 0: two touching windows splitting [10, 30); rank 2: a window missing its interval;
    # an inverted window; a window of a rank with no set
    w_group = np.array([0, 0, 2, 0, 1])
    w_start = np.array([T0 + 0, T0 + 20, T0 + 5, T0 + 9, T0 + 0])
    w_end = np.array([T0 + 20, T0 + 40, T0 + 9, T0 + 2, T0 + 50])
    window, starts, ends = pieces_in_windows(*flat(sets), w_group, w_start, w_end)
    assert window.tolist() == [0, 0, 1]
    assert (starts - T0).tolist() == [0, 10, 20] and (ends - T0).tolist() == [5, 20, 30]


def test_pieces_in_windows_equal_clip_per_window():
    rng = np.random.default_rng(7)
    for _ in range(30):
        sets = {g: _random_set(rng, T0, T0 + 10_000, int(rng.integers(0, 40)))
                for g in sorted(rng.choice(50, size=int(rng.integers(1, 8)), replace=False).tolist())}
        w_group = rng.integers(0, 50, 60)
        w_start = rng.integers(T0 - 500, T0 + 10_500, 60)
        w_end = w_start + rng.integers(-50, 3_000, 60)
        window, starts, ends = pieces_in_windows(*flat(sets), w_group, w_start, w_end)
        for w in range(60):
            want = sets.get(int(w_group[w]), Intervals.empty()).clip(int(w_start[w]), int(w_end[w]))
            mine = window == w
            assert starts[mine].tolist() == want.starts.tolist() and ends[mine].tolist() == want.ends.tolist()


def test_axes_answer_every_row_as_its_own_sets_do():
    rng = np.random.default_rng(11)
    n = 25
    rows_a = [_random_set(rng, T0, T0 + 5_000, int(rng.integers(0, 30))) for _ in range(n)]
    rows_b = [_random_set(rng, T0, T0 + 5_000, int(rng.integers(0, 30))) for _ in range(n)]
    axes = Axes.over(n, T0, T0 + 5_000 + 5_000 // 8 + 2)

    def place(rows):
        row, starts, ends = flat(dict(enumerate(rows)))
        return axes.place(row, starts, ends)

    a, b = place(rows_a), place(rows_b)
    lo = rng.integers(T0 - 100, T0 + 5_000, n)
    hi = lo + rng.integers(-10, 2_000, n)
    for placed, op in ((a | b, Intervals.__or__), (a & b, Intervals.__and__), (a - b, Intervals.__sub__)):
        row, starts, ends = axes.unplace(placed)
        cuts = axes.slices(placed)
        for r in range(n):
            want = op(rows_a[r], rows_b[r])
            assert starts[row == r].tolist() == want.starts.tolist() and ends[row == r].tolist() == want.ends.tolist()
            assert (placed.starts[cuts[r]:cuts[r + 1]] == starts[row == r] + r * axes.stride - axes.lo).all()
        assert axes.totals(placed).tolist() == [op(x, y).total for x, y in zip(rows_a, rows_b)]
    assert axes.covered(a, lo, hi).tolist() == [
        x.clip(int(l), int(h)).total for x, l, h in zip(rows_a, lo, hi)]


def test_partition_of_many_rows_at_once_sums_each_row():
    axes = Axes.over(2, T0, T0 + 100)
    span = axes.place([0, 1], [T0, T0 + 10], [T0 + 100, T0 + 60])
    x = axes.place([0, 1], [T0 + 10, T0], [T0 + 50, T0 + 100])  # row 1's x runs past its window
    y = axes.place([0, 1], [T0 + 40, T0 + 20], [T0 + 70, T0 + 30])
    parts = partition(span, [("x", x), ("y", y)], rest="rest")
    assert {k: axes.totals(v).tolist() for k, v in parts.items()} == {"x": [40, 50], "y": [20, 0], "rest": [40, 0]}


def test_axes_refuse_a_span_int64_cannot_hold():
    with pytest.raises(ValueError, match="too long"):
        Axes.over(1 << 20, 0, 1 << 45)


def _touching_set(rng, n) -> Intervals:
    """Sorted, disjoint, and some neighbours touching (end == next start), as sets built
    without union() (windows, placed rows) are: each bound has to count."""
    cuts = np.unique(rng.integers(0, 200, 2 * n))
    starts, ends = cuts[:-1], cuts[1:]
    keep = rng.random(len(starts)) < 0.6
    return Intervals(starts[keep].astype(np.int64), ends[keep].astype(np.int64))


def _mask(s: Intervals) -> np.ndarray:
    m = np.zeros(200, bool)
    for a, b in zip(s.starts, s.ends):
        m[a:b] = True
    return m


def test_set_operations_equal_a_mask_of_every_nanosecond():
    rng = np.random.default_rng(5)
    for _ in range(300):
        a, b = _touching_set(rng, int(rng.integers(0, 12))), _touching_set(rng, int(rng.integers(0, 12)))
        for got, want in ((a & b, _mask(a) & _mask(b)), (a - b, _mask(a) & ~_mask(b)),
                          (a | b, _mask(a) | _mask(b))):
            assert (_mask(got) == want).all()
            # the answer is a proper set: sorted, no empty interval, neighbours apart
            assert (got.ends > got.starts).all() and (got.starts[1:] > got.ends[:-1]).all()


@pytest.mark.parametrize("n_parts", [1, 3, 7, 12])
def test_partition_gives_each_nanosecond_to_the_first_part_over_it(n_parts):
    """Up to 7 parts (8 sets) are labelled from a table of membership values, more part by
    part: both against a mask of every nanosecond, a name given twice included."""
    rng = np.random.default_rng(n_parts)
    for _ in range(50):
        window = _touching_set(rng, int(rng.integers(1, 6)))
        names = [f"p{int(rng.integers(0, max(n_parts - 1, 1)))}" for _ in range(n_parts)]
        parts = [(name, _touching_set(rng, int(rng.integers(0, 8)))) for name in names]
        got = partition(window, parts, rest="rest")
        free = _mask(window)
        want = {name: np.zeros(200, bool) for name in names}
        for name, intervals in parts:
            mine = free & _mask(intervals)
            want[name] |= mine
            free &= ~mine
        want["rest"] = free
        assert set(got) == set(want)
        for name in want:
            assert (_mask(got[name]) == want[name]).all(), name


@pytest.mark.parametrize("presorted", [False, True])
def test_union_by_group_equals_each_groups_own_union(presorted):
    """All groups in one pass, with and without the sort (merged_by_group skips it for
    intervals already in (group, start) order): each group's set is its own union."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        group, starts = rng.integers(0, 4, n), rng.integers(0, 100, n)
        ends = starts + rng.integers(-3, 30, n)
        if presorted:
            order = np.lexsort((starts, group))
            group, starts, ends = group[order], starts[order], ends[order]
        sets = union_by_group(4, group, starts, ends)
        for g in range(4):
            want = union(starts[group == g], ends[group == g])
            assert sets[g].starts.tolist() == want.starts.tolist() and sets[g].ends.tolist() == want.ends.tolist()
