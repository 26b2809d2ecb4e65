"""What-if: replay a measured run under another schedule, vpp, microbatch count, without its
straggler, with free p2p or with its experts' tokens spread evenly, and predict the step time.

Flow: measured durations from the Run (per stage and microbatch: forward, backward, weight
grad; per link p2p latency; host overhead per op; the fixed part of the step outside the
pipeline window) -> ``replay.simulate`` -> a JSON-ready dict. The measured schedule is
replayed too (``replay``): its error against the measured step says how far to trust the
prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ..vocab import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, INTERLEAVED, LOSS, SCHEDULES, ZB_H1, canonical,
                     has_closed_form)
from ..schedules.replay import PipelineTimes, Timeline, action_programs, simulate
from ..timeline.programs import main_thread_work
from ..timeline.projection import gpu_extent
from ..timeline.windows import Window, pipeline_passes
from .costs import eager_latencies, exchange_latencies, latency_of, overhead, post_cost
from .experts import balanced_shifts, check_balanceable
from ..progress import WHATIF, phased

SCHEMA = "pptrace.whatif/1"
# ZB-H1 paper's working assumption (T_W ~ T_B) when a run never split its backward.
DEFAULT_WGRAD_FRACTION = 0.5
REPLICATIONS = 33
#: passes (stages x chunks x microbatches) times replications one replay may simulate. The
#: replay engine steps through every pass (about 1 ms per pass and 33 replications on a
#: 2-core machine), so this keeps a prediction to seconds where --microbatches 100000 took
#: twenty minutes; a longer step gets fewer replications, down to MIN_REPLICATIONS: it sums
#: more latency draws, so its makespan varies less and fewer replications find its median.
SIMULATION_BUDGET = REPLICATIONS * 4096
MIN_REPLICATIONS = 5
OUTLIER_STEP = 0.25  # relative distance from the median step beyond which a step is left out
SEED = 0
#: the result's ``comparison``: what to read a prediction by (_comparison says when which)
BY_REPLAY_ERROR, BY_THROUGHPUT, BY_STEP_TIME = "replay_error", "throughput", "step_time"


@dataclass
class Measured:
    """What the simulation needs from a run, plus the measured step for comparison."""

    schedule: str
    vpp: int
    times: PipelineTimes
    step_time_s: float
    window_s: float
    fixed_s: float  # step time outside the pipeline window: grad-norm all-reduce, optimizer, ...
    split_backward: bool  # the run traced B and W separately (ZB-H1)
    wgrad_fraction: float | None  # W / (B + W) from the run's metadata (sleep mode), if any
    notes: list = field(default_factory=list)
    overlap_p2p_comm: bool = False  # the run's interleaved exchanges were Megatron's overlapped ones
    #: a schedule pptrace has no table for: the programs built from its own action order
    #: (replay.action_programs), replayed with eager sends as torch posts them
    programs: list | None = None
    #: (fwd, bwd, wgrad) as ``times`` has them, with every rank's experts given its ep
    #: group's mean tokens (whatif/experts.py); measured only when asked
    balanced: tuple | None = None
    experts: dict | None = None  # what the balancing moved (experts.SUMMARY_KEYS)


def _main_events(run) -> pd.DataFrame:
    keep = main_thread_work(run.events, run.steps, categories=None)
    return run.events.loc[keep, ["rank", "step", "category", "kind", "op", "mb", "chunk", "start_ns", "end_ns", "dur_ns"]]


def _typical_steps(run, notes: list) -> pd.Series:
    """Step times (median over ranks) of the steps that look like the run: a step far off the
    median is a hiccup of the machine (a stalled process, a page-cache flush), not the
    schedule, and its slow transfers would poison the latency distribution."""
    windows = run.step_windows
    wall = pd.Series([e - s for s, e in windows.values()], dtype="int64",
                     index=pd.Index([step for _, step in windows], name="step"))
    steps = wall.groupby(level="step").median()
    # A hiccup only lengthens a step: of two steps the median cannot tell which one stalled
    # (both sit half the stall away from it, and a long stall drops both), the shorter can.
    reference, against = (steps.median(), "a median") if len(steps) >= 3 else (steps.min(), "the shorter step")
    typical = steps[(steps - reference).abs() <= OUTLIER_STEP * reference]
    if typical.empty:  # no two steps alike: the shortest is the least disturbed
        reference, against = steps.min(), "the shortest step"
        typical = steps[(steps - reference).abs() <= OUTLIER_STEP * reference]
    for step, ns in steps.drop(typical.index).items():
        notes.append(f"step {step} left out: {ns / 1e6:.1f} ms against {against} of {reference / 1e6:.1f} ms")
    return typical


def _pipeline_ops(main: pd.DataFrame) -> pd.DataFrame:
    """The passes and pipeline p2p of the main threads; a last stage's loss is replayed as
    part of its microbatch's forward (analyzers/bubble.microbatch_times)."""
    p2p = ((main["category"] == "p2p") & (main["kind"] == "pp")).to_numpy()
    return main[pipeline_passes(main) | p2p]


def _stage_matrix(ops: pd.DataFrame, op_names, stage_of, p: int, m: int) -> np.ndarray:
    """(p, m) seconds: per rank, step, microbatch the sum over chunks; median over steps; the
    slowest rank of a stage (its tp/dp peers wait for it at the next collective)."""
    sel = ops[ops["op"].isin(op_names).to_numpy()]
    out = np.zeros((p, m))
    if sel.empty:
        return out
    per_step = sel.groupby(["rank", "step", "mb"], observed=True)["dur_ns"].sum()
    per_mb = per_step.groupby(level=["rank", "mb"]).median().reset_index()
    per_mb["stage"] = per_mb["rank"].map(stage_of)
    table = per_mb.groupby(["stage", "mb"])["dur_ns"].max()
    for (stage, mb), ns in table.items():
        if 0 <= mb < m:
            out[int(stage), int(mb)] = ns / 1e9
    return out


def _pass_matrices(ops: pd.DataFrame, split: bool, stage_of, p: int, m: int) -> tuple[np.ndarray, ...]:
    """(fwd, bwd, wgrad) stage matrices; a stage without a usable trace takes the median of
    the others (partial input: assume it was like them)."""
    fwd = _stage_matrix(ops, [FWD, LOSS], stage_of, p, m)
    # a split run's full backward passes (some torch zero-bubble schedules mix them) count as B
    bwd = _stage_matrix(ops, [BWD_INPUT, BWD] if split else [BWD], stage_of, p, m)
    wgrad = _stage_matrix(ops, [BWD_WEIGHT], stage_of, p, m)
    present = sorted(set(ops["rank"].map(stage_of)))
    for stage in sorted(set(range(p)) - set(present)):
        for a in (fwd, bwd, wgrad):
            a[stage] = np.median(a[present], axis=0)
    return fwd, bwd, wgrad


def _windows(run, ops: pd.DataFrame, p: int) -> dict:
    """step -> the pipeline window. One stage has no pipeline to report (windows.
    pipeline_windows), yet its replay still spans its passes, and the step outside them is
    the fixed part: the same span, from the passes measured (where their GPU work ran)."""
    if p > 1:
        return run.pipeline_windows
    start, end, _ = gpu_extent(run.events, run.events.loc[ops.index])
    g = pd.DataFrame({"step": ops["step"].to_numpy(np.int64), "s": start, "e": end}).groupby("step")
    lo, hi = g["s"].min(), g["e"].max()
    return dict(zip(lo.index.tolist(), map(Window, lo.to_numpy(np.int64).tolist(), hi.to_numpy(np.int64).tolist())))


def _wgrad_fraction(run) -> float | None:
    for meta in run.meta.values():
        block = meta.get("pptrace") or {}
        b, w = block.get("bwd_ms"), block.get("wgrad_ms")
        if block.get("compute") == "sleep" and isinstance(b, (int, float)) and isinstance(w, (int, float)) and b + w > 0:
            return float(w) / float(b + w)
    return None


def _overlap_p2p_comm(run) -> bool:
    """Whether the run used Megatron's overlap_p2p_comm, from the trainer's config in the
    pptrace block; runs that do not say are replayed with blocking exchanges."""
    for meta in run.meta.values():
        config = (meta.get("pptrace") or {}).get("config") or {}
        if isinstance(config.get("overlap_p2p_comm"), bool):
            return config["overlap_p2p_comm"]
    return False


def measure(run, *, balanced_experts: bool = False) -> Measured:
    """Durations, latencies and the measured step of a run (medians over its profiled steps);
    with ``balanced_experts`` also the pass durations with every rank's experts given its ep
    group's mean tokens (``Measured.balanced``; NotBalanceable, a ValueError, for a run
    without expert-parallel ranges)."""
    p, v = run.layout.pp, int(run.vpp or 1)
    schedule = canonical(run.schedule)
    programs, m = None, int(run.microbatches or 0)
    if not has_closed_form(schedule):
        programs, m = _own_programs(run, v, m)
    if not m:
        raise ValueError(
            f"{run.path}: the traces do not say how many microbatches ran and show no compute passes; "
            "what-if needs a run recorded with pptrace.profile (or its passes named)"
        )
    stage_of = {r: run.layout.coords(r).pp for r in run.ranks}
    main = _main_events(run)
    notes = []
    steps = _typical_steps(run, notes)
    main = main[main["step"].isin(steps.index).to_numpy()]
    ops = _pipeline_ops(main)
    if ops.empty:
        raise ValueError(f"{run.path}: no compute:fwd/bwd ranges in the profiled steps; nothing to replay")
    split = bool((ops["op"] == BWD_INPUT).any())
    fwd, bwd, wgrad = _pass_matrices(ops, split, stage_of, p, m)
    present = set(ops["rank"].map(stage_of))
    notes.extend(f"stage {stage} has no traced passes; assumed the median of the other stages"
                 for stage in sorted(set(range(p)) - present))
    balanced = experts = None
    if balanced_experts:
        is_pass = (ops["category"] == "compute").to_numpy()
        shift, experts = balanced_shifts(run, main, ops[is_pass], notes)
        moved = ops["dur_ns"].to_numpy(np.int64).copy()
        moved[is_pass] += shift
        balanced = _pass_matrices(ops.assign(dur_ns=np.maximum(moved, 0)), split, stage_of, p, m)
    # torch's runtime schedules are replayed with eager sends (_replicated), whose latency
    # runs from the send's post
    observe = exchange_latencies if programs is None else eager_latencies
    observed = observe(run, steps.index, ops, stage_of)
    latency, samples = latency_of(observed, p)
    times = PipelineTimes(fwd, bwd, wgrad, latency, overhead(ops), samples, post_s=post_cost(main),
                          recv_s=float(observed.attrs.get("recv_ns", 0.0)) / 1e9)

    spans = _windows(run, ops, p)
    window = pd.Series({s: spans[s].end_ns - spans[s].start_ns for s in steps.index if s in spans}, dtype="float64")
    step_time = float(steps.median()) / 1e9
    fixed = float((steps - window.reindex(steps.index)).median()) / 1e9
    if len(steps) < 2:
        notes.append("only one profiled step: measured times carry that step's noise")
    return Measured(
        schedule=schedule or "unknown", vpp=v, times=times, step_time_s=step_time,
        window_s=float(window.median()) / 1e9, fixed_s=max(fixed, 0.0),
        split_backward=split, wgrad_fraction=_wgrad_fraction(run), notes=notes,
        overlap_p2p_comm=schedule == INTERLEAVED and _overlap_p2p_comm(run),
        programs=programs, balanced=balanced, experts=experts,
    )


def _own_programs(run, v: int, m: int) -> tuple[list, int]:
    """Programs of a schedule without a table, from its recorded or measured action order,
    and the microbatch count (what the orders hold when the run did not say)."""
    from ..analyzers.bubble import action_orders, microbatch_times

    found = action_orders(run, microbatch_times(run), v)
    if found is None:
        raise ValueError(
            f"{run.path}: schedule {run.schedule or '(unknown)'} has no table in pptrace and the traces show "
            "no pipeline passes to take its order from; nothing to replay"
        )
    orders, placement, _ = found
    m = max(m, 1 + max((action.mb for order in orders for action in order), default=-1))
    return action_programs(orders, placement), m


# ---------------------------------------------------------------------------------------
# overrides
# ---------------------------------------------------------------------------------------
def _target(measured: Measured, m: int, schedule, vpp, microbatches) -> tuple[str, int, int]:
    if schedule is None:
        schedule = INTERLEAVED if vpp is not None and vpp > 1 else measured.schedule
    if vpp is None:
        if schedule == measured.schedule and measured.programs is not None:
            vpp = measured.vpp  # a schedule without a table keeps the stages it ran with
        else:
            vpp = (measured.vpp if measured.vpp > 1 else 2) if schedule == INTERLEAVED else 1
    if schedule != INTERLEAVED and vpp != 1 and not (schedule == measured.schedule and measured.programs):
        raise ValueError(f"--vpp {vpp} needs --schedule interleaved (got {schedule})")
    return schedule, vpp, int(microbatches or m)


def _resize(a: np.ndarray, m: int) -> np.ndarray:
    """Per-stage medians for every microbatch when the count changes."""
    if a.shape[1] == m:
        return a
    return np.repeat(np.median(a, axis=1, keepdims=True), m, axis=1)


def _drop_straggler(times: PipelineTimes) -> tuple[PipelineTimes, int | None]:
    """Replace the slowest stage's times by its peers' median (elementwise)."""
    if times.p < 2:
        return times, None
    total = times.fwd.sum(1) + times.bwd.sum(1) + times.wgrad.sum(1)
    slow = int(np.argmax(total))
    peers = [s for s in range(times.p) if s != slow]
    arrays = []
    for a in (times.fwd, times.bwd, times.wgrad):
        a = a.copy()
        a[slow] = np.median(a[peers], axis=0)
        arrays.append(a)
    fwd, bwd, wgrad = arrays
    return replace(times, fwd=fwd, bwd=bwd, wgrad=wgrad), slow


def _for_schedule(measured: Measured, times: PipelineTimes, schedule: str, wgrad_fraction, notes) -> PipelineTimes:
    """Split or join B and W for the target schedule."""
    if schedule != ZB_H1 or measured.split_backward:
        return times
    fraction = wgrad_fraction if wgrad_fraction is not None else measured.wgrad_fraction
    if wgrad_fraction is None and fraction is not None:
        notes.append(f"W = {fraction:.0%} of the measured backward, from the run's sleep-mode settings")
    if fraction is None:
        fraction = DEFAULT_WGRAD_FRACTION
        notes.append(f"the run never split its backward; assumed W = {fraction:.0%} of it for ZB-H1")
    full = times.bwd + times.wgrad
    return replace(times, bwd=full * (1 - fraction), wgrad=full * fraction)


# ---------------------------------------------------------------------------------------
# the result
# ---------------------------------------------------------------------------------------
def _stages(timeline: Timeline) -> list[dict]:
    span = timeline.makespan_s or 1.0
    stages = timeline.stages[["stage", "bubble_s", "compute_s", "transfer_s"]].astype(
        {"stage": int, "bubble_s": float, "compute_s": float, "transfer_s": float})
    return stages.assign(bubble_fraction=stages["bubble_s"] / span).to_dict("records")


def _ops(timeline: Timeline) -> dict:
    cols = ["stage", "kind", "mb", "chunk", "start_s", "end_s"]
    return {"columns": cols, "rows": timeline.ops[cols].to_numpy().tolist()}


def _changes(measured: Measured, schedule: str, v: int, m: int, straggler, p2p_free: bool, wgrad_fraction,
             balanced_experts: bool = False) -> list:
    """What the prediction changed from the measured configuration (an empty list: nothing,
    and the prediction is the replay)."""
    changed = {
        "schedule": schedule != measured.schedule, "vpp": v != measured.vpp, "microbatches": m != measured.times.m,
        "no_straggler": straggler is not None, "p2p_free": bool(p2p_free),
        "balanced_experts": bool(balanced_experts),
        "wgrad_fraction": wgrad_fraction is not None and schedule == ZB_H1 and not measured.split_backward,
    }
    return [name for name, yes in changed.items() if yes]


def _comparison(measured: Measured, m: int, predicted_step: float, changes: list) -> dict:
    """How the prediction compares with the run. With another microbatch count a step does
    other work, so the step time is no measure: per-sample throughput is (the microbatch size
    is the run's). With no change, predicted and measured differ by the replay's own error
    only, which is no speedup. ``speedup``: the throughput gain, None when nothing changed;
    ``step_time_ratio``: measured over predicted step time, always."""
    ratio = measured.step_time_s / predicted_step if predicted_step > 0 else None
    throughput = ratio * m / measured.times.m if ratio is not None and measured.times.m else None
    basis = BY_REPLAY_ERROR if not changes else BY_THROUGHPUT if "microbatches" in changes else BY_STEP_TIME
    return {"changes": changes, "comparison": basis, "step_time_ratio": ratio, "throughput_ratio": throughput,
            "speedup": None if basis == BY_REPLAY_ERROR else throughput}


def _replicated(schedule: str, times: PipelineTimes, v: int, sends: str, n: int, overlap: bool,
                programs: list | None = None) -> Timeline:
    """The median-makespan timeline of n simulations with drawn latencies (one if nothing
    is random)."""
    if programs is not None:
        sends = "eager"  # torch posts its sends and waits on them later
    if times.latency_samples is None or n <= 1:
        return simulate(schedule, times, v, sends=sends, overlap_p2p_comm=overlap, programs=programs)
    rng = np.random.default_rng(SEED)
    runs = sorted((simulate(schedule, times, v, sends=sends, rng=rng, overlap_p2p_comm=overlap, programs=programs)
                   for _ in range(n)), key=lambda t: t.makespan_s)
    return runs[len(runs) // 2]


def _replications(p: int, v: int, m: int, wanted: int, drawn: bool, notes: list, what: str,
                  fix: str | None = None) -> int:
    """How many replays a schedule of ``p`` stages x ``v`` chunks x ``m`` microbatches gets
    within SIMULATION_BUDGET: ``wanted``, or fewer (odd) for a long one, with a note; a
    ValueError saying the largest count that fits when not even MIN_REPLICATIONS do (one
    replay when no latency is drawn: all replays would be the same)."""
    passes = p * v * m
    floor = min(wanted, MIN_REPLICATIONS) if drawn else 1
    n = min(wanted, SIMULATION_BUDGET // max(passes, 1))
    if n < floor:
        most = SIMULATION_BUDGET // floor // (p * v)
        shape = f"{p} stages x {v} chunks" if v > 1 else f"{p} stages"
        fix = fix or (f"use --microbatches {most} or fewer" if most >= 1 else
                      "use fewer --vpp chunks" if v > 1 else "pptrace cannot replay this pipeline")
        raise ValueError(
            f"{what} {shape} x {m} microbatches is {passes} passes to replay; pptrace replays at most "
            f"{SIMULATION_BUDGET // floor} per step so that a prediction takes seconds, not minutes: {fix}"
        )
    if drawn and n < wanted:
        n -= 1 - n % 2
        notes.append(f"{what} {passes} passes per step: the median of {n} replays with drawn latencies, "
                     f"not {wanted}, to answer in seconds")
    return n


@phased(WHATIF)
def whatif(run, *, schedule=None, vpp=None, microbatches=None, no_straggler=False, p2p_free=False,
           balanced_experts=False, wgrad_fraction=None, sends="rendezvous", replications=REPLICATIONS) -> dict:
    """Predict the step time of ``run`` under the given changes (None = as measured).

    Returns a JSON-ready dict: ``measured`` (step_time_s, schedule, ...), ``replay`` (the
    measured schedule simulated with the measured times, and its error), ``predicted``
    (step_time_s, stages[] {stage, bubble_s, ...}, timeline), ``changes`` (what differs from
    the measured configuration), ``comparison`` (what to compare: ``throughput`` when the
    microbatch count changed, ``step_time`` for other changes, ``replay_error`` when nothing
    changed), ``step_time_ratio``, ``throughput_ratio``, ``speedup`` (see _comparison) and
    ``notes``.
    ``balanced_experts``: every rank's expert compute (``compute:expert`` ranges, tagged
    ``tokens=``) rescaled to its ep group's mean tokens per layer call, and each pass moved
    by what that moves its group's all-to-all (whatif/experts.py); ``predicted.experts``
    says what moved.
    Raises ValueError for impossible changes (interleaved with microbatches % pp != 0, a run
    without expert parallelism for ``balanced_experts``, ...).
    Message latencies are drawn from the run's measured transfers in ``replications``
    simulations (fixed seed); the median one is reported.
    """
    if balanced_experts:
        check_balanceable(run)
    if run.microbatches:  # before measure() sizes its arrays by what the traces claim
        _replications(run.layout.pp, int(run.vpp or 1), int(run.microbatches), replications, True, [],
                      f"{run.path}: the traces say that", "what-if cannot replay this run")
    measured = measure(run, balanced_experts=balanced_experts)
    times, notes = measured.times, list(measured.notes)
    target, v, m = _target(measured, times.m, schedule, vpp, microbatches)
    if schedule is None and target != measured.schedule:
        notes.append(f"--vpp {v} chunks per stage need the interleaved schedule: predicted with it "
                     f"(the run used {measured.schedule}); give --schedule to choose another")
    drawn = times.latency_samples is not None
    n_replay = _replications(times.p, measured.vpp, times.m, replications, drawn, notes, "the measured schedule:",
                             "what-if cannot replay this run")
    n_predict = _replications(times.p, v, m, replications, drawn and not p2p_free, notes,
                              f"--microbatches {m}:" if microbatches else "the prediction:")

    replay = _replicated(measured.schedule, times, measured.vpp, sends, n_replay, measured.overlap_p2p_comm,
                         measured.programs)
    replay_step = replay.makespan_s + measured.fixed_s

    if balanced_experts:
        fwd, bwd, wgrad = measured.balanced
        times = replace(times, fwd=fwd, bwd=bwd, wgrad=wgrad)
        moved = measured.experts
        saved, share = moved["pass_time_saved_s"], moved["max_over_mean_tokens"]
        busiest = f" (the busiest had {share:.2f}x the mean)" if share is not None else ""
        notes.append(f"balanced experts: {moved['layer_calls']:g} MoE layer calls a step, each rank's expert time "
                     f"rescaled to its ep group's mean tokens{busiest}: a rank's passes {abs(saved) * 1e3:.1f} ms "
                     f"{'shorter' if saved >= 0 else 'longer'} a step, the all-to-all waits for it included")
        notes.append("balanced experts, accuracy: a lower bound. Each all-to-all after the experts keeps the cost "
                     "it had here after its last arrival, where the early ranks had swapped their rows before the "
                     "late one came; balanced, all arrive at once and pay the whole exchange (reference trainer, "
                     "4 ranks on 2 cores: 2.0 ms a rank against the late rank's 1.1-1.3 ms), so the step is "
                     "predicted low by up to the all-to-alls after the experts (measured 1.7-9% low)")
    straggler = None
    if no_straggler:
        times, straggler = _drop_straggler(times)
    if p2p_free:
        times = replace(times, latency_s=0.0, latency_samples=None)
    times = replace(times, fwd=_resize(times.fwd, m), bwd=_resize(times.bwd, m), wgrad=_resize(times.wgrad, m))
    times = _for_schedule(measured, times, target, wgrad_fraction, notes)
    if measured.split_backward and target != ZB_H1:
        notes.append("B and W measured separately run back to back as one backward in this schedule")
    # a schedule the run did not use runs as Megatron's training scripts run it by default
    overlap = measured.overlap_p2p_comm if target == measured.schedule else target == INTERLEAVED
    own = measured.programs if target == measured.schedule else None
    if own is not None and m != measured.times.m:
        raise ValueError(
            f"schedule {measured.schedule} has no table in pptrace: its order is known for the "
            f"{measured.times.m} microbatches that ran only; pick a --schedule to change the count"
        )
    if target not in SCHEDULES and own is None:
        raise ValueError(f"schedule {target!r} is not one of {SCHEDULES}")
    predicted = _replicated(target, times, v, sends, n_predict, overlap, own)
    predicted_step = predicted.makespan_s + measured.fixed_s
    return {
        "schema": SCHEMA,
        "measured": {
            "schedule": measured.schedule, "pp": times.p, "microbatches": measured.times.m,
            "vpp": measured.vpp, "overlap_p2p_comm": measured.overlap_p2p_comm, "step_time_s": measured.step_time_s,
            "window_s": measured.window_s, "fixed_s": measured.fixed_s, "steps": list(run.steps),
        },
        "model": {
            "t_fwd_s": measured.times.fwd.mean(1).tolist(),
            "t_bwd_s": measured.times.bwd.mean(1).tolist(),
            "t_wgrad_s": measured.times.wgrad.mean(1).tolist(),
            "latency_s": float(np.median(measured.times.latency_s)),
            "overhead_s": measured.times.overhead_s, "post_s": measured.times.post_s,
            "sends": sends,
        },
        "replay": {
            "step_time_s": replay_step, "window_s": replay.makespan_s,
            "error_fraction": replay_step / measured.step_time_s - 1 if measured.step_time_s else None,
        },
        "predicted": {
            "schedule": target, "microbatches": m, "vpp": v, "overlap_p2p_comm": overlap,
            "no_straggler": bool(no_straggler), "straggler_stage": straggler,
            "p2p_free": bool(p2p_free),
            "balanced_experts": bool(balanced_experts), "experts": measured.experts,
            "step_time_s": predicted_step, "window_s": predicted.makespan_s,
            "stages": _stages(predicted), "timeline": _ops(predicted),
        },
        **_comparison(measured, m, predicted_step, _changes(measured, target, v, m, straggler, p2p_free,
                                                            wgrad_fraction, balanced_experts)),
        "notes": notes,
    }
