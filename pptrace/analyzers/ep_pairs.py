"""The expert-parallel rank-pair matrix, as the p2p link table is for the pipeline: per
profiled step and (src, dst) pair of an ep group, the token rows and bytes src sent dst in
its all-to-alls, and the time src spent waiting for dst.

Sizes come from the ``send`` / ``recv`` tags of the exchanges (contract 1: rows to / from
each peer of the group, in group-rank order, which is the sorted ranks' order); a row's bytes
are the range's ``bytes`` over its ``tokens``. A plain trace's NCCL all_to_all kernels carry
torch's "In / Out split size" (rows per peer; a row's bytes: "In msg nelems" x the dtype's size
over the rows), or ``[]`` for an even split, where only bytes are known (tokens NaN). Wait: in an ep collective instance a rank waits
from its arrival to the last rank's arrival (collectives.instance_waits), and the one it
waited for is that last rank, so the pair (rank, last arrival) gets it: a rank's pair waits
sum to its ep wait.

Split sizes are checked, never trusted blindly: a rank's sends must have one entry per peer and
add up to the rows it moved, and what src says it sent dst must be what dst says it got from
src in the same instance. The ranks whose splits fail are named (``EpPairs.inconsistent``) and
every pair they are in has its sizes unmeasured (NaN), not guessed.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from ..ingest.nccl import itemsize
from ..ingest.schema import tags_of
from .collectives import profiled_waits

COLUMNS = ("step", "src", "dst", "tokens", "bytes", "wait_s")


class EpPairs(NamedTuple):
    table: pd.DataFrame  # COLUMNS, one row per (step, src, dst) with traffic or wait
    inconsistent: tuple  # ranks whose split sizes do not add up


def _ints(value) -> list[int] | None:
    """``"12,12,30"`` (or one int) -> [12, 12, 30]; None if it is not that."""
    try:
        out = [int(v) for v in str(value).split(",")]
    except ValueError:
        return None
    return out if all(v >= 0 for v in out) else None


def _spec(tags, in_splits, out_splits) -> tuple:
    """(send, recv, says_splits, counts_rows) of one call: from a range's ``send`` / ``recv``
    tags, else from a kernel's "In/Out split size" (``"[3, 5]"``; ``"[]"``: the even split of
    an all_to_all_single given no sizes, whose rows per peer the trace does not say)."""
    try:
        parsed = tags_of(tags) if isinstance(tags, str) else {}
    except ValueError:
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    if "send" in parsed or "recv" in parsed:
        send, recv = _ints(parsed.get("send")), _ints(parsed.get("recv"))
        if send is not None and parsed.get("tokens") is not None and _ints(parsed["tokens"]) != [sum(send)]:
            send = None  # sends that do not add up to the rows the range says it moved
        return send, recv, True, True
    if isinstance(in_splits, str) and isinstance(out_splits, str):
        send, recv = (text.strip("[]() ") for text in (in_splits, out_splits))
        if not send and not recv:
            return None, None, True, False
        return _ints(send), _ints(recv), True, True
    return None, None, False, False


def _parsed(tags, in_splits, out_splits, groups):
    """Per row: (peers, sent, received) flattened over the rows' peers, each row's offset and
    length, whether it is free of faults, whether its splits are well formed, whether they
    count rows (else the peers' shares are even and only bytes are known), and the rows it
    moved; one parse per distinct (tags, splits, group)."""
    frame = pd.DataFrame({"t": tags, "i": in_splits, "o": out_splits, "g": groups}).astype(str)
    codes, uniques = pd.factorize(pd.MultiIndex.from_frame(frame))
    peers, sent, got, lengths, valid, sized, counted, moved = [], [], [], [], [], [], [], []
    for tag_text, in_text, out_text, group in uniques:
        members = [int(r) for r in group.split(",") if r.strip().lstrip("-").isdigit()]
        send, recv, says, rows = _spec(*(None if t in ("None", "nan") else t for t in (tag_text, in_text, out_text)))
        if says and not rows:  # an even split: one share per peer
            send = recv = [1] * len(members)
        ok = send is not None and recv is not None and len(send) == len(recv) == len(members) > 0
        n = len(members) if ok else 0
        peers += members[:n]
        sent += (send or [])[:n]
        got += (recv or [])[:n]
        lengths.append(n)
        valid.append(ok or not says)  # a call that says nothing of its splits (the counts exchange) is no fault
        sized.append(ok)
        counted.append(ok and rows)
        moved.append(sum(send) if ok else 0)
    lengths = np.asarray(lengths, np.int64)
    offsets = np.r_[0, np.cumsum(lengths)[:-1]]
    pick = lambda values, dtype: np.asarray(values, dtype)[codes]  # noqa: E731
    return (np.asarray(peers, np.int64), np.asarray(sent, np.int64), np.asarray(got, np.int64),
            offsets[codes], lengths[codes], pick(valid, bool), pick(sized, bool), pick(counted, bool),
            pick(moved, float))


def _explode(rows: pd.DataFrame, offsets, lengths, peers, sent, got) -> pd.DataFrame:
    """One row per (instance row, peer): the rank, the peer, rows sent to it and got from it."""
    at = np.repeat(np.arange(len(rows)), lengths)
    flat = np.repeat(offsets, lengths) + (np.arange(len(at)) - np.repeat(np.cumsum(lengths) - lengths, lengths))
    return pd.DataFrame({
        "instance": rows["instance"].to_numpy()[at], "step": rows["step"].to_numpy()[at],
        "rank": rows["rank"].to_numpy(np.int64)[at], "peer": peers[flat],
        "sent": sent[flat], "got": got[flat], "row_bytes": rows["row_bytes"].to_numpy(float)[at],
        "counted": rows["counted"].to_numpy(bool)[at],
    })


def ep_pairs(run, inst: pd.DataFrame | None = None, waits: pd.DataFrame | None = None) -> EpPairs:
    """The ep pair matrix of ``run``'s profiled steps (``inst``: its collective instances,
    default ``run.collectives``; ``waits``: their ``profiled_waits`` where the caller has
    them already). Empty without ep collectives."""
    if waits is None:
        waits = profiled_waits(run, inst if inst is not None else run.collectives)
    empty = EpPairs(pd.DataFrame(columns=list(COLUMNS)), ())
    if waits.empty or not (waits["dim"] == "ep").any():
        return empty
    waits = waits[waits["dim"] == "ep"]

    # wait: each rank's, on the instance's last arrival (the first of a tie)
    last = waits[waits["is_last"].to_numpy(bool)].drop_duplicates("instance").set_index("instance")["rank"]
    waited = waits.assign(dst=waits["instance"].map(last))
    waited = waited[waited["dst"].notna() & (waited["wait_ns"] > 0)]
    waited = waited.assign(dst=waited["dst"].astype(np.int64))
    wait = waited.groupby(["step", "rank", "dst"])["wait_ns"].sum().rename("wait_ns")
    wait.index = wait.index.set_names(["step", "src", "dst"])

    # sizes: from the exchanges' split tags, or the kernels' split sizes
    events = run.events
    at = waits["index"].to_numpy()
    column = lambda name: events[name].reindex(at).astype(object).to_numpy()  # noqa: E731
    peers, sent, got, offsets, lengths, valid, sized, counted, moved = _parsed(
        column("tags"), column("in_splits"), column("out_splits"), waits["group"].astype(str).to_numpy())
    nccl = (waits["kind"] == "nccl").to_numpy()
    item = pd.Series(column("dtype")).map(lambda d: itemsize(d) if isinstance(d, str) else None)
    total = np.where(nccl, pd.to_numeric(pd.Series(column("in_nelems")), errors="coerce").to_numpy(float)
                     * item.astype(float).to_numpy(), events["bytes"].reindex(at).to_numpy(float))
    rows = waits.assign(row_bytes=np.where(moved > 0, total / np.maximum(moved, 1), np.nan), counted=counted)
    bad = set(rows.loc[~valid, "rank"].astype(int))
    long = _explode(rows[sized], offsets[sized], lengths[sized], peers, sent, got)
    if len(long):
        # what src says it sent dst against what dst says it got from src, in the same instance
        said = long[["instance", "rank", "peer", "sent"]].rename(columns={"rank": "src", "peer": "dst"})
        heard = long[["instance", "rank", "peer", "got"]].rename(columns={"rank": "dst", "peer": "src"})
        both = said.merge(heard, on=["instance", "src", "dst"], how="inner")
        off = both[both["sent"] != both["got"]]
        bad |= set(off["src"].astype(int)) | set(off["dst"].astype(int))
    long = long.assign(bytes=long["sent"] * long["row_bytes"],
                       sent=long["sent"].where(long["counted"]))  # an even split's shares are no rows
    size = long.groupby(["step", "rank", "peer"])[["sent", "bytes"]].sum(min_count=1)
    size.index = size.index.set_names(["step", "src", "dst"])

    table = size.join(wait, how="outer").reset_index()
    table = table[table["src"] != table["dst"]] if len(table) else table
    unmeasured = table["src"].isin(list(bad)) | table["dst"].isin(list(bad))
    out = pd.DataFrame({
        "step": table["step"].to_numpy(np.int64), "src": table["src"].to_numpy(np.int64),
        "dst": table["dst"].to_numpy(np.int64),
        "tokens": table["sent"].where(~unmeasured).to_numpy(float),
        "bytes": table["bytes"].where(~unmeasured).to_numpy(float),
        "wait_s": table["wait_ns"].fillna(0).to_numpy(float) / 1e9,
    })
    return EpPairs(out.sort_values(["step", "src", "dst"]).reset_index(drop=True), tuple(sorted(bad)))


def pair_means(table: pd.DataFrame, n_steps: int) -> pd.DataFrame:
    """Per (src, dst): tokens, bytes and wait_s per profiled step (means; NaN sizes stay NaN)."""
    if table.empty:
        return pd.DataFrame(columns=["src", "dst", "tokens", "bytes", "wait_s"])
    g = table.groupby(["src", "dst"])
    out = g[["tokens", "bytes", "wait_s"]].sum(min_count=1) / max(n_steps, 1)
    out["wait_s"] = out["wait_s"].fillna(0.0)
    return out.reset_index()
