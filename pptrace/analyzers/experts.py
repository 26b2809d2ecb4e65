"""Expert load: how many tokens each ep rank's experts processed per step, how uneven that
is within each ep group, and what the unevenness cost the others.

Tokens come from the ``tokens`` tag of the forward ``compute:expert`` ranges (contract 1; the
reference trainer's MoE layers write them). The cost is read from the all-to-all waits
(collectives.waits_by_rank): in an ep group, the rank whose experts got the most tokens
arrives last at the combine, and every other rank's ep wait beyond its own is time spent
waiting for it. The culprit is that rank, never the waiters.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..naming import parse_name

#: max over mean tokens in an ep group from which the group is called imbalanced: routing
#: noise of a balanced router stays well under it
IMBALANCED = 1.10

COLUMNS = ("rank", "ep_group", "tokens", "share_of_mean", "hottest", "wait_cost_s")


def _tokens_of_names(names: pd.Series) -> np.ndarray:
    """The forward tokens tag of each row's name (0 for a backward or untagged range), one
    parse per distinct name."""
    names = names.astype("category")
    table = []
    for name in names.cat.categories:
        parsed = parse_name(str(name))
        tags = getattr(parsed, "tags", {}) or {}
        try:
            table.append(0 if tags.get("dir") == "bwd" else int(tags.get("tokens", 0)))
        except (TypeError, ValueError):
            table.append(0)
    table = np.array([*table, 0], dtype=np.int64)
    return table[names.cat.codes.to_numpy()]


def expert_load(run, waits: pd.DataFrame) -> pd.DataFrame:
    """One row per rank with expert work: ``tokens`` per profiled step (mean), its
    ``share_of_mean`` in its ep group, whether it is its group's ``hottest`` (only in an
    imbalanced group), and for the hottest the ``wait_cost_s`` per step its group's other
    ranks spent waiting for it (mean over them). Empty without ``compute:expert`` ranges."""
    ev = run.events
    sel = (ev["category"] == "compute").to_numpy() & (ev["op"] == "expert").to_numpy() & (ev["step"] >= 0).to_numpy()
    if run.steps:
        sel &= ev["step"].isin(list(run.steps)).to_numpy()
    if not sel.any():
        return pd.DataFrame(columns=list(COLUMNS))
    rows = ev[sel]
    per = pd.DataFrame({"rank": rows["rank"].to_numpy(np.int64), "tokens": _tokens_of_names(rows["name"])})
    n_steps = max(len(run.steps), 1)
    load = (per.groupby("rank")["tokens"].sum() / n_steps).rename("tokens").reset_index()
    layout = run.layout
    load["ep_group"] = [",".join(map(str, layout.group_ranks("ep", r))) if r < layout.world_size else str(r)
                        for r in load["rank"]]
    group = load.groupby("ep_group")["tokens"]
    load["share_of_mean"] = load["tokens"] / group.transform("mean").replace(0, np.nan)
    is_max = load["tokens"] == group.transform("max")
    imbalanced = group.transform("max") >= IMBALANCED * group.transform("mean")
    load["hottest"] = is_max & imbalanced & (group.transform("size") > 1)
    ep_wait = (waits[waits["dim"] == "ep"].set_index("rank")["wait_s"] if len(waits) else pd.Series(dtype=float))
    wait = load["rank"].map(ep_wait).fillna(0.0)
    hot_wait = wait.where(load["hottest"]).groupby(load["ep_group"]).transform("max")
    # the others' wait beyond the hottest rank's own (its noise floor), mean over them
    extra = (wait - hot_wait).clip(lower=0).where(~load["hottest"])
    cost = extra.groupby(load["ep_group"]).transform("mean")
    load["wait_cost_s"] = np.where(load["hottest"], cost.fillna(0.0), 0.0)
    return load[list(COLUMNS)].sort_values("rank").reset_index(drop=True)
