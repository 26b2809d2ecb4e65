"""Collectives by parallel dimension: how many, how big, how long in progress, how much of
that exposed vs hidden under compute, and how much of it is waiting for late ranks.

A rank's *wait* in one collective instance is the time from its own arrival to the last
rank's arrival (it could not finish before everyone came); the rest until it leaves is the
*transfer*. The step-final grad-norm all-reduce is left out of wait/transfer: its wait is
the pipeline draining (counted as pp_bubble in the step partition), not a collective cost.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..naming import parse_name
from ..sweeps import isin
from ..timeline.activity import kernel_dim
from ..vocab import COMM_CATEGORIES, COMM_DIMS, is_step_end

COLUMNS = ("dim", "count", "bytes", "time_s", "exposed_s", "hidden_s", "wait_s", "transfer_s", "ops")


def instance_waits(inst: pd.DataFrame) -> pd.DataFrame:
    """Per (instance, rank): wait_ns (last arrival - own arrival), transfer_ns, is_last; with
    the call's event ``index``, ``op`` and ``group``."""
    if inst is None or inst.empty:
        return pd.DataFrame(columns=["instance", "rank", "kind", "op", "name", "step", "group", "index", "wait_ns",
                                     "transfer_ns", "late_ns", "is_last", "n"])
    df = inst[["instance", "rank", "kind", "op", "name", "step", "group", "index", "arrive_ns", "leave_ns"]].copy()
    g = df.groupby("instance")["arrive_ns"]
    df["n"] = g.transform("size")
    last = g.transform("max")
    df["wait_ns"] = (last - df["arrive_ns"]).astype(np.int64)
    df["transfer_ns"] = np.maximum(df["leave_ns"] - last, 0).astype(np.int64)
    # How long the group waited because of this rank alone: last minus second-last arrival.
    second = _second_latest(df["instance"].to_numpy(), df["arrive_ns"].to_numpy(np.int64))
    df["is_last"] = (df["arrive_ns"] == last) & (df["n"] > 1)
    df["late_ns"] = np.where(df["is_last"], last - second, 0).astype(np.int64)
    return df


def _second_latest(group, values: np.ndarray) -> np.ndarray:
    """Per row, the second-largest ``values`` of its group (the largest for a group of one):
    one sort, then each group's last-but-one position."""
    codes = pd.factorize(group)[0]
    order = np.lexsort((values, codes))
    sorted_codes = codes[order]
    ends = np.flatnonzero(np.r_[sorted_codes[1:] != sorted_codes[:-1], True])  # last row of each group
    starts = np.r_[0, ends[:-1] + 1]
    pick = np.where(ends > starts, ends - 1, ends)
    return values[order][pick][codes]


def step_end_rows(names: pd.Series) -> np.ndarray:
    """Which instances, by their range name, are the step-end collective (vocab.STEP_END_TAGS);
    one parse per distinct name."""
    names = names.astype(str)
    found = {n: is_step_end(getattr(parse_name(n), "tags", {})) for n in names.unique()}
    return names.map(found).to_numpy(bool)


def profiled_waits(run, inst: pd.DataFrame | None) -> pd.DataFrame:
    """instance_waits of the profiled steps' collectives of more than one rank, step-end
    all-reduce left out, with their dim."""
    waits = instance_waits(inst if inst is not None else run.collectives)
    if waits.empty:
        return waits.assign(dim=pd.Series(dtype=object))
    waits = waits[(waits["n"] > 1) & ~step_end_rows(waits["name"])]
    if run.steps:
        waits = waits[waits["step"].isin(list(run.steps))]
    kind = waits["kind"].astype(str)
    dim = kind.where(kind.isin(list(COMM_DIMS)), "dp").to_numpy(object)
    nccl = (kind == "nccl").to_numpy()
    if nccl.any():
        dim[nccl] = _kernel_dims(run, waits[nccl])
    return waits.assign(dim=dim)


def _kernel_dims(run, waits: pd.DataFrame) -> np.ndarray:
    """The dim of each NCCL collective kernel's instance row as the step partition gives it
    (activity.kernel_dim: its process group's description, else the layout group its ranks
    are, an all_to_all on an unknown group ep), once per distinct rank, group, collective and
    process group."""
    pg_name = run.events["pg_name"].reindex(waits["index"].to_numpy()).astype(object).to_numpy()
    key = pd.DataFrame({"rank": waits["rank"].to_numpy(), "group": waits["group"].astype(str).to_numpy(),
                        "op": waits["op"].astype(str).to_numpy(), "pg": pd.Series(pg_name).astype(str).to_numpy()})
    codes, uniques = pd.factorize(pd.MultiIndex.from_frame(key))
    groups = run.process_groups
    found = np.array([kernel_dim(g, int(r), run.layout, op, None if pg == "nan" else pg, groups.get(int(r)))[0]
                      for r, g, op, pg in uniques], dtype=object)
    return found[codes]


def waits_by_rank(run, inst: pd.DataFrame | None = None, waits: pd.DataFrame | None = None) -> pd.DataFrame:
    """rank, dim, wait_s, transfer_s: each rank's collective time per profiled step (mean),
    waiting for the group's last arrival vs after it. Under expert imbalance the ranks of
    the lighter experts wait in the combine for the one with the most tokens. ``waits``:
    ``profiled_waits(run, inst)`` where the caller has it already."""
    waits = profiled_waits(run, inst) if waits is None else waits
    columns = ["rank", "dim", "wait_s", "transfer_s"]
    if waits.empty:
        return pd.DataFrame(columns=columns)
    n_steps = max(len(run.steps), 1)
    out = waits.groupby(["rank", "dim"], as_index=False)[["wait_ns", "transfer_ns"]].sum()
    return pd.DataFrame({"rank": out["rank"].astype(np.int64), "dim": out["dim"],
                         "wait_s": out["wait_ns"] / n_steps / 1e9, "transfer_s": out["transfer_ns"] / n_steps / 1e9})


def collectives_by_dim(run, partitions, inst: pd.DataFrame | None = None,
                       waits: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per dimension with communication: per rank per step means (``waits`` as in
    waits_by_rank)."""
    ev = run.events
    keep = isin(ev["category"], COMM_CATEGORIES) & ((ev["lane_kind"] == "host")
                                                    & ~ev["gpu_annotation"] & (ev["step"] >= 0)).to_numpy()
    if run.steps:
        keep = keep & isin(ev["step"], run.steps)
    calls = ev.loc[keep, ["kind", "op", "bytes"]]  # the columns read below, not a copy of every row's all
    n_rank_steps = max(len(partitions), 1)
    waits = profiled_waits(run, inst) if waits is None else waits
    w_dim = waits["dim"].to_numpy(object) if not waits.empty else None
    waits = waits[["wait_ns", "transfer_ns"]]
    rows = []
    for dim in COMM_DIMS:
        mine = calls[calls["kind"] == dim]
        exposed = int(partitions.totals(f"{dim}_exposed").sum()) / n_rank_steps / 1e9
        hidden = int(partitions.hidden[dim].sum()) / n_rank_steps / 1e9
        w = waits[w_dim == dim] if w_dim is not None else waits
        if mine.empty and exposed == 0 and hidden == 0 and w.empty:
            continue
        rows.append({
            "dim": dim,
            "count": len(mine) / n_rank_steps,
            "bytes": float(mine["bytes"].fillna(0).sum()) / n_rank_steps,
            "time_s": exposed + hidden,
            "exposed_s": exposed, "hidden_s": hidden,
            "wait_s": float(w["wait_ns"].sum()) / n_rank_steps / 1e9 if not w.empty else 0.0,
            "transfer_s": float(w["transfer_ns"].sum()) / n_rank_steps / 1e9 if not w.empty else 0.0,
            "ops": {str(op): n / n_rank_steps for op, n in mine["op"].astype(str).value_counts().sort_index().items()},
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))
