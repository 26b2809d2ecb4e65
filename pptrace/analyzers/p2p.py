"""Pipeline p2p, summarised: each rank's p2p time split into wait and transfer, and per
link (src -> dst) counts, bytes, wait, transfer and bandwidth.

Pairing is the loader's (``pptrace.run.match``), and what waiting and moving mean, and
which ranges form one exchange, is ``pptrace.timeline.exchanges``: this module only adds up.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from ..timeline import exchanges
from ..run import match
from ..timeline.intervals import Axes, merged_by_group, union_by_group
from ..run.model import Run


class MatchedPairs(NamedTuple):
    """What :func:`match_pairs` finds; a pair to unpack, as :func:`split_by_rank` takes it."""

    pairs: pd.DataFrame      # pp pairs, match.PAIR_COLUMNS
    unmatched: pd.DataFrame  # the pp p2p ranges no pair holds: match.p2p_ops rows


def match_pairs(run: Run) -> MatchedPairs:
    """The run's pipeline p2p pairs, and the pipeline p2p ranges without a peer."""
    ops = match.p2p_ops(run.events)
    ops = ops[(ops["kind"] == "pp").to_numpy()]
    pairs = run.pairs
    pairs = pairs[(pairs["kind"] == "pp").to_numpy()].reset_index(drop=True)
    paired = np.concatenate([pairs["send_index"].to_numpy(), pairs["recv_index"].to_numpy()])
    return MatchedPairs(pairs, ops[~ops["index"].isin(paired)])


def peer_not_loaded(unmatched: pd.DataFrame, requested) -> np.ndarray:
    """Mask of the unmatched p2p ranges whose peer a ``--ranks`` subset left out (``requested``:
    the ranks it asked for, None for all): nothing in the loaded traces can split their wait
    from their transfer. (A peer whose trace was lost keeps the older rule: its ranges count
    as transfer, with the "no matching peer range" warning.)"""
    if unmatched.empty or requested is None:
        return np.zeros(len(unmatched), bool)
    other = np.where(unmatched["is_send"].to_numpy(bool), unmatched["dst"].to_numpy(np.int64),
                     unmatched["src"].to_numpy(np.int64))
    return ~np.isin(other, np.asarray(list(requested), np.int64))


def unsplit_by_rank(unmatched: pd.DataFrame, mask: np.ndarray) -> dict:
    """rank -> Intervals of its unmatched ranges under ``mask`` (:func:`peer_not_loaded`)."""
    sel = unmatched[mask]
    ranks, code = np.unique(sel["rank"].to_numpy(np.int64), return_inverse=True)
    sets = union_by_group(len(ranks), code, sel["start_ns"].to_numpy(np.int64), sel["end_ns"].to_numpy(np.int64))
    return dict(zip(ranks.tolist(), sets))


def split_by_rank(pairs: pd.DataFrame, unmatched: pd.DataFrame, kernels: bool = False,
                  unsplit: np.ndarray | None = None) -> dict:
    """rank -> (wait Intervals, transfer Intervals) over that rank's own p2p ranges.

    A range moves data from when both sides of its message have posted, but not before its
    exchange had every message ready (exchanges.py), until the first side completes; the
    rest of it waits, and waits are bubble. A send the transport buffered holds nothing up.
    Ranges without a matched peer cannot be split and count as transfer (without the peer
    nothing shows that it was waiting), except those under ``unsplit`` (a mask over
    ``unmatched``: their peer is not loaded, :func:`peer_not_loaded`), which stay in the wait
    for the partition to mark unknown. ``kernels``: NCCL kernels (GPU traces), each message
    moving once its two kernels have started."""
    t0, t1 = exchanges.moving(pairs)
    found = exchanges.ranges(pairs, unmatched)
    free_start, free_end = unmatched["start_ns"].to_numpy(np.int64), unmatched["end_ns"].to_numpy(np.int64)
    move0 = np.concatenate([t0, t0, free_start]).astype(np.int64)
    move1 = np.concatenate([t1, t1, free_end]).astype(np.int64)
    rank, start, end = found.rank, found.start, found.end
    a = np.clip(np.maximum(move0, found.last(kernels)), start, end)
    b = np.clip(move1, start, end)
    if unsplit is not None and len(unsplit):
        b = np.where(np.concatenate([np.zeros(2 * len(pairs), bool), unsplit]), a, b)  # never moving
    if not len(rank):
        return {}
    # every rank's ranges on an axis of its own: one union and one subtraction for all ranks
    ranks, code = np.unique(rank, return_inverse=True)
    moving = b > a
    axes = Axes.over(len(ranks), int(start.min()), int(end.max()))
    whole = axes.place(*merged_by_group(code, start, end))
    transfer = axes.place(*merged_by_group(code[moving], a[moving], b[moving]))
    return dict(zip(ranks.tolist(), zip(axes.split(whole - transfer), axes.split(transfer))))


#: A message's transfer is timed when at least this share of its window (both sides posted
#: until the first side done) was exposed: the rest of the window was a pass that hid when the
#: data landed (exchanges.wait_transfer), so what is left of it understates the time it took.
TIMED_SHARE = 0.5
LINK_COLUMNS = ("src", "dst", "count", "bytes", "wait_s", "transfer_s", "bandwidth_gbps", "bandwidth_count")


def link_table(pairs: pd.DataFrame, steps=None) -> pd.DataFrame:
    """Per link src -> dst: count, bytes, wait_s, transfer_s, effective bandwidth (bytes over
    transfer time, the rate once both sides were ready) and bandwidth_count, the messages it
    is over: those of known size whose transfer was timed (TIMED_SHARE); NaN when none was.
    Totals over the selected steps."""
    if steps is not None:
        pairs = pairs[pairs["step"].isin(list(steps))]
    if pairs.empty:
        return pd.DataFrame(columns=list(LINK_COLUMNS))
    t0, t1 = exchanges.moving(pairs)
    transfer = pairs["transfer_ns"].to_numpy(np.float64)
    timed = (t1 > t0) & (transfer >= TIMED_SHARE * (t1 - t0)) & (pairs["bytes"].to_numpy(np.float64) > 0)
    pairs = pairs.assign(timed=timed, timed_bytes=pairs["bytes"].where(timed, 0), timed_ns=np.where(timed, transfer, 0))
    g = pairs.groupby(["src", "dst"], sort=True).agg(
        count=("wait_ns", "size"), bytes=("bytes", "sum"),
        wait_ns=("wait_ns", "sum"), transfer_ns=("transfer_ns", "sum"),
        bandwidth_count=("timed", "sum"), timed_bytes=("timed_bytes", "sum"), timed_ns=("timed_ns", "sum")).reset_index()
    g["wait_s"] = g["wait_ns"] / 1e9
    g["transfer_s"] = g["transfer_ns"] / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        bw = np.where(g["timed_ns"] > 0, g["timed_bytes"] / g["timed_ns"], np.nan)  # bytes/ns == GB/s
    g["bandwidth_gbps"] = bw
    return g[list(LINK_COLUMNS)]
