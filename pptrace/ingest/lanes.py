"""Sort keys for many lanes at once: searching every thread's (or rank's) timeline with one
searchsorted instead of one search per lane.

A time is replaced by its dense rank among all the times involved, and the rank offset by
its lane: ``lane * size + rank`` then sorts as (lane, time), and a lane's keys all lie
above those of the lanes before it, so a running maximum never leaks from one lane into
the next.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def dense_ranks(*arrays) -> tuple[list, int]:
    """The dense ranks of the values of all ``arrays`` together (one array per input), and
    a size above every rank: ``lane * size + rank`` sorts as (lane, value)."""
    uniq, inv = np.unique(np.concatenate([np.asarray(a, np.int64) for a in arrays]), return_inverse=True)
    return np.split(inv.astype(np.int64), np.cumsum([len(a) for a in arrays])[:-1]), len(uniq) + 1


def lane_keys(lanes: list, times: list) -> list:
    """int64 keys that sort as (lane, time) across all the arrays given (lanes >= 0: a
    thread, a rank), one key array per (lane, time) pair of arrays."""
    ranks, size = dense_ranks(*times)
    return [np.asarray(lane, np.int64) * size + rank for lane, rank in zip(lanes, ranks)]


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
    """For rows sorted by lane: the largest value of the lane up to and including each row."""
    return pd.Series(np.asarray(values, np.int64)).groupby(np.asarray(lane)).cummax().to_numpy(np.int64)
