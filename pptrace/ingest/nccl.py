"""Give every NCCL kernel the collective it belongs to, from the host op that launched it.

Recent PyTorch writes "Collective name" / "Process Group Ranks" on the kernel itself; older
traces (and every SendRecv kernel of an all_to_all) only have them on the host side: the
kernel's ``correlation`` leads to its launch call (``cudaLaunchKernel*``), and that call lies
inside ``record_param_comms`` (collective, group, sizes) and ``nccl:<op>`` /
``c10d::<op>`` ranges on the launching thread. Without this, a SendRecv kernel cannot be
told apart from pipeline p2p: NCCL runs all_to_all (and some all_gathers) as SendRecv.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweeps import dominance_max, lane_keys
from .p2p_args import pp_comm_label
from ..vocab import RECV_BWD, RECV_FWD, SEND_BWD, SEND_FWD, collective_key

#: columns filled on a kernel from its launching record_param_comms when the kernel lacks them
FIELDS = ("collective", "group_ranks", "pg_name", "in_nelems", "out_nelems", "in_splits", "out_splits", "dtype",
          "comm_seq")
_P2P = frozenset({"send", "recv", "isend", "irecv", "sendrecv", "batchisendirecv", "p2p"})


def is_p2p_collective(collective) -> bool:
    """``send``/``recv``/``batch_isend_irecv`` and friends: point-to-point, not a collective."""
    if not isinstance(collective, str):
        return False
    base = collective_key(collective)
    return base in _P2P or base.startswith(("send", "recv"))


def group_members(group_ranks) -> tuple[int, ...]:
    """A "Process Group Ranks" value (``"[0, 1, 2]"``, or pg_config's list) as sorted global
    ranks; () when null or unreadable."""
    try:
        return tuple(sorted(int(x) for x in str(group_ranks).strip("[]() ").split(",") if x.strip()))
    except ValueError:
        return ()


def _op_of(name: str) -> str | None:
    """``nccl:all_reduce`` -> all_reduce, ``c10d::recv_`` -> recv."""
    for prefix in ("nccl:", "c10d::"):
        if name.startswith(prefix):
            return name[len(prefix):].strip("_") or None
    return None


def _lanes(first: pd.DataFrame, *others: pd.DataFrame) -> list[np.ndarray]:
    """The (pid, tid) thread of each row as a number: threads numbered in the order they
    first appear in ``first``; -1 in ``others`` for a thread ``first`` has no row on."""
    def keys(frame):
        return pd.MultiIndex.from_arrays([frame["pid"].to_numpy(np.int64), frame["tid"].to_numpy(np.int64)])
    threads = keys(first).unique()
    return [threads.get_indexer(keys(frame)) for frame in (first, *others)]


def _innermost(op_lane: np.ndarray, op_start: np.ndarray, op_end: np.ndarray,
               lane: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per query [start, end] on thread ``lane`` (>= 0): the op of that thread around it
    (op_start <= start, op_end >= end) that starts last, the last listed of those starting
    together (as index into the op arrays); -1 where none is."""
    order = np.lexsort((op_start, op_lane))  # stable: listed order among equal starts
    weight = np.empty(len(order), np.int64)
    weight[order] = np.arange(len(order))  # later start (or listed later) weighs more
    best = dominance_max(np.asarray(op_lane, np.int64), np.asarray(op_start, np.int64),
                         np.asarray(op_end, np.int64), weight, np.asarray(lane, np.int64),
                         np.asarray(start, np.int64), np.asarray(end, np.int64))
    return np.where(best >= 0, order[np.clip(best, 0, None)], -1) if len(order) else best


def link_nccl_kernels(df: pd.DataFrame) -> int:
    """Fill FIELDS of NCCL kernels (in place) from the host ops enclosing their launch call;
    returns how many kernels got a collective they did not have."""
    kern = df.index[(df["is_nccl"] & df["correlation"].notna()).to_numpy()]
    if len(kern) == 0:
        return 0
    host = (df["lane_kind"] == "host").to_numpy()
    corr = df["correlation"]
    launch = df[host & (df["category"] == "runtime").to_numpy() & corr.isin(corr[kern].dropna()).to_numpy()]
    if launch.empty:
        return 0
    name = df["name"] if isinstance(df["name"].dtype, pd.CategoricalDtype) else df["name"].astype("category")
    names, codes = name.cat.categories.astype(str), name.cat.codes.to_numpy()  # decided per distinct name
    named_cat = np.r_[names.str.startswith(("nccl:", "c10d::")), False]  # code -1 (null): last
    rpc_cat = np.r_[names == "record_param_comms", False]
    is_rpc, is_named = host & rpc_cat[codes], host & named_cat[codes]
    if not (is_rpc | is_named).any():
        return 0
    # the launch call of each kernel (of calls sharing a correlation, the last listed)
    launch = launch[~launch["correlation"].duplicated(keep="last").to_numpy()]
    call = pd.Index(launch["correlation"].to_numpy(np.int64)).get_indexer(
        df.loc[kern, "correlation"].to_numpy(np.int64))
    ops = df[is_rpc | is_named]
    op_lane, call_lane = _lanes(ops, launch)
    op_name = ops["name"].map(_op_of).astype(object).to_numpy()  # per distinct name
    rpc = is_rpc[ops.index.to_numpy()]
    named = is_named[ops.index.to_numpy()] & ~pd.isna(op_name)
    has = call >= 0
    has[has] = call_lane[call[has]] >= 0
    kern, call = kern[has], call[has]
    c_lane = call_lane[call]
    c_start, c_end = launch["start_ns"].to_numpy(np.int64)[call], launch["end_ns"].to_numpy(np.int64)[call]
    o_start, o_end = ops["start_ns"].to_numpy(np.int64), ops["end_ns"].to_numpy(np.int64)
    inner_rpc = _innermost(op_lane[rpc], o_start[rpc], o_end[rpc], c_lane, c_start, c_end)
    inner_named = _innermost(op_lane[named], o_start[named], o_end[named], c_lane, c_start, c_end)
    # the innermost record_param_comms around the launch gives the kernel what it lacks
    updates = {}
    got = inner_rpc >= 0
    rpc_rows = ops.index[rpc][inner_rpc[got]]
    for field in FIELDS:
        value = df.loc[rpc_rows, field].to_numpy(object)
        take = ~pd.isna(value) & df.loc[kern[got], field].isna().to_numpy()
        updates[field] = (kern[got][take].to_numpy(), value[take])
    # no record_param_comms said which collective: the innermost nccl:<op> / c10d::<op> does
    rows, values = updates["collective"]
    lacking = df.loc[kern, "collective"].isna().to_numpy() & ~np.isin(kern, rows) & (inner_named >= 0)
    updates["collective"] = (np.concatenate([rows, kern[lacking]]),
                             np.concatenate([values, op_name[named][inner_named[lacking]]]))
    for field, (rows, values) in updates.items():
        if not len(rows):
            continue
        if isinstance(df[field].dtype, pd.CategoricalDtype):
            full = np.array(df[field].astype(object).to_numpy(), dtype=object)  # a writable copy
            full[rows] = pd.Series(values, dtype=object).astype(str).to_numpy(object)
            df[field] = pd.Categorical(full)
        else:
            col = df[field].copy()
            col.loc[rows] = values.astype(np.int64)
            df[field] = col
    return len(updates["collective"][0])


# -------------------------------------------------------------------------------------------
# pipeline p2p of plain NCCL traces
# -------------------------------------------------------------------------------------------
#: bytes per element of the dtypes PyTorch writes in record_param_comms ("Float", "BFloat16")
_ITEMSIZE = {
    "bool": 1, "byte": 1, "char": 1, "uint8": 1, "int8": 1, "half": 2, "bfloat16": 2, "short": 2,
    "int16": 2, "uint16": 2, "complexhalf": 4, "float": 4, "int": 4, "int32": 4, "uint32": 4,
    "double": 8, "long": 8, "int64": 8, "uint64": 8, "complexfloat": 8, "complexdouble": 16,
}
#: what a SendRecv kernel launched by batch_isend_irecv (endCoalescing) is recorded as
COALESCED_P2P = "batch_isend_irecv"


def itemsize(dtype) -> int | None:
    if not isinstance(dtype, str):
        return None
    key = dtype.strip().strip('"').lower()
    if key.startswith("float8"):
        return 1
    return _ITEMSIZE.get(key)


def _p2p_side(collective: pd.Series) -> np.ndarray:
    """"send" / "recv" / "" per row of a categorical "Collective name" column (decided once
    per category, not per row)."""
    cats = collective.cat.categories
    keys = [collective_key(c) if isinstance(c, str) else "" for c in cats]
    side = np.array([k if k in ("send", "recv") else "" for k in keys] + [""], dtype=object)
    return side[collective.cat.codes.to_numpy()]  # code -1 (null) takes the last entry


def _set(df: pd.DataFrame, column: str, rows: np.ndarray, values) -> None:
    """df.loc[rows, column] = values, adding categories to a categorical column first."""
    if isinstance(df[column].dtype, pd.CategoricalDtype):
        new = pd.unique(pd.Series(np.atleast_1d(np.asarray(values, dtype=object))))
        missing = [v for v in new if v not in df[column].cat.categories]
        if missing:
            df[column] = df[column].cat.add_categories(missing)
    df.loc[rows, column] = values


def _covered(lane: np.ndarray, starts: np.ndarray, ends: np.ndarray, at_lane: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Whether each instant ``at`` lies inside one of the (properly nesting) ranges of its
    lane (ranges and instants on lane -1 take no part)."""
    out = np.zeros(len(at), bool)
    mine, asked = lane >= 0, at_lane >= 0
    if not mine.any() or not asked.any():
        return out
    order = np.lexsort((starts[mine], lane[mine]))
    lane, starts, ends = lane[mine][order], starts[mine][order], ends[mine][order]
    s_key, e_key, at_key = lane_keys([lane, lane, at_lane[asked]], [starts, ends, at[asked]])
    # the keys of a lane exceed those of the lanes before it: a running maximum stays in its lane
    reach = np.maximum.accumulate(e_key)
    i = np.searchsorted(s_key, at_key, side="right") - 1
    j = np.clip(i, 0, None)
    out[asked] = (i >= 0) & (lane[j] == at_lane[asked]) & (reach[j] >= at_key)
    return out


def _peers(ops: pd.DataFrame, rank: int, is_send: np.ndarray) -> np.ndarray:
    """Global rank of each op's peer: "Dst Rank" of a send, "Src Rank" of a recv (PyTorch
    writes them since mid-2024); before that, only a group of two names its other member."""
    peer = np.where(is_send, ops["dst_rank"].astype("Float64").to_numpy(np.float64, na_value=np.nan),
                    ops["src_rank"].astype("Float64").to_numpy(np.float64, na_value=np.nan))
    missing = np.isnan(peer)
    if missing.any():
        groups = ops["group_ranks"].astype("category")
        other = np.full(len(groups.cat.categories) + 1, np.nan)  # per distinct group; last: null
        for k, text in enumerate(groups.cat.categories):
            members = group_members(text)
            if len(members) == 2 and rank in members:
                other[k] = members[1 - members.index(rank)]
        peer[missing] = other[groups.cat.codes.to_numpy()[missing]]
    return peer


_LAUNCH, _PENDING, _OTHER = 0, 1, 2


def _kernel_of_ops(df: pd.DataFrame, ops: pd.DataFrame) -> tuple[np.ndarray, pd.DataFrame]:
    """For each send/recv op (record_param_comms rows), the row of the NCCL kernel it
    launched (-1 if none), and the coalesced kernels found: one row (kernel, op) per op of
    each coalesced kernel.

    A plain send/recv launches its kernel inside its own record_param_comms. Inside
    batch_isend_irecv (NCCL group) it launches nothing: one kernel is launched at
    endCoalescing, outside every op's scope, for all the ops posted since the group began.
    So the ops without a launch of their own belong to the next NCCL kernel their thread
    launches outside any record_param_comms, provided no other collective came between."""
    host = (df["lane_kind"] == "host").to_numpy()
    kern = df[(df["is_nccl"] & df["correlation"].notna()).to_numpy()]
    launch = df[host & (df["category"] == "runtime").to_numpy()
                & df["correlation"].isin(kern["correlation"]).to_numpy()]
    kernel_row = pd.Series(kern.index.to_numpy(), index=kern["correlation"].to_numpy(np.int64))
    kernel_row = kernel_row[~kernel_row.index.duplicated()]
    rpc = df[host & (df["name"] == "record_param_comms").to_numpy()]
    # a scope around endCoalescing itself (if a PyTorch version records one) opens no new op
    rpc = rpc[~rpc["collective"].astype(str).str.contains("coalesced", case=False).to_numpy()]
    out = np.full(len(ops), -1, dtype=np.int64)
    # threads numbered as they first appear in ops; launches and scopes of other threads: -1
    op_lane, c_lane, r_lane = _lanes(ops, launch, rpc)
    by_time = np.lexsort((launch["start_ns"].to_numpy(), c_lane))  # stable: listed order at one start
    by_time = by_time[c_lane[by_time] >= 0]
    calls, c_lane = launch.iloc[by_time], c_lane[by_time]
    c_start, c_end = calls["start_ns"].to_numpy(np.int64), calls["end_ns"].to_numpy(np.int64)
    c_kernel = kernel_row.reindex(calls["correlation"].to_numpy(np.int64)).to_numpy()
    # a launch inside the op's own scope: its kernel (the first launch of its thread from its start on)
    s, e = ops["start_ns"].to_numpy(np.int64), ops["end_ns"].to_numpy(np.int64)
    inside = np.zeros(len(ops), bool)
    if len(calls):
        c_key, s_key = lane_keys([c_lane, op_lane], [c_start, s])
        j = np.searchsorted(c_key, s_key, side="left")
        k = np.clip(j, 0, len(calls) - 1)
        inside = (j < len(calls)) & (c_lane[k] == op_lane) & (c_end[k] <= e)
        out[inside] = c_kernel[j[inside]]
    # the others: by order, to the next launch of their thread outside every
    # record_param_comms, when nothing else (a collective, a send/recv with its own kernel)
    # came between
    theirs = rpc.assign(lane=r_lane)[r_lane >= 0]
    t_lane = theirs["lane"].to_numpy(np.int64)
    free = ~_covered(t_lane, theirs["start_ns"].to_numpy(np.int64), theirs["end_ns"].to_numpy(np.int64),
                     c_lane, c_start)
    pending = np.isin(theirs.index.to_numpy(), ops.index[~inside])
    # one timeline per thread of its scopes and free launches; at one instant a launch first
    lane = np.concatenate([t_lane, c_lane[free]])
    t = np.concatenate([theirs["start_ns"].to_numpy(np.int64), c_start[free]])
    what = np.concatenate([np.where(pending, _PENDING, _OTHER), np.full(int(free.sum()), _LAUNCH)])
    ref = np.concatenate([theirs.index.to_numpy(np.int64), calls.index.to_numpy(np.int64)[free]])
    call = np.concatenate([np.full(len(theirs), -1), np.flatnonzero(free)])
    order = np.lexsort((ref, what != _LAUNCH, t, lane))
    lane, what, ref, call = lane[order], what[order], ref[order], call[order]
    breaks = np.flatnonzero(what != _PENDING)  # each pending op goes to the first break after it
    ops_at = np.flatnonzero(what == _PENDING)
    nxt = np.searchsorted(breaks, ops_at)
    has = nxt < len(breaks)
    to_launch = np.zeros(len(ops_at), bool)
    to_launch[has] = (what[breaks[nxt[has]]] == _LAUNCH) & (lane[breaks[nxt[has]]] == lane[ops_at[has]])
    members, launch_at = ref[ops_at[to_launch]], call[breaks[nxt[to_launch]]]
    rows = c_kernel[launch_at].astype(np.int64)
    out[ops.index.get_indexer(members)] = rows
    return out, pd.DataFrame({"kernel": rows, "op": members.astype(np.int64)})


def _labelled_directions(df: pd.DataFrame, kernel: np.ndarray, is_send: np.ndarray) -> np.ndarray:
    """Per op (its kernel's row, whether it sends): the direction torch's ``PP::`` p2p label
    (p2p_args.pp_comm_label: ``dist.record_comm`` names the Work ``PP::fwd_send (stage 0)``
    where NCCL writes ``nccl:send``) around the kernel's launch call gives it, "" where none
    does. A coalesced batch's label (``PP::fwd_send_bwd_recv``) is around the one launch of
    its ops: each takes the direction of its own side."""
    out = np.full(len(kernel), "", dtype=object)
    host = (df["lane_kind"] == "host").to_numpy()
    name = df["name"] if isinstance(df["name"].dtype, pd.CategoricalDtype) else df["name"].astype("category")
    said = [pp_comm_label(n) for n in name.cat.categories]  # per distinct name
    if not any(said):
        return out
    table = pd.DataFrame([s or ("", "", -1) for s in said] + [("", "", -1)], columns=["send", "recv", "stage"])
    codes = name.cat.codes.to_numpy()
    is_label = host & ((table["send"] != "") | (table["recv"] != "")).to_numpy()[codes]
    corr = df.loc[kernel, "correlation"].to_numpy(np.int64)
    calls = df[host & (df["category"] == "runtime").to_numpy() & df["correlation"].isin(corr).to_numpy()]
    calls = calls[~calls["correlation"].duplicated(keep="last").to_numpy()]
    call = pd.Index(calls["correlation"].to_numpy(np.int64)).get_indexer(corr)
    labels = df[is_label]
    l_lane, c_lane = _lanes(labels, calls)
    has = call >= 0
    has[has] = c_lane[call[has]] >= 0  # a launch on a thread with no label
    inner = np.full(len(kernel), -1)
    c = call[has]
    inner[has] = _innermost(l_lane, labels["start_ns"].to_numpy(np.int64), labels["end_ns"].to_numpy(np.int64),
                            c_lane[c], calls["start_ns"].to_numpy(np.int64)[c], calls["end_ns"].to_numpy(np.int64)[c])
    found = inner >= 0
    code = codes[is_label][inner[found]]
    out[found] = np.where(is_send[found], table["send"].to_numpy(object)[code], table["recv"].to_numpy(object)[code])
    return out


def infer_nccl_p2p(df: pd.DataFrame, rank: int, warnings: list | None = None) -> int:
    """Pipeline p2p of a plain NCCL trace (in place): every send/recv ``record_param_comms``
    with its kernel becomes a ``pp`` row as a contract range would (op send_*/recv_*, peer =
    the peer's global rank, bytes from nelems x dtype, category p2p, inferred=True), and its
    ``correlation`` is set to its kernel's, so that projection.gpu_extent gives it the
    kernel's times: matching (match.py) then pairs sends with recvs FIFO per (group, src,
    dst, step) and wait/transfer come from the kernels, exactly as for contract ranges.

    NCCL does not say whether a message is an activation or a gradient: torch's ``PP::``
    label around the kernel's launch says (:func:`_labelled_directions`), else the direction
    is read from rank order (to a higher global rank: fwd), a guess that is the same on both
    sides of every pair, which is all the pairing needs; the wrap-around of interleaved
    schedules (last stage to first) then reads as bwd. Ops nested in a contract pp range carry
    a pptrace range already and are left alone. Returns how many ops were inferred."""
    host = (df["lane_kind"] == "host").to_numpy()
    base = _p2p_side(df["collective"])
    sel = host & (df["name"] == "record_param_comms").to_numpy() & (base != "")
    if not sel.any():
        return 0
    tagged = df[host & (df["category"] == "p2p").to_numpy() & df["peer"].notna().to_numpy() & ~df["inferred"].to_numpy()]
    if len(tagged):
        ops = df[sel]
        t_lane, o_lane = _lanes(tagged, ops)
        inside = _covered(t_lane, tagged["start_ns"].to_numpy(np.int64), tagged["end_ns"].to_numpy(np.int64),
                          o_lane, ops["start_ns"].to_numpy(np.int64))
        sel[np.flatnonzero(sel)[inside]] = False
    ops = df[sel].sort_values("start_ns", kind="stable")
    if ops.empty:
        return 0
    is_send = base[ops.index.to_numpy()] == "send"
    peer = _peers(ops, rank, is_send)
    kernel, coalesced = _kernel_of_ops(df, ops)
    ok = ~np.isnan(peer) & (kernel >= 0)
    if warnings is not None and (~ok).any():
        no_peer, no_kernel = int(np.isnan(peer).sum()), int((kernel < 0).sum())
        warnings.append(
            f"{int((~ok).sum())} NCCL send/recv ops are not pipeline p2p pairs: {no_peer} without a peer "
            f"(their record_param_comms lacks Dst Rank / Src Rank: PyTorch before 2.4), {no_kernel} "
            "without their kernel (profile with ProfilerActivity.CUDA)")
    ops, is_send, peer, kernel = ops[ok], is_send[ok], peer[ok].astype(np.int64), kernel[ok]
    if ops.empty:
        return 0
    rows = ops.index.to_numpy()
    named = _labelled_directions(df, kernel, is_send)
    forward = np.where(named != "", named == "fwd", np.where(is_send, peer > rank, peer < rank))
    op = np.where(is_send, np.where(forward, SEND_FWD, SEND_BWD), np.where(forward, RECV_FWD, RECV_BWD))
    nelems = ops["in_nelems"].fillna(ops["out_nelems"]).astype("Float64").to_numpy(np.float64, na_value=np.nan)
    dtype = ops["dtype"].astype("category")
    per_dtype = np.array([itemsize(d) or np.nan for d in dtype.cat.categories] + [np.nan], dtype=np.float64)
    size = per_dtype[dtype.cat.codes.to_numpy()]  # code -1 (null) takes the last entry
    nbytes = pd.array(nelems * size, dtype="Float64").astype("Int64")  # NaN (dtype unknown) -> NA
    _set(df, "kind", rows, "pp")
    _set(df, "op", rows, op)
    _set(df, "category", rows, "p2p")
    df.loc[rows, "peer"] = peer
    df.loc[rows, "bytes"] = nbytes
    df.loc[rows, "correlation"] = df.loc[kernel, "correlation"].to_numpy()
    df.loc[rows, "inferred"] = True
    # the coalesced kernel is p2p, not whatever range was open at endCoalescing ("nccl:coalesced")
    if len(coalesced):
        kernels = coalesced["kernel"].unique()
        plain = ~df.loc[kernels, "collective"].map(is_p2p_collective).to_numpy(bool)
        _set(df, "collective", kernels[plain], COALESCED_P2P)
        for field in ("group_ranks", "pg_name"):
            # the group of the kernel's ops, where they agree on one and the kernel has none
            values = df.loc[coalesced["op"].to_numpy(), field].astype(object).to_numpy()
            agree = pd.DataFrame({"kernel": coalesced["kernel"].to_numpy(), "v": values}).dropna() \
                .groupby("kernel")["v"].agg(["nunique", "first"])
            agree = agree[(agree["nunique"] == 1).to_numpy() & df.loc[agree.index, field].isna().to_numpy()]
            if len(agree):
                _set(df, field, agree.index.to_numpy(), agree["first"].astype(str).to_numpy())
    return len(rows)
