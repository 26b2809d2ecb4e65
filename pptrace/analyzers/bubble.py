"""Per pipeline stage: measured bubble (and its warm-up / steady / cool-down split), per-
microbatch forward/backward times, and the schedule's theory from those measured times.

Theory (Narayanan et al. 2021; Qi et al. 2023), T = t_f + t_b per microbatch per stage, t_b
the whole backward (input grad B plus weight grad W): GPipe/1F1B (p-1)T, interleaved (p-1)T/v,
ZB-H1 (p-1)(t_f + t_B - t_W) = (p-1)(T - 2 t_w), the paper's formula with T_B the input grad
alone (a third of 1F1B's bubble when t_f = t_B = t_W). Real stages are rarely
equal, so the primary theory uses the closed form those come from — a step lasts m rounds
of the slowest stage plus one fill/drain pass of the others — which reduces to the formulas
above when stages are balanced:
    1F1B/GPipe  step = m max(T) + (sum(T) - max(T))
    interleaved step = m max(T) + (sum(T) - max(T)) / v
    ZB-H1       step = m max(T) + (sum(T-2t_w) - max(T-2t_w))
and a stage's theoretical bubble is step - m T_stage.

The closed forms assume free p2p and no host time between passes. A real pipeline also waits
for p2p latency and host gaps on its critical path; every stage idles through those too, so
they add the same time to every stage's bubble. ``bubble_split`` separates that part
(``bubble_latency_s``) from the rest (``bubble_schedule_s``, the schedule's own bubble, the
number to compare with the theory).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from ..sweeps import isin
from ..vocab import (ACTION_OF, BWD, BWD_INPUT, BWD_OPS, BWD_WEIGHT, FWD, FWD_OPS, INTERLEAVED, LOSS, PP_SENDS,
                     SEND_FWD, ZB_H1, canonical, has_closed_form)
from ..schedules.replay import PipelineTimes, action_programs, simulate
from ..timeline.exchanges import on_gpu
from ..timeline.programs import latency_free_lengths


class Action(NamedTuple):
    """One entry of an action order, as ``replay.action_programs`` unpacks it: ``op`` an
    action letter of vocab.ACTION_OPS (a pass, or the post of a stage's send), ``stage`` the
    global stage, ``mb`` the microbatch."""

    op: str
    stage: int
    mb: int


def microbatch_times(run) -> pd.DataFrame:
    """One row per compute range of pipeline work: rank, stage, step, mb, chunk, op, dur_s.
    A last stage's loss (``compute:loss``) is part of its microbatch's forward (as Megatron's
    forward_step computes it): its time is added to that forward's ``dur_s``."""
    ev = run.events
    sel = ev.loc[(ev["category"] == "compute").to_numpy() & (ev["lane_kind"] == "host").to_numpy()
                 & ~ev["gpu_annotation"].to_numpy() & (ev["step"] >= 0).to_numpy()
                 & isin(ev["op"], FWD_OPS + BWD_OPS + (LOSS,)),
                 ["rank", "step", "mb", "chunk", "op", "start_ns", "end_ns", "dur_ns"]]  # what is read, not every column
    if run.steps:
        sel = sel[sel["step"].isin(list(run.steps))]
    stage = {r: run.layout.coords(r).pp if r < run.layout.world_size else 0 for r in run.ranks}
    times = pd.DataFrame({
        "rank": sel["rank"].to_numpy(np.int64),
        "stage": sel["rank"].map(stage).to_numpy(np.int64),
        "step": sel["step"].to_numpy(np.int64),
        "mb": sel["mb"].fillna(-1).to_numpy(np.int64),
        "chunk": sel["chunk"].fillna(0).to_numpy(np.int64),
        "op": sel["op"].astype(str).to_numpy(),
        "start_ns": sel["start_ns"].to_numpy(np.int64),
        "end_ns": sel["end_ns"].to_numpy(np.int64),
        "dur_s": sel["dur_ns"].to_numpy(np.int64) / 1e9,
    })
    is_loss = (times["op"] == LOSS).to_numpy()
    if not is_loss.any():
        return times
    keys = ["rank", "step", "mb", "chunk"]
    loss = times[is_loss].groupby(keys)["dur_s"].sum().rename("loss_s")
    passes = times[~is_loss].merge(loss, left_on=keys, right_index=True, how="left")
    fwd = (passes["op"] == FWD).to_numpy()
    passes["dur_s"] += np.where(fwd, passes["loss_s"].fillna(0.0).to_numpy(), 0.0)
    return passes.drop(columns="loss_s").reset_index(drop=True)


def _per_microbatch(times: pd.DataFrame, ops) -> pd.Series:
    """stage -> median over its (rank, step, mb) of the summed durations (all chunks) of
    ``ops``; a stage without such passes is absent (0.0 to its readers)."""
    sel = times[times["op"].isin(ops)]
    return sel.groupby(["stage", "rank", "step", "mb"])["dur_s"].sum().groupby(level="stage").median()


def _per_microbatch_by_chunk(times: pd.DataFrame) -> pd.DataFrame:
    """(stage, chunk) -> fwd, bwd: :func:`_per_microbatch` of each chunk of each stage (0.0 for
    a chunk without such passes), in one groupby per kind."""
    keys = ["stage", "chunk"]
    present = times[keys].drop_duplicates().set_index(keys).sort_index().index
    out = pd.DataFrame(index=present)
    for name, ops in (("fwd", FWD_OPS), ("bwd", BWD_OPS)):
        sel = times[times["op"].isin(ops)]
        med = sel.groupby([*keys, "rank", "step", "mb"])["dur_s"].sum().groupby(level=keys).median()
        out[name] = med.reindex(present).fillna(0.0).to_numpy() if len(present) else []
    return out


def _at(series: pd.Series, rows: pd.MultiIndex, default: np.ndarray) -> np.ndarray:
    """``series`` (int64, indexed like ``rows``) at each of ``rows``; ``default`` where absent.
    Not reindex: a missing row would turn the column into floats, which cannot hold a time."""
    pos = series.index.get_indexer(rows) if len(series) else np.full(len(rows), -1)
    values = series.to_numpy(np.int64)
    return np.where(pos >= 0, values[np.maximum(pos, 0)] if len(values) else default, default)


def _phase_bubble(partitions, times: pd.DataFrame) -> pd.DataFrame:
    """Per partition (rank, step): bubble seconds in warm-up / steady / cool-down. Warm-up
    ends at the first backward; cool-down starts after the last forward (or at the first
    backward when all forwards come first, as in GPipe)."""
    keys = ["rank", "step"]
    first_bwd = times[times["op"].isin((BWD, BWD_INPUT)).to_numpy()].groupby(keys)["start_ns"].min()
    last_fwd = times[times["op"].isin(FWD_OPS).to_numpy()].groupby(keys)["end_ns"].max()
    rows = pd.MultiIndex.from_arrays([partitions.rank, partitions.step])
    start, end = partitions.start_ns, partitions.end_ns
    t1 = _at(first_bwd, rows, end)
    t2 = np.maximum(_at(last_fwd, rows, t1), t1)
    return pd.DataFrame({
        "rank": partitions.rank, "step": partitions.step,
        "warmup_s": partitions.covered("pp_bubble", start, t1) / 1e9,
        "steady_s": partitions.covered("pp_bubble", t1, t2) / 1e9,
        "cooldown_s": partitions.covered("pp_bubble", t2, end) / 1e9,
    }, columns=["rank", "step", "warmup_s", "steady_s", "cooldown_s"])


def theory_step(schedule: str | None, m: int, v: int, t_stage: np.ndarray, t_w: np.ndarray) -> float:
    """The theoretical step time of the schedule from per-stage T = t_f + t_b and t_w."""
    if len(t_stage) == 0 or m <= 0:
        return 0.0
    slow = float(t_stage.max())
    if schedule == INTERLEAVED:
        fill = (float(t_stage.sum()) - slow) / max(v, 1)
    elif schedule == ZB_H1:
        short = t_stage - 2 * t_w
        fill = float(short.sum()) - float(short.max())
    else:
        fill = float(t_stage.sum()) - slow
    return m * slow + fill


def balanced_theory_bubble(schedule: str | None, p: int, v: int, t: float, t_w: float) -> float:
    """The textbook formula for one stage, as if every stage took this stage's times."""
    if schedule == INTERLEAVED:
        return (p - 1) * t / max(v, 1)
    if schedule == ZB_H1:
        return (p - 1) * (t - 2 * t_w)
    return (p - 1) * t


def _measured_orders(times: pd.DataFrame, run, placement: list[int], p: int) -> list | None:
    """Per pipeline position, the Action order one of its ranks ran in its
    first profiled step with passes: the schedule's own order, as the trace shows it, with
    the posts of its sends where it placed them ("SF"/"SB", of the producing stage)."""
    if times.empty:
        return None
    stage_of = {(pos, g // p): g for g, pos in enumerate(placement)}
    sends = _send_posts(run)
    orders = []
    for pos in range(p):
        mine = times[times["stage"] == pos]
        if mine.empty:
            return None
        rank = int(mine["rank"].min())
        first = mine[(mine["rank"] == rank).to_numpy()]
        step = int(first["step"].min())
        first = first[(first["step"] == step).to_numpy()]
        # (time, 1, action) for passes, (time, 0, action) for sends: a send posted the
        # instant a pass began came first (the pass would have held the thread)
        items = [(start, 1, Action(ACTION_OF[op], stage_of.get((pos, int(c)), pos), int(mb)))
                 for start, op, c, mb in zip(first["start_ns"], first["op"], first["chunk"], first["mb"])]
        posted = sends[(sends["rank"] == rank).to_numpy() & (sends["step"] == step).to_numpy()]
        for start, op, peer, c, mb in zip(posted["start_ns"], posted["op"], posted["peer_pos"], posted["chunk"], posted["mb"]):
            consumer = stage_of.get((int(peer), int(c)))
            if consumer is not None and mb >= 0:  # the send's chunk is its consumer's
                items.append((start, 0, Action("SF", consumer - 1, int(mb)) if op == SEND_FWD
                              else Action("SB", consumer + 1, int(mb))))
        orders.append([action for _, _, action in sorted(items, key=lambda item: item[:2])])
    return orders


def _send_posts(run) -> pd.DataFrame:
    """Host pipeline sends with mb and peer: rank, step, start_ns, op, peer_pos, chunk, mb."""
    ev = run.events
    sel = ev.loc[(ev["category"] == "p2p").to_numpy() & (ev["lane_kind"] == "host").to_numpy()
                 & ~ev["gpu_annotation"].to_numpy() & isin(ev["op"], PP_SENDS)
                 & ev["peer"].notna().to_numpy() & ev["mb"].notna().to_numpy(),
                 ["rank", "step", "start_ns", "op", "peer", "chunk", "mb"]]
    pos = {r: run.layout.coords(r).pp for r in range(run.layout.world_size)}
    return pd.DataFrame({
        "rank": sel["rank"].to_numpy(np.int64), "step": sel["step"].to_numpy(np.int64),
        "start_ns": sel["start_ns"].to_numpy(np.int64), "op": sel["op"].astype(str).to_numpy(),
        "peer_pos": sel["peer"].astype("Int64").map(pos).fillna(-1).to_numpy(np.int64),
        "chunk": sel["chunk"].fillna(0).to_numpy(np.int64), "mb": sel["mb"].to_numpy(np.int64),
    })


def _recorded_orders(run, p: int) -> list | None:
    """Per pipeline position, the action order the trainer recorded in the pptrace block
    (``pipeline_actions``, written by the integrations), from one rank of each position."""
    actions = getattr(run, "pipeline_actions", None) or {}
    orders: list = [None] * p
    for rank in sorted(actions):
        pos = run.layout.coords(rank).pp if rank < run.layout.world_size else None
        if pos is not None and orders[pos] is None:
            orders[pos] = [Action(str(op), int(stage), int(mb)) for op, stage, mb in actions[rank]]
    return orders if all(o is not None for o in orders) else None


def action_orders(run, times: pd.DataFrame, v: int):
    """(orders per pipeline position, placement, where they came from) of a run, or None:
    the order the trainer's integration recorded, else the order the trace shows."""
    from ..schedules.tables import stage_placement

    p = run.layout.pp
    placement = stage_placement(run.schedule, p, v)
    recorded = getattr(run, "stage_ranks", None)
    if recorded and len(recorded) == p * v:
        placement = [run.layout.coords(int(r)).pp for r in recorded]
    # The order as the trace ran it comes first: it holds where sends were posted too; the
    # order the integration recorded (passes only) serves where the trace lacks passes.
    orders, source = _measured_orders(times, run, placement, p), "replay of the measured action order"
    if orders is None:
        orders, source = _recorded_orders(run, p), "replay of the schedule's recorded action order"
    return None if orders is None else (orders, placement, source)


def replay_theory(run, times: pd.DataFrame, stages: pd.DataFrame, m: int, v: int):
    """Theory of a schedule without a closed form: its own action order (as recorded by the
    trainer's integration, else as the trace ran it) replayed with free p2p and the run's
    measured per-stage pass times (schedules/replay.py). -> (step, bubble per stage, source) or None."""
    found = action_orders(run, times, v)
    if found is None:
        return None
    orders, placement, source = found
    m = max(m, 1 + max((action.mb for order in orders for action in order), default=0))
    column = lambda a: np.repeat(np.asarray(a, dtype=float)[:, None], m, axis=1)  # noqa: E731
    t_w = stages["t_wgrad_s"].to_numpy()
    pipe = PipelineTimes(column(stages["t_fwd_s"]), column(np.maximum(stages["t_bwd_s"].to_numpy() - t_w, 0)),
                         column(t_w), 0.0)
    p = run.layout.pp
    gstage = np.full((p, max(len(placement) // p, 1)), -1, dtype=np.int64)  # (position, chunk) -> stage
    for g, pos in enumerate(placement):
        gstage[pos, g // p] = g
    pos, chunk = times["stage"].to_numpy(np.int64), times["chunk"].to_numpy(np.int64)
    inside = (pos >= 0) & (pos < p) & (chunk >= 0) & (chunk < gstage.shape[1])
    found = np.where(inside, gstage[np.clip(pos, 0, p - 1), np.clip(chunk, 0, gstage.shape[1] - 1)], -1)
    mean = times.assign(action=times["op"].map(ACTION_OF), gstage=np.where(found >= 0, found, pos)
                        ).groupby(["action", "gstage"])["dur_s"].mean()
    seconds = {(str(a), int(g)): float(t) for (a, g), t in mean.items()}
    try:
        timeline = simulate(str(run.schedule), pipe, v, sends="eager",
                            programs=action_programs(orders, placement, seconds))
    except ValueError:
        return None
    return timeline.makespan_s, np.maximum(timeline.makespan_s - timeline.stages["compute_s"].to_numpy(), 0.0), source


def bubble_split(run, partitions, pairs: pd.DataFrame | None = None) -> dict:
    """(rank, step) -> ns of that rank's pp_bubble owed to latency rather than to the schedule.

    Per step, L is how much sooner the pipeline window would have ended with free p2p and no
    host time between ops (``timeline.programs.latency_free_lengths``: the step replayed in its measured
    order with its measured pass times); every stage would idle L less. A rank already spends
    part of its idle time in its own transfers and host gaps, which are not bubble, so its
    bubble owes L minus that part to latency (clipped to [0, bubble]). The rest, the schedule
    part, is then what the replay leaves idle on the rank: on a balanced GPipe, 1F1B,
    interleaved or ZB-H1 schedule with any fixed latency exactly the closed form (less on a
    stage whose own transfers exceed L: it moved data in part of its slack),
    tests/analyzers/test_bubble_split.py.
    Steps the replay cannot follow, and GPU traces (their window is where kernels ran, the
    replay follows the host), are left out: the caller reports their split as unknown.
    """
    windows = run.pipeline_windows
    pairs = pairs if pairs is not None else run.pairs
    if not windows or pairs is None or "send_index" not in pairs.columns:
        return {}
    if on_gpu(run.events) or missing_stages(run):  # a replay without those stages' passes would be another pipeline
        return {}
    # the replay runs the step's whole programs, its first pipeline op to its last (a recv
    # posted before the first pass, a send waited on after the last), and says how long the
    # window, first pass to last, would have lasted: by how much less every stage would idle
    spans = {step: span for step, span in run.pipeline_spans.items() if step in run.steps and step in windows}
    latency = {step: max(windows[step].end_ns - windows[step].start_ns - length, 0)
               for step, length in latency_free_lengths(run, pairs, spans).items()}
    # per partition of a replayed step: its transfers and host gaps inside the pipeline window
    replayed = np.array(sorted(latency), np.int64)
    rows = np.flatnonzero(np.isin(partitions.step, replayed))
    which = np.searchsorted(replayed, partitions.step[rows])
    lo, hi = partitions.start_ns.copy(), partitions.start_ns.copy()  # elsewhere: empty windows
    lo[rows] = np.array([windows[int(s)][0] for s in replayed], np.int64)[which]
    hi[rows] = np.array([windows[int(s)][1] for s in replayed], np.int64)[which]
    own = (partitions.covered("pp_transfer", lo, hi) + partitions.covered("other", lo, hi))[rows]
    owed = np.array([latency[int(s)] for s in replayed], np.int64)[which]
    value = np.minimum(np.maximum(owed - own, 0), partitions.totals("pp_bubble")[rows])
    steps = partitions.step[rows]
    return dict(zip(zip(partitions.rank[rows].tolist(), steps.tolist()), value.tolist()))


def missing_stages(run) -> list[int]:
    """The pipeline stages none of whose ranks is loaded (a --ranks subset, dead ranks)."""
    world = run.layout.world_size
    return sorted(set(range(run.layout.pp)) - {run.layout.coords(r).pp for r in run.ranks if r < world})


def pipeline_stages(run, partitions, latency: dict | None = None,
                    times: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """(one row per physical stage with a loaded rank, run-level summary dict). ``latency``:
    bubble_split's output; without it the bubble is not split. ``times``: microbatch_times(run)
    where the caller has it already. A stage whose ranks have p2p
    with a peer not loaded has its bubble unknown (None: the split of that p2p time needs the
    peer, analyzers/partition.py), and with a stage not loaded the theory is unknown (it
    needs every stage's pass times): neither is a number made up from the stages present."""
    latency = latency or {}
    times = microbatch_times(run) if times is None else times
    p = run.layout.pp
    m = int(run.microbatches or (times["mb"].nunique() if not times.empty else 0))
    v = run.v
    phases = _phase_bubble(partitions, times)
    world = run.layout.world_size
    stage_of = {r: run.layout.coords(r).pp for r in run.ranks if r < world}
    # per partition: its stage (-1 off the layout) and bubble_split's latency part (-1: none)
    stages = np.full(max(max(run.ranks, default=-1), int(partitions.rank.max(initial=-1))) + 1, -1, np.int64)
    stages[list(stage_of)] = list(stage_of.values())
    row_stage = stages[partitions.rank]
    wall, unsplit, bubble_ns = partitions.wall_ns, partitions.unsplit_ns, partitions.totals("pp_bubble")
    owed_at = np.array(list(latency), np.int64).reshape(-1, 2)
    pos = pd.MultiIndex.from_arrays([owed_at[:, 0], owed_at[:, 1]]).get_indexer(
        pd.MultiIndex.from_arrays([partitions.rank, partitions.step])) if len(latency) else np.full(len(partitions), -1)
    row_latency = np.where(pos >= 0, np.fromiter(latency.values(), np.int64, len(latency))[np.maximum(pos, 0)]
                           if len(latency) else -1, -1)
    by_chunk = _per_microbatch_by_chunk(times)
    per_mb = {name: _per_microbatch(times, ops).to_dict()
              for name, ops in (("t_fwd_s", FWD_OPS), ("t_bwd_s", BWD_OPS), ("t_wgrad_s", (BWD_WEIGHT,)))}
    absent = missing_stages(run) if p > 1 else []
    rows = []
    for stage in (s for s in range(p) if s not in absent):
        ranks = [r for r in run.ranks if stage_of.get(r) == stage]
        parts = np.flatnonzero(row_stage == stage)  # the stage's partitions, by (rank, step)
        chunks = [{"chunk": int(c), "t_fwd_s": float(f), "t_bwd_s": float(b)}
                  for (_, c), f, b in zip(by_chunk.loc[[stage]].index, by_chunk.loc[[stage], "fwd"],
                                          by_chunk.loc[[stage], "bwd"])] if stage in by_chunk.index else []
        ph = phases.iloc[parts]
        step_s = float(np.mean(wall[parts]) / 1e9) if len(parts) else 0.0
        known = not unsplit[parts].any()
        bubble = float(np.mean(bubble_ns[parts]) / 1e9) if len(parts) else 0.0
        split = row_latency[parts][row_latency[parts] >= 0]
        owed = float(np.mean(split) / 1e9) if len(parts) and len(split) == len(parts) and known else None
        per_step = []
        for q in parts[np.lexsort((partitions.rank[parts], partitions.step[parts]))]:  # output rows, by (step, rank)
            lat = int(row_latency[q]) if row_latency[q] >= 0 and not unsplit[q] else None
            mine = int(bubble_ns[q]) / 1e9 if not unsplit[q] else None
            per_step.append({"rank": int(partitions.rank[q]), "step": int(partitions.step[q]), "bubble_s": mine,
                             "bubble_latency_s": None if lat is None else lat / 1e9,
                             "bubble_schedule_s": None if lat is None else (int(bubble_ns[q]) - lat) / 1e9})
        phase = (lambda name: float(ph[name].mean()) if not ph.empty else 0.0) if known else (lambda name: None)
        rows.append({
            "stage": stage, "ranks": ranks, "step_s": step_s, "bubble_s": bubble if known else None,
            "bubble_schedule_s": None if owed is None else bubble - owed,
            "bubble_latency_s": owed,
            "steps": per_step,
            "bubble_fraction": (bubble / step_s if step_s else 0.0) if known else None,
            "warmup_bubble_s": phase("warmup_s"), "steady_bubble_s": phase("steady_s"),
            "cooldown_bubble_s": phase("cooldown_s"),
            **{name: float(per_mb[name].get(stage, 0.0)) for name in ("t_fwd_s", "t_bwd_s", "t_wgrad_s")},
            "chunks": chunks if v > 1 else [],
        })
    stages = pd.DataFrame(rows)
    summary = {"schedule": run.schedule, "pp": p, "microbatches": m, "vpp": v,
               "bubble_fraction": 0.0, "theory_bubble_fraction": 0.0, "theory_step_s": 0.0}
    if stages.empty:
        return stages, summary
    t_stage = (stages["t_fwd_s"] + stages["t_bwd_s"]).to_numpy()
    t_w = stages["t_wgrad_s"].to_numpy()
    schedule = canonical(run.schedule)
    if absent:
        step_theory = 0.0
        stages["theory_bubble_s"] = stages["theory_bubble_balanced_s"] = np.nan
        summary["theory_source"] = None
        summary["theory_unknown"] = f"it needs the pass times of stages {absent}, whose traces are not loaded"
    elif has_closed_form(schedule) or p == 1:
        step_theory = theory_step(schedule, m, v, t_stage, t_w)
        stages["theory_bubble_s"] = np.maximum(step_theory - m * t_stage, 0.0) if p > 1 else 0.0
        stages["theory_bubble_balanced_s"] = [
            balanced_theory_bubble(schedule, p, v, t, w) if p > 1 else 0.0 for t, w in zip(t_stage, t_w)]
        summary["theory_source"] = f"closed form ({schedule})" if p > 1 else None
    else:
        replayed = replay_theory(run, times, stages, m, v)
        if replayed is None:
            step_theory = 0.0
            stages["theory_bubble_s"] = np.nan
            summary["theory_source"] = None
        else:
            step_theory, bubble, source = replayed
            stages["theory_bubble_s"] = bubble
            summary["theory_source"] = source
        stages["theory_bubble_balanced_s"] = stages["theory_bubble_s"]
    stages["theory_bubble_fraction"] = stages["theory_bubble_s"] / step_theory if step_theory else (
        np.nan if absent else 0.0)
    bubble_known = stages["bubble_s"].notna().to_numpy()
    measured = stages[(stages["step_s"] > 0).to_numpy() & stages["theory_bubble_s"].notna().to_numpy() & bubble_known]
    if absent or not bubble_known.all():
        # a mean over the stages whose bubble is known, or unknown: never one taken over zeros
        known = stages[(stages["step_s"] > 0).to_numpy() & bubble_known]
        summary.update(
            bubble_fraction=float(known["bubble_fraction"].mean()) if not known.empty else None,
            bubble_s=float(known["bubble_s"].mean()) if not known.empty else None,
            theory_bubble_fraction=None if absent or measured.empty else float(measured["theory_bubble_fraction"].mean()),
            theory_bubble_s=None if absent or measured.empty else float(measured["theory_bubble_s"].mean()),
            theory_step_s=None if absent else step_theory)
        return stages, summary
    summary.update(
        bubble_fraction=float(measured["bubble_fraction"].mean()) if not measured.empty else 0.0,
        theory_bubble_fraction=float(measured["theory_bubble_fraction"].mean()) if not measured.empty else 0.0,
        theory_step_s=step_theory,
        bubble_s=float(measured["bubble_s"].mean()) if not measured.empty else 0.0,
        theory_bubble_s=float(measured["theory_bubble_s"].mean()) if not measured.empty else 0.0,
    )
    return stages, summary
