"""Analysis documents (contract 4) built by hand, every number known, for the diff's unit
tests: each (rank, step) cell's parts come from a function, the step time is their sum."""
from __future__ import annotations

from pptrace.topology import Layout
from pptrace.vocab import COMM_DIMS, PARTS

PASSES = ("fwd", "bwd", "bwd_input", "bwd_weight", "other")


def cell(fwd=0.010, bwd=0.020, other_compute=0.0, schedule=0.005, latency=0.001, transfer=0.0005, dp=0.0,
         tp=0.0, other=0.0002) -> dict:
    """One (rank, step): the compute split, the bubble's two parts and the rest (seconds)."""
    return {"compute_s": {"fwd": fwd, "bwd": bwd, "bwd_input": 0.0, "bwd_weight": 0.0, "other": other_compute},
            "schedule": schedule, "latency": latency, "pp_transfer": transfer, "dp_exposed": dp, "tp_exposed": tp,
            "other": other}


def document(values, *, layout=None, steps=(1, 2, 3, 4), schedule="1f1b", microbatches=4, theory=0.005,
             stragglers=(), schema="pptrace.analysis/1", versions=None) -> dict:
    """``values(rank, stage, step) -> cell(...)``; ``theory``: each stage's theory bubble (s),
    or a function of the stage."""
    layout = layout or Layout(pp=2)
    ranks, stages = [], {}
    for rank in range(layout.world_size):
        stage = layout.coords(rank).pp
        entries = []
        for step in steps:
            c = values(rank, stage, step)
            compute = sum(c["compute_s"].values())
            breakdown = {p: 0.0 for p in PARTS}
            breakdown.update(compute=compute, pp_bubble=c["schedule"] + c["latency"],
                             **{k: c[k] for k in ("pp_transfer", "dp_exposed", "tp_exposed", "other")})
            entries.append({"step": step, "time_s": sum(breakdown.values()), "breakdown_s": breakdown,
                            "hidden_s": {d: 0.0 for d in COMM_DIMS}, "compute_s": dict(c["compute_s"])})
            stages.setdefault(stage, []).append({"rank": rank, "step": step, "bubble_s": c["schedule"] + c["latency"],
                                                 "bubble_schedule_s": c["schedule"], "bubble_latency_s": c["latency"]})
        ranks.append({"rank": rank, "coords": layout.coords(rank)._asdict(), "steps": entries,
                      "mean": {"time_s": sum(e["time_s"] for e in entries) / len(entries)}})
    theory_of = theory if callable(theory) else (lambda s: theory)
    stage_rows = [{"stage": s, "ranks": sorted({e["rank"] for e in rows}), "steps": rows,
                   "bubble_s": sum(e["bubble_s"] for e in rows) / len(rows),
                   "bubble_fraction": 0.1, "theory_bubble_s": theory_of(s), "theory_bubble_fraction": 0.1,
                   "warmup_bubble_s": 0.0, "steady_bubble_s": sum(e["bubble_s"] for e in rows) / len(rows),
                   "cooldown_bubble_s": 0.0, "t_fwd_s": 0.01, "t_bwd_s": 0.02, "t_wgrad_s": 0.0}
                  for s, rows in sorted(stages.items())]
    passes = [{"rank": r["rank"], "stage": r["coords"]["pp"], "step": step, "mb": mb, "chunk": 0, "op": op,
               "start_s": 0.03 * mb + (0.01 if op == "bwd" else 0.0) + 0.002 * r["coords"]["pp"],
               "dur_s": 0.01 if op == "fwd" else 0.02}
              for r in ranks for step in steps for mb in range(microbatches) for op in ("fwd", "bwd")]
    return {
        "schema": schema,
        "run": {"world_size": layout.world_size, "layout": layout.to_dict(), "schedule": schedule,
                "microbatches": microbatches, "vpp": 1, "steps": list(steps), "ranks": list(range(layout.world_size)),
                "environment": {"hosts": {"box": list(range(layout.world_size))},
                                "versions": versions or {"torch": "2.13.0", "pptrace": "0.1.0"}}},
        "ranks": ranks,
        "pipeline": {"stages": stage_rows, "microbatch_times": passes, "bubble_fraction": 0.1,
                     "theory_bubble_fraction": 0.1, "theory_bubble_s": theory_of(0), "theory_source": "closed form"},
        "critical_path": [], "p2p": {"links": []}, "collectives": [], "stragglers": list(stragglers), "warnings": [],
    }
