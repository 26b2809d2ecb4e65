"""What-if: replay a measured run under another schedule, vpp, microbatch count, without its
straggler or with free p2p, and predict the step time.

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

from ..vocab import BWD, BWD_INPUT, BWD_WEIGHT, FWD, LOSS, PASS_OPS, SCHEDULES, canonical, has_closed_form
from ..schedules.replay import PipelineTimes, Timeline, action_programs, simulate
from ..ingest import exchanges
from ..ingest.lanes import lane_keys
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


def _main_events(run) -> pd.DataFrame:
    ev = run.events
    keep = (ev["lane"] == "main").to_numpy() & ev["step"].isin(run.steps).to_numpy()
    return ev.loc[keep, ["rank", "step", "category", "kind", "op", "mb", "chunk", "start_ns", "end_ns", "dur_ns"]]


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
    compute = (main["category"] == "compute") & main["op"].isin((*PASS_OPS, LOSS))
    p2p = (main["category"] == "p2p") & (main["kind"] == "pp")
    return main[(compute | p2p).to_numpy()]


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


def _exchange_spans(rank, exchange, start, end, ops: pd.DataFrame) -> pd.DataFrame:
    """Per exchange (ids of exchanges.exchange_ids): rank, exchange, lo, hi (its span) and
    ``passes``: whether a pass of the rank starts inside it (posted, then waited after other
    work: ZB-H1's W's, overlap_p2p_comm, torch's sends waited at the end of the step)."""
    ranges = pd.DataFrame({"rank": np.asarray(rank, np.int64), "exchange": np.asarray(exchange, np.int64),
                           "start": np.asarray(start, np.int64), "end": np.asarray(end, np.int64)})
    g = ranges.groupby("exchange", sort=True)
    spans = pd.DataFrame({"rank": g["rank"].first(), "lo": g["start"].min(), "hi": g["end"].max()}).reset_index()
    compute = ops.loc[(ops["category"] == "compute").to_numpy(), ["rank", "start_ns"]]
    compute = compute.astype({"rank": np.int64, "start_ns": np.int64}).sort_values("start_ns")
    nxt = pd.merge_asof(spans.sort_values("lo", kind="stable"), compute, left_on="lo", right_on="start_ns",
                        by="rank", direction="forward")
    nxt["passes"] = (nxt["start_ns"] < nxt["hi"]).to_numpy()
    return nxt.drop(columns="start_ns").sort_values("exchange").reset_index(drop=True)


def _exchange_latencies(run, steps, ops: pd.DataFrame, stage_of) -> pd.DataFrame:
    """One latency observation per p2p exchange (exchanges.py; the loader's pairs carry each
    side's): its end minus the moment its last message was ready. The ranges of one combined
    exchange all close when its last direction completes, so a pair's own recv_end -
    max(starts) would count the wait for the *other* directions as transfer; the exchange's
    tail after its last match does not. Exchanges with passes inside (_exchange_spans) are
    left out: their tail is the passes'. Rows in order of rank and exchange start (the order
    latency draws index)."""
    columns = ["rank", "exchange", "link", "latency_ns"]
    pairs = run.pairs
    pairs = pairs[(pairs["kind"] == "pp").to_numpy() & pairs["step"].isin(steps).to_numpy()]
    if pairs.empty:
        return pd.DataFrame(columns=columns)
    link = list(zip(pairs["src"].map(stage_of), pairs["dst"].map(stage_of)))
    sides = pd.DataFrame({
        "rank": np.concatenate([pairs["src"], pairs["dst"]]).astype(np.int64),
        "exchange": np.concatenate([pairs["send_exchange"], pairs["recv_exchange"]]).astype(np.int64),
        "start": np.concatenate([pairs["send_start_ns"], pairs["recv_start_ns"]]).astype(np.int64),
        "end": np.concatenate([pairs["send_end_ns"], pairs["recv_end_ns"]]).astype(np.int64),
        "ready": np.concatenate(exchanges.sides_ready(pairs)),
        "link": link + link,
    }).sort_values(["rank", "start"], kind="stable").reset_index(drop=True)
    # the first of the latest-ready ranges, in range order, names the link
    last = sides.loc[sides.groupby("exchange", sort=True)["ready"].idxmax().to_numpy()]
    spans = _exchange_spans(sides["rank"], sides["exchange"], sides["start"], sides["end"], ops)
    quiet = ~spans["passes"].to_numpy()
    return pd.DataFrame({"rank": spans["rank"].to_numpy()[quiet], "exchange": spans["exchange"].to_numpy()[quiet],
                         "link": last["link"].to_numpy()[quiet],
                         "latency_ns": np.maximum(0, spans["hi"].to_numpy() - last["ready"].to_numpy())[quiet]},
                        columns=columns)


#: A recv that lasted more than this many times a recv's own cost waited for its message, so
#: its end is the message's arrival (an exact eager latency); a shorter one found it landed.
WAITED_FACTOR = 2.0


def _left_censored_cdf(value: np.ndarray, exact: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distribution of observations of which the inexact ones are upper bounds (reverse
    Kaplan-Meier: ``value`` read backwards is right-censored): (support ascending, its CDF)."""
    flipped = value.max() - value
    order = np.lexsort((~exact, flipped))  # at ties, events before censorings
    flipped, exact = flipped[order], exact[order]
    at_risk = len(flipped) - np.arange(len(flipped))
    survive = np.cumprod(np.where(exact, 1.0 - 1.0 / at_risk, 1.0))
    mass = np.where(exact, np.r_[1.0, survive[:-1]] - survive, 0.0)
    support = (value.max() - flipped)[::-1]
    cdf = np.cumsum(mass[::-1])
    return support, cdf / cdf[-1] if cdf[-1] > 0 else cdf


def _eager_latencies(run, steps, ops: pd.DataFrame, stage_of) -> pd.DataFrame:
    """One latency per p2p message for a replay with eager sends (torch's runtime schedules
    post a send and wait on it later; a recv ends once its message landed): from the send's
    post to the recv's end. Exact when the recv waited for it: it was posted before the send,
    or it lasted over :data:`WAITED_FACTOR` times a recv's own cost (the median recv posted
    well after its send). Otherwise the message had landed before the recv was posted, and
    that span is only an upper bound: such a message gets the median of the distribution
    below its bound (reverse Kaplan-Meier over all of them), not the bound, which would
    count the receiver's own lateness as latency, nor the recv's own span, which would drop
    the time the message took. Recvs with passes inside (posted, waited later) are left out."""
    columns = ["rank", "exchange", "link", "latency_ns"]
    pairs = run.pairs
    pairs = pairs[(pairs["kind"] == "pp").to_numpy() & pairs["step"].isin(steps).to_numpy()]
    if pairs.empty:
        return pd.DataFrame(columns=columns)
    dst = pairs["dst"].to_numpy(np.int64)
    recv_start, recv_end = pairs["recv_start_ns"].to_numpy(np.int64), pairs["recv_end_ns"].to_numpy(np.int64)
    send_start = pairs["send_start_ns"].to_numpy(np.int64)
    spans = _exchange_spans(dst, np.arange(len(pairs)), recv_start, recv_end, ops)
    quiet = ~spans["passes"].to_numpy()
    if not quiet.any():
        return pd.DataFrame(columns=columns)
    bound = np.maximum(recv_end - send_start, 0)[quiet].astype(float)
    lasted = (recv_end - recv_start)[quiet].astype(float)
    before = (recv_start <= send_start)[quiet]
    # a recv posted long after its send (beyond 4 typical bounds) found its message there
    landed = (recv_start - send_start)[quiet] > 4 * np.median(bound)
    cost = float(np.median(lasted[landed])) if landed.any() else float(np.percentile(lasted, 10))
    exact = before | (lasted > WAITED_FACTOR * cost)
    latency = bound
    if (~exact).any() and exact.any():
        support, cdf = _left_censored_cdf(bound, exact)
        below = cdf[np.clip(np.searchsorted(support, bound[~exact], side="right") - 1, 0, len(cdf) - 1)]
        median_below = support[np.clip(np.searchsorted(cdf, below / 2), 0, len(support) - 1)]
        latency = bound.copy()
        latency[~exact] = np.minimum(median_below, bound[~exact])
    link = list(zip(pairs["src"].map(stage_of)[quiet], pairs["dst"].map(stage_of)[quiet]))
    return pd.DataFrame({"rank": dst[quiet], "exchange": np.flatnonzero(quiet), "link": link,
                         "latency_ns": latency}, columns=columns)


def _latency(observed: pd.DataFrame, p: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per link median latency, and all observations (the empirical distribution)."""
    lat = np.zeros((p, p))
    if observed.empty:
        return lat, None
    seconds = observed["latency_ns"].to_numpy(dtype=float) / 1e9
    lat[:] = float(np.median(seconds))  # links the run never used (e.g. interleaved's wrap)
    per_link = observed.groupby("link")["latency_ns"].median()
    ends = np.array(per_link.index.tolist(), dtype=np.int64).reshape(-1, 2)
    lat[ends[:, 0], ends[:, 1]] = per_link.to_numpy(dtype=float) / 1e9
    return lat, seconds


def _overhead(ops: pd.DataFrame) -> float:
    """Median host gap after a pipeline op of a rank ends until its next op starts. A p2p
    exchange (exchanges.py) blocks as one op; one with passes inside (_exchange_spans) was
    posted and waited apart, so its ranges are ops of their own (each a post, later a wait).
    It is an op's end, not the end of all opened before it, that the next start is measured
    from: an exchange open across passes hides no gap between them."""
    p2p = ops[(ops["category"] == "p2p").to_numpy()]
    ids = exchanges.exchange_ids(p2p["rank"], p2p["start_ns"], p2p["end_ns"])
    spans = _exchange_spans(p2p["rank"], ids, p2p["start_ns"], p2p["end_ns"], ops)
    apart = spans["passes"].to_numpy()[np.searchsorted(spans["exchange"].to_numpy(), ids)]
    steps = p2p.groupby(ids)["step"].first()
    blocking = spans[~spans["passes"]]
    units = pd.concat([
        ops.loc[(ops["category"] != "p2p").to_numpy(), ["rank", "step", "start_ns", "end_ns"]],
        p2p.loc[apart, ["rank", "step", "start_ns", "end_ns"]],
        pd.DataFrame({"rank": blocking["rank"], "step": steps.reindex(blocking["exchange"]).to_numpy(),
                      "start_ns": blocking["lo"], "end_ns": blocking["hi"]}),
    ])
    group = pd.MultiIndex.from_arrays([units["rank"].to_numpy(), units["step"].to_numpy()]).factorize()[0]
    start_key, end_key = lane_keys([group, group], [units["start_ns"].to_numpy(np.int64),
                                                    units["end_ns"].to_numpy(np.int64)])
    s_order, e_order = np.argsort(start_key, kind="stable"), np.argsort(end_key, kind="stable")
    start_key, end_key = start_key[s_order], end_key[e_order]
    start, end = units["start_ns"].to_numpy(np.int64)[s_order], units["end_ns"].to_numpy(np.int64)[e_order]
    g_start, g_end = group[s_order], group[e_order]
    first_end = np.searchsorted(g_end, g_start, side="left")  # where each start's group begins among ends
    later = np.r_[False, g_start[1:] == g_start[:-1]]  # every start but its group's first
    done = np.searchsorted(end_key, start_key, side="right")  # ops of the group ended by each start
    ended = end[np.maximum(done - 1, 0)]
    prev_start = np.r_[start[:1], start[:-1]]
    # a start with no op ended since the previous start opened inside that one: no gap
    gap = np.where(later & (done > first_end) & (ended >= prev_start), start - ended, 0)
    gaps = gap[gap > 0]
    return float(np.median(gaps)) / 1e9 if gaps.size else 0.0


def _post_cost(main: pd.DataFrame) -> float:
    """Median host time from posting an exchange that is waited later to the pass run
    meanwhile (ZB-H1's W, overlap_p2p_comm): the earliest p2p range opened since the rank's
    previous pass, up to the start of the pass nested in it."""
    groups = pd.MultiIndex.from_arrays([main["rank"].to_numpy(), main["step"].to_numpy()]).factorize()[0]
    is_pass = (main["category"] == "compute").to_numpy()
    is_p2p = (main["category"] == "p2p").to_numpy() & (main["kind"] == "pp").to_numpy()
    if not is_pass.any() or not is_p2p.any():
        return 0.0
    g_pass, g_p2p = groups[is_pass], groups[is_p2p]
    pass_start, pass_end = main["start_ns"].to_numpy(np.int64)[is_pass], main["end_ns"].to_numpy(np.int64)[is_pass]
    p_start, p_end = main["start_ns"].to_numpy(np.int64)[is_p2p], main["end_ns"].to_numpy(np.int64)[is_p2p]
    (keys,) = lane_keys([np.r_[g_pass, g_p2p]], [np.r_[pass_start, p_start]])
    pass_key, p2p_key = keys[:len(g_pass)], keys[len(g_pass):]
    order = np.argsort(pass_key, kind="stable")
    pass_key, g_pass, pass_start, pass_end = pass_key[order], g_pass[order], pass_start[order], pass_end[order]
    # previous pass of the same rank and step (by start): a range posted after it ended and
    # still open when the next pass starts was posted to be waited later
    prev_end = np.where(np.r_[False, g_pass[1:] == g_pass[:-1]], np.r_[0, pass_end[:-1]], np.iinfo(np.int64).min)
    nxt = np.searchsorted(pass_key, p2p_key, side="right")  # the first pass starting after each post
    ok = nxt < len(pass_key)
    nxt = np.minimum(nxt, len(pass_key) - 1)
    opened = ok & (g_pass[nxt] == g_p2p) & (p_start >= prev_end[nxt]) & (p_start < pass_start[nxt]) \
        & (p_end > pass_start[nxt])
    if not opened.any():
        return 0.0
    earliest = np.full(len(pass_key), np.iinfo(np.int64).max)
    np.minimum.at(earliest, nxt[opened], p_start[opened])
    hit = earliest < np.iinfo(np.int64).max
    costs = pass_start[hit] - earliest[hit]
    return float(np.median(costs)) / 1e9


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


def measure(run) -> Measured:
    """Durations, latencies and the measured step of a run (medians over its profiled steps)."""
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
    fwd = _stage_matrix(ops, [FWD, LOSS], stage_of, p, m)
    # a split run's full backward passes (some torch zero-bubble schedules mix them) count as B
    bwd = _stage_matrix(ops, [BWD_INPUT, BWD] if split else [BWD], stage_of, p, m)
    wgrad = _stage_matrix(ops, [BWD_WEIGHT], stage_of, p, m)
    present = sorted(set(ops["rank"].map(stage_of)))
    for stage in sorted(set(range(p)) - set(present)):
        # a stage without a usable trace: assume it was like the others (partial input)
        notes.append(f"stage {stage} has no traced passes; assumed the median of the other stages")
        for a in (fwd, bwd, wgrad):
            a[stage] = np.median(a[present], axis=0)
    # torch's runtime schedules are replayed with eager sends (_replicated), whose latency
    # runs from the send's post
    observe = _exchange_latencies if programs is None else _eager_latencies
    latency, samples = _latency(observe(run, steps.index, ops, stage_of), p)
    times = PipelineTimes(fwd, bwd, wgrad, latency, _overhead(ops), samples, post_s=_post_cost(main))

    spans = run.pipeline_windows
    window = pd.Series({s: spans[s][1] - spans[s][0] for s in steps.index if s in spans}, dtype="float64")
    step_time = float(steps.median()) / 1e9
    fixed = float((steps - window.reindex(steps.index)).median()) / 1e9
    if len(steps) < 2:
        notes.append("only one profiled step: measured times carry that step's noise")
    return Measured(
        schedule=schedule or "unknown", vpp=v, times=times, step_time_s=step_time,
        window_s=float(window.median()) / 1e9, fixed_s=max(fixed, 0.0),
        split_backward=split, wgrad_fraction=_wgrad_fraction(run), notes=notes,
        overlap_p2p_comm=schedule == "interleaved" and _overlap_p2p_comm(run),
        programs=programs,
    )


def _own_programs(run, v: int, m: int) -> tuple[list, int]:
    """Programs of a schedule without a table, from its recorded or measured action order,
    and the microbatch count (what the orders hold when the run did not say)."""
    from ..analyzers.bubble import action_orders, microbatch_times

    view = run
    found = action_orders(view, microbatch_times(view), v)
    if found is None:
        raise ValueError(
            f"{run.path}: schedule {run.schedule or '(unknown)'} has no table in pptrace and the traces show "
            "no pipeline passes to take its order from; nothing to replay"
        )
    orders, placement, _ = found
    m = max(m, 1 + max((mb for order in orders for _, _, mb in order), default=-1))
    return action_programs(orders, placement), m


# ---------------------------------------------------------------------------------------
# overrides
# ---------------------------------------------------------------------------------------
def _target(measured: Measured, m: int, schedule, vpp, microbatches) -> tuple[str, int, int]:
    if schedule is None:
        schedule = "interleaved" if vpp is not None and vpp > 1 else measured.schedule
    if vpp is None:
        if schedule == measured.schedule and measured.programs is not None:
            vpp = measured.vpp  # a schedule without a table keeps the stages it ran with
        else:
            vpp = (measured.vpp if measured.vpp > 1 else 2) if schedule == "interleaved" else 1
    if schedule != "interleaved" and vpp != 1 and not (schedule == measured.schedule and measured.programs):
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
    return replace(times, fwd=arrays[0], bwd=arrays[1], wgrad=arrays[2]), slow


def _for_schedule(measured: Measured, times: PipelineTimes, schedule: str, wgrad_fraction, notes) -> PipelineTimes:
    """Split or join B and W for the target schedule."""
    if schedule != "zb-h1" or measured.split_backward:
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


def _changes(measured: Measured, schedule: str, v: int, m: int, straggler, p2p_free: bool, wgrad_fraction) -> list:
    """What the prediction changed from the measured configuration (an empty list: nothing,
    and the prediction is the replay)."""
    changed = {
        "schedule": schedule != measured.schedule, "vpp": v != measured.vpp, "microbatches": m != measured.times.m,
        "no_straggler": straggler is not None, "p2p_free": bool(p2p_free),
        "wgrad_fraction": wgrad_fraction is not None and schedule == "zb-h1" and not measured.split_backward,
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
    basis = "replay_error" if not changes else "throughput" if "microbatches" in changes else "step_time"
    return {"changes": changes, "comparison": basis, "step_time_ratio": ratio, "throughput_ratio": throughput,
            "speedup": None if basis == "replay_error" else throughput}


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
           wgrad_fraction=None, sends="rendezvous", replications=REPLICATIONS) -> dict:
    """Predict the step time of ``run`` under the given changes (None = as measured).

    Returns a JSON-ready dict: ``measured`` (step_time_s, schedule, ...), ``replay`` (the
    measured schedule simulated with the measured times, and its error), ``predicted``
    (step_time_s, stages[] {stage, bubble_s, ...}, timeline), ``changes`` (what differs from
    the measured configuration), ``comparison`` (what to compare: ``throughput`` when the
    microbatch count changed, ``step_time`` for other changes, ``replay_error`` when nothing
    changed), ``step_time_ratio``, ``throughput_ratio``, ``speedup`` (see _comparison) and
    ``notes``.
    Raises ValueError for impossible changes (interleaved with microbatches % pp != 0, ...).
    Message latencies are drawn from the run's measured transfers in ``replications``
    simulations (fixed seed); the median one is reported.
    """
    if run.microbatches:  # before measure() sizes its arrays by what the traces claim
        _replications(run.layout.pp, int(run.vpp or 1), int(run.microbatches), replications, True, [],
                      f"{run.path}: the traces say that", "what-if cannot replay this run")
    measured = measure(run)
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

    straggler = None
    if no_straggler:
        times, straggler = _drop_straggler(times)
    if p2p_free:
        times = replace(times, latency_s=0.0, latency_samples=None)
    times = replace(times, fwd=_resize(times.fwd, m), bwd=_resize(times.bwd, m), wgrad=_resize(times.wgrad, m))
    times = _for_schedule(measured, times, target, wgrad_fraction, notes)
    if measured.split_backward and target != "zb-h1":
        notes.append("B and W measured separately run back to back as one backward in this schedule")
    # a schedule the run did not use runs as Megatron's training scripts run it by default
    overlap = measured.overlap_p2p_comm if target == measured.schedule else target == "interleaved"
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
            "step_time_s": predicted_step, "window_s": predicted.makespan_s,
            "stages": _stages(predicted), "timeline": _ops(predicted),
        },
        **_comparison(measured, m, predicted_step, _changes(measured, target, v, m, straggler, p2p_free,
                                                            wgrad_fraction)),
        "notes": notes,
    }
