"""The comparisons beside the waterfall: communication per dimension (exposed, hidden, wait,
transfer), pipeline links per pair of stages, the stragglers that appeared or went, the
critical path's bound before and after, and the typical step of each run (the page draws its
pipeline)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from .setup import DIMS

_BOUNDS = {"compute_s": "compute", "p2p_s": "p2p", "comm_s": "collectives", "other_s": "host overhead"}


def _pair(b, n) -> dict:
    b, n = float(b or 0.0), float(n or 0.0)
    return {"base": b, "new": n, "delta": n - b}


def dims(base: dict, new: dict, run_changes: dict, sizes: tuple[dict, dict]) -> list[dict]:
    """Per communication dimension either run has: its sizes, exposed and hidden time (mean per
    rank per step, with noise: ``run_changes``) and the collectives' wait and transfer (per rank
    per step, from ``collectives[]``)."""
    rows_b = {c["dim"]: c for c in base.get("collectives") or []}
    rows_n = {c["dim"]: c for c in new.get("collectives") or []}
    out = []
    for dim in (d for d in DIMS if d != "pp"):
        exposed, hidden = run_changes.get(f"{dim}_exposed"), run_changes.get(f"hidden_{dim}")
        cb, cn = rows_b.get(dim, {}), rows_n.get(dim, {})
        if not (cb or cn or (exposed and (exposed["base_s"] or exposed["new_s"]))):
            continue
        size = {"base": sizes[0][dim], "new": sizes[1][dim]}
        out.append({"dim": dim, "size": size, "comparable": size["base"] > 1 and size["new"] > 1,
                    "exposed": exposed, "hidden": hidden,
                    **{k: _pair(cb.get(k), cn.get(k)) for k in ("time_s", "wait_s", "transfer_s")}})
    return out


def _stage_links(doc: dict) -> pd.DataFrame:
    links = pd.DataFrame((doc.get("p2p") or {}).get("links") or [],
                         columns=["src", "dst", "count", "bytes", "wait_s", "transfer_s"])
    stage = {r["rank"]: (r.get("coords") or {}).get("pp") for r in doc["ranks"]}
    links = links.assign(src_stage=links["src"].map(stage), dst_stage=links["dst"].map(stage)).dropna(
        subset=["src_stage", "dst_stage"])
    per = links.groupby(["src_stage", "dst_stage"]).agg(
        links=("src", "size"), count=("count", "sum"), bytes=("bytes", "sum"), wait_s=("wait_s", "sum"),
        transfer_s=("transfer_s", "sum"))
    # per link: a stage pair of dp x tp replicas has as many links, each a rank's own
    return per[["count", "bytes", "wait_s", "transfer_s"]].div(per["links"], axis=0)


def links(base: dict, new: dict) -> list[dict]:
    """Per (src stage, dst stage) of the pipeline in both runs: wait and transfer per link per
    step (wait is bubble, transfer is pp_transfer), messages and bytes."""
    lb, ln = _stage_links(base), _stage_links(new)
    shared = lb.index.intersection(ln.index)
    return [{"src_stage": int(s), "dst_stage": int(d),
             **{k: _pair(lb.at[(s, d), k], ln.at[(s, d), k]) for k in ("wait_s", "transfer_s", "count", "bytes")}}
            for s, d in shared]


def stragglers(base: dict, new: dict, by_rank: bool, by_stage: bool) -> dict:
    """The stragglers that appeared in NEW, went from BASE, and stayed: matched by (rank,
    metric) under one layout, by (stage, metric) under one pipeline depth; else each run's
    own, unmatched."""
    def keyed(doc):
        stage = {r["rank"]: (r.get("coords") or {}).get("pp") for r in doc["ranks"]}
        out = {}
        for s in doc.get("stragglers") or []:
            row = {k: s.get(k) for k in ("rank", "metric", "slowdown", "cost_s", "evidence")}
            row["stage"] = stage.get(s["rank"])
            key = (s["rank"], s["metric"]) if by_rank else (row["stage"], s["metric"]) if by_stage else id(row)
            out[key] = row
        return out

    kb, kn = keyed(base), keyed(new)
    return {"matched_by": "rank" if by_rank else "stage" if by_stage else None,
            "appeared": [kn[k] for k in kn if k not in kb], "disappeared": [kb[k] for k in kb if k not in kn],
            "stayed": [{"base": kb[k], "new": kn[k]} for k in kn if k in kb]}


def _bound(doc: dict) -> dict | None:
    bounds = [b for b in doc.get("critical_path") or [] if b.get("length_s")]
    if not bounds:
        return None
    table = pd.DataFrame(bounds)
    shares = table[list(_BOUNDS)].div(table["length_s"], axis=0).mean()
    per_step = table[list(_BOUNDS)].idxmax(axis=1).map(_BOUNDS)
    return {"bound": Counter(per_step).most_common(1)[0][0], "length_s": float(table["length_s"].median()),
            "shares": {_BOUNDS[k]: float(v) for k, v in shares.items()}, "steps": len(table)}


def critical_path(base: dict, new: dict) -> dict:
    """What bounded the steps before and after (the bound of most steps, the median path)."""
    b, n = _bound(base), _bound(new)
    return {"base": b, "new": n, "changed": None if b is None or n is None else b["bound"] != n["bound"]}


def typical_step(cells: pd.DataFrame) -> int | None:
    """The step whose mean time over the ranks is nearest the median step's."""
    if cells.empty:
        return None
    per = cells.groupby("step")["time_s"].mean()
    return int((per - per.median()).abs().idxmin())


def timeline(doc: dict, step: int | None) -> dict:
    """The passes of ``step`` on the first rank of each stage (from the pipeline window's
    start): what the page draws, one run above the other."""
    rows = pd.DataFrame((doc.get("pipeline") or {}).get("microbatch_times") or [],
                        columns=["rank", "stage", "step", "mb", "chunk", "op", "start_s", "dur_s"])
    rows = rows[rows["step"] == step]
    first = rows.groupby("stage")["rank"].transform("min")
    rows = rows[(rows["rank"] == first).to_numpy()].sort_values(["stage", "start_s"], kind="stable")
    return {"step": step, "passes": rows.astype({"rank": np.int64, "stage": np.int64, "mb": np.int64,
                                                  "chunk": np.int64}).to_dict("records")}
