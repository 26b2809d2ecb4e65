"""p2p exchanges, and how long each message waited and moved: the one place these rules live.

A rank blocks in *exchanges*: one op posts one or more messages and waits for all of them.
Megatron's combined ops (send_forward_recv_backward, the interleaved four-way exchange) open
one range per message inside the op's and close them in reverse order, so an exchange is the
ranges *nested* in its first one. A range that outlives the open exchange belongs to an op
posted meanwhile: Megatron's overlap_p2p_comm keeps a forward and a backward exchange open at
once, each waited on its own (their ranges overlap without nesting); posted at one instant,
the one waited first comes first.

A recv posted before its send sits waiting for the peer: that part is bubble, not
communication (Megatron's p2p timers mix the two). Once both sides have posted, the data
moves until the first side is done: the transfer. An exchange cannot move on before its
*last* message had both sides posted, so until then it waits, even while an earlier-matched
message moves (the simulator's rendezvous model).

The loader's pairs carry the result (``pptrace.run.match``); the report's split
(analyzers/p2p.py), the what-if latencies and the critical path group by the same ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .intervals import Axes, flat, union_by_group
from ..sweeps import reach_before

#: What :func:`wait_transfer` adds to pairs.
TIMED_COLUMNS = ("wait_ns", "transfer_ns", "send_exchange", "recv_exchange")
#: ``ready`` of a range with no matched peer: it never holds its exchange back.
UNMATCHED = np.iinfo(np.int64).min


def exchange_ids(rank, start, end, kind=None) -> np.ndarray:
    """Per p2p range, the id of its exchange (0, 1, ... in order of rank, kind, start).

    Ranges of different ranks, or of different kinds (a rank's pp and cp ops), never share one.
    Ties in start go shorter first: of two ops posted at one instant, the one waited first is
    its own exchange, not a range nested in the other."""
    rank = np.asarray(rank, np.int64)
    start, end = np.asarray(start, np.int64), np.asarray(end, np.int64)
    n = len(rank)
    if not n:
        return np.zeros(0, np.int64)
    lane = rank if kind is None else rank * (n + 1) + pd.factorize(np.asarray(kind, dtype=object))[0]
    order = np.lexsort((end, start, lane))
    lane, start, end = lane[order], start[order], end[order]
    # The open exchange's first range is the latest-ending so far: a range that opens a new
    # exchange ends after every earlier one, and the others end within it. So "nested in the
    # open exchange" is "starts before and ends no later than everything so far" (a lane's
    # first range: nothing before it, a head).
    before = reach_before(lane, end)
    head = (start >= before) | (end > before)
    ids = np.empty(n, np.int64)
    ids[order] = np.cumsum(head) - 1
    return ids


def latest(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per range, the largest ``values`` over its exchange."""
    if not len(ids):
        return np.zeros(0, np.int64)
    top = np.full(int(ids.max()) + 1, UNMATCHED, dtype=np.int64)
    np.maximum.at(top, ids, values)
    return top[ids]


def moving(pairs: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """When each pair's data moves: from both posted to the first side done — or, when the
    send completed before the recv was even posted (an eager send, buffered by the
    transport), the whole recv, which then only copies."""
    send_start, send_end = pairs["send_start_ns"].to_numpy(np.int64), pairs["send_end_ns"].to_numpy(np.int64)
    recv_start, recv_end = pairs["recv_start_ns"].to_numpy(np.int64), pairs["recv_end_ns"].to_numpy(np.int64)
    t0 = np.maximum(send_start, recv_start)
    t1 = np.where(send_end < recv_start, recv_end, np.minimum(send_end, recv_end))
    return t0, np.maximum(t1, t0)


def sides_ready(pairs: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(send side, recv side): when each message lets the exchange holding that side move on
    (:attr:`Ranges.ready`)."""
    send_start, send_end = pairs["send_start_ns"].to_numpy(np.int64), pairs["send_end_ns"].to_numpy(np.int64)
    recv_start = pairs["recv_start_ns"].to_numpy(np.int64)
    both = np.maximum(send_start, recv_start)
    return np.where(send_end < recv_start, send_start, both), both


@dataclass(frozen=True)
class Ranges:
    """Every pair's send range, then every recv range, then the unmatched ranges."""

    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray
    #: when the message lets the exchange holding that range move on: once both sides posted;
    #: for a send the transport buffered (done before its recv was posted), at once: it holds
    #: nothing up; never for an unmatched range
    ready: np.ndarray
    exchange: np.ndarray

    def last(self, kernels: bool) -> np.ndarray:
        """Per range, when its exchange had every message ready. NCCL kernels (GPU traces)
        form no exchanges: kernels on other streams, or the ops of one coalesced kernel, move
        data independently, each once its two kernels started."""
        return self.ready if kernels else latest(self.exchange, self.ready)


def ranges(pairs: pd.DataFrame, free: pd.DataFrame | None = None) -> Ranges:
    """The p2p ranges of ``pairs`` (both sides) and ``free`` (unmatched ranges: rank, start_ns,
    end_ns, and kind where pairs have it) with their exchanges. Unmatched ranges count in the
    grouping: they are ops of the rank like the others."""
    free = free if free is not None else pd.DataFrame({"rank": [], "start_ns": [], "end_ns": []})
    rank = np.concatenate([pairs["src"], pairs["dst"], free["rank"]]).astype(np.int64)
    start = np.concatenate([pairs["send_start_ns"], pairs["recv_start_ns"], free["start_ns"]]).astype(np.int64)
    end = np.concatenate([pairs["send_end_ns"], pairs["recv_end_ns"], free["end_ns"]]).astype(np.int64)
    ready = np.concatenate([*sides_ready(pairs), np.full(len(free), UNMATCHED)]).astype(np.int64)
    kind = None
    if "kind" in pairs.columns:
        free_kind = free["kind"] if "kind" in free.columns else np.full(len(free), None)
        kind = np.concatenate([pairs["kind"].astype(object), pairs["kind"].astype(object),
                               np.asarray(free_kind, dtype=object)])
    return Ranges(rank, start, end, ready, exchange_ids(rank, start, end, kind))


def wait_transfer(pairs: pd.DataFrame, free: pd.DataFrame | None = None, busy: dict | None = None,
                  kernels: bool = False) -> pd.DataFrame:
    """``pairs`` with wait_ns, transfer_ns and each side's exchange (send_exchange,
    recv_exchange; ids of :func:`exchange_ids` over these pairs and the unmatched ranges
    ``free``).

    wait_ns: how long the recv was posted before the send, less the time the receiver spent
    in its own passes meanwhile (a recv posted early and waited later, as torch.distributed.
    pipelining and overlap_p2p_comm do, waits only while the receiver has nothing else to
    do). transfer_ns: how long the data moved: from both posted (see :func:`moving`) to the
    first side done, but not before the exchange of that first side had all its messages
    matched — until then it was waiting for another message, and its end says nothing about
    this one before. ``busy``: rank -> Intervals of its passes. A pass run between posting
    and waiting (ZB-H1's W, overlap_p2p_comm) hides when the message landed: only the time
    that side was not computing counts, the transfer it exposed. ``kernels``: the sides are
    NCCL kernels (GPU traces), and the earlier of two spins until its peer's starts, a send
    as much as a recv: wait_ns is the gap between their starts (0 for a send done before its
    recv began); no exchange holds a message back (:meth:`Ranges.last`)."""
    n = len(pairs)
    t0, t1 = moving(pairs)
    found = ranges(pairs, free)
    last = found.last(kernels)
    send_end = pairs["send_end_ns"].to_numpy(np.int64)
    send_first = send_end == t1
    a = np.minimum(np.maximum(t0, np.where(send_first, last[:n], last[n:2 * n])), t1)
    transfer = t1 - a
    send_start = pairs["send_start_ns"].to_numpy(np.int64)
    recv_start = pairs["recv_start_ns"].to_numpy(np.int64)
    posted = np.maximum(send_start, recv_start)
    wait = posted - recv_start
    if kernels:
        wait = np.where(send_end < recv_start, 0, posted - np.minimum(send_start, recv_start))
    if busy:
        src, dst = pairs["src"].to_numpy(np.int64), pairs["dst"].to_numpy(np.int64)
        _less_busy(transfer, np.where(send_first, src, dst), a, t1, busy)
        _less_busy(wait, dst, recv_start, posted, busy)
    return pairs.assign(wait_ns=wait, transfer_ns=transfer,
                        send_exchange=found.exchange[:n], recv_exchange=found.exchange[n:2 * n])


def _less_busy(span: np.ndarray, rank: np.ndarray, start: np.ndarray, end: np.ndarray, busy: dict) -> None:
    """span -= the part of [start, end) that ``rank`` spent in its own passes (in place):
    every rank's passes on an axis of its own, one search for all the spans."""
    group, b_start, b_end = flat(busy)
    if not len(group) or not len(span):
        return
    lo = min(int(b_start.min()), int(np.min(start)))
    hi = max(int(b_end.max()), int(np.max(end)))
    known = np.isin(rank, np.asarray(list(busy), np.int64))  # a rank with no passes loses nothing
    axes = Axes.over(int(max(group.max(), rank.max())) + 1, lo, hi)
    span[known] -= axes.covered_at(axes.place(group, b_start, b_end), rank[known], start[known], end[known])


def on_gpu(events: pd.DataFrame) -> bool:
    """Whether the p2p ranges are NCCL kernels' GPU extents (see ``kernels`` above)."""
    return bool((events["lane_kind"] == "gpu").any())


def busy_intervals(events: pd.DataFrame) -> dict:
    """rank -> Intervals of its host passes; empty for GPU traces, whose host ranges only
    launch work (the p2p ranges there are GPU extents)."""
    if on_gpu(events):
        return {}
    sel = events.loc[(events["category"] == "compute").to_numpy() & (events["lane_kind"] == "host").to_numpy(),
                     ["rank", "start_ns", "end_ns"]]
    if sel.empty:
        return {}
    ranks, lane = np.unique(sel["rank"].to_numpy(), return_inverse=True)
    busy = union_by_group(len(ranks), lane, sel["start_ns"].to_numpy(np.int64), sel["end_ns"].to_numpy(np.int64))
    return {int(r): iv for r, iv in zip(ranks, busy)}
