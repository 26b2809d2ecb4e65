"""A side's analysis document as one table of cells: a row per (rank, step) with the step
time, every part of the step partition (contract 3) and the finer items of the waterfall —
compute by pass type (``ranks[].steps[].compute_s``) and the bubble's schedule and latency
parts (``pipeline.stages[].steps[]``). Every number the diff compares is a mean of these
cells over a scope (the run, a stage), and every spread is theirs."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..vocab import COMM_DIMS, PARTS

PASS_ITEMS = ("fwd", "bwd", "bwd_input", "bwd_weight", "other")
COMPUTE_ITEMS = tuple(f"compute_{k}" for k in PASS_ITEMS)
BUBBLE_ITEMS = ("pp_bubble_schedule", "pp_bubble_latency")
HIDDEN = tuple(f"hidden_{d}" for d in COMM_DIMS)


def cells(doc: dict) -> pd.DataFrame:
    """rank, stage, step, time_s, PARTS, HIDDEN, COMPUTE_ITEMS and BUBBLE_ITEMS (NaN where
    the document does not split them) of every analysed (rank, step)."""
    ranks = [r for r in doc["ranks"] if r.get("steps")]
    columns = ["rank", "stage", "step", "time_s", *PARTS, *HIDDEN, *COMPUTE_ITEMS, *BUBBLE_ITEMS]
    if not ranks:
        return pd.DataFrame(columns=columns)
    flat = pd.json_normalize(ranks, record_path="steps", meta=["rank"])
    # parts a newer partition adds (a p2p peer not loaded: pp_bubble_or_transfer) are items too
    extra = [c.removeprefix("breakdown_s.") for c in flat.columns
             if c.startswith("breakdown_s.") and c.removeprefix("breakdown_s.") not in PARTS]
    stage = {r["rank"]: (r.get("coords") or {}).get("pp", 0) for r in ranks}
    out = pd.DataFrame({"rank": flat["rank"].astype(np.int64), "step": flat["step"].astype(np.int64)})
    out["stage"] = out["rank"].map(stage).fillna(0).astype(np.int64)
    out["time_s"] = flat["time_s"].astype(float)
    for part in (*PARTS, *extra):
        out[part] = _column(flat, f"breakdown_s.{part}", 0.0)
    for dim, name in zip(COMM_DIMS, HIDDEN):
        out[name] = _column(flat, f"hidden_s.{dim}", 0.0)
    for item, name in zip(PASS_ITEMS, COMPUTE_ITEMS):
        out[name] = _column(flat, f"compute_s.{item}", np.nan)
    split = _bubble_split(doc)
    if split is not None:
        out = out.merge(split, on=["rank", "step"], how="left")
    else:
        out[list(BUBBLE_ITEMS)] = np.nan
    return out[[*columns, *extra]]


def _column(flat: pd.DataFrame, key: str, missing: float) -> np.ndarray:
    return flat[key].astype(float).fillna(missing).to_numpy() if key in flat else np.full(len(flat), missing)


def _bubble_split(doc: dict) -> pd.DataFrame | None:
    stages = [s for s in (doc.get("pipeline") or {}).get("stages") or [] if s.get("steps")]
    if not stages:
        return None
    rows = pd.json_normalize(stages, record_path="steps")
    if not {"rank", "step", "bubble_schedule_s", "bubble_latency_s"} <= set(rows.columns):
        return None
    return pd.DataFrame({"rank": rows["rank"].astype(np.int64), "step": rows["step"].astype(np.int64),
                         "pp_bubble_schedule": rows["bubble_schedule_s"].astype(float),
                         "pp_bubble_latency": rows["bubble_latency_s"].astype(float)}
                        ).drop_duplicates(["rank", "step"])


def items_of(base: pd.DataFrame, new: pd.DataFrame) -> list[tuple[str, str]]:
    """The waterfall's items as (item, the part it belongs to), in the partition's order:
    compute split by pass type and the bubble into its schedule and latency parts where both
    sides split every cell, else whole. Their sum per cell is the step time."""
    def split(columns) -> bool:
        return all(len(t) and t[list(columns)].notna().all().all() for t in (base, new))

    items = []
    for part in PARTS:
        if part == "compute" and split(COMPUTE_ITEMS):
            items += [(c, part) for c in COMPUTE_ITEMS]
        elif part == "pp_bubble" and split(BUBBLE_ITEMS):
            items += [(b, part) for b in BUBBLE_ITEMS]
        else:
            items.append((part, part))
    known = {*PARTS, *COMPUTE_ITEMS, *BUBBLE_ITEMS, *HIDDEN, "rank", "stage", "step", "time_s"}
    extra = dict.fromkeys(c for t in (base, new) for c in t.columns if c not in known)
    return items + [(c, c) for c in extra]
