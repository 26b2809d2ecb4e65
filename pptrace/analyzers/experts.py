"""Expert load: how many tokens each ep rank's experts processed per step, how uneven that
is within each ep group, and what the unevenness cost the others.

Tokens come from the ``tokens`` tag of the forward ``compute:expert`` ranges (contract 1; the
reference trainer's MoE layers write them). The cost is read from the all-to-all waits
(collectives.waits_by_rank): in an ep group, the rank whose experts got the most tokens
arrives last at the combine, and every other rank's ep wait beyond its own is time spent
waiting for it. The culprit is that rank, never the waiters.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from ..ingest.schema import tags_of
from ..sweeps import isin

#: max over mean tokens in an ep group from which the group is called imbalanced: routing
#: noise of a balanced router stays well under it
IMBALANCED = 1.10

COLUMNS = ("rank", "ep_group", "tokens", "share_of_mean", "hottest", "wait_cost_s")


class ExpertTags(NamedTuple):
    tokens: np.ndarray  # float, NaN where a range has no usable ``tokens`` tag
    backward: np.ndarray  # bool: a ``dir=bwd`` range
    per_expert: np.ndarray  # object: the ``per_expert`` counts as a list, None where absent or not adding up


def expert_tags(tags: pd.Series) -> ExpertTags:
    """The tags of each ``compute:expert`` row from its ``tags`` column, one parse per
    distinct value."""
    codes = tags.astype("category")
    tokens, backward, per_expert = [], [], []
    for text in codes.cat.categories:
        try:
            parsed = tags_of(str(text))
        except ValueError:
            parsed = {}
        parsed = parsed if isinstance(parsed, dict) else {}
        try:
            tokens.append(float(parsed.get("tokens")))
        except (TypeError, ValueError):
            tokens.append(np.nan)
        backward.append(parsed.get("dir") == "bwd")
        try:
            counts = [int(v) for v in str(parsed["per_expert"]).split(",")]
        except (KeyError, ValueError):
            counts = None
        per_expert.append(counts if counts and min(counts) >= 0 and sum(counts) == tokens[-1] else None)
    # code -1 (no tags at all) reads the appended last entry
    c = codes.cat.codes.to_numpy()
    return ExpertTags(np.array([*tokens, np.nan])[c], np.array([*backward, False])[c],
                      np.array([*per_expert, None], dtype=object)[c])


def _forward_experts(run) -> pd.DataFrame:
    """The profiled steps' forward ``compute:expert`` rows (a backward moves the same tokens)."""
    ev = run.events
    sel = (ev["category"] == "compute").to_numpy() & (ev["op"] == "expert").to_numpy() & (ev["step"] >= 0).to_numpy()
    if run.steps:
        sel &= isin(ev["step"], run.steps)
    return ev[sel]


def expert_tokens(run) -> pd.DataFrame:
    """Tokens per expert per step: one row per (rank, step, expert) from the ``per_expert``
    tags (the counts of the rank's local experts; expert ``ep_rank * local + i``, Megatron's
    local expert indices). Empty without them."""
    columns = ["rank", "step", "expert", "tokens"]
    rows = _forward_experts(run)
    if rows.empty:
        return pd.DataFrame(columns=columns)
    parsed = expert_tags(rows["tags"])
    keep = ~parsed.backward & np.array([c is not None for c in parsed.per_expert], bool)
    if not keep.any():
        return pd.DataFrame(columns=columns)
    counts = parsed.per_expert[keep]
    lengths = np.fromiter((len(c) for c in counts), np.int64, len(counts))
    ranks = rows["rank"].to_numpy(np.int64)[keep]
    layout = run.layout
    first = {r: layout.expert_coords(r)[0] if r < layout.world_size else 0 for r in np.unique(ranks).tolist()}
    ep_rank = pd.Series(ranks).map(first).to_numpy(np.int64)
    local = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    long = pd.DataFrame({
        "rank": np.repeat(ranks, lengths), "step": np.repeat(rows["step"].to_numpy(np.int64)[keep], lengths),
        "expert": np.repeat(ep_rank * lengths, lengths) + local,
        "tokens": np.concatenate(counts).astype(np.int64),
    })
    return long.groupby(["rank", "step", "expert"], as_index=False)["tokens"].sum()


def expert_load(run, waits: pd.DataFrame) -> pd.DataFrame:
    """One row per rank with expert work: ``tokens`` per profiled step (mean), its
    ``share_of_mean`` in its ep group, whether it is its group's ``hottest`` (only in an
    imbalanced group), and for the hottest the ``wait_cost_s`` per step its group's other
    ranks spent waiting for it (mean over them). Empty without ``compute:expert`` ranges."""
    rows = _forward_experts(run)
    if rows.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    tokens, backward, _ = expert_tags(rows["tags"])  # the forward's tokens: a backward moves the same ones
    per = pd.DataFrame({"rank": rows["rank"].to_numpy(np.int64),
                        "tokens": np.where(backward | np.isnan(tokens), 0, tokens).astype(np.int64)})
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
