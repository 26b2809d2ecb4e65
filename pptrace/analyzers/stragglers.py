"""Stragglers: the ranks that make the others wait, with the step time they cost.

A straggler's own timeline shows the extra time as compute; its peers see it as bubble
(recvs posted early, waiting for its sends) or as collective wait (it arrives last). So
the culprit is found from its own excess, and the waits name who suffered:

- ``compute``: the rank computes longer per step than the median rank. In a pipeline every
  microbatch round is paced by the slowest stage, and a data-parallel group waits for its
  slowest member at the gradient all-reduce, so the excess is the step-time cost.
  slowdown = rank / median - 1.
- ``collective_arrival``: the rank is the last to arrive at collectives; cost = how long
  the group waited for it alone (last minus second-last arrival), per step; slowdown =
  the share of its collective instances in which it came last.

Each row also carries ``peers_wait_s``: how long per step the recvs paired with this rank's
sends waited for them — the victims' side. It is evidence, not a metric of its own: in any
pipeline the schedule's bubble makes every stage's sends wait-causing, so it cannot name a
culprit alone.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .collectives import instance_waits, step_end_rows

COLUMNS = ("rank", "metric", "slowdown", "cost_s", "peers_wait_s")
#: below these a difference is noise, not a straggler.
MIN_SLOWDOWN = 0.05
MIN_COST_FRACTION = 0.01


def _compute_rows(partitions: list, step_s: float) -> list[dict]:
    per_rank: dict = {}
    for p in partitions:
        per_rank.setdefault(p.rank, []).append(p.parts["compute"].total / 1e9)
    if len(per_rank) < 2:
        return []
    # median over steps: one step stalled by the machine is not a straggler
    mean = {r: float(np.median(v)) for r, v in per_rank.items()}
    ref = float(np.median(list(mean.values())))
    rows = []
    for rank, value in mean.items():
        if ref > 0 and value / ref - 1 >= MIN_SLOWDOWN and value - ref >= MIN_COST_FRACTION * step_s:
            rows.append({"rank": rank, "metric": "compute", "slowdown": value / ref - 1, "cost_s": value - ref})
    return rows


def _arrival_rows(inst: pd.DataFrame | None, n_steps: int, step_s: float) -> list[dict]:
    waits = instance_waits(inst)
    if waits.empty:
        return []
    waits = waits[(waits["n"] > 1) & ~step_end_rows(waits["name"])]
    rows = []
    for rank, grp in waits.groupby("rank"):
        late = float(grp["late_ns"].sum()) / 1e9 / max(n_steps, 1)
        share = float(grp["is_last"].mean())
        if share > 0.5 and late >= MIN_COST_FRACTION * step_s:
            rows.append({"rank": int(rank), "metric": "collective_arrival", "slowdown": share, "cost_s": late})
    return rows


def _caused_waits(pairs: pd.DataFrame | None, n_steps: int) -> dict:
    if pairs is None or pairs.empty:
        return {}
    caused = pairs.groupby("src")["wait_ns"].sum() / 1e9 / max(n_steps, 1)
    return {int(r): float(v) for r, v in caused.items()}


def find_stragglers(partitions: list, pairs: pd.DataFrame | None, inst: pd.DataFrame | None) -> pd.DataFrame:
    """Rows {rank, metric, slowdown, cost_s}, the most costly first (the culprit)."""
    if not partitions:
        return pd.DataFrame(columns=list(COLUMNS))
    n_steps = len({p.step for p in partitions})
    step_s = float(np.mean([p.wall_ns for p in partitions])) / 1e9
    rows = _compute_rows(partitions, step_s) + _arrival_rows(inst, n_steps, step_s)
    caused = _caused_waits(pairs, n_steps)
    for row in rows:
        row["peers_wait_s"] = caused.get(row["rank"], 0.0)
    out = pd.DataFrame(rows, columns=list(COLUMNS))
    return out.sort_values(["cost_s", "rank"], ascending=[False, True], kind="stable").reset_index(drop=True)
