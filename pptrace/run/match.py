"""Cross-rank matching: p2p sends with their recvs, collective calls into instances.

Matching uses names, tags, the layout and *order of occurrence* only, never timestamps,
so it runs before clock alignment (align.py needs its output) and gives the same answer
after it. Times in the outputs come from whatever clocks ``events`` carries.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ..sweeps import isin
from ..timeline import exchanges
from ..ingest.nccl import group_members, is_p2p_collective
from ..timeline.activity import per_value, row_codes, str_test
from ..timeline.projection import gpu_extent
from ..topology import Layout
from ..vocab import COMM_DIMS, KIND_GROUP_DIMS, SIZE_TAGS, is_step_end

PAIR_COLUMNS = (
    "kind", "src", "dst", "direction", "mb", "chunk", "ring_step", "layer", "step", "bytes",
    "send_index", "recv_index", "send_start_ns", "send_end_ns", "recv_start_ns", "recv_end_ns",
    *exchanges.TIMED_COLUMNS,
)
INSTANCE_COLUMNS = (
    "instance", "source", "kind", "op", "name", "step", "group", "group_size", "n_present",
    "complete", "rank", "index", "arrive_ns", "leave_ns",
)
#: A user's own collective over all ranks whatever its kind (tag group=world), beside the
#: step-end one (vocab.STEP_END_TAGS).
_WORLD_GROUP = '"group":"world"'
#: The experts' gradient sync (tag group=edp): over the expert-data-parallel group
_EDP_GROUP = '"group":"edp"'
_P2P_KINDS = ("pp", "cp")
_P2P_OP_COLUMNS = ("rank", "kind", "op", "peer", "mb", "chunk", "ring_step", "layer", "step", "pg_name", "bytes",
                   "start_ns", "end_ns", "external_id", "correlation")
# group: the NCCL process group of inferred ops ("" for contract ranges, which carry none)
_KEY = ["kind", "src", "dst", "direction", "mb", "chunk", "ring_step", "layer", "step", "group"]


def _int(col: pd.Series, fill: int = -1) -> np.ndarray:
    return col.astype("Int64").fillna(fill).to_numpy(np.int64)


def p2p_ops(events: pd.DataFrame) -> pd.DataFrame:
    """Host send/recv ranges of pp and cp with a peer, one row each, in time order."""
    # Filter on the cheap categorical columns first; string tests only on what is left.
    pre = (isin(events["kind"], _P2P_KINDS) & events["peer"].notna().to_numpy()
           & (events["lane_kind"] == "host").to_numpy() & ~events["gpu_annotation"].to_numpy())
    # the columns read here and by gpu_extent, not every column of the rows
    ev = events[[c for c in _P2P_OP_COLUMNS if c in events.columns]][pre]
    is_send = str_test(ev["op"], lambda s: s.startswith("send_"))
    keep = is_send | str_test(ev["op"], lambda s: s.startswith("recv_"))
    ev, send = ev[keep], is_send[keep]
    rank, peer = ev["rank"].to_numpy(np.int64), _int(ev["peer"])
    start, end, _ = gpu_extent(events, ev)
    out = pd.DataFrame({
        "index": ev.index.to_numpy(),
        "rank": rank,
        "is_send": send,
        "kind": ev["kind"].astype(str).to_numpy(),
        "direction": per_value(ev["op"], lambda s: s[5:], None),  # send_fwd -> fwd, recv_kv -> kv
        "src": np.where(send, rank, peer),
        "dst": np.where(send, peer, rank),
        "mb": _int(ev["mb"]), "chunk": _int(ev["chunk"]), "ring_step": _int(ev["ring_step"]),
        "layer": _int(ev["layer"]), "step": ev["step"].to_numpy(np.int64),
        "group": ev["pg_name"].astype(object).fillna("").astype(str).to_numpy(),
        "bytes": _int(ev["bytes"], 0),
        # GPU traces: when the transfer ran on the stream, not when the host launched it
        "start_ns": start, "end_ns": end,
    })
    return out.sort_values(["start_ns", "index"], kind="stable").reset_index(drop=True)


def _pair_by(sends: pd.DataFrame, recvs: pd.DataFrame, key: list) -> pd.DataFrame:
    sends = sends.assign(occ=sends.groupby(key, sort=False).cumcount())
    recvs = recvs.assign(occ=recvs.groupby(key, sort=False).cumcount())
    return sends.merge(recvs, on=[*key, "occ"], suffixes=("_s", "_r"))


def match_p2p(events: pd.DataFrame, timed: bool = True) -> tuple[pd.DataFrame, list[str]]:
    """Pair every send with its recv -> (pairs with PAIR_COLUMNS, warnings).

    Key: (kind, src, dst, direction, mb, chunk, ring step, layer, profiler step) plus the
    order of occurrence of that key. Ranges the first pass leaves unmatched are tried again
    without chunk, in case a trainer tags the sender's chunk on one side and the
    receiver's on the other (they differ where the interleaved ring wraps around).
    Wait, transfer and exchanges come from exchanges.wait_transfer on the clocks of
    ``events``; ``timed=False`` leaves them out, for a caller that moves the times to other
    clocks first (the loader: shift_pairs adds them on the aligned clocks).
    """
    ops = p2p_ops(events)
    sends, recvs = ops[ops["is_send"]], ops[~ops["is_send"]]
    first = _pair_by(sends, recvs, _KEY)
    used_s, used_r = set(first["index_s"]), set(first["index_r"])
    rest_s = sends[~sends["index"].isin(used_s)]
    rest_r = recvs[~recvs["index"].isin(used_r)]
    parts = [first]
    if len(rest_s) and len(rest_r):
        loose = [k for k in _KEY if k != "chunk"]
        second = _pair_by(rest_s.drop(columns="chunk"), rest_r.drop(columns="chunk"), loose)
        second["chunk"] = -1
        parts.append(second)
        rest_s = rest_s[~rest_s["index"].isin(set(second["index_s"]))]
        rest_r = rest_r[~rest_r["index"].isin(set(second["index_r"]))]
    m = pd.concat(parts, ignore_index=True)
    pairs = pd.DataFrame({
        "kind": m["kind"], "src": m["src"], "dst": m["dst"], "direction": m["direction"],
        "mb": m["mb"], "chunk": m["chunk"], "ring_step": m["ring_step"], "layer": m["layer"],
        "step": m["step"],
        "bytes": np.maximum(m["bytes_s"], m["bytes_r"]),  # a side without a size tag takes the other's
        "send_index": m["index_s"], "recv_index": m["index_r"],
        "send_start_ns": m["start_ns_s"], "send_end_ns": m["end_ns_s"],
        "recv_start_ns": m["start_ns_r"], "recv_end_ns": m["end_ns_r"],
    })
    pairs = pairs.sort_values(["send_start_ns", "send_index"], kind="stable").reset_index(drop=True)
    if timed:
        pairs = _timed(pairs, pd.concat([rest_s, rest_r]), events)
    warnings = []
    sizes = m[(m["bytes_s"] > 0) & (m["bytes_r"] > 0) & (m["bytes_s"] != m["bytes_r"])]
    if len(sizes):  # pairing by order went wrong somewhere (NCCL ops carry nelems x dtype)
        row = sizes.iloc[0]
        warnings.append(
            f"{len(sizes)} p2p pairs differ in size between send and recv (first: {row['src']} -> "
            f"{row['dst']} step {row['step']}: {row['bytes_s']} vs {row['bytes_r']} bytes); a peer's "
            "trace may miss ops, so later pairs on that link may be off"
        )
    for side, rest in (("send", rest_s), ("recv", rest_r)):
        if len(rest):
            row = rest.iloc[0]
            warnings.append(
                f"{len(rest)} p2p {side}s have no matching {'recv' if side == 'send' else 'send'} "
                f"(first: rank {row['rank']} {row['kind']}:{side}_{row['direction']} "
                f"src {row['src']} -> dst {row['dst']} mb={row['mb']} step {row['step']}); "
                "a peer's trace may be missing or cover other steps"
            )
    return pairs[[c for c in PAIR_COLUMNS if c in pairs.columns]], warnings


def _timed(pairs: pd.DataFrame, free: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """``pairs`` with exchanges.TIMED_COLUMNS on the clocks of ``events``; ``free``: the p2p
    ranges (p2p_ops rows) no pair holds."""
    return exchanges.wait_transfer(pairs, free, exchanges.busy_intervals(events), exchanges.on_gpu(events))


# -------------------------------------------------------------------------------------------
# collectives
# -------------------------------------------------------------------------------------------
def group_of(kind: str, tags_json, rank: int, layout: Layout) -> tuple[int, ...]:
    """The ranks a contract collective of ``kind`` on ``rank`` spans."""
    if isinstance(tags_json, str) and (is_step_end(tags_json) or _WORLD_GROUP in tags_json):
        return tuple(range(layout.world_size))
    if isinstance(tags_json, str) and _EDP_GROUP in tags_json and layout.ep > 1:
        return tuple(sorted(layout.group_ranks("edp", rank)))
    dims = KIND_GROUP_DIMS.get(kind, ("dp",))
    if kind == "ep" and layout.ep == 1:  # a layout that does not say its ep: all the expert-capable ranks
        dims = KIND_GROUP_DIMS["dp"]
    ranks = {rank}
    for dim in dims:
        ranks = {r2 for r in ranks for r2 in layout.group_ranks(dim, r)}
    return tuple(sorted(ranks))


_SIZE_TAG = re.compile(rf"\s(?:{'|'.join(SIZE_TAGS)})=\S+")


def _call_names(names: pd.Series) -> np.ndarray:
    """The names that say which call a range is: without its size tags (the ranks of one
    all-to-all each send their own bytes), once per distinct name."""
    names = names.astype("category")
    table = np.array([_SIZE_TAG.sub("", str(n)) for n in names.cat.categories] + ["nan"], dtype=object)
    return table[names.cat.codes.to_numpy()]


def _instances(calls: pd.DataFrame, source: str) -> pd.DataFrame:
    """calls: rank, index, kind, op, name, step, group (tuple), arrive_ns, leave_ns.
    The k-th call of one (name, step, group) on each rank of the group is instance k."""
    if calls.empty:
        return pd.DataFrame(columns=list(INSTANCE_COLUMNS))
    calls = calls.sort_values(["arrive_ns", "index"], kind="stable")
    key = ["name", "step", "group"]
    calls = calls.assign(occ=calls.groupby(key + ["rank"], sort=False).cumcount())
    ids = calls.groupby(key + ["occ"], sort=False).ngroup()
    calls = calls.assign(instance=ids.to_numpy())
    calls["n_present"] = calls.groupby("instance")["rank"].transform("size")
    calls["group_size"] = calls["group"].map(len)
    calls["complete"] = calls["n_present"] == calls["group_size"]
    calls["source"] = source
    codes, uniques = pd.factorize(calls["group"])  # a world's group is 1,024 numbers: joined once
    calls["group"] = np.array([",".join(map(str, g)) for g in uniques] or [""], dtype=object)[codes]
    return calls[list(INSTANCE_COLUMNS)]


def match_collectives(events: pd.DataFrame, layout: Layout, ranks=None) -> tuple[pd.DataFrame, list[str]]:
    """Group collective calls into instances across the ranks of their group ->
    (long table, one row per (instance, rank), INSTANCE_COLUMNS; warnings).

    Host ranges of kinds tp/cp/dp/ep that are not p2p and not waits (group from the layout
    via KIND_GROUP_DIMS, or all ranks for the step-end all-reduce), and on GPU traces the NCCL
    collective kernels (group from their "Process Group Ranks"). An instance lacking a rank
    that was loaded is reported as a warning, never dropped silently.
    """
    loaded = set(int(r) for r in (ranks if ranks is not None else events["rank"].unique()))
    host = isin(events["kind"], COMM_DIMS) & (
        (events["lane_kind"] == "host") & ~events["gpu_annotation"] & (events["op"] != "wait")
    ).to_numpy()
    ev = events[host]
    ev = ev[~str_test(ev["op"], lambda s: s.startswith(("send_", "recv_")))]
    # each call's group, once per distinct (kind, tags, rank)
    kinds, tags, rank_of = (ev["kind"].astype(str).to_numpy(object), ev["tags"].astype(object).to_numpy(),
                            ev["rank"].to_numpy(np.int64))
    code = row_codes(kinds, tags, rank_of)
    firsts = np.unique(code, return_index=True)[1]  # the codes count 0, 1, ... in order of appearance
    groups = np.empty(len(firsts), dtype=object)
    for i, (kind, tag, rank) in enumerate(zip(kinds[firsts], tags[firsts], rank_of[firsts].tolist())):
        tag = tag if isinstance(tag, str) else None
        groups[i] = group_of(kind, tag, rank, layout) if rank < layout.world_size else (rank,)
    group_col = groups[code]
    host_calls = pd.DataFrame({
        "rank": ev["rank"].to_numpy(np.int64), "index": ev.index.to_numpy(),
        "kind": ev["kind"].astype(str).to_numpy(), "op": ev["op"].astype(str).to_numpy(),
        "name": _call_names(ev["name"]), "step": ev["step"].to_numpy(np.int64),
        "group": group_col,
        "arrive_ns": ev["start_ns"].to_numpy(np.int64), "leave_ns": ev["end_ns"].to_numpy(np.int64),
    })
    parts = [_instances(host_calls, "range")]
    nccl = events[(events["is_nccl"] & events["collective"].notna() & events["group_ranks"].notna()).to_numpy()]
    p2p = [c for c in nccl["collective"].astype("category").cat.categories if is_p2p_collective(c)]
    nccl = nccl[~nccl["collective"].isin(p2p).to_numpy()]  # send/recv kernels pair as p2p instead
    if len(nccl):
        group = nccl["group_ranks"].astype(str).map(group_members)
        ok = group.map(bool).to_numpy()
        nccl, group = nccl[ok], group[ok]
        coll = nccl["collective"].astype(str)
        parts.append(_instances(pd.DataFrame({
            "rank": nccl["rank"].to_numpy(np.int64), "index": nccl.index.to_numpy(),
            "kind": "nccl", "op": coll.to_numpy(),
            "name": (coll + " " + nccl["pg_name"].astype(str)).to_numpy(),
            "step": nccl["step"].to_numpy(np.int64), "group": group.to_numpy(),
            "arrive_ns": nccl["start_ns"].to_numpy(np.int64), "leave_ns": nccl["end_ns"].to_numpy(np.int64),
        }), "nccl_kernel"))
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=list(INSTANCE_COLUMNS)), []
    out = pd.concat(parts, ignore_index=True)
    if len(parts) > 1:  # instance ids must stay unique across sources
        out["instance"] = out.groupby(["source", "instance"], sort=False).ngroup()
    warnings = _incomplete_warnings(out, loaded)
    return out.sort_values(["instance", "rank"], kind="stable").reset_index(drop=True), warnings


def _incomplete_warnings(out: pd.DataFrame, loaded: set) -> list[str]:
    """One line per (name, source) whose instances lack ranks that were loaded: how many
    instances, and the step and the missing ranks of the first."""
    bad = out[~out["complete"].to_numpy(bool)]
    if bad.empty:
        return []
    by_name = bad.groupby(["name", "source"], sort=False)
    keys, count = by_name.size().index, by_name["instance"].nunique().to_numpy()  # in order of appearance
    line = by_name.ngroup().to_numpy()
    is_first = bad["instance"].to_numpy() == by_name["instance"].transform("min").to_numpy()
    first = pd.DataFrame({"line": line[is_first], "rank": bad["rank"].to_numpy(np.int64)[is_first],
                          "group": bad["group"].to_numpy(object)[is_first], "step": bad["step"].to_numpy()[is_first]})
    head = first.drop_duplicates("line")  # the group and step of each line's first row
    members = head[["line", "group"]].assign(rank=head["group"].str.split(",")).explode("rank")
    members = members.assign(rank=members["rank"].astype(np.int64)).drop_duplicates(["line", "rank"])
    members = members[members["rank"].isin(list(loaded)).to_numpy()]
    present = pd.MultiIndex.from_frame(first[["line", "rank"]])
    missing = members[~pd.MultiIndex.from_frame(members[["line", "rank"]]).isin(present)].sort_values(["line", "rank"])
    lines, at = np.unique(missing["line"].to_numpy(), return_index=True)
    ranks = np.split(missing["rank"].to_numpy(np.int64), at[1:])
    step = head.set_index("line")["step"]
    return [
        f"{count[i]} instances of '{keys[i][0]}' lack ranks that were loaded "
        f"(first: step {step[i]}, missing rank(s) {r.tolist()}); ranks called it a "
        "different number of times, or the layout does not match the run"
        for i, r in zip(lines, ranks)
    ]


def shift_pairs(pairs: pd.DataFrame, offsets: dict, events: pd.DataFrame) -> pd.DataFrame:
    """Pairs on other clocks: subtract each side's rank offset (rank -> ns) from its times;
    wait, transfer and exchanges on those clocks, those of ``events``."""
    out = pairs.copy()
    src = out["src"].map(offsets).fillna(0).astype(np.int64).to_numpy()
    dst = out["dst"].map(offsets).fillna(0).astype(np.int64).to_numpy()
    for column, shift in (("send_start_ns", src), ("send_end_ns", src), ("recv_start_ns", dst), ("recv_end_ns", dst)):
        out[column] = out[column].to_numpy(np.int64) - shift
    out = out.sort_values(["send_start_ns", "send_index"], kind="stable").reset_index(drop=True)
    ops = p2p_ops(events)
    free = ops[~ops["index"].isin(np.concatenate([out["send_index"], out["recv_index"]]))]
    return _timed(out, free, events)[list(PAIR_COLUMNS)]


def shift_instances(instances: pd.DataFrame, offsets: dict) -> pd.DataFrame:
    out = instances.copy()
    shift = out["rank"].map(offsets).fillna(0).astype(np.int64).to_numpy()
    out["arrive_ns"] = out["arrive_ns"].to_numpy(np.int64) - shift
    out["leave_ns"] = out["leave_ns"].to_numpy(np.int64) - shift
    return out
