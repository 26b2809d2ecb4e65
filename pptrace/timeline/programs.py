"""A measured step as replay programs: every rank's main-thread work units (the ranges it ran
on its main thread: passes, p2p ops, waits, collectives) in their measured order, and that
step replayed with free p2p and no host gaps (``latency_free_lengths``, the bubble's schedule
part). One selection of the main thread's work (``main_thread_work``) serves the replay, the
critical path and the what-if's measurements."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweeps import isin, reach_before, running_max
from ..vocab import COMM_CATEGORIES
from .windows import pipeline_passes

#: The main thread's work units: what it replays and what a critical path runs through; a
#: collective after the pipeline window is not replayed (its wait for the last stage is what
#: the window ends on).
WORK_CATEGORIES = ("compute", "p2p", "wait", *COMM_CATEGORIES)


def main_thread_work(events: pd.DataFrame, steps=None, categories=WORK_CATEGORIES) -> np.ndarray:
    """Mask of the rows of ``events`` on a rank's main thread, of ``categories`` (None: any),
    in ``steps`` (None: any)."""
    keep = (events["lane"] == "main").to_numpy()
    if categories is not None:
        keep = keep & isin(events["category"], categories)
    if steps is not None:
        keep = keep & isin(events["step"], steps)
    return keep


def latency_free_lengths(run, pairs: pd.DataFrame, spans: dict) -> dict:
    """step -> how long that step's pipeline window (its first pass's start to its last
    pass's end, ns) would have lasted had p2p been free and host gaps zero: the step's
    measured programs (the ranges inside ``spans``: step -> (start, end) of its pipeline
    ops, run.pipeline_spans, so that a recv posted before the first pass and a send waited
    on after the last are in them) replayed with their pass durations, zero latency and
    eager sends, every rank starting at once. Steps the replay cannot follow (a wait whose
    matched peer op is never posted: a deadlock) are left out.

    Each rank's measured program is the ranges it ran on its main thread in their measured
    order: each top-level range a "run" of its measured duration (ranges inside a pass are
    part of the pass), each matched pipeline p2p op a "post" where it began and a "wait"
    where it ended. Ranges nested in an open p2p op (ZB-H1's W passes, Megatron's
    overlap_p2p_comm) so run between posting and waiting, as they did.

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
    critical-path sum of transfers and gaps misses those.

    It is what :func:`~pptrace.schedules.replay.replay` gives these programs (eager sends, no
    latency), computed for every rank and step at once: an op's clock is its program's
    running sum of durations, raised by the latest wait that held it up, so a program's
    clocks are one running maximum; the waits whose senders' posts are settled settle each
    round, and a round settles at least one wait, so the rounds number the longest chain of
    messages, not the ops."""
    ev = run.events
    steps = list(spans)
    keep = main_thread_work(ev, steps)
    sel = pairs[pairs["step"].isin(steps).to_numpy()]
    send_of = pd.to_numeric(sel["send_index"], errors="coerce").fillna(-1).to_numpy(np.int64)
    recv_of = pd.to_numeric(sel["recv_index"], errors="coerce").fillna(-1).to_numpy(np.int64)
    work = ev.loc[keep, ["rank", "step", "start_ns", "end_ns", "category", "kind", "op"]]
    step = work["step"].to_numpy(np.int64)
    start, end = work["start_ns"].to_numpy(np.int64), work["end_ns"].to_numpy(np.int64)
    # each step's ranges inside its window, as one selection (not a frame per rank and step)
    known = np.array(sorted(spans), np.int64)
    at = np.searchsorted(known, step)
    lo = np.array([spans[int(s)][0] for s in known], np.int64)[at]
    hi = np.array([spans[int(s)][1] for s in known], np.int64)[at]
    inside = np.flatnonzero((start >= lo) & (end <= hi))
    rank, step, start, end = work["rank"].to_numpy(np.int64)[inside], step[inside], start[inside], end[inside]
    index = work.index.to_numpy()[inside]
    is_pp = ((work["category"] == "p2p") & (work["kind"] == "pp")).to_numpy()[inside] \
        & np.isin(index, np.r_[send_of, recv_of])
    is_pass = pipeline_passes(work)[inside]
    # by step, rank, start, longest first; stable: equal spans keep the trace's order
    order = np.lexsort((-end, start, rank, step))
    rank, step, start, end, index, is_pp, is_pass = (a[order] for a in (rank, step, start, end, index, is_pp, is_pass))
    program = np.cumsum(np.r_[False, (np.diff(step) != 0) | (np.diff(rank) != 0)]) if len(step) else step

    # -- every program's ops: a post and a wait per p2p op, a run per top-level range ----
    # top-level: begins at or after the end of every earlier range that is not a p2p op
    top = ~is_pp & (start >= reach_before(program, np.where(is_pp, np.iinfo(np.int64).min, end)))
    post, runs = np.flatnonzero(is_pp), np.flatnonzero(top)
    # at one instant a range that ends there comes before one that begins there, except a
    # range's own end, which follows its beginning
    row = np.r_[post, post, runs]
    klass = np.r_[np.ones(len(post), np.int64), np.where(end[post] > start[post], 0, 2), np.ones(len(runs), np.int64)]
    op_kind = np.repeat([_POST, _WAIT, _RUN], [len(post), len(post), len(runs)])
    order = np.lexsort((row, klass, np.r_[start[post], end[post], start[runs]], program[row]))
    row, op_kind = row[order], op_kind[order]
    op_program = program[row]
    duration = np.where(op_kind == _RUN, end[row] - start[row], 0)
    # clocks from 0 at the replay's start, durations in integer ns: exact sums
    ran = np.cumsum(duration)
    first = np.r_[True, op_program[1:] != op_program[:-1]] if len(row) else np.zeros(0, bool)
    ran -= np.maximum.accumulate(np.where(first, ran - duration, 0))  # restart at each program

    # -- each recv's wait on its sender's post ----------------------------------------------
    op_of = {kind: pd.Series(np.flatnonzero(op_kind == kind), index=index[row[op_kind == kind]])
             for kind in (_POST, _WAIT)}
    wait_op = op_of[_WAIT].reindex(recv_of).to_numpy()
    post_op = op_of[_POST].reindex(send_of).to_numpy()
    edge = ~np.isnan(wait_op)
    wait_op, post_op = wait_op[edge].astype(np.int64), post_op[edge]
    # a sender not replayed, or replayed in another step, is never posted: that wait blocks
    never = np.isnan(post_op)
    post_op = np.where(never, 0, post_op).astype(np.int64)
    never |= step[row[post_op]] != step[row[wait_op]]

    blocked = np.zeros(len(row), bool)
    blocked[wait_op] = True
    held = np.zeros(len(row), np.int64)  # what settled waits wait for (0: nothing)
    while True:
        clock = ran + np.maximum(running_max(op_program, held - ran), 0)
        # an op's clock is settled when no wait before it in its program is still blocked
        settled = running_max(op_program, blocked.astype(np.int64)) == 0
        ready = ~never & settled[post_op]
        # a wait settles once every one of its senders has posted
        unready = np.zeros(len(row), bool)
        unready[wait_op[~ready]] = True
        newly = blocked & ~unready
        if not newly.any():
            break
        now = newly[wait_op]  # (every edge of a newly settled wait is ready)
        np.maximum.at(held, wait_op[now], clock[post_op[now]])
        blocked &= ~newly
    # (the round that found nothing new computed the clocks from the final ``held``)

    # -- per step: its last pass's clock; a step with a wait that never settled deadlocked --
    out = {}
    stuck = set(step[row[blocked]].tolist())
    last = np.zeros(len(known), np.int64)
    ends = (op_kind == _RUN) & is_pass[row]  # a run's clock is where it ends
    np.maximum.at(last, np.searchsorted(known, step[row[ends]]), clock[ends])
    for s in np.unique(work["step"].to_numpy(np.int64)).tolist():  # a step with none inside replays empty
        if s not in stuck:
            out[int(s)] = int(last[np.searchsorted(known, s)])
    return out


_POST, _WAIT, _RUN = 0, 1, 2
