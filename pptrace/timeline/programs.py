"""A measured step as replay programs: every rank's main-thread work units (the ranges it ran
on its main thread: passes, p2p ops, waits, collectives) in their measured order, and that
step replayed with free p2p and no host gaps (``latency_free_ends``, the bubble's schedule
part). One selection of the main thread's work (``main_thread_work``) serves the replay, the
critical path and the what-if's measurements."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..schedules.replay import Msg, Op, replay
from ..vocab import COMM_CATEGORIES

#: The main thread's work units: what it replays and what a critical path runs through; a
#: collective after the pipeline window is not replayed (its wait for the last stage is what
#: the window ends on).
WORK_CATEGORIES = ("compute", "p2p", "wait", *COMM_CATEGORIES)


def main_thread_work(events: pd.DataFrame, steps=None, categories=WORK_CATEGORIES) -> np.ndarray:
    """Mask of the rows of ``events`` on a rank's main thread, of ``categories`` (None: any),
    in ``steps`` (None: any)."""
    keep = (events["lane"] == "main").to_numpy()
    if categories is not None:
        keep = keep & events["category"].isin(list(categories)).to_numpy()
    if steps is not None:
        keep = keep & events["step"].isin(list(steps)).to_numpy()
    return keep


def measured_programs(start, end, is_pp, index, bounds, messages: dict) -> list[list[Op]]:
    """Per rank of one step (``bounds``: where each rank's rows begin and end in the arrays,
    which hold that step's main-thread ranges inside its window, each rank's sorted by start
    then longest first), the ops it ran in its measured order: each top-level range a "run"
    of its measured duration (ns; ranges inside a pass are part of the pass), each matched
    pipeline p2p op (``is_pp``) a "post" where it began and a "wait" where it ended. Ranges
    nested in an open p2p op (ZB-H1's W passes, Megatron's overlap_p2p_comm) so run between
    posting and waiting, as they did. ``messages``: event index -> the Msgs of its matched
    pairs (``pair_messages``); an unmatched op has nobody to wait for and is left out."""
    return [_measured_program(start[a:b], end[a:b], is_pp[a:b], index[a:b], messages)
            for a, b in zip(bounds[:-1], bounds[1:])]


def _measured_program(start, end, is_pp, index, messages: dict) -> list[Op]:
    # top-level: begins at or after the end of every earlier range that is not a p2p op
    reach = np.maximum.accumulate(np.where(is_pp, np.iinfo(np.int64).min, end))
    top = ~is_pp & (start >= np.concatenate(([np.iinfo(np.int64).min], reach[:-1])))
    post, run = np.flatnonzero(is_pp), np.flatnonzero(top)
    # at one instant a range that ends there comes before one that begins there, except a
    # range's own end, which follows its beginning
    time = np.concatenate((start[post], end[post], start[run]))
    klass = np.concatenate((np.ones(post.size, np.int64), np.where(end[post] > start[post], 0, 2),
                            np.ones(run.size, np.int64)))
    row = np.concatenate((post, post, run))
    order = np.lexsort((row, klass, time))
    kind = np.repeat([0, 1, 2], [post.size, post.size, run.size])[order].tolist()
    row = row[order].tolist()
    index, duration = index.tolist(), (end - start).tolist()
    return [Op("post", msgs=messages[index[i]], handle=index[i]) if k == 0
            else Op("wait", handle=index[i]) if k == 1 else Op("run", duration=duration[i])
            for k, i in zip(kind, row)]


def pair_messages(pairs: pd.DataFrame) -> dict:
    """Event index -> the Msgs (one per matched pair it is a side of) it posts."""
    out: dict = {}
    tags = [pd.to_numeric(pairs[c], errors="coerce").fillna(-1).astype(np.int64).tolist()
            for c in ("src", "dst", "mb", "chunk", "send_index", "recv_index")]
    for pair, (direction, src, dst, mb, chunk, send, recv) in enumerate(zip(pairs["direction"].astype(str), *tags)):
        for index, is_send in ((send, True), (recv, False)):
            out[index] = out.get(index, ()) + (Msg(direction, is_send, src, dst, mb, chunk, pair),)
    return out


def latency_free_ends(run, pairs: pd.DataFrame, windows: dict) -> dict:
    """step -> the end of that step's pipeline window (ns, measured clock; ``windows``: step
    -> (start, end)) had p2p been free and host gaps zero: the step's measured programs
    replayed with their pass durations, zero latency and eager sends, every rank starting
    at the window's start. Steps the replay cannot follow (a wait whose matched peer op is
    never posted) are left out.

    Free p2p is the schedule's pure data dependencies (the closed forms' model): a recv
    completes the moment its matched send has been posted, and a send never holds its
    sender. gloo's and NCCL's sends do wait for their recv to be posted, and a trainer that
    waits on its sends (Megatron's combined ops) or whose integration closes a send's range
    only when it next looks (torch's runtime schedules wait on sends at the end of the step)
    shows that wait; it is owed to the transport's rendezvous, not to the order of the passes.

    The replay keeps what the schedule and the measured pass times decide and drops what
    latency and host gaps added, including their knock-on effects: a pass that started
    before a late message arrived and then held it up (ZB-H1 places its W passes to fill the
    bubble of a latency-free pipeline) starts where it would have without the latency. A
    critical-path sum of transfers and gaps misses those."""
    ev = run.events
    steps = list(windows)
    keep = main_thread_work(ev, steps)
    messages = pair_messages(pairs[pairs["step"].isin(steps).to_numpy()])
    work = ev[keep]
    step = work["step"].to_numpy(np.int64)
    start, end = work["start_ns"].to_numpy(np.int64), work["end_ns"].to_numpy(np.int64)
    # each step's ranges inside its window, as one selection (not a frame per rank and step)
    known = np.array(sorted(windows), np.int64)
    at = np.searchsorted(known, step)
    lo = np.array([windows[int(s)][0] for s in known], np.int64)[at]
    hi = np.array([windows[int(s)][1] for s in known], np.int64)[at]
    inside = np.flatnonzero((start >= lo) & (end <= hi))
    rank, step, start, end = work["rank"].to_numpy(np.int64)[inside], step[inside], start[inside], end[inside]
    index = work.index.to_numpy()[inside]
    is_pp = ((work["category"] == "p2p") & (work["kind"] == "pp")).to_numpy()[inside] \
        & np.isin(index, np.fromiter(messages, np.int64, len(messages)))
    # by step, rank, start, longest first; stable: equal spans keep the trace's order
    order = np.lexsort((-end, start, rank, step))
    rank, step, start, end, index, is_pp = (a[order] for a in (rank, step, start, end, index, is_pp))
    cuts = np.flatnonzero((np.diff(step) != 0) | (np.diff(rank) != 0)) + 1
    groups = np.concatenate(([0], cuts, [step.size])) if step.size else np.zeros(1, np.int64)
    group_step = step[groups[:-1]]
    out = {}
    for s in np.unique(work["step"].to_numpy(np.int64)).tolist():  # a step with none inside replays empty
        mine = np.flatnonzero(group_step == s)
        bounds = np.append(groups[mine], groups[mine[-1] + 1]) if mine.size else np.zeros(1, np.int64)
        # Durations in integer ns and clocks from 0 at the window's start: exact sums.
        try:
            rows = replay(measured_programs(start, end, is_pp, index, bounds, messages),
                          lambda op, stage: op.duration, lambda msg: 0, sends="eager")
        except ValueError:
            continue
        out[int(s)] = windows[int(s)][0] + max((row[5] for row in rows), default=0)
    return out
