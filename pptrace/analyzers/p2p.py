"""Pipeline p2p: pair every send with its recv, split each side into wait and transfer,
and summarise per link (src -> dst).

A recv posted before the matching send sits waiting for the peer: that part is bubble,
not communication (Megatron's p2p timers mix the two). Once both sides have posted, the
data moves until the first side is done: that is the transfer. A send posted before its
recv waits the same way, and whatever follows the transfer inside a range is waiting too
(see split_by_rank).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..ingest.projection import gpu_extent
from ..ingest.intervals import Intervals, union
from ..ingest.runview import RunView

_DIRECTION = {"send_fwd": "fwd", "recv_fwd": "fwd", "send_bwd": "bwd", "recv_bwd": "bwd"}
PAIR_COLUMNS = (
    "src", "dst", "direction", "mb", "chunk", "step", "bytes", "send_index", "recv_index",
    "send_start_ns", "send_end_ns", "recv_start_ns", "recv_end_ns", "wait_ns", "transfer_ns",
)


def p2p_events(view: RunView) -> pd.DataFrame:
    """Host-side pipeline send/recv ranges with their direction and link end points."""
    ev = view.events
    sel = ev[(ev["category"] == "p2p") & (ev["lane_kind"] == "host") & ~ev["gpu_annotation"]
             & ev["op"].isin(list(_DIRECTION)) & ev["peer"].notna()]
    start, end, _ = gpu_extent(ev, sel)
    out = pd.DataFrame({
        "index": sel.index.to_numpy(),
        "rank": sel["rank"].to_numpy(np.int64),
        "is_send": sel["op"].astype(str).str.startswith("send").to_numpy(),
        "direction": sel["op"].astype(str).map(_DIRECTION).to_numpy(),
        "peer": sel["peer"].to_numpy(np.int64),
        "mb": sel["mb"].fillna(-1).to_numpy(np.int64),
        "chunk": sel["chunk"].fillna(-1).to_numpy(np.int64),
        "step": sel["step"].to_numpy(np.int64),
        "bytes": sel["bytes"].fillna(0).to_numpy(np.int64),
        "start_ns": start,  # GPU traces: the GPU-side extent (projection.py)
        "end_ns": end,
    })
    out["src"] = np.where(out["is_send"], out["rank"], out["peer"])
    out["dst"] = np.where(out["is_send"], out["peer"], out["rank"])
    return out


def match_pairs(view: RunView) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(pairs, unmatched p2p events). The loader's pairs (pptrace.ingest.match) when the view has
    them and they refer to its events; else sends and recvs pair here by (src, dst,
    direction, mb, chunk) and order of occurrence, the key the trainer's tags are made for."""
    ev = p2p_events(view).sort_values("start_ns", kind="stable")
    given = view.pairs
    if given is not None and {"send_index", "recv_index", "send_start_ns"} <= set(given.columns):
        given = given[given["kind"] == "pp"] if "kind" in given.columns else given
        known = set(ev["index"])
        if set(given["send_index"]) <= known and set(given["recv_index"]) <= known:
            paired = set(given["send_index"]) | set(given["recv_index"])
            out = _with_wait_transfer(given.reset_index(drop=True), _busy(view), _on_gpu(view))
            return out[[c for c in PAIR_COLUMNS if c in out.columns]], ev[~ev["index"].isin(paired)]
    key = ["src", "dst", "direction", "mb", "chunk"]
    ev["nth"] = ev.groupby(key + ["is_send"]).cumcount()
    sends, recvs = ev[ev["is_send"]], ev[~ev["is_send"]]
    pairs = sends.merge(recvs, on=key + ["nth"], suffixes=("_s", "_r"))
    paired = set(pairs["index_s"]) | set(pairs["index_r"])
    unmatched = ev[~ev["index"].isin(paired)]
    send_start, recv_start = pairs["start_ns_s"].to_numpy(), pairs["start_ns_r"].to_numpy()
    recv_end = pairs["end_ns_r"].to_numpy()
    out = pd.DataFrame({
        "src": pairs["src"], "dst": pairs["dst"], "direction": pairs["direction"],
        "mb": pairs["mb"], "chunk": pairs["chunk"], "step": pairs["step_r"],
        "bytes": np.maximum(pairs["bytes_s"], pairs["bytes_r"]),
        "send_index": pairs["index_s"], "recv_index": pairs["index_r"],
        "send_start_ns": send_start, "send_end_ns": pairs["end_ns_s"].to_numpy(),
        "recv_start_ns": recv_start, "recv_end_ns": recv_end,
    })
    return _with_wait_transfer(out, _busy(view), _on_gpu(view))[list(PAIR_COLUMNS)].reset_index(drop=True), unmatched


def _moving(pairs: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """When each pair's data moves: from both posted to the first side done — or, when the
    send completed before the recv was even posted (an eager send, buffered by the
    transport), the whole recv, which then only copies."""
    send_start, send_end = pairs["send_start_ns"].to_numpy(), pairs["send_end_ns"].to_numpy()
    recv_start, recv_end = pairs["recv_start_ns"].to_numpy(), pairs["recv_end_ns"].to_numpy()
    t0 = np.maximum(send_start, recv_start)
    t1 = np.where(send_end < recv_start, recv_end, np.minimum(send_end, recv_end))
    return t0, np.maximum(t1, t0)


_UNMATCHED = np.iinfo(np.int64).min


def _sides(pairs: pd.DataFrame) -> tuple[np.ndarray, ...]:
    """(rank, start, end, ready) of every pair's send range, then of every recv range.
    ``ready``: when the message lets the exchange holding that range move on — once both
    sides posted; for a send the transport buffered (done before its recv was posted), at
    once: it holds nothing up."""
    send_start, send_end = pairs["send_start_ns"].to_numpy(), pairs["send_end_ns"].to_numpy()
    recv_start, recv_end = pairs["recv_start_ns"].to_numpy(), pairs["recv_end_ns"].to_numpy()
    both = np.maximum(send_start, recv_start)
    both_sides = (
        (pairs["src"].to_numpy(), pairs["dst"].to_numpy()), (send_start, recv_start), (send_end, recv_end),
        (np.where(send_end < recv_start, send_start, both), both),
    )
    return tuple(np.concatenate(sides).astype(np.int64) for sides in both_sides)


def _exchanges(rank: np.ndarray, start: np.ndarray, end: np.ndarray, ready: np.ndarray) -> np.ndarray:
    """Per range, the latest ``ready`` of its exchange: one combined op posts several
    messages and waits for all of them, so its ranges nest in the first one (regions close in
    reverse order). A range that outlives the open exchange belongs to another op posted
    meanwhile: Megatron's overlap_p2p_comm keeps a forward and a backward exchange open at
    once, each waited on its own (posted at one instant, the one waited first comes first)."""
    last = np.empty(len(rank), dtype=np.int64)
    for r in np.unique(rank):
        mine = np.flatnonzero(rank == r)
        mine = mine[np.lexsort((end[mine], start[mine]))]
        group_of, first_end, groups = np.empty(len(mine), dtype=np.int64), None, -1
        for i, (s, e) in enumerate(zip(start[mine], end[mine])):
            if first_end is None or s >= first_end or e > first_end:
                groups, first_end = groups + 1, e
            group_of[i] = groups
        latest = np.full(groups + 1, np.iinfo(np.int64).min)
        np.maximum.at(latest, group_of, ready[mine])
        last[mine] = latest[group_of]
    return last


def _with_wait_transfer(pairs: pd.DataFrame, busy: dict | None = None, kernels: bool = False) -> pd.DataFrame:
    """wait_ns: how long the recv was posted before the send, less the time the receiver spent
    in its own passes meanwhile (a recv posted early and waited later, as torch.distributed.
    pipelining and overlap_p2p_comm do, waits only while the receiver has nothing else to
    do); transfer_ns: how long the data
    moved: from both posted (see _moving) to the first side done, but not before the
    exchange of that first side had all its messages matched — until then it was waiting
    for another message (split_by_rank), and its end says nothing about this one before.
    ``busy``: rank -> Intervals of its passes. A pass run between posting and waiting
    (ZB-H1's W, overlap_p2p_comm) hides when the message landed: only the time that side
    was not computing counts, the transfer it exposed. ``kernels``: the sides are NCCL kernels
    (GPU traces), and the earlier of two spins until its peer's starts, a send as much as a
    recv: wait_ns is the gap between their starts (0 for a send done before its recv began);
    kernels on other streams, or the ops of one coalesced kernel, move data independently:
    no exchange holds a message back."""
    t0, t1 = _moving(pairs)
    n = len(pairs)
    last = _sides(pairs)[3] if kernels else _exchanges(*_sides(pairs))
    send_first = pairs["send_end_ns"].to_numpy() == t1
    a = np.minimum(np.maximum(t0, np.where(send_first, last[:n], last[n:])), t1)
    transfer = t1 - a
    recv_start = pairs["recv_start_ns"].to_numpy()
    posted = np.maximum(pairs["send_start_ns"].to_numpy(), recv_start)
    wait = posted - recv_start
    if kernels:
        send_start, send_end = pairs["send_start_ns"].to_numpy(), pairs["send_end_ns"].to_numpy()
        wait = np.where(send_end < recv_start, 0, posted - np.minimum(send_start, recv_start))
    if busy:
        _less_busy(transfer, np.where(send_first, pairs["src"].to_numpy(), pairs["dst"].to_numpy()), a, t1, busy)
        _less_busy(wait, pairs["dst"].to_numpy(), recv_start, posted, busy)
    return pairs.assign(wait_ns=wait, transfer_ns=transfer)


def _less_busy(span: np.ndarray, rank: np.ndarray, start: np.ndarray, end: np.ndarray, busy: dict) -> None:
    """span -= the part of [start, end) that ``rank`` spent in its own passes (in place)."""
    for r in np.unique(rank):
        if int(r) in busy:
            mine = rank == r
            span[mine] -= busy[int(r)].covered(start[mine], end[mine])


def _on_gpu(view: RunView) -> bool:
    return bool((view.events["lane_kind"] == "gpu").any())


def _busy(view: RunView) -> dict:
    """rank -> Intervals of its host passes; empty for GPU traces, whose host ranges only
    launch work (the p2p ranges there are GPU extents)."""
    ev = view.events
    if (ev["lane_kind"] == "gpu").any():
        return {}
    sel = ev[(ev["category"] == "compute").to_numpy() & (ev["lane_kind"] == "host").to_numpy()]
    return {int(r): union(g["start_ns"].to_numpy(), g["end_ns"].to_numpy())
            for r, g in sel.groupby("rank", observed=True)}


def split_by_rank(pairs: pd.DataFrame, unmatched: pd.DataFrame, kernels: bool = False) -> dict:
    """rank -> (wait Intervals, transfer Intervals) over that rank's own p2p ranges.

    A pair moves data from when both sides have posted until the first side completes
    (a finished recv has its data; a finished send has handed it over; see _moving). A rank
    blocks in *exchanges*: the overlapping p2p ranges of one op. Megatron's combined ops
    (send_forward_recv_backward, the interleaved four-way exchange) post several messages
    and wait for all, so an exchange cannot be moving data before its *last* message has
    both sides posted: until then it waits for that peer, even while an earlier-matched
    message moves (the simulator's rendezvous model). A send the transport buffered (done
    before its recv was posted) holds nothing up. Waits are bubble. Ranges without a
    matched peer cannot be split and count as transfer (without the peer nothing shows
    that it was waiting). ``kernels``: NCCL kernels (GPU traces) form no exchanges: each
    message moves once its two kernels have started (see _with_wait_transfer)."""
    t0, t1 = _moving(pairs)
    free_start, free_end = unmatched["start_ns"].to_numpy(), unmatched["end_ns"].to_numpy()
    free = (unmatched["rank"].to_numpy(), free_start, free_end, np.full(len(unmatched), _UNMATCHED))
    rank, start, end, ready = (np.concatenate([side, f]).astype(np.int64) for side, f in zip(_sides(pairs), free))
    move0 = np.concatenate([t0, t0, free_start]).astype(np.int64)
    move1 = np.concatenate([t1, t1, free_end]).astype(np.int64)
    last = ready if kernels else _exchanges(rank, start, end, ready)
    a = np.clip(np.maximum(move0, last), start, end)
    b = np.clip(move1, start, end)
    out = {}
    for r in np.unique(rank):
        mine = rank == r
        moving = mine & (b > a)
        transfer = union(a[moving], b[moving])
        out[int(r)] = (union(start[mine], end[mine]) - transfer, transfer)
    return out


def link_table(pairs: pd.DataFrame, steps=None) -> pd.DataFrame:
    """Per link src -> dst: count, bytes, wait_s, transfer_s, effective bandwidth (bytes over
    transfer time, the rate once both sides were ready). Totals over the selected steps."""
    if steps is not None:
        pairs = pairs[pairs["step"].isin(list(steps))]
    if pairs.empty:
        return pd.DataFrame(columns=["src", "dst", "count", "bytes", "wait_s", "transfer_s", "bandwidth_gbps"])
    g = pairs.groupby(["src", "dst"], sort=True).agg(
        count=("wait_ns", "size"), bytes=("bytes", "sum"),
        wait_ns=("wait_ns", "sum"), transfer_ns=("transfer_ns", "sum")).reset_index()
    g["wait_s"] = g["wait_ns"] / 1e9
    g["transfer_s"] = g["transfer_ns"] / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        bw = np.where(g["transfer_ns"] > 0, g["bytes"] / g["transfer_ns"], np.nan)  # bytes/ns == GB/s
    g["bandwidth_gbps"] = bw
    return g[["src", "dst", "count", "bytes", "wait_s", "transfer_s", "bandwidth_gbps"]]


def empty_split() -> tuple[Intervals, Intervals]:
    return Intervals.empty(), Intervals.empty()
