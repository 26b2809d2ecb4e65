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
from ..progress import ANALYSE, phased
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


def _whole(x):
    """A count (a per-step mean) as an int when it is whole: JSON says 48, not 48.0."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _whole_counts(report: dict) -> dict:
    """Counts and byte counts of the document as ints where whole (p2p pairs, links,
    collectives); means that are not whole stay floats."""
    p2p = report["p2p"]
    p2p["pairs"] = _whole(p2p["pairs"])
    for row in [*p2p["links"], *report["collectives"]]:
        for key in row:
            if key in ("count", "bytes") or key.endswith("_count"):
                row[key] = _whole(row[key])
        if isinstance(row.get("ops"), dict):
            row["ops"] = {op: _whole(n) for op, n in row["ops"].items()}
    return report


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
        flagged = mean[is_launch_bound(mean["idle_s"], mean["time_s"], mean["launch_bound_s"])]
        warnings += [
            f"rank {rank} looks launch-bound: the GPU is idle {idle / time:.0%} of "
            f"the step, {bound / idle:.0%} of it waiting for the host to "
            f"launch work (host in CUDA calls {launching * 1e3:.2f} ms of it); "
            "fewer, larger kernels (fusion, CUDA graphs) or less host work per step would help"
            for rank, time, idle, bound, launching in zip(
                flagged.index, flagged["time_s"], flagged["idle_s"], flagged["launch_bound_s"],
                flagged["host_launching_s"])
        ]
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
    missing = list(getattr(view, "missing_ranks", ()))  # of the ranks requested (load_run's ranks)
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
        hidden = mine[[f"hidden_{d}" for d in COMM_DIMS]].set_axis(list(COMM_DIMS), axis=1)
        steps = [{"step": int(step), "time_s": time, "breakdown_s": parts, "hidden_s": dims}
                 for step, time, parts, dims in zip(mine["step"], mine["time_s"], mine[list(PARTS)].to_dict("records"),
                                                   hidden.to_dict("records"))]
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


@phased(ANALYSE)
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
    for column in ("count", "bytes", "wait_s", "transfer_s", "bandwidth_count"):
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
    return _whole_counts(_clean(report))


# -------------------------------------------------------------------------------------------
# terminal
# -------------------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _n(x) -> str:
    """A count or byte figure (a per-step mean): whole numbers without a fraction."""
    if x is None:
        return "-"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _header(part: str) -> str:
    """A step part as a column header: words, so that the header wraps instead of widening
    the column ("tp_exposed" -> "tp exposed")."""
    return part.replace("_", " ")


#: What each column means, per table: (headers, short or None, long). The legend under the
#: tables gives the short text of the columns shown; ``--explain`` the long text of each.
LEGEND = {
    "stages": ("Pipeline bubble per stage", [
        (("stage",), None, "pipeline stage (its ranks are those with this pp coordinate)"),
        (("step",), None, "mean step wall time of the stage's ranks"),
        (("bubble",), "idle, waiting for another stage",
         "mean pp_bubble per step of the stage's ranks: receives waiting for the peer stage to "
         "send, and the step-end all-reduce waiting while the pipeline drains"),
        (("frac",), None, "bubble / step"),
        (("schedule",), "the part of it the schedule causes (compare with theory)",
         "bubble_schedule_s: what a replay of the step in its measured order, with free p2p and no "
         "host gaps, leaves idle; the number to compare with theory"),
        (("latency",), "the part p2p latency and host gaps add",
         "bubble_latency_s = bubble - schedule: idle time owed to p2p latency and host gaps on the "
         "critical path (every stage idles through it)"),
        (("theory", "theory frac"), "the schedule's bubble with these pass times and free p2p",
         "theory_bubble_s: the schedule's closed form (GPipe and 1F1B (p-1)(t_fwd+t_bwd), "
         "interleaved the same / vpp, ZB-H1 less the weight-gradient passes) or a zero-latency "
         "replay of its action order, fed this run's measured pass times (the line under the "
         "table says which); theory frac = theory / step"),
        (("warm-up", "steady", "cool-down"), "bubble before the first backward / to the last forward / after",
         "the bubble by phase: before the stage's first backward (the pipeline filling), from "
         "there to its last forward (steady state), after it (the pipeline draining)"),
        (("t_fwd", "t_bwd", "t_w"), "median forward / backward / weight-gradient pass of one microbatch",
         "median over ranks, steps and microbatches of one microbatch's forward, whole backward "
         "(input and weight gradient), and weight-gradient pass alone (zero-bubble schedules run "
         "it apart; 0 otherwise)"),
    ]),
    "ranks": ("Step time per rank", [
        (("rank",), None, "global rank"),
        (("where",), "pipeline stage, tp/cp/dp index",
         "the rank's layout coordinates: pp stage, then its tp, cp and dp index where that size is over 1"),
        (("step",), "compute to other add up to it",
         "step wall time (ProfilerStep#N; on GPU traces, of the GPU work it launched); the columns "
         "from compute to other are its parts and add up to it"),
        (("compute",), None, "compute ranges (forward, backward, optimizer...) or compute kernels"),
        (tuple(_header(f"{d}_exposed") for d in COMM_DIMS),
         "communication with no compute under it (it lengthens the step)",
         "breakdown_s.<dim>_exposed: time in tp (tensor), cp (context), dp (data) or ep (expert) "
         "parallel communication while nothing computed"),
        ((_header("pp_transfer"),), "p2p moving data",
         "breakdown_s.pp_transfer: pipeline send/recv time once both sides had posted, and p2p "
         "that could not be paired"),
        ((_header("pp_bubble"),), "waiting for another stage", "breakdown_s.pp_bubble: see bubble above"),
        (("other",), "host gaps, unannotated work",
         "breakdown_s.other: step time in none of the above (host gaps, unannotated work, "
         "memcpy on GPU traces)"),
        (tuple(f"{d} hidden" for d in COMM_DIMS), "communication under compute (not part of step)",
         "hidden_s.<dim>: that dimension's communication while compute ran; not one of the parts "
         "that add up to step"),
    ]),
    "links": ("Pipeline p2p links", [
        (("src", "dst"), None, "sending and receiving rank"),
        (("count", "bytes"), None, "messages and bytes per step (mean over steps)"),
        (("wait ms",), "a receive waiting for its send (bubble)",
         "time a message waited until both sides had posted (and the exchange's last message "
         "too); part of pp_bubble, not of communication"),
        (("transfer ms",), "moving data once both sides had posted",
         "time from both sides posted until the first side was done; pp_transfer"),
        (("GB/s",), None, "bytes / transfer time over the messages whose transfer was exposed (at least "
         "half of their moving time not under a pass): the rate once both sides were ready"),
    ]),
    "collectives": ("Collectives by dimension", [
        (("dim",), None, "parallel dimension of the process group"),
        (("count", "bytes"), None, "collectives and bytes per rank per step (mean)"),
        (("time ms",), None, "time collectives were in progress, launch to completion"),
        (("exposed ms", "hidden ms"), "with no compute under it / under compute",
         "the part of time with nothing computing (<dim> exposed in the step) / under compute (<dim> hidden)"),
        (("wait ms",), "waiting for the group's last rank",
         "time from the rank's arrival to the last rank's (the step-end all-reduce is left out: "
         "its wait is the pipeline draining)"),
        (("transfer ms",), None, "the rest of the time until the rank left"),
        (("ops",), None, "each collective and how many of it per rank per step"),
    ]),
    "stragglers": ("Stragglers", [
        (("rank",), None, "the straggler; the one that costs most first"),
        (("metric",), "compute: computes longer than the median rank; collective_arrival: last at collectives",
         "compute: the rank computes longer per step than the median rank (its stage paces every "
         "microbatch round, its dp group waits for it); collective_arrival: it is the last to "
         "arrive at collectives"),
        (("slowdown",), None, "compute: its compute over the median rank's, minus 1; "
         "collective_arrival: share of its collectives where it came last"),
        (("cost ms/step",), "step time it costs the others",
         "compute: its compute beyond the median rank's; collective_arrival: how long the group "
         "waited for it alone (last minus second-last arrival)"),
        (("evidence",), "in how many steps it was late, by how much, against the run's own spread",
         "a rank is named only when it is late in most profiled steps by more than three times the "
         "run's own spread (step to step, and across ranks): OS scheduling noise on an oversubscribed "
         "machine makes single slow steps, not persistent stragglers"),
    ]),
}
CRITICAL_PATH_LEGEND = ("critical path: per step, the chain of work across ranks that set the step "
                        "time, and what it was made of")


def _names(names) -> str:
    """("tp exposed", "cp exposed") -> "tp, cp exposed"; other groups joined by " / "."""
    tails = {n.partition(" ")[2] for n in names}
    if len(names) > 1 and len(tails) == 1 and all(n.partition(" ")[0] in COMM_DIMS for n in names):
        return ", ".join(n.partition(" ")[0] for n in names) + f" {tails.pop()}"
    return " / ".join(names)


def print_legend(console, shown: dict, explain: bool = False) -> None:
    """The legend of the tables printed (``shown``: table key -> headers): the jargon in a few
    lines, or with ``explain`` every column of them."""
    from rich.markup import escape
    from rich.padding import Padding
    from rich.text import Text

    def entry(label: str, text: str) -> None:
        line = Text.assemble((label, "bold"), text)
        console.print(Padding(line, (0, 0, 0, 2), expand=False), highlight=False)

    if explain:
        console.print("\n[bold]Columns[/] (ms: milliseconds per step, mean over the profiled steps)")
    else:
        console.print("\n[bold]legend[/] (ms per step, mean over steps; every column: pptrace analyze --explain)")
    for key, (title, entries) in LEGEND.items():
        headers = set(shown.get(key) or ())
        # a group is named whole (its text speaks of each), also when a column of it was left out
        picked = [(names, short, long) for names, short, long in entries if headers & set(names)]
        if explain and picked:
            console.print(f"[bold]{escape(title)}[/]")
            for names, _, long in picked:
                entry(f"{_names(names)}: ", long)
        elif picked:
            text = "; ".join(f"{_names(names)} = {short}" for names, short, _ in picked if short)
            if text:
                entry(f"{title}: ", text)
    if explain and shown.get("critical_path"):
        entry("", CRITICAL_PATH_LEGEND)


def print_report(report: dict, console, explain: bool = False) -> None:
    """Tables, one per view: pipeline stages, per-rank breakdown (mean over steps, ms), p2p
    links, collectives by dim, stragglers; then warnings and a legend of the columns shown
    (``explain``: every column at length). Tables fit the console's width and never cut a
    value (export/tables.py)."""
    from rich.markup import escape

    from .tables import Col, print_table

    shown: dict = {}
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
        cols = [Col("stage", key=True), *(Col(h) for h in (
            "step", "bubble", "frac", "schedule", "latency", "theory", "theory frac", "warm-up", "steady",
            "cool-down", "t_fwd", "t_bwd", "t_w"))]
        rows = [[str(s["stage"]), _ms(s["step_s"]), _ms(s["bubble_s"]), _pct(s["bubble_fraction"]),
                 _ms(s.get("bubble_schedule_s")), _ms(s.get("bubble_latency_s")),
                 _ms(s.get("theory_bubble_s")), _pct(s.get("theory_bubble_fraction") or 0),
                 _ms(s["warmup_bubble_s"]), _ms(s["steady_bubble_s"]), _ms(s["cooldown_bubble_s"]),
                 _ms(s["t_fwd_s"]), _ms(s["t_bwd_s"]), _ms(s["t_wgrad_s"])] for s in pipe["stages"]]
        if pipe.get("theory_source"):
            caption = f"theory: {pipe['theory_source']} with this run's measured pass times"
        else:
            caption = "theory: unknown (no closed form for this schedule and no pass order to replay)"
        shown["stages"] = print_table(
            console, f"Pipeline bubble per stage (ms) — measured {pipe['bubble_fraction']:.1%} vs "
                     f"theory {pipe['theory_bubble_fraction']:.1%} of the step", cols, rows, caption=caption)
    for bound in report.get("critical_path") or ():
        shown["critical_path"] = True
        console.print(f"[bold]critical path[/] {escape(bound['summary'])}", highlight=False)
    cols = [Col("rank", key=True), Col("where", key=True, justify="left"), Col("step", drop_zero=False),
            *(Col(_header(p)) for p in PARTS), *(Col(f"{d} hidden") for d in COMM_DIMS)]
    rows = []
    for r in report["ranks"]:
        m = r["mean"]
        if m is None:
            continue
        rows.append([str(r["rank"]), r.get("describe") or "", _ms(m["time_s"]),
                     *(_ms(m["breakdown_s"][p]) for p in PARTS), *(_ms(m["hidden_s"][d]) for d in COMM_DIMS)])
    shown["ranks"] = print_table(console, "Step time per rank (ms, mean over steps)", cols, rows)
    p2p = report["p2p"]
    if p2p["links"]:
        cols = [Col("src", key=True), Col("dst", key=True),
                *(Col(h) for h in ("count", "bytes", "wait ms", "transfer ms", "GB/s"))]
        rows = []
        for link in p2p["links"]:
            bw = link.get("bandwidth_gbps")
            rows.append([str(link["src"]), str(link["dst"]), _n(link["count"]), _n(link["bytes"]),
                         _ms(link["wait_s"]), _ms(link["transfer_s"]), "-" if bw is None else f"{bw:.3f}"])
        shown["links"] = print_table(
            console, f"Pipeline p2p links (per step): {_n(p2p['pairs'])} pairs, wait {_ms(p2p['wait_s'])} ms, "
                     f"transfer {_ms(p2p['transfer_s'])} ms", cols, rows)
    if report["collectives"]:
        cols = [Col("dim", key=True), *(Col(h) for h in ("count", "bytes", "time ms", "exposed ms", "hidden ms",
                                                         "wait ms", "transfer ms")),
                Col("ops", wrap=True, justify="left")]
        rows = []
        for c in report["collectives"]:
            ops = ", ".join(f"{k}×{_n(v)}" for k, v in (c.get("ops") or {}).items())
            rows.append([c["dim"], _n(c["count"]), _n(c["bytes"]), _ms(c["time_s"]), _ms(c["exposed_s"]),
                         _ms(c["hidden_s"]), _ms(c["wait_s"]), _ms(c["transfer_s"]), ops])
        shown["collectives"] = print_table(console, "Collectives by dimension (per rank per step)", cols, rows)
    if report["stragglers"]:
        cols = [Col("rank", key=True), Col("metric", key=True), *(Col(h) for h in ("slowdown", "cost ms/step")),
                Col("evidence", wrap=True, justify="left")]
        rows = []
        for s in report["stragglers"]:
            slow = s["slowdown"]
            rows.append([str(s["rank"]), s["metric"], "-" if slow is None else f"{slow:+.1%}", _ms(s["cost_s"]),
                         s.get("evidence") or "-"])
        shown["stragglers"] = print_table(console, "Stragglers (culprit first)", cols, rows)
    else:
        console.print("No persistent straggler: no rank was late in most steps by more than the run's own "
                      "step-to-step spread.")
    for w in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    print_legend(console, shown, explain)
