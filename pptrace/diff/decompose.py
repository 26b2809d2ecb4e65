"""The change of the step time split into the parts the report already has, per scope (the
whole run; each stage, where the two runs have the same stages): for every quantity the mean
over the scope's cells (rank, step) on each side, the change, its noise and whether it is
significant; and the waterfall from BASE's step time to NEW's, whose items (compute by pass
type, the bubble's schedule and latency parts, p2p transfer, exposed communication per
dimension, other) sum to the measured change. Each cell's items sum to its step time
(contract 3), so the mean changes do too; what floating point leaves is the ``unexplained``
item, nanoseconds' worth at most, which makes the sum exact."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .noise import pooled, significant, spreads

STEP = "time_s"


def changes(base: pd.DataFrame, new: pd.DataFrame, scope: str | None, quantities: list[str]) -> pd.DataFrame:
    """One row per (scope value, quantity): base_s, new_s, delta_s, noise_s, significant.
    ``scope``: a column of the cells (``stage``) or None for the whole run (scope value 0);
    a scope value on one side only is left out."""
    def means(cells):
        key = cells[scope] if scope else np.zeros(len(cells), dtype=np.int64)
        return cells[quantities].groupby(key).mean()

    mb, mn = means(base), means(new)
    shared = mb.index.intersection(mn.index)
    sb, sn = spreads(base, scope, quantities), spreads(new, scope, quantities)
    long = pd.DataFrame({
        "scope": np.repeat(shared.to_numpy(), len(quantities)),
        "quantity": np.tile(quantities, len(shared)),
        "base_s": mb.loc[shared].to_numpy().ravel(), "new_s": mn.loc[shared].to_numpy().ravel(),
        "noise_s": pooled(sb.reindex(shared).to_numpy().ravel(), sn.reindex(shared).to_numpy().ravel()),
    })
    long["delta_s"] = long["new_s"] - long["base_s"]
    long["significant"] = significant(long["delta_s"], long["noise_s"])
    return long


def change(row) -> dict:
    """A change as the document writes it: base_s, new_s, delta_s, fraction (of base), noise_s
    (the pooled spread; significance needs 3 of them), significant."""
    base = float(row["base_s"])
    return {"base_s": base, "new_s": float(row["new_s"]), "delta_s": float(row["delta_s"]),
            "fraction": float(row["delta_s"]) / base if base else None,
            "noise_s": None if not math.isfinite(row["noise_s"]) else float(row["noise_s"]),
            "significant": row["significant"]}


def by_quantity(long: pd.DataFrame) -> dict:
    """scope value -> {quantity: change}, scopes in order (one pass over the rows)."""
    out: dict = {}
    for row in long.sort_values("scope", kind="stable").to_dict("records"):
        out.setdefault(row["scope"], {})[row["quantity"]] = change(row)
    return out


def waterfall(step: dict, values: dict, items: list[tuple[str, str]]) -> dict:
    """The waterfall of one scope: ``items`` [(item, part)] with their changes (``values``:
    quantity -> change), and ``unexplained_s``, the measured change less their sum, so that
    base + the items + unexplained = new exactly."""
    rows = [{"item": item, "part": part, **values[item]} for item, part in items]
    unexplained = step["delta_s"] - math.fsum(r["delta_s"] for r in rows)
    return {"base_s": step["base_s"], "new_s": step["new_s"], "delta_s": step["delta_s"],
            "items": rows, "unexplained_s": unexplained}
