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

#: columns filled on a kernel from its launching record_param_comms when the kernel lacks them
FIELDS = ("collective", "group_ranks", "pg_name", "in_nelems", "out_nelems", "dtype", "comm_seq")
_P2P = frozenset({"send", "recv", "isend", "irecv", "sendrecv", "batchisendirecv", "p2p"})


def is_p2p_collective(collective) -> bool:
    """``send``/``recv``/``batch_isend_irecv`` and friends: point-to-point, not a collective."""
    if not isinstance(collective, str):
        return False
    base = collective.split(":")[-1].lower().replace("_", "")
    return base in _P2P or base.startswith(("send", "recv"))


def _op_of(name: str) -> str | None:
    """``nccl:all_reduce`` -> all_reduce, ``c10d::recv_`` -> recv."""
    for prefix in ("nccl:", "c10d::"):
        if name.startswith(prefix):
            return name[len(prefix):].strip("_") or None
    return None


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
    names = df["name"].astype(str)
    is_op = host & (names.eq("record_param_comms") | names.str.startswith(("nccl:", "c10d::"))).to_numpy()
    ops = df[is_op]
    if ops.empty:
        return 0
    by_thread = {key: grp for key, grp in ops.groupby(["pid", "tid"], sort=False)}
    launch_of = {int(c): (int(p), int(t), int(s), int(e)) for c, p, t, s, e in zip(
        launch["correlation"], launch["pid"], launch["tid"], launch["start_ns"], launch["end_ns"])}
    updates: dict = {f: {} for f in FIELDS}
    filled = 0
    for row in df.loc[kern, ["correlation", "collective"]].itertuples():
        found = launch_of.get(int(row.correlation))
        if found is None:
            continue
        pid, tid, start, end = found
        grp = by_thread.get((pid, tid))
        if grp is None:
            continue
        around = grp[(grp["start_ns"].to_numpy() <= start) & (grp["end_ns"].to_numpy() >= end)]
        if around.empty:
            continue
        around = around.sort_values("start_ns", kind="stable")  # outermost first
        op_names = [str(n) for n in around["name"]]
        rpc = around[np.array([n == "record_param_comms" for n in op_names])]
        if len(rpc):
            inner = rpc.iloc[-1]
            for field in FIELDS:
                value = inner[field]
                if value is not None and not pd.isna(value) and pd.isna(df.at[row.Index, field]):
                    updates[field][row.Index] = value
        if pd.isna(row.collective) and row.Index not in updates["collective"]:
            named = [_op_of(n) for n in reversed(op_names)]
            named = [n for n in named if n]
            if named:
                updates["collective"][row.Index] = named[0]
        filled += row.Index in updates["collective"]
    for field, values in updates.items():
        if not values:
            continue
        if isinstance(df[field].dtype, pd.CategoricalDtype):
            full = np.array(df[field].astype(object).to_numpy(), dtype=object)  # a writable copy
            full[list(values)] = [str(v) for v in values.values()]
            df[field] = pd.Categorical(full)
        else:
            col = df[field].copy()
            col.loc[list(values)] = [int(v) for v in values.values()]
            df[field] = col
    return filled
