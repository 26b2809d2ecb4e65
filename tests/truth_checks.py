"""Checks shared by the tests that run real pipelines against their own logged truth
(tests/pipelining_run.py and tests/megatron_run.py runs, with pptrace or plain).

A harness knows two things about each pass exactly: the sleep inside it (the least the rank
was busy) and the framework's own span around it (torch's ``forward_one_chunk`` or
Megatron's ``forward_step`` as the harness timed them: the most it was busy, autograd and the
profiler included). The analysis is right when its compute lies between the two, and its idle
between the pipeline window less the one and less the other (the window itself bounded from
inside by the first and last pass, from outside by the schedule call): a **bracket**, tight
where the truth is tight, and free of any margin tuned to one machine's overhead. Only what
the truth cannot see widens it: :data:`TOLERANCE_MS`, and the clock offset the analysis applied.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

#: What no truth span covers and the analysis may rightly book either way, per rank-step: the
#: profiler's own clock against ``time.time_ns`` (µs), a last stage's loss between passes
#: (tens of µs a microbatch), the step's bookkeeping around the marks. Not pass overhead: that
#: is inside the bracket.
TOLERANCE_MS = 2.0

Spans = Callable[[dict, int], list]  # (one rank's truth, step) -> [(start, end) epoch ns]


def truth_step(truth: dict, step: int) -> dict:
    """One rank's logged truth of ``step``."""
    return next(s for s in truth["steps"] if s["step"] == step)


def _work(truth: dict, step: int) -> list:
    """The step's actions and its loss calls (the last stage's compute between them)."""
    s = truth_step(truth, step)
    return [*s["actions"], *s.get("losses", ())]


def sleeps(truth: dict, step: int) -> list:
    """(start, end) epoch ns of every sleep this rank logged in ``step`` (its passes' and
    its loss calls')."""
    return [(z["start_epoch_ns"], z["end_epoch_ns"]) for a in _work(truth, step) for z in a["sleeps"]]


def passes(truth: dict, step: int) -> list:
    """(start, end) epoch ns of every pass (torch's forward_one_chunk, backward_one_chunk,
    backward_weight_one_chunk, timed by the harness around them) and loss call this rank ran
    in ``step``."""
    return [(a["start_epoch_ns"], a["end_epoch_ns"]) for a in _work(truth, step)]


def loss_calls(truth: dict, step: int) -> dict:
    """(stage, mb) -> the logged loss call after that forward of the last stage: the j-th
    loss of the step follows the j-th forward of the last stage."""
    s = truth_step(truth, step)
    last = len(truth["stage_ranks"]) - 1
    forwards = [a for a in s["actions"] if a["op"] == "F" and a["stage"] == last]
    return {(f["stage"], f["mb"]): call for f, call in zip(forwards, s.get("losses", ()))}


def _own_work(truth: dict, step: int) -> list:
    """The rank's step outside ``schedule.step()`` less the closing all-reduce (zero_grad, the
    grad norm, the optimizer)."""
    s = truth_step(truth, step)
    return [(s["start_epoch_ns"], s["pipeline_start_epoch_ns"]), (s["pipeline_end_epoch_ns"], s["reduce_start_epoch_ns"]),
            (s["reduce_end_epoch_ns"], s["end_epoch_ns"])]


def passes_and_own_work(truth: dict, step: int) -> list:
    """Everything this rank may have computed in ``step``: its passes and its own work."""
    return [*passes(truth, step), *_own_work(truth, step)]


def passes_to_posts_and_own_work(truth: dict, step: int) -> list:
    """:func:`passes_and_own_work` with each pass stretched to the p2p calls beside it: what a
    plain trace's pass may hold, from where its input's wait returned (torch's bookkeeping
    between that wait and its pass function included)."""
    return [*passes_to_posts(truth, step), *_own_work(truth, step)]


def covered(spans, lo: int, hi: int) -> int:
    """ns of [lo, hi) covered by the union of ``spans``."""
    total, last = 0, lo
    for a, b in sorted(spans):
        a, b = max(a, last), min(b, hi)
        if b > a:
            total += b - a
            last = b
    return total


def _spanning(truths: dict, rank: int, step: int, spans_of: Spans, start: str, end: str) -> tuple:
    """From the first start to the last end of ``spans_of(truth, step)`` over every rank,
    within ``rank``'s own step (``start`` / ``end``: its keys in the truth): the part before
    this rank's step began belongs to its previous step."""
    spans = [span for t in truths.values() for span in spans_of(t, step)]
    own = truth_step(truths[rank], step)
    return max(min(a for a, _ in spans), own[start]), min(max(b for _, b in spans), own[end])


def _schedule_call(truth: dict, step: int) -> list:
    s = truth_step(truth, step)
    return [(s["pipeline_start_epoch_ns"], s["pipeline_end_epoch_ns"])]


def pipeline_window(truths: dict, rank: int, step: int) -> tuple:
    """The pipeline window (DESIGN contract 3) from the truth (rank -> truth), within
    ``rank``'s step: every rank runs its pipeline inside schedule.step(), so the window spans
    the earliest call to the latest return."""
    return _spanning(truths, rank, step, _schedule_call, "start_epoch_ns", "end_epoch_ns")


def passes_window(truths: dict, rank: int, step: int) -> tuple:
    """The pipeline window as DESIGN contract 3 means it: the first pass any rank began to
    the last one any rank ended, within ``rank``'s step (the framework's spans, so it holds
    the analysis' window, which starts at the first pass's range). :func:`pipeline_window`,
    the schedule call, is wider: torch's schedule.step() spends ~1-2 ms before its first
    operation, and after its last pass reduces FSDP's gradients and waits on its sends."""
    return _spanning(truths, rank, step, passes, "start_epoch_ns", "end_epoch_ns")


def step_span(truths: dict, rank: int, step: int) -> tuple:
    """The whole of ``rank``'s ``step`` (epoch ns)."""
    own = truth_step(truths[rank], step)
    return own["start_epoch_ns"], own["end_epoch_ns"]


def orders_that_ran(truths: dict, step: int, recorded_if_same: bool = True) -> tuple[list, list]:
    """(per pipeline position its action order, global stage -> position) from the truth of
    torch pipelining: the order torch's runtime schedules run, send posts included
    (``pipeline_order_with_comms``); for GPipe / 1F1B, which post each send right after its
    pass, the order ``step`` ran, or (``recorded_if_same``) the schedule's own
    ``pipeline_order`` when it holds the same actions."""
    by_pos = {t["pp_rank"]: t for t in truths.values()}
    placement = [by_pos[0]["pp_ranks"].index(r) for r in by_pos[0]["stage_ranks"]]
    orders = []
    for pos in range(len(by_pos)):
        t = by_pos[pos]
        order = t["pipeline_order_with_comms"]
        if order is None:
            executed = [[a["op"], a["stage"], a["mb"]] for a in truth_step(t, step)["actions"]]
            same = recorded_if_same and sorted(t["pipeline_order"]) == sorted(executed)
            order = t["pipeline_order"] if same else executed
        orders.append([tuple(a) for a in order])
    return orders, placement


def sends_per_step(truths: dict) -> int:
    """The p2p messages one step moves: each microbatch crosses every stage boundary whose two
    stages sit on different ranks, once forward and once backward."""
    t = next(iter(truths.values()))
    where = t["stage_ranks"]
    boundaries = sum(1 for s in range(len(where) - 1) if where[s] != where[s + 1])
    return 2 * boundaries * t["microbatches"]


# Megatron's truth (tests/megatron_run.py): epoch ns in ``*_ns``, passes and frames in lists.
def megatron_sleeps(truth: dict, step: int) -> list:
    """(start, end) of every sleep this rank logged in ``step``."""
    return [(p["start_ns"], p["end_ns"]) for p in truth["passes"] if p["step"] == step]


def megatron_frames(truth: dict, step: int) -> list:
    """(start, end) of every call of Megatron's forward_step / backward_step in ``step``."""
    return [(f["start_ns"], f["end_ns"]) for f in truth["frames"] if f["step"] == step and f["op"] != "p2p"]


def _stretched_to_calls(spans: list, calls: list, bounds: tuple | None = None) -> list:
    """Each span stretched to the end of the p2p call before it and the start of the one
    after it: the most a pass inferred between posts can span. ``bounds``: the schedule
    call, where a span with no call before (after) it stretches to (the first stage's first
    forward takes in the schedule's set-up before it, the last backward its wind-down)."""
    out = []
    lo, hi = bounds if bounds is not None else (None, None)
    for start, end in spans:
        before = [e for _, e in calls if e <= start]
        after = [s for s, _ in calls if s >= end]
        out.append((max(before, default=start if lo is None else min(lo, start)),
                    min(after, default=end if hi is None else max(hi, end))))
    return out


def p2p_calls(truth: dict, step: int) -> list:
    """(start, end) epoch ns of every p2p call (torch's ``_batch_p2p`` posts and
    ``_wait_batch_p2p`` waits) this rank made in ``step``."""
    return [(c["start_epoch_ns"], c["end_epoch_ns"]) for c in truth_step(truth, step)["p2p"]]


def passes_to_posts(truth: dict, step: int) -> list:
    """:func:`passes` stretched to the p2p calls beside them (torch's ``_batch_p2p`` posts and
    ``_wait_batch_p2p`` waits, as the harness timed them)."""
    return _stretched_to_calls(passes(truth, step), p2p_calls(truth, step))


def megatron_p2p_calls(truth: dict, step: int) -> list:
    """(start, end) of every p2p post (``_batched_p2p_ops`` / ``_p2p_ops``) and every wait
    on a handle one returned, in ``step``."""
    return [(f["start_ns"], f["end_ns"]) for f in truth["frames"] if f["step"] == step and f["op"] == "p2p"]


def megatron_frames_to_posts(truth: dict, step: int) -> list:
    """Each frame stretched to the p2p calls beside it (a ``_communicate`` call, or a wait on
    a handle it returned), else to the schedule call's bounds."""
    return _stretched_to_calls(megatron_frames(truth, step), megatron_p2p_calls(truth, step),
                               _megatron_schedule_call(truth, step)[0])


def megatron_frames_and_own_work(truth: dict, step: int) -> list:
    """The frames, and the step outside the schedule call less the closing all-reduce."""
    s = truth_step(truth, step)
    return [*megatron_frames(truth, step), (s["start_ns"], s["pipeline_start_ns"]),
            (s["pipeline_end_ns"], s["reduce_start_ns"]), (s["reduce_end_ns"], s["end_ns"])]


def _megatron_schedule_call(truth: dict, step: int) -> list:
    s = truth_step(truth, step)
    return [(s["pipeline_start_ns"], s["pipeline_end_ns"])]


def megatron_frames_window(truths: dict, rank: int, step: int) -> tuple:
    """:func:`passes_window` of a Megatron run: the first pass Megatron started on any rank
    to the last one it ended, the pipeline window (it spends ~1 ms in the schedule call before
    its first pipeline operation and after its last, which is no part of it)."""
    return _spanning(truths, rank, step, megatron_frames, "start_ns", "end_ns")


def megatron_step_span(truths: dict, rank: int, step: int) -> tuple:
    """:func:`step_span` of a Megatron run."""
    own = truth_step(truths[rank], step)
    return own["start_ns"], own["end_ns"]


@dataclass(frozen=True)
class Bracket:
    """A measured value (seconds) and what the truth pins it to: ``lo`` .. ``hi``."""

    measured: float
    lo: float
    hi: float

    def miss_ms(self, tolerance_ms: float = TOLERANCE_MS) -> float:
        """ms by which ``measured`` lies outside the bracket widened by ``tolerance_ms``
        (negative below it, positive above it, 0 inside)."""
        tol = tolerance_ms / 1e3
        if self.measured < self.lo - tol:
            return round((self.measured - self.lo + tol) * 1e3, 2)
        if self.measured > self.hi + tol:
            return round((self.measured - self.hi - tol) * 1e3, 2)
        return 0.0

    def __repr__(self) -> str:
        return f"{self.measured * 1e3:.1f} ms in [{self.lo * 1e3:.1f}, {self.hi * 1e3:.1f}]"


def breakdowns(report: dict) -> dict:
    """(rank, step) -> that step's breakdown_s in the analyze --json document."""
    return {(r["rank"], s["step"]): s["breakdown_s"] for r in report["ranks"] for s in r["steps"]}


def idle_brackets(report: dict, truths: dict, steps, least: Spans, most: Spans,
                  window=pipeline_window, inner=passes_window) -> dict:
    """(rank, step) -> pp_bubble + pp_transfer against the true idle of the pipeline window,
    which lies between ``inner`` (surely in it) and ``window`` (surely around it): at least
    the inner window less ``most`` (the framework's spans), at most the outer one less
    ``least`` (the sleeps)."""
    parts, out = breakdowns(report), {}
    # The truth's clock is the host's; the analysis aligns each rank's clock first, and a rank
    # it moves by d moves its share of the cross-rank window by up to d at either end.
    moved = {r["rank"]: 2 * abs(r["clock_offset_us"]) / 1e6 for r in report["ranks"]}
    for rank, truth in truths.items():
        for step in steps:
            lo, hi = window(truths, rank, step)
            a, b = inner(truths, rank, step)
            p = parts[rank, step]
            out[rank, step] = Bracket(p["pp_bubble"] + p["pp_transfer"],
                                      (b - a - covered(most(truth, step), a, b)) / 1e9 - moved.get(rank, 0.0),
                                      (hi - lo - covered(least(truth, step), lo, hi)) / 1e9 + moved.get(rank, 0.0))
    return out


def compute_brackets(report: dict, truths: dict, steps, least: Spans, most: Spans, window=step_span) -> dict:
    """(rank, step) -> the step's compute against what the rank can have computed: at least
    its ``least`` spans (the sleeps), at most its ``most`` (everything the framework did)."""
    parts, out = breakdowns(report), {}
    for rank, truth in truths.items():
        for step in steps:
            lo, hi = window(truths, rank, step)
            out[rank, step] = Bracket(parts[rank, step]["compute"], covered(least(truth, step), lo, hi) / 1e9,
                                      covered(most(truth, step), lo, hi) / 1e9)
    return out


def _compute_in(run, report: dict, truths: dict, steps, spans: Spans, window, inside: bool) -> dict:
    """(rank, step) -> Bracket of the analysis' compute intervals (``run.activities``) of that
    step that lie inside (``inside``) or outside the union of ``spans``, pinned to [0, slack]:
    where a pass is timed around its function, no compute lies outside it and none in a wait.
    slack: each compute interval's two ends may move by the rank's clock offset."""
    from pptrace.timeline.intervals import union

    offset = {r["rank"]: abs(r["clock_offset_us"]) * 1e3 for r in report["ranks"]}
    out = {}
    for rank, truth in truths.items():
        for step in steps:
            compute = run.activities[rank].compute.clip(*window(truths, rank, step))
            given = spans(truth, step)
            truth_set = union([a for a, _ in given], [b for _, b in given])
            part = (compute & truth_set) if inside else (compute - truth_set)
            out[rank, step] = Bracket(part.total / 1e9, 0.0, 2 * len(compute) * offset.get(rank, 0.0) / 1e9)
    return out


def compute_outside(run, report: dict, truths: dict, steps, most: Spans, window=step_span) -> dict:
    """Compute the analysis places outside ``most`` (the framework's pass functions, loss
    calls and the rank's own work, as the harness timed them): at least 0, at most the clock
    slack. Stronger than :func:`compute_brackets`' total, where a wait booked as compute can
    hide behind a pass booked short."""
    return _compute_in(run, report, truths, steps, most, window, inside=False)


def compute_in_waits(run, report: dict, truths: dict, steps, waits: Spans, window=step_span) -> dict:
    """Compute the analysis places inside ``waits`` (the p2p posts and waits as the harness
    timed them, the pipeline's blocking): at least 0, at most the clock slack."""
    return _compute_in(run, report, truths, steps, waits, window, inside=True)


def assert_compute_is_the_sleeps(report: dict, truths: dict, steps, share: float = 0.08) -> None:
    """Each (rank, step)'s compute within ``share`` of its sleeps, or at most what its pass
    functions and loss calls spanned (+ TOLERANCE_MS) where a busy box stalled them beyond
    that (torch's own pass functions were seen 13% over their sleeps with the suite beside)."""
    parts, missed, found = breakdowns(report), {}, {}
    for rank, t in truths.items():
        for step in steps:
            lo, hi = step_span(truths, rank, step)
            slept, spanned = covered(sleeps(t, step), lo, hi) / 1e9, covered(passes(t, step), lo, hi) / 1e9
            compute = parts[rank, step]["compute"]
            found[rank, step] = (round(compute * 1e3, 1), round(slept * 1e3, 1), round(spanned * 1e3, 1))
            if compute < (1 - share) * slept or compute > max((1 + share) * slept, spanned + TOLERANCE_MS / 1e3):
                missed[rank, step] = found[rank, step]
    assert not missed, (f"(rank, step) -> (compute, sleeps, passes ms) beyond {share:.0%} of the sleeps: "
                        f"{missed}; all: {found}")


def assert_inside(brackets: dict, what: str, tolerance_ms: float = TOLERANCE_MS) -> None:
    """Every (rank, step) inside its bracket (widened by ``tolerance_ms``); the failure names
    each miss and shows every bracket."""
    missed = {key: b.miss_ms(tolerance_ms) for key, b in brackets.items() if b.miss_ms(tolerance_ms)}
    assert not missed, f"{what} outside the truth's bracket (± {tolerance_ms} ms), ms: {missed}; all: {brackets}"


def schedule_part_misses(stages: list, replays: dict) -> dict:
    """(stage, step) -> (schedule part ms, truth ms, gap ms) for every step of the report's
    pipeline ``stages`` whose ``bubble_schedule_s`` lies more than 10% + twice ``gap`` +
    TOLERANCE_MS from the truth: ``replays[step]`` = (per stage the truth's free-p2p replay
    bubble, gap: how far the truth's pass timings lie from pptrace's, the most that moves the
    replay), never more than the stage's bubble (time moving data is no bubble)."""
    misses = {}
    for stage in stages:
        for entry in stage["steps"]:
            replay, gap = replays[entry["step"]]
            truth = min(replay[stage["stage"]], entry["bubble_s"])
            if abs(entry["bubble_schedule_s"] - truth) > 0.10 * truth + 2 * gap + TOLERANCE_MS / 1e3:
                misses[stage["stage"], entry["step"]] = (round(entry["bubble_schedule_s"] * 1e3, 1),
                                                         round(truth * 1e3, 1), round(gap * 1e3, 2))
    return misses


def check_whatif_replay(run, schedule: str, limit: float = 0.10) -> None:
    """What-if replays the measured schedule within ``limit`` of the measured step."""
    from pptrace.vocab import canonical
    from pptrace.whatif.predict import whatif

    result = whatif(run)
    assert result["measured"]["schedule"] == canonical(schedule)
    error = result["replay"]["error_fraction"]
    assert abs(error) < limit, f"whatif replay error {error:+.3f}"


def check_dashboard(analysis, path) -> None:
    """The dashboard page of ``analysis`` (``pptrace.analyze(run)``) is written with every
    figure and its data."""
    from pptrace.export.dashboard import write_page

    html = write_page(analysis, path).read_text()
    for key in ("timeline", "replay", "partition", "bubble", "p2p_links"):
        assert f'id="fig-{key}"' in html, key
    assert html.count('type="application/json"') >= 5  # the figures' data
