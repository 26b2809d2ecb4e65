"""How much a number moves by itself: each run's own spread, the rule the straggler detection
uses (analyzers/stragglers.py). Per quantity and scope (the run, a stage), a side's spread is
the larger of

- step to step: each rank's values around its own median over the steps, and
- rank to rank: the ranks' medians around their stage's median (stages of 3 ranks or more:
  with two, both sit the same distance either side),

each a robust standard deviation (1.4826 x the median absolute deviation). The two sides'
spreads are pooled (root mean square), and a change is significant only when it exceeds
``NOISE_SPREADS`` (3) pooled spreads — and the traces' microsecond resolution. A run against
itself therefore changes by exactly zero, and a re-run of the same configuration by less than
its own noise."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..analyzers.stragglers import NOISE_SPREADS, MAD_TO_SIGMA

#: below this no change is real: the traces' timestamps are microseconds
RESOLUTION_S = 1e-6
RULE = (f"significant when beyond {NOISE_SPREADS:g} x the pooled spread of both runs (spread: {MAD_TO_SIGMA} x the "
        "median absolute deviation, the larger of step to step and rank to rank within a stage) and 1 us")


def _mad(frame: pd.DataFrame, by) -> pd.DataFrame:
    """Per group: each column's robust standard deviation (NaN-skipping; NaN for none)."""
    med = frame.groupby(by).transform("median")
    return MAD_TO_SIGMA * (frame - med).abs().groupby(by).median()


def spreads(cells: pd.DataFrame, scope: str | None, quantities: list[str]) -> pd.DataFrame:
    """A side's spread (seconds) of each quantity, per value of the ``scope`` column (None:
    the whole run, as the one row 0); NaN where neither can be measured (one step, and
    fewer than three ranks in every stage)."""
    key = cells[scope].to_numpy() if scope else np.zeros(len(cells), dtype=np.int64)
    values = cells[quantities]
    several = (cells.groupby("rank")["step"].transform("size") > 1).to_numpy()
    by_step = values.sub(values.groupby(cells["rank"]).transform("median")).where(np.repeat(several[:, None], len(quantities), axis=1), np.nan)
    step_spread = _mad(by_step, key)
    if scope == "rank":  # a rank has no peers within itself
        return step_spread.reindex(columns=quantities)
    medians = values.groupby([cells["stage"], cells["rank"]]).median()
    stage = medians.index.get_level_values(0).to_numpy()
    sizes = pd.Series(stage).map(pd.Series(stage).value_counts()).to_numpy()
    off = medians.sub(medians.groupby(level=0).transform("median"))[sizes >= 3]
    rank_key = off.index.get_level_values(0).to_numpy() if scope == "stage" else np.zeros(len(off), dtype=np.int64)
    out = pd.concat([step_spread, _mad(off.reset_index(drop=True), rank_key)]).groupby(level=0).max()
    return out.reindex(columns=quantities)


def pooled(base, new):
    """Root mean square of the two sides' spreads (arrays; NaN: unknown on that side)."""
    b, n = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    known = np.isfinite(b).astype(int) + np.isfinite(n).astype(int)
    both = np.sqrt((np.nan_to_num(b) ** 2 + np.nan_to_num(n) ** 2) / np.maximum(known, 1))
    return np.where(np.isfinite(b) | np.isfinite(n), both, np.nan)


def significant(delta, noise):
    """Whether each change is beyond noise: True/False, None where no spread is known."""
    delta, noise = np.asarray(delta, dtype=float), np.asarray(noise, dtype=float)
    beyond = (np.abs(delta) > NOISE_SPREADS * np.nan_to_num(noise)) & (np.abs(delta) > RESOLUTION_S)
    return [None if not np.isfinite(s) else bool(x) for x, s in zip(np.atleast_1d(beyond), np.atleast_1d(noise))]
