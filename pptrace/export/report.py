"""Analysis results -> the contract-4 JSON document (schema ``pptrace.analysis/1``) and
rich terminal tables. All computing happens in ``pptrace.analyzers``; this file only runs
them in order, selects ranks/steps and formats.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd

from ..analyzers.partition import breakdown_table, partition_run
from ..analyzers.collectives import collectives_by_dim
from ..analyzers.critical_path import step_bounds
from ..analyzers.gpu_timeline import gpu_timeline, is_launch_bound
from ..analyzers.p2p import link_table, match_pairs
from ..analyzers.bubble import bubble_split, microbatch_times, pipeline_stages
from ..ingest.run import Run
from ..analyzers.stragglers import find_stragglers
from ..vocab import COMM_DIMS, PARTS, RANGE_KINDS

SCHEMA = "pptrace.analysis/1"
#: an alignment bound above this share of the mean step time makes cross-rank numbers shaky.
CLOCK_WARN_FRACTION = 0.01


def _clean(value):
    """numpy scalars -> Python, NaN/inf -> None, recursively: strict JSON."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if value is pd.NA:
        return None
    return value


def _select(view: Run, steps, ranks) -> tuple[Run, list[str]]:
    warnings = []
    if steps is None:
        return view, warnings
    wanted = [int(s) for s in steps]
    keep = [s for s in view.steps if s in wanted] if view.steps else wanted
    absent = sorted(set(wanted) - set(keep))
    if absent:
        warnings.append(f"requested steps {absent} were not profiled (profiled: {list(view.steps)})")
    return replace(view, steps=tuple(keep)), warnings


def _gpu_warnings(view: Run, acts: dict, gpu: pd.DataFrame, contract: bool) -> list[str]:
    """What a GPU trace could not tell, and the launch-bound hint."""
    warnings = []
    if not contract and len(gpu):
        warnings.append(
            "traces without pptrace ranges: pipeline bubble cannot be separated from p2p wait; NCCL send/recv "
            "kernels count as pp_transfer (wait included) and GPU idle time as other; showing "
            "idle instead (instrument the trainer with pptrace.region for the full breakdown)"
        )
    guessed = {r: a.unknown_groups for r, a in acts.items() if a.unknown_groups}
    if guessed:
        warnings.append(
            f"{sum(guessed.values())} NCCL collective kernels (ranks {sorted(guessed)[:8]}) belong to "
            "process groups that neither a pg_desc nor the layout names: counted as dp (all_to_all "
            "as ep); give the layout (tp/cp/pp/dp) or name groups with new_group(group_desc=...)"
        )
    if len(gpu):
        mean = gpu.groupby("rank")[["time_s", "idle_s", "launch_bound_s", "host_launching_s"]].mean()
        for rank, row in mean.iterrows():
            if is_launch_bound(row.idle_s, row.time_s, row.launch_bound_s):
                warnings.append(
                    f"rank {rank} looks launch-bound: the GPU is idle {row.idle_s / row.time_s:.0%} of "
                    f"the step, {row.launch_bound_s / row.idle_s:.0%} of it waiting for the host to "
                    f"launch work (host in CUDA calls {row.host_launching_s * 1e3:.2f} ms of it); "
                    "fewer, larger kernels (fusion, CUDA graphs) or less host work per step would help"
                )
    return warnings


def _input_warnings(view: Run, partitions, pairs_unmatched) -> list[str]:
    ev = view.events
    warnings = []
    contract = ev["kind"].isin(list(RANGE_KINDS)) & (ev["lane_kind"] == "host")
    gpu_run = ev["category"].isin(["kernel_compute", "kernel_comm"]).any()
    if not contract.any() and not gpu_run:
        warnings.append(
            "traces without pptrace ranges: dims from process-group metadata; bubble cannot be "
            "separated from p2p: NCCL send/recv kernels count as pp_transfer, and time outside "
            "kernels as other (instrument the trainer with pptrace.region for the full breakdown)"
        )
    missing = sorted(set(range(view.layout.world_size)) - set(view.ranks))
    if missing and not any("no usable trace" in w for w in view.warnings):
        warnings.append(f"ranks {missing[:8]} of {view.layout.world_size} have no trace; results cover the others only")
    stepped = {p.rank for p in partitions}
    unstepped = sorted(set(view.ranks) - stepped)
    if unstepped:
        warnings.append(
            f"ranks {unstepped[:8]} have no profiled ProfilerStep#N range on their main thread; "
            "their time is not partitioned (call prof.step() every step)"
        )
    untagged = ((ev["category"] == "p2p") & (ev["lane_kind"] == "host") & ~ev["gpu_annotation"]
                & ev["peer"].isna()).sum()
    if untagged:
        warnings.append(
            f"{untagged} pipeline p2p ranges carry no peer/mb tags (Megatron's own range names): "
            "they cannot be paired, so their wait and transfer are not split; counted as pp_transfer"
        )
    if len(pairs_unmatched):
        warnings.append(
            f"{len(pairs_unmatched)} pipeline p2p ranges have no matching peer range; their time "
            "counts as pp_transfer (wait and transfer cannot be told apart without the peer)"
        )
    already = any("clock alignment" in w for w in view.warnings)
    if partitions and view.uncertainty_ns and not already:
        step = float(np.mean([p.wall_ns for p in partitions]))
        bad = {r: b for r, b in view.uncertainty_ns.items() if b and b > CLOCK_WARN_FRACTION * step}
        if bad:
            worst = max(bad, key=bad.get)
            warnings.append(
                f"clock alignment of ranks {sorted(bad)[:8]} is uncertain by up to "
                f"{bad[worst] / 1e6:.2f} ms (rank {worst}), over {CLOCK_WARN_FRACTION:.0%} of the "
                "step: cross-rank bubble/wait splits are approximate"
            )
    return warnings


_GPU_FIELDS = ("time_s", "busy_s", "compute_s", "comm_s", "overlap_s", "overlap_pct", "comm_exposed_s",
               "memcpy_s", "memcpy_exposed_s", "idle_s", "launch_bound_s", "host_launching_s")


def _rank_entries(view: Run, table: pd.DataFrame, ranks, gpu: pd.DataFrame) -> list[dict]:
    out = []
    for rank in view.ranks:
        if ranks is not None and rank not in ranks:
            continue
        coords = view.layout.coords(rank)._asdict() if rank < view.layout.world_size else None
        mine = table[table["rank"] == rank]
        steps = [{
            "step": int(row.step), "time_s": row.time_s,
            "breakdown_s": {part: getattr(row, part) for part in PARTS},
            "hidden_s": {d: getattr(row, f"hidden_{d}") for d in COMM_DIMS},
        } for row in mine.itertuples()]
        # GPU timeline (analyzers/gpu_timeline.py): beside the partition, memcpy and idle apart, launch-bound
        on_gpu = gpu[gpu["rank"] == rank].set_index("step") if len(gpu) else gpu
        for entry in steps:
            if entry["step"] in on_gpu.index:
                g = on_gpu.loc[entry["step"]]
                entry["gpu"] = {k: g[k] for k in _GPU_FIELDS} | {"launch_bound": bool(g["launch_bound"])}
        mean = None
        if len(mine):
            mean = {"time_s": mine["time_s"].mean(),
                    "breakdown_s": {part: mine[part].mean() for part in PARTS},
                    "hidden_s": {d: mine[f"hidden_{d}"].mean() for d in COMM_DIMS}}
            if len(on_gpu):
                mean["gpu"] = {k: on_gpu[k].astype(float).mean() for k in _GPU_FIELDS}
        out.append({
            "rank": rank, "coords": coords,
            "describe": view.layout.describe(rank) if rank < view.layout.world_size else None,
            "clock_offset_us": view.offsets_ns.get(rank, 0) / 1e3,
            "clock_uncertainty_us": (view.uncertainty_ns.get(rank) or 0) / 1e3,
            "steps": steps, "mean": mean,
        })
    return out


def _microbatch_rows(view: Run, ranks) -> list[dict]:
    """Every forward/backward range: rank, stage, step, mb, chunk, op, start_s (from the
    step's pipeline window start, aligned clocks) and dur_s — per-microbatch detail."""
    times = microbatch_times(view)
    if ranks is not None:
        times = times[times["rank"].isin(ranks)]
    if times.empty:
        return []
    windows = view.pipeline_windows
    origin = times["step"].map({s: w[0] for s, w in windows.items()}).fillna(times.groupby("step")["start_ns"].transform("min"))
    times = times.assign(start_s=(times["start_ns"] - origin) / 1e9)
    return times[["rank", "stage", "step", "mb", "chunk", "op", "start_s", "dur_s"]].to_dict("records")


def build_report(run, steps=None, ranks=None) -> dict:
    """The contract-4 document for a loaded run (a ``pptrace.ingest.run.Run``).
    ``steps``/``ranks`` select what is reported; the pipeline window still spans every
    loaded rank, because a stage's bubble is defined against all stages."""
    view, warnings = _select(run, steps, ranks)
    ranks = None if ranks is None else [int(r) for r in ranks]
    acts = view.activities
    pairs, unmatched = match_pairs(view)
    partitions = partition_run(view, acts, (pairs, unmatched))
    table = breakdown_table(partitions)
    gpu = gpu_timeline(view.events, set(view.steps) if view.steps else None)
    n_steps = max(len(view.steps), 1)
    inst = view.collectives
    stages, pipe = pipeline_stages(view, partitions, bubble_split(view, partitions, pairs))
    sel_pairs = pairs[pairs["step"].isin(list(view.steps))] if view.steps else pairs
    if view.steps and inst is not None and len(inst):
        inst = inst[inst["step"].isin(list(view.steps))]
    links = link_table(sel_pairs)
    for column in ("count", "bytes", "wait_s", "transfer_s"):
        links[column] = links[column] / n_steps
    chosen = partitions if ranks is None else [p for p in partitions if p.rank in ranks]
    report = {
        "schema": SCHEMA,
        "run": {
            "world_size": view.layout.world_size, "layout": view.layout.to_dict(),
            "schedule": view.schedule, "microbatches": view.microbatches or pipe.get("microbatches"),
            "vpp": view.vpp, "steps": list(view.steps), "ranks": list(view.ranks),
            "inferred": dict(view.inferred),
        },
        "ranks": _rank_entries(view, table, ranks, gpu),
        "pipeline": {
            **pipe,
            "stages": stages.to_dict("records") if len(stages) else [],
            "microbatch_times": _microbatch_rows(view, ranks),
        },
        # per step, what bounded it: the cross-rank critical path ([] without a pipeline)
        "critical_path": step_bounds(view),
        "p2p": {
            "pairs": len(sel_pairs) / n_steps,
            "wait_s": float(sel_pairs["wait_ns"].sum()) / 1e9 / n_steps,
            "transfer_s": float(sel_pairs["transfer_ns"].clip(lower=0).sum()) / 1e9 / n_steps,
            "unmatched": len(unmatched),
            "links": links.to_dict("records"),
        },
        "collectives": collectives_by_dim(view, chosen, inst).to_dict("records"),
        "stragglers": find_stragglers(partitions, sel_pairs, inst).to_dict("records"),
        "warnings": [*view.warnings, *warnings, *_input_warnings(view, partitions, unmatched),
                     *_gpu_warnings(view, acts, gpu, bool((view.events["kind"].isin(list(RANGE_KINDS))
                                                          & (view.events["lane_kind"] == "host")).any()))],
    }
    return _clean(report)


# -------------------------------------------------------------------------------------------
# terminal
# -------------------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def print_report(report: dict, console) -> None:
    """Rich tables, one per view: pipeline stages, per-rank breakdown (mean over steps, ms),
    p2p links, collectives by dim, stragglers, warnings."""
    from rich.markup import escape
    from rich.table import Table

    run = report["run"]
    lay = run["layout"]
    console.print(
        f"[bold]pptrace analysis[/] world {run['world_size']} (tp{lay['tp']} cp{lay['cp']} "
        f"pp{lay['pp']} dp{lay['dp']}), schedule {run['schedule'] or '?'}, microbatches "
        f"{run['microbatches'] or '?'}, vpp {run['vpp'] or 1}, steps {run['steps']}"
    )
    if run.get("inferred"):
        console.print("[bold]inferred[/] (the run carries no pptrace metadata): " + "; ".join(
            f"{escape(str(k))}: {escape(str(v))}" for k, v in run["inferred"].items()), highlight=False)
    pipe = report["pipeline"]
    if pipe["stages"] and lay["pp"] > 1:
        # "schedule" is the part of the bubble the schedule causes (compare with theory);
        # "latency" the part owed to p2p latency and host gaps on the critical path.
        t = Table(title=f"Pipeline bubble per stage (ms) — measured {pipe['bubble_fraction']:.1%} vs "
                        f"theory {pipe['theory_bubble_fraction']:.1%} of the step")
        for col in ("stage", "step", "bubble", "frac", "schedule", "latency", "theory", "theory frac",
                    "warm-up", "steady", "cool-down", "t_fwd", "t_bwd", "t_w"):
            t.add_column(col, justify="right")
        for s in pipe["stages"]:
            t.add_row(str(s["stage"]), _ms(s["step_s"]), _ms(s["bubble_s"]), f"{s['bubble_fraction']:.1%}",
                      _ms(s.get("bubble_schedule_s")), _ms(s.get("bubble_latency_s")),
                      _ms(s.get("theory_bubble_s")), f"{s.get('theory_bubble_fraction') or 0:.1%}",
                      _ms(s["warmup_bubble_s"]), _ms(s["steady_bubble_s"]), _ms(s["cooldown_bubble_s"]),
                      _ms(s["t_fwd_s"]), _ms(s["t_bwd_s"]), _ms(s["t_wgrad_s"]))
        if pipe.get("theory_source"):
            t.caption = f"theory: {pipe['theory_source']} with this run's measured pass times"
        else:
            t.caption = "theory: unknown (no closed form for this schedule and no pass order to replay)"
        console.print(t)
    for bound in report.get("critical_path") or ():
        console.print(f"[bold]critical path[/] {escape(bound['summary'])}", highlight=False)
    t = Table(title="Step time per rank (ms, mean over steps)")
    for col in ("rank", "where", "step", *PARTS, *(f"{d} hidden" for d in COMM_DIMS)):
        t.add_column(col, justify="right")
    for r in report["ranks"]:
        m = r["mean"]
        if m is None:
            continue
        t.add_row(str(r["rank"]), r.get("describe") or "", _ms(m["time_s"]),
                  *(_ms(m["breakdown_s"][p]) for p in PARTS), *(_ms(m["hidden_s"][d]) for d in COMM_DIMS))
    console.print(t)
    p2p = report["p2p"]
    if p2p["links"]:
        t = Table(title=f"Pipeline p2p links (per step): {p2p['pairs']:.0f} pairs, wait "
                        f"{_ms(p2p['wait_s'])} ms, transfer {_ms(p2p['transfer_s'])} ms")
        for col in ("src", "dst", "count", "bytes", "wait ms", "transfer ms", "GB/s"):
            t.add_column(col, justify="right")
        for link in p2p["links"]:
            bw = link.get("bandwidth_gbps")
            t.add_row(str(link["src"]), str(link["dst"]), f"{link['count']:.0f}", f"{link['bytes']:.0f}",
                      _ms(link["wait_s"]), _ms(link["transfer_s"]), "-" if bw is None else f"{bw:.3f}")
        console.print(t)
    if report["collectives"]:
        t = Table(title="Collectives by dimension (per rank per step)")
        for col in ("dim", "count", "bytes", "time ms", "exposed ms", "hidden ms", "wait ms", "transfer ms", "ops"):
            t.add_column(col, justify="right")
        for c in report["collectives"]:
            ops = ", ".join(f"{k}×{v:g}" for k, v in (c.get("ops") or {}).items())
            t.add_row(c["dim"], f"{c['count']:.1f}", f"{c['bytes']:.0f}", _ms(c["time_s"]), _ms(c["exposed_s"]),
                      _ms(c["hidden_s"]), _ms(c["wait_s"]), _ms(c["transfer_s"]), ops)
        console.print(t)
    if report["stragglers"]:
        t = Table(title="Stragglers (culprit first)")
        for col in ("rank", "metric", "slowdown", "cost ms/step"):
            t.add_column(col, justify="right")
        for s in report["stragglers"]:
            slow = s["slowdown"]
            t.add_row(str(s["rank"]), s["metric"], "-" if slow is None else f"{slow:+.1%}", _ms(s["cost_s"]))
        console.print(t)
    else:
        console.print("No stragglers found.")
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
