"""pptrace/sweeps.py: the many-lanes-at-once sort keys and sweeps every timeline query is
built on. Each function against answers worked out by hand, then against a brute-force
reference (a loop over rows, written here) on random inputs with a fixed seed; the random
times are few distinct values around an epoch instant, so ties are common and the dense
ranks, not the raw nanoseconds, carry the order.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pptrace.sweeps import (ascending, budget_groups, cover_max, dense_ranks, dominance_max, inside, isin, lane_keys,
                            reach_before, running_max)

I64_MIN = np.iinfo(np.int64).min
EPOCH = 1_790_000_000_000_000_000  # ns: the size of the times the analyses pass in


def _a(*values) -> np.ndarray:
    return np.array(values, np.int64)


# -- dense_ranks ----------------------------------------------------------------------------
def test_dense_ranks_by_hand():
    (a, b), size = dense_ranks([5, 1, 5], [3, 1])
    # the values of both together are 1 < 3 < 5
    assert a.tolist() == [2, 0, 2] and b.tolist() == [1, 0]
    assert size == 4
    assert a.dtype == np.int64 and b.dtype == np.int64


def test_dense_ranks_of_epoch_nanoseconds_keep_one_ns_apart():
    # float64 cannot tell these apart; the ranks must
    (r,), size = dense_ranks(_a(EPOCH + 1, EPOCH, EPOCH + 1, EPOCH + 2))
    assert r.tolist() == [1, 0, 1, 2] and size == 4


def test_dense_ranks_with_empty_arrays():
    (r,), size = dense_ranks(np.zeros(0, np.int64))
    assert r.tolist() == [] and size == 1
    (a, b, c), size = dense_ranks([], [7, 7], [])
    assert a.tolist() == [] and b.tolist() == [0, 0] and c.tolist() == [] and size == 2


def test_dense_ranks_random_against_sorted_set():
    rng = np.random.default_rng(1)
    for _ in range(50):
        arrays = [EPOCH + rng.integers(0, 12, rng.integers(0, 9)) for _ in range(rng.integers(1, 4))]
        ranks, size = dense_ranks(*arrays)
        values = sorted({int(v) for a in arrays for v in a})
        assert size == len(values) + 1
        assert len(ranks) == len(arrays)
        for a, r in zip(arrays, ranks):
            assert r.tolist() == [values.index(int(v)) for v in a]


# -- lane_keys ------------------------------------------------------------------------------
def test_lane_keys_by_hand():
    k1, k2 = lane_keys([_a(0, 1), _a(1)], [_a(10, 5), _a(5)])
    # lane 0 at the latest time still sorts before lane 1 at the earliest; equal pairs, equal keys
    assert k1[0] < k1[1] and k1[1] == k2[0]


@pytest.mark.parametrize("spread", [10**6, 2**62], ids=["offset times", "ranked times"])
def test_lane_keys_sort_as_lane_then_time(spread):
    """Both ways of keying: times offset by their lane where lanes x span fit int64, their
    dense ranks where not (epoch times beside a sentinel)."""
    rng = np.random.default_rng(3)
    lanes = [rng.integers(0, 40, 500), rng.integers(0, 40, 300)]
    times = [rng.integers(-spread, spread, 500), rng.integers(-spread, spread, 300)]
    times[1][:100] = times[0][:100]  # equal (lane, time) pairs across the arrays
    lanes[1][:100] = lanes[0][:100]
    keys = np.concatenate(lane_keys(lanes, times))
    lane, time = np.concatenate(lanes), np.concatenate(times)
    by_pair = np.lexsort((time, lane))
    assert (np.diff(keys[by_pair]) >= 0).all()
    same = (np.diff(lane[by_pair]) == 0) & (np.diff(time[by_pair]) == 0)
    assert ((np.diff(keys[by_pair]) == 0) == same).all()


def test_lane_keys_empty():
    (k,) = lane_keys([np.zeros(0, np.int64)], [np.zeros(0, np.int64)])
    assert k.tolist() == []


def test_lane_keys_random_sort_as_lane_then_time():
    rng = np.random.default_rng(2)
    for _ in range(40):
        n = rng.integers(1, 4)
        lanes = [rng.integers(0, 4, m) for m in rng.integers(0, 10, n)]
        times = [EPOCH + rng.integers(0, 6, len(lane)) for lane in lanes]
        keys = lane_keys(lanes, times)
        flat_keys = np.concatenate(keys)
        pairs = [(int(l), int(t)) for lane, time in zip(lanes, times) for l, t in zip(lane, time)]
        for i, p in enumerate(pairs):
            for j, q in enumerate(pairs):
                assert (flat_keys[i] < flat_keys[j]) == (p < q)
                assert (flat_keys[i] == flat_keys[j]) == (p == q)


# -- running_max / reach_before -------------------------------------------------------------
def _running_max_ref(lane, values):
    out, best = [], {}
    for l, v in zip(lane, values):
        best[l] = max(best.get(l, v), v)
        out.append(best[l])
    return out


def _reach_before_ref(lane, end):
    out = []
    for i in range(len(end)):
        before = [end[j] for j in range(i) if lane[j] == lane[i]]
        out.append(max(before) if before else I64_MIN)
    return out


def test_running_max_by_hand():
    assert running_max(_a(0, 0, 0, 1, 1), _a(5, 3, 9, 2, 4)).tolist() == [5, 5, 9, 2, 4]
    assert running_max(_a(7), _a(-3)).tolist() == [-3]
    assert running_max(np.zeros(0, np.int64), np.zeros(0, np.int64)).tolist() == []
    # grouped but not ascending, and a span no key holds: the groupby's answers
    assert running_max(_a(3, 3, 1, 1), _a(1, 5, 2, 0)).tolist() == [1, 5, 2, 2]
    big = _a(-(2**62), 2**62, 0, -5)
    assert running_max(_a(0, 0, 1, 1), big).tolist() == [-(2**62), 2**62, 0, 0]


def test_reach_before_by_hand():
    lane, end = _a(0, 0, 0, 1, 1), _a(5, 3, 9, 2, 4)
    got = reach_before(lane, end)
    assert got.tolist() == [I64_MIN, 5, 5, I64_MIN, 2]
    assert got.dtype == np.int64


def test_reach_before_marks_nested_ranges():
    # one thread: A [0, 10) holds B [1, 4) and C [4, 10) (ends together), then D [10, 12)
    start, end = _a(0, 1, 4, 10), _a(10, 4, 10, 12)
    lane = np.zeros(4, np.int64)
    assert (reach_before(lane, end) >= end).tolist() == [False, True, True, False]
    assert start.tolist() == sorted(start.tolist())  # the rows are sorted as it requires


def test_reach_before_string_lanes_and_edges():
    assert reach_before(np.array([], object), np.zeros(0, np.int64)).tolist() == []
    assert reach_before(np.array(["main"]), _a(3)).tolist() == [I64_MIN]
    lane = np.array(["main", "main", "thread:5 gloo", "thread:5 gloo"])
    assert reach_before(lane, _a(8, 2, 1, 1)).tolist() == [I64_MIN, 8, I64_MIN, 1]


def test_running_max_and_reach_before_random():
    rng = np.random.default_rng(3)
    for _ in range(60):
        n = int(rng.integers(0, 30))
        lane = np.sort(rng.integers(0, 4, n))  # sorted by lane, as both require
        end = EPOCH + rng.integers(0, 10, n)
        assert running_max(lane, end).tolist() == _running_max_ref(lane.tolist(), end.tolist())
        assert reach_before(lane, end).tolist() == _reach_before_ref(lane.tolist(), end.tolist())


# -- dominance_max --------------------------------------------------------------------------
def _dominance_ref(p_group, p_lo, p_hi, p_w, q_group, q_lo, q_hi):
    out = []
    for g, lo, hi in zip(q_group, q_lo, q_hi):
        ws = [w for pg, pl, ph, w in zip(p_group, p_lo, p_hi, p_w) if pg == g and pl <= lo and ph >= hi]
        out.append(max(ws) if ws else -1)
    return out


POINTS = dict(p_group=_a(0, 0, 0, 1), p_lo=_a(0, 2, 5, 0), p_hi=_a(10, 6, 8, 3), p_w=_a(1, 5, 2, 7))


@pytest.mark.parametrize("q, want", [
    ((0, 3, 4), 5),     # inside [0, 10) (w 1) and [2, 6) (w 5)
    ((0, 5, 9), 1),     # [2, 6) ends before 9, [5, 8) too: only [0, 10)
    ((0, 5, 6), 5),     # both ends shared with [2, 6) and [5, 8): inclusive on both sides
    ((0, 0, 11), -1),   # no point reaches 11
    ((0, -1, 0), -1),   # no point starts by -1
    ((1, 1, 2), 7),     # group 1's only point
    ((1, 1, 4), -1),    # ... too short
    ((2, 1, 2), -1),    # a group with no points
])
def test_dominance_max_by_hand(q, want):
    g, lo, hi = q
    got = dominance_max(**POINTS, q_group=_a(g), q_lo=_a(lo), q_hi=_a(hi))
    assert got.tolist() == [want]


def test_dominance_max_weight_zero_is_found_not_none():
    got = dominance_max(_a(0), _a(0), _a(5), _a(0), _a(0, 0), _a(1, 6), _a(2, 7))
    assert got.tolist() == [0, -1]


def test_dominance_max_empty_inputs():
    none = np.zeros(0, np.int64)
    assert dominance_max(none, none, none, none, _a(0, 1), _a(1, 2), _a(2, 3)).tolist() == [-1, -1]
    assert dominance_max(**POINTS, q_group=none, q_lo=none, q_hi=none).tolist() == []
    assert dominance_max(**POINTS, q_group=none, q_lo=none, q_hi=none).dtype == np.int64


def test_dominance_max_points_need_not_be_sorted():
    order = np.array([3, 1, 0, 2])
    shuffled = {k: v[order] for k, v in POINTS.items()}
    q = dict(q_group=_a(0, 0, 1, 0), q_lo=_a(3, 5, 1, 5), q_hi=_a(4, 9, 2, 6))
    assert dominance_max(**shuffled, **q).tolist() == dominance_max(**POINTS, **q).tolist() == [5, 1, 7, 5]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 31, 64, 100, 257])
def test_dominance_max_random_against_brute_force(n):
    # sizes around powers of two: the blocks of the segment-tree walk end exactly there
    rng = np.random.default_rng(100 + n)
    for trial in range(8):
        groups = 1 if trial % 4 == 0 else int(rng.integers(2, 5))
        p_group = rng.integers(0, groups, n)
        p_lo = EPOCH + rng.integers(0, 20, n)
        p_hi = p_lo + rng.integers(0, 12, n)
        # weights: distinct row indices (as the timeline passes them) or repeats with zeros
        p_w = rng.permutation(n) if trial % 2 else rng.integers(0, 4, n)
        m = 3 * n + 5
        q_group = rng.integers(0, groups + 1, m)  # some queries in a group without points
        q_lo = EPOCH + rng.integers(-2, 22, m)
        q_hi = q_lo + rng.integers(0, 10, m)
        # ties on purpose: queries sitting exactly on a point's ends
        pick = rng.integers(0, n, m // 3)
        q_group[:len(pick)], q_lo[:len(pick)], q_hi[:len(pick)] = p_group[pick], p_lo[pick], p_hi[pick]
        args = (p_group, p_lo, p_hi, p_w, q_group, q_lo, q_hi)
        got = dominance_max(*(a.copy() for a in args))
        assert got.tolist() == _dominance_ref(*(a.tolist() for a in args)), (n, trial)


def test_dominance_max_leaves_its_inputs_alone():
    args = {k: v.copy() for k, v in POINTS.items()}
    dominance_max(**args, q_group=_a(0), q_lo=_a(3), q_hi=_a(4))
    assert all((args[k] == POINTS[k]).all() for k in POINTS)


# -- cover_max ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 31, 64, 100, 257])
def test_cover_max_is_dominance_max_of_a_point(n):
    """Sizes around powers of two: the sparse table's blocks end exactly there; times at
    epoch size (offset keys) and beside a sentinel (ranked keys)."""
    rng = np.random.default_rng(200 + n)
    for trial in range(8):
        groups = 1 if trial % 4 == 0 else int(rng.integers(2, 5))
        base = EPOCH if trial % 3 else -(2**62)
        p_group = rng.integers(0, groups, n)
        p_lo = base + rng.integers(0, 20, n)
        p_hi = p_lo + rng.integers(0, 12, n)  # some empty: they cover nothing
        p_w = rng.permutation(n) if trial % 2 else rng.integers(0, 4, n)
        m = 3 * n + 5
        q_group = rng.integers(0, groups + 1, m)
        q_t = base + rng.integers(-2, 34, m)
        pick = rng.integers(0, n, m // 2)  # queries on a point's own ends
        q_group[:len(pick)] = p_group[pick]
        q_t[:len(pick)] = np.where(rng.random(len(pick)) < 0.5, p_lo[pick], p_hi[pick])
        if trial % 3 == 0:
            q_t[-1] = 2**62  # a sentinel beside the rest: ranked keys
        want = dominance_max(p_group, p_lo, p_hi, p_w, q_group, q_t, q_t + 1)
        assert cover_max(p_group, p_lo, p_hi, p_w, q_group, q_t).tolist() == want.tolist(), (n, trial)


def test_cover_max_empty_inputs():
    none = np.zeros(0, np.int64)
    assert cover_max(none, none, none, none, _a(0, 1), _a(1, 2)).tolist() == [-1, -1]
    assert cover_max(**POINTS, q_group=none, q_t=none).tolist() == []


# -- inside ---------------------------------------------------------------------------------
def _inside_ref(lane, start, end, o_lane, o_start, o_end):
    return [any(ol == l and os <= s and e <= oe for ol, os, oe in zip(o_lane, o_start, o_end))
            for l, s, e in zip(lane, start, end)]


def test_inside_by_hand():
    # lane 0: outer spans [0, 10) holding [2, 5), and [20, 30); lane 2: [0, 100); lane 1 has none
    o_lane, o_start, o_end = _a(0, 0, 0, 2), _a(20, 0, 2, 0), _a(30, 10, 5, 100)
    rows = [
        (0, 3, 4, True),     # in [2, 5) and [0, 10)
        (0, 0, 10, True),    # exactly an outer span: its ends count
        (0, 9, 11, False),   # runs past [0, 10)
        (0, 12, 15, False),  # between spans
        (0, 20, 30, True),
        (1, 3, 4, False),    # a lane with no outer spans
        (2, 50, 60, True),
        (3, 1, 2, False),    # a lane above every outer lane
    ]
    lane, start, end, want = zip(*rows)
    assert inside(_a(*lane), _a(*start), _a(*end), o_lane, o_start, o_end).tolist() == list(want)


def test_inside_empty_inputs():
    none = np.zeros(0, np.int64)
    assert inside(_a(0, 1), _a(1, 2), _a(2, 3), none, none, none).tolist() == [False, False]
    assert inside(none, none, none, _a(0), _a(0), _a(9)).tolist() == []


def test_inside_random_against_brute_force():
    rng = np.random.default_rng(4)
    for trial in range(80):
        lanes = 1 if trial % 5 == 0 else int(rng.integers(2, 6))
        # outer spans on a lane nest or are disjoint (one thread's ranges): split a line
        o_lane, o_start, o_end = [], [], []
        for lane in range(lanes):
            if rng.random() < 0.2:
                continue  # a lane without outer spans
            t = 0
            for _ in range(int(rng.integers(1, 4))):
                s = t + int(rng.integers(0, 4))
                e = s + int(rng.integers(1, 10))
                o_lane.append(lane), o_start.append(EPOCH + s), o_end.append(EPOCH + e)
                if e - s > 2 and rng.random() < 0.6:  # a child inside it
                    cs = s + int(rng.integers(0, e - s - 1))
                    o_lane.append(lane), o_start.append(EPOCH + cs), o_end.append(EPOCH + int(rng.integers(cs + 1, e + 1)))
                t = e
        m = int(rng.integers(0, 40))
        lane = rng.integers(0, lanes + 1, m)
        start = EPOCH + rng.integers(0, 30, m)
        end = start + rng.integers(0, 8, m)
        got = inside(lane, start, end, _a(*o_lane), _a(*o_start), _a(*o_end))
        assert got.tolist() == _inside_ref(lane.tolist(), start.tolist(), end.tolist(), o_lane, o_start, o_end)


def test_ascending_is_whether_a_lexsort_keeps_the_rows_where_they_are():
    assert ascending(np.array([], np.int64)) and ascending(np.array([7]))
    assert ascending([0, 0, 1], [5, 9, 1]) and not ascending([0, 0, 1], [9, 5, 1])
    assert not ascending([1, 0], [0, 9])
    rng = np.random.default_rng(11)
    for _ in range(500):
        n = int(rng.integers(0, 8))
        keys = [rng.integers(0, 3, n) for _ in range(int(rng.integers(1, 4)))]
        if rng.random() < 0.5:  # sorted inputs too, not only the (mostly unsorted) random ones
            keys = [k[np.lexsort(keys[::-1])] for k in keys]
        order = np.lexsort(keys[::-1])
        kept = all((k[order] == k).all() for k in keys)
        assert ascending(*keys) == kept, keys


def test_isin_answers_as_pandas_isin_on_every_kind_of_column():
    """Categorical (nulls, unused categories, values not among them), plain ints (consecutive
    values, scattered ones, none), nullable ints and strings: each against Series.isin."""
    rng = np.random.default_rng(5)
    words = np.array(["compute", "comm:tp", "p2p", "wait", None], dtype=object)
    for _ in range(200):
        n = int(rng.integers(0, 30))
        picked = words[rng.integers(0, len(words), n)]
        columns = [
            pd.Series(pd.Categorical(picked, categories=["compute", "comm:tp", "p2p", "wait", "unused"])),
            pd.Series(picked, dtype=object),
            pd.Series(rng.integers(-1, 6, n).astype(np.int32)),
            pd.Series(pd.array(np.where(rng.random(n) < 0.3, None, rng.integers(0, 4, n)), dtype="Int32")),
        ]
        for column in columns:
            if column.dtype.kind in "iu" or isinstance(column.dtype, pd.Int32Dtype):
                options = [[], [2], [1, 2, 3], [0, 3, 5], range(-1, 2)]
            else:
                options = [[], ["p2p"], ["compute", "wait", "absent"], [None], ["p2p", None]]
            values = options[int(rng.integers(0, len(options)))]
            want = column.isin(list(values)).to_numpy(bool)
            assert isin(column, values).tolist() == want.tolist(), (column.tolist(), values)
    many = pd.Series(pd.Categorical([f"k{i % 23}" if i % 7 else None for i in range(200)]))
    for values in ([f"k{i}" for i in range(0, 23, 2)], [f"k{i}" for i in range(9)] + [None], ["k3"]):
        assert isin(many, values).tolist() == many.isin(values).to_numpy(bool).tolist()


def test_budget_groups_start_a_group_where_the_budget_runs_out():
    assert budget_groups([], 5).tolist() == []
    assert budget_groups([3, 3, 3, 3], 6).tolist() == [0, 2]   # items begin at 0 3 | 6 9
    assert budget_groups([10, 1, 1], 4).tolist() == [0, 1]     # the large one alone
    assert budget_groups([2, 2, 2], 100).tolist() == [0]
    assert budget_groups([1, 1, 1], 1).tolist() == [0, 1, 2]
