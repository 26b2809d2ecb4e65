"""Sort keys for many lanes at once: searching every thread's (or rank's) timeline with one
searchsorted instead of one search per lane.

A time is offset by its lane: ``lane * span + (time - first)`` sorts as (lane, time), and a
lane's keys all lie above those of the lanes before it, so a running maximum never leaks
from one lane into the next. Where lanes x span would pass int64, the time's dense rank
among all the times involved stands in for it (a sort).

Also :func:`isin`, the whole-column membership test the analyses make of the events table,
and :func:`budget_groups`, how whole ranks are cut into passes of bounded memory.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def dense_ranks(*arrays) -> tuple[list, int]:
    """The dense ranks of the values of all ``arrays`` together (one array per input), and
    a size above every rank: ``lane * size + rank`` sorts as (lane, value)."""
    values = np.concatenate([np.asarray(a, np.int64) for a in arrays])
    if not len(values):
        return [np.zeros(0, np.int64) for _ in arrays], 1
    # a stable argsort, not np.unique's quicksort: times come in sorted runs, which it merges
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    rank = np.r_[0, np.cumsum(ordered[1:] != ordered[:-1])]
    inv = np.empty(len(values), np.int64)
    inv[order] = rank
    return np.split(inv, np.cumsum([len(a) for a in arrays])[:-1]), int(rank[-1]) + 2


def isin(column, values) -> np.ndarray:
    """``column.isin(values)`` as a bool array, without hashing every row as pandas does
    (2-3 ms per 400k rows, and an analysis tests the events table some twenty times): a
    categorical column tests its categories and then compares each row's code with the few
    codes that passed (indexing by the codes would widen them to intp first: 5x the time);
    an integer one tests a range where the values are consecutive (steps), else np.isin."""
    values = list(values)
    if isinstance(column, pd.Series) and isinstance(column.dtype, pd.CategoricalDtype):
        hit = np.empty(len(column.cat.categories) + 1, bool)
        hit[:-1] = column.cat.categories.isin(values)
        hit[-1] = any(v is None or (isinstance(v, float) and np.isnan(v)) for v in values)  # a null's code, -1
        codes = column.cat.codes.to_numpy()
        passed = np.flatnonzero(hit)
        if len(passed) > 8:
            return hit[codes]
        out = np.zeros(len(codes), bool)
        for code in passed:
            out |= codes == (-1 if code == len(hit) - 1 else code)
        return out
    array = column.to_numpy() if isinstance(column, pd.Series) else np.asarray(column)
    if array.dtype.kind not in "iu" or not all(isinstance(v, (int, np.integer)) for v in values):
        return (column if isinstance(column, pd.Series) else pd.Series(array)).isin(values).to_numpy(bool)
    if not values:
        return np.zeros(len(array), bool)
    lo, hi = int(min(values)), int(max(values))
    if hi - lo + 1 == len(set(values)):
        return (array >= lo) & (array <= hi)
    return np.isin(array, np.asarray(values, np.int64))


def budget_groups(sizes, budget: int) -> np.ndarray:
    """Where each group of consecutive items begins (their indices), the items of ``sizes``
    taken in order about ``budget`` at a time (one larger than it alone): the passes over
    whole ranks that keep an analysis' temporaries bounded whatever the run's size."""
    sizes = np.asarray(sizes, np.int64)
    if not len(sizes):
        return np.zeros(0, np.int64)
    group = (np.cumsum(sizes) - sizes) // max(int(budget), 1)  # where each item begins, in budgets
    return np.flatnonzero(np.r_[True, group[1:] != group[:-1]])


def ascending(*keys) -> bool:
    """Whether the rows already come in the order of ``keys`` (the first the major key), so
    that a sort by them (stable, or np.lexsort of the keys reversed) would keep them as they
    are. Tables often arrive so (by rank, then time): a check is one pass, a sort is not."""
    tied = np.ones(max(len(keys[0]) - 1, 0), bool)
    for key in keys:
        key = np.asarray(key)
        if (tied & (key[1:] < key[:-1])).any():
            return False
        tied &= key[1:] == key[:-1]
    return True


def lane_keys(lanes: list, times: list) -> list:
    """int64 keys that sort as (lane, time) across all the arrays given (lanes >= 0: a
    thread, a rank), one key array per (lane, time) pair of arrays."""
    lanes, times = [np.asarray(a, np.int64) for a in lanes], [np.asarray(t, np.int64) for t in times]
    full = [t for t in times if len(t)]
    if full:
        lo, hi = min(int(t.min()) for t in full), max(int(t.max()) for t in full)
        top = max((max(abs(int(a.min())), abs(int(a.max()))) for a in lanes if len(a)), default=0)
        if (top + 1) * (hi - lo + 1) < 2**62:  # times themselves fit: no sort needed to rank them
            return [lane * (hi - lo + 1) + (t - lo) for lane, t in zip(lanes, times)]
    ranks, size = dense_ranks(*times)
    return [lane * size + rank for lane, rank in zip(lanes, ranks)]


def reach_before(lane, end) -> np.ndarray:
    """For rows sorted by lane (then start): the latest end among the rows before each one
    in its lane, the int64 minimum for a lane's first row. On a thread whose ranges nest, a
    range lies inside an earlier one exactly when this reaches its own end."""
    lane, end = np.asarray(lane), np.asarray(end, np.int64)
    if not len(end):
        return np.zeros(0, np.int64)
    reach = running_max(lane, end)
    before = np.r_[np.iinfo(np.int64).min, reach[:-1]]
    before[np.r_[True, lane[1:] != lane[:-1]]] = np.iinfo(np.int64).min
    return before


def running_max(lane, values) -> np.ndarray:
    """For rows sorted by lane: the largest value of the lane up to and including each row.
    Where the lanes ascend from 0 and lane x span fits, one np.maximum.accumulate over the
    lane-offset values (this module's keys: no lane leaks into the next), in place, at two
    int64 rows of memory; else a groupby (a hash of the lanes, several rows more)."""
    lane, values = np.asarray(lane), np.asarray(values, np.int64)
    if len(values) and lane.dtype.kind in "iu" and int(lane[0]) >= 0 and ascending(lane):
        lo, top = int(values.min()), int(lane[-1])
        span = int(values.max()) - lo + 1
        if (top + 1) * span < 2**62:
            offset = lane.astype(np.int64) * span - lo
            key = values + offset
            np.maximum.accumulate(key, out=key)
            key -= offset
            return key
    return pd.Series(values).groupby(lane).cummax().to_numpy(np.int64)


def dominance_max(p_group, p_lo, p_hi, p_w, q_group, q_lo, q_hi) -> np.ndarray:
    """Per query, the largest weight p_w (>= 0) among the points of its group with
    p_lo <= q_lo and p_hi >= q_hi; -1 where none: which intervals contain a time (q_hi =
    q_lo + 1) or an interval.

    Points sorted by (group, lo) are cut into aligned blocks of 2**level: the points of a
    query (its group's, up to q_lo) are one run of positions, the union of O(log n) blocks,
    and within a block, points sorted by hi answer with a suffix maximum."""
    out = np.full(len(q_lo), -1, np.int64)
    n = len(p_lo)
    if n == 0 or len(q_lo) == 0:
        return out
    order = np.lexsort((p_lo, p_group))
    p_group, p_lo, p_hi, p_w = p_group[order], p_lo[order], p_hi[order], p_w[order]
    (lo_p, lo_q), lo_size = dense_ranks(p_lo, q_lo)
    left = np.searchsorted(p_group, q_group, "left")
    right = np.searchsorted(p_group * lo_size + lo_p, q_group * lo_size + lo_q, "right")
    (hi_p, hi_q), hi_size = dense_ranks(p_hi, q_hi)
    span = int(p_w.max()) + 1
    pos = np.arange(n)
    level = 0
    order = pos
    while (left < right).any():
        block = pos >> level
        # the last level's order holds each block's two halves sorted: a stable sort of the
        # keys in that order is one merge per block (timsort), not a sort from scratch, and
        # ties stay in position order as they would
        key = (block * hi_size + hi_p)[order]
        by = np.argsort(key, kind="stable")
        order, key = order[by], key[by]
        blk = block[order]
        # suffix maxima within blocks; reversed, each block is offset above the ones after it
        shift = (blk[-1] + 1 - blk) * span
        suffix = np.maximum.accumulate((p_w[order] + shift)[::-1])[::-1] - shift

        def probe(take, b):  # the queries ``take`` read block b of this level
            j = np.searchsorted(key, b * hi_size + hi_q[take], "left")
            j_in = np.minimum(j, n - 1)
            ok = (j < n) & (blk[j_in] == b)
            rows = np.flatnonzero(take)[ok]
            out[rows] = np.maximum(out[rows], suffix[j_in[ok]])

        # the usual bottom-up walk of a segment tree over [left, right)
        active = left < right
        take = active & (left & 1 == 1)
        probe(take, left[take])
        left[take] += 1
        take = active & (right & 1 == 1)
        right[take] -= 1
        probe(take, right[take])
        left >>= 1
        right >>= 1
        level += 1
    return out


def cover_max(p_group, p_lo, p_hi, p_w, q_group, q_t) -> np.ndarray:
    """Per query time ``q_t``, the largest weight p_w (>= 0) among the intervals [p_lo, p_hi)
    of its group that contain it; -1 where none does: ``dominance_max`` of the point
    [q_t, q_t + 1), in O((n + q) log n) array work and two rows of memory.

    The groups' distinct bounds cut their time into pieces; an interval covers a run of
    pieces, which two aligned-length blocks (one from each end, overlapping) cover exactly,
    as a sparse table covers a range. Each interval raises its two blocks, then each level
    hands its maxima down to the two halves of its blocks, so the bottom row holds, per
    piece, the largest weight over it; a query reads the piece it falls in."""
    p_group, p_lo, p_hi, p_w = (np.asarray(a, np.int64) for a in (p_group, p_lo, p_hi, p_w))
    q_group, q_t = np.asarray(q_group, np.int64), np.asarray(q_t, np.int64)
    real = p_hi > p_lo
    p_group, p_lo, p_hi, p_w = p_group[real], p_lo[real], p_hi[real], p_w[real]
    out = np.full(len(q_t), -1, np.int64)
    if not len(p_lo) or not len(q_t):
        return out
    lo_key, hi_key, q_key = lane_keys([p_group, p_group, q_group], [p_lo, p_hi, q_t])
    # stable: numpy's merge sort takes the runs the keys come in (by group, then start) as they
    # are, ~6x quicker than its quicksort on such keys; the values sort the same either way
    bounds = np.sort(np.r_[lo_key, hi_key], kind="stable")
    bounds = bounds[np.r_[True, bounds[1:] != bounds[:-1]]]  # not np.unique: numpy 2's hashes 10x slower here
    first, stop = np.searchsorted(bounds, lo_key), np.searchsorted(bounds, hi_key)  # pieces [first, stop)
    level = np.frexp((stop - first).astype(np.float64))[1].astype(np.int64) - 1  # floor(log2), exactly
    order = np.argsort(level, kind="stable")
    level, w = level[order], p_w[order]
    at, at2 = first[order], stop[order] - np.left_shift(1, level)  # a block from each end
    cuts = np.searchsorted(level, np.arange(int(level[-1]) + 2))
    row = np.full(len(bounds), -1, np.int64)
    for k in range(int(level[-1]), -1, -1):
        if k < int(level[-1]):  # the level above hands each block's maximum to its two halves
            half = 1 << k
            # in place (numpy buffers the overlap), not a fresh row per level
            np.maximum(row[half:], row[:-half], out=row[half:])
        a, b = cuts[k], cuts[k + 1]
        np.maximum.at(row, at[a:b], w[a:b])
        np.maximum.at(row, at2[a:b], w[a:b])
    piece = np.searchsorted(bounds, q_key, side="right") - 1
    # a piece ending a group's last bound is covered by none of its intervals, so a query
    # past (or before) every bound of its group reads -1 there
    ok = piece >= 0
    out[ok] = row[piece[ok]]
    return out


def inside(lane, start, end, o_lane, o_start, o_end) -> np.ndarray:
    """Per row (``lane``, ``start``, ``end``): whether it lies inside one of the outer spans
    of its lane (``o_*``; on one lane those nest or are disjoint, as one thread's ranges)."""
    lane, start, end = (np.asarray(a, np.int64) for a in (lane, start, end))
    if not len(o_start) or not len(start):
        return np.zeros(len(start), bool)
    order = np.lexsort((np.asarray(o_start, np.int64), np.asarray(o_lane, np.int64)))
    o_lane = np.asarray(o_lane, np.int64)[order]
    o_s_key, o_e_key, s_key, e_key = lane_keys([o_lane, o_lane, lane, lane],
                                               [np.asarray(o_start, np.int64)[order],
                                                np.asarray(o_end, np.int64)[order], start, end])
    reach = np.maximum.accumulate(o_e_key)  # a lane's keys exceed those before it: stays in its lane
    j = np.searchsorted(o_s_key, s_key, side="right") - 1
    k = np.clip(j, 0, None)
    return (j >= 0) & (o_lane[k] == lane) & (e_key <= reach[k])
