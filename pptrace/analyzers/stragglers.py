"""Stragglers: the ranks that make the others wait, with the step time they cost.

A straggler's own timeline shows the extra time as compute; its peers see it as bubble
(recvs posted early, waiting for its sends) or as collective wait (it arrives last). So
the culprit is found from its own excess, and the waits name who suffered:

- ``compute``: the rank computes longer per step than the median rank. In a pipeline every
  microbatch round is paced by the slowest stage, and a data-parallel group waits for its
  slowest member at the gradient all-reduce, so the excess is the step-time cost.
  slowdown = rank / median - 1.
- ``collective_arrival``: the rank is the last to arrive at collectives; cost = how long
  the group waited for it alone (last minus second-last arrival), per step, beyond what the
  median rank made its groups wait; slowdown = the share of its collective instances in
  which it came last.

Only a *persistent* excess names a rank. Processes sharing too few cores are descheduled at
random, and in any one step some rank is the slowest, some member of every pair arrives
last: that is noise, and a rank the noise favoured in one step is not slow. So each step is
compared on its own (a step slow for everyone cancels), and a rank is late in a step when it
exceeds that step's median rank by more than ``NOISE_SPREADS`` times the run's own spread —
the larger of how much a rank's excess varies from one of its steps to the next and how far
the ranks' steady offsets scatter (so it must stand out from its peers) — and by more than
the thresholds below. It is named when late in most steps; cost_s and slowdown are medians over
its steps. The row carries that evidence: steps_late of steps, spread_s, and ``evidence``,
the sentence to show.

Each row also carries ``peers_wait_s``: how long per step the recvs paired with this rank's
sends waited for them — the victims' side. It is evidence, not a metric of its own: in any
pipeline the schedule's bubble makes every stage's sends wait-causing, so it cannot name a
culprit alone.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweeps import isin

COLUMNS = ("rank", "metric", "slowdown", "cost_s", "peers_wait_s", "steps_late", "steps", "spread_s", "evidence")
#: below these a difference is noise, not a straggler.
MIN_SLOWDOWN = 0.05
MIN_COST_FRACTION = 0.01
#: an excess within this many spreads of the median rank is noise (normal noise goes beyond
#: three standard deviations about once in 700 draws)
NOISE_SPREADS = 3.0
#: the MAD of normal noise times this is its standard deviation
MAD_TO_SIGMA = 1.4826


def _robust_sigma(x: np.ndarray) -> float:
    """Standard deviation from the median absolute deviation: one outlier (the straggler
    itself) does not widen it."""
    x = x[np.isfinite(x)]
    return float(MAD_TO_SIGMA * np.median(np.abs(x - np.median(x)))) if x.size else 0.0


def _spreads(excess: pd.DataFrame) -> tuple[float | None, float | None]:
    """The run's own noise (seconds), two ways: (step to step: each rank's excess around its
    own median over steps; across ranks: the ranks' steady offsets). Descheduling gives both:
    a rank unlucky in one step, and ranks unlucky for several steps running (processes
    sharing too few cores keep their share of them for a while). None where it cannot be measured: one step;
    fewer than three ranks, whose offsets are the same distance either side of their median."""
    steps = (excess.sub(excess.median(axis=1), axis=0).to_numpy(float) if excess.shape[1] > 1 else None)
    ranks = excess.median(axis=1).to_numpy(float) if len(excess) > 2 else None
    return (None if steps is None else _robust_sigma(steps.ravel()),
            None if ranks is None else _robust_sigma(ranks))


def _persistent(values: pd.DataFrame, floor: np.ndarray, metric: str) -> pd.DataFrame:
    """``values``: seconds per (rank row, step column), NaN where a rank lacks the step;
    ``floor``: per rank and step, the least excess that matters. -> per named rank: metric,
    cost_s, relative (excess / the median rank), steps_late, steps, spread_s, evidence."""
    ref = values.median(axis=0)  # the median rank of each step
    excess = values.sub(ref, axis=1)
    by_step, by_rank = _spreads(excess)
    if by_step is None and by_rank is None:
        # one step of two ranks: nothing tells a slow rank from a slow moment
        return pd.DataFrame(columns=["rank", "metric", "cost_s", "relative", "steps_late", "steps", "spread_s",
                                     "evidence"])
    spread = max(by_step or 0.0, by_rank or 0.0)
    late = excess.to_numpy(float) > np.maximum(NOISE_SPREADS * spread, floor)  # NaN compares False
    steps = values.notna().sum(axis=1).to_numpy()
    steps_late = late.sum(axis=1)
    named = (steps > 0) & (steps_late * 2 > steps)
    relative = excess.div(ref.where(ref > 0), axis=1)
    out = pd.DataFrame({"rank": values.index.to_numpy()[named].astype(int), "metric": metric,
                        "cost_s": excess[named].median(axis=1).to_numpy(float),
                        "relative": relative[named].median(axis=1).to_numpy(float),
                        "steps_late": steps_late[named].astype(int), "steps": steps[named].astype(int),
                        "spread_s": spread})
    noise = "; ".join(f"{what} {value * 1e3:.2g} ms" for what, value in
                      (("step to step", by_step), ("across ranks", by_rank)) if value is not None)
    out["evidence"] = [f"late in {k} of {n} steps by {c * 1e3:.3g} ms (median); noise spread {noise}"
                       for k, n, c in zip(out["steps_late"], out["steps"], out["cost_s"])]
    return out


def _compute_rows(partitions, step_s: float) -> pd.DataFrame:
    table = pd.DataFrame({"rank": partitions.rank, "step": partitions.step,
                          "compute_s": partitions.totals("compute") / 1e9})
    # pivot_table's own sum and layout, without its general machinery (4x its time here)
    values = table.groupby(["rank", "step"])["compute_s"].sum().unstack()
    if len(values) < 2:
        return pd.DataFrame()
    floor = np.maximum(MIN_SLOWDOWN * values.median(axis=0).to_numpy(float), MIN_COST_FRACTION * step_s)
    rows = _persistent(values, floor, "compute")
    return rows.assign(slowdown=rows["relative"])


def _arrival_rows(waits: pd.DataFrame, ranks: pd.Index, steps: pd.Index, step_s: float) -> pd.DataFrame:
    if waits.empty or len(ranks) < 2:
        return pd.DataFrame()
    waits = waits[isin(waits["step"], steps)]
    if waits.empty:
        return pd.DataFrame()
    waits = waits.astype({"rank": np.int64, "step": np.int64})
    # a rank at no collective of a step kept nobody waiting in it
    lateness = (waits.groupby(["rank", "step"])["late_ns"].sum().unstack()
                .reindex(index=ranks, columns=steps).fillna(0.0) / 1e9)
    rows = _persistent(lateness, np.full(lateness.shape, MIN_COST_FRACTION * step_s), "collective_arrival")
    share = waits.groupby("rank")["is_last"].mean()
    return rows.assign(slowdown=rows["rank"].map(share).to_numpy(float))


def _caused_waits(pairs: pd.DataFrame | None, n_steps: int) -> dict:
    if pairs is None or pairs.empty:
        return {}
    caused = pairs.groupby("src")["wait_ns"].sum() / 1e9 / max(n_steps, 1)
    return {int(r): float(v) for r, v in caused.items()}


def find_stragglers(partitions, pairs: pd.DataFrame | None, waits: pd.DataFrame) -> pd.DataFrame:
    """Rows {rank, metric, slowdown, cost_s, peers_wait_s, steps_late, steps, spread_s,
    evidence}, the most costly first (the culprit); none when no rank is persistently late.
    ``waits``: the collective waits of the run (collectives.profiled_waits)."""
    if not len(partitions):
        return pd.DataFrame(columns=list(COLUMNS))
    ranks = pd.Index(np.unique(partitions.rank), dtype=np.int64)
    steps = pd.Index(np.unique(partitions.step), dtype=np.int64)
    step_s = float(np.mean(partitions.wall_ns)) / 1e9
    found = [f for f in (_compute_rows(partitions, step_s), _arrival_rows(waits, ranks, steps, step_s)) if len(f)]
    if not found:
        return pd.DataFrame(columns=list(COLUMNS))
    out = pd.concat(found, ignore_index=True)
    caused = _caused_waits(pairs, len(steps))
    out["peers_wait_s"] = out["rank"].map(caused).fillna(0.0).astype(float)
    out = out[list(COLUMNS)]
    return out.sort_values(["cost_s", "rank"], ascending=[False, True], kind="stable").reset_index(drop=True)
