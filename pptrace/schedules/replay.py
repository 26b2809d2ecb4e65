"""The one replay engine of pipeline steps (``replay``): every stage runs a *program* (passes
with durations, the posts and waits of its p2p messages) against the others. Programs come
from two places:

- a schedule: its compute passes (F, B, W) in the trainer's order (``pptrace.schedules.tables``,
  which the trainer executes) interleaved with the p2p exchanges the trainer posts between them
  (Megatron's combined ops: ``send_forward_recv_backward`` and the interleaved schedule's
  four-way exchange); ``simulate`` runs them with given durations (what-if, and the theory of
  schedules without a closed form);
- a measured step: every rank's main thread as traced (``pptrace.timeline.programs``), run
  with free p2p to split the bubble (analyzers/bubble.py).

Modelling the exchanges and not only the data dependencies matters: a combined op waits for
*all* its directions, so a stage can be held by a message it does not need yet, and that is
part of the step time the trainer really shows.

Communication follows rendezvous semantics by default (gloo's send waits for the peer's recv,
and the trainer waits on every request of an exchange): a send and its recv both complete
``latency`` after the later of the two was posted; an exchange completes when all its directions
have. ``sends="eager"`` models fire-and-forget sends instead (a send completes when posted, its
message lands ``latency`` later), i.e. the pure data dependencies of the schedule: that is the
model behind the papers' closed forms, and it shows what asynchronous sends would gain.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..vocab import ACTION_OPS, SCHEDULES
from .tables import Exchange, schedule_table, stage_steps


@dataclass(frozen=True)
class Msg:
    """One direction of a p2p exchange. ``chunk`` is the chunk that consumes the tensor on
    the receiving stage (the trainer's tag convention), so (direction, src, dst, mb, chunk)
    names a message uniquely within a step. A measured message is named by its row in the
    run's matched pairs (``pair``) instead: traces other than the trainer's may lack the tags."""

    direction: str  # "fwd" (activation) | "bwd" (gradient)
    is_send: bool
    src: int
    dst: int
    mb: int
    chunk: int = 0
    pair: int = -1

    @property
    def key(self) -> tuple:
        return (self.direction, self.src, self.dst, self.mb, self.chunk, self.pair)


@dataclass(frozen=True)
class Op:
    """One entry of a stage program: a compute pass ("F", "B", "I", "W"), a measured range of
    any work ("run"), an exchange ("comm": post and wait), or an exchange split in two
    ("post" ... "wait") with work in between; ``handle`` names which open exchange a "wait"
    completes (overlap_p2p_comm keeps a forward and a backward one open at once)."""

    kind: str
    mb: int = -1
    chunk: int = 0
    msgs: tuple = ()
    handle: object = ""
    # The op's own duration (seconds in ``simulate``, ns in a measured replay), instead of
    # the one PipelineTimes gives its pass.
    duration: float | None = None


# ---------------------------------------------------------------------------------------
# programs: the trainer's order of passes and exchanges
# ---------------------------------------------------------------------------------------
def _comm(*msgs) -> list[Op]:
    present = tuple(m for m in msgs if m is not None)
    return [Op("comm", msgs=present)] if present else []


def stage_program(schedule: str, p: int, r: int, m: int, v: int = 1, overlap_p2p_comm: bool = False) -> list[Op]:
    """The ops stage r runs in one step: ``tables.stage_steps``, the program the trainer
    executes, with each exchange's directions as messages; its compute ops equal
    ``schedule_table``. ``overlap_p2p_comm``: Megatron's option for the interleaved schedule
    (its training scripts' default there)."""
    if schedule == "interleaved" and p == 1:
        # One stage is no ring to interleave over: replayed as no pipelining (its v chunks'
        # passes merged into one per microbatch), as the replay always has.
        schedule_table(schedule, p, r, m, v)  # validates with the trainer's rules
        steps = stage_steps("1f1b", 1, 0, m)
    else:
        steps = stage_steps(schedule, p, r, m, v, overlap_p2p_comm)  # validates them too
    prev, nxt = (r - 1) % p, (r + 1) % p

    def msgs(ex: Exchange) -> tuple:
        directions = (("fwd", True, r, nxt, ex.send_next), ("bwd", True, r, prev, ex.send_prev),
                      ("fwd", False, prev, r, ex.recv_prev), ("bwd", False, nxt, r, ex.recv_next))
        return tuple(Msg(d, is_send, src, dst, *carried) for d, is_send, src, dst, carried in directions
                     if carried is not None)

    return [Op(step.kind, msgs=msgs(step), handle=step.handle) if isinstance(step, Exchange) else Op(*step)
            for step in steps]


def action_programs(orders: list, placement: list[int], seconds: dict | None = None) -> list[list[Op]]:
    """Programs from an action order, for schedules pptrace has no table of
    (torch.distributed.pipelining's LoopedBFS, InterleavedZeroBubble, ZBV, DualPipeV, ...).

    ``orders[s]``: pipeline position s's actions in execution order, ``(op, stage, mb)`` with op
    in ``ACTION_OPS`` and ``stage`` the global stage index; ``placement``: global stage ->
    position. A pass waits for the message it consumes right before it runs and posts what it
    produces right after (torch's schedules do exactly that); stages on one position hand
    tensors over locally. Chunk = global stage // p. An order that lists its sends ("SF",
    "SB": the stage whose output is sent) posts them there instead of right after the pass.
    ``seconds``: (op, global stage) -> a pass's duration, where known (else PipelineTimes'):
    one stage's passes differ (torch's stage 0 runs no input grad, its W the whole backward),
    which per-microbatch sums cannot tell.
    Simulate such programs with eager sends: torch posts its sends asynchronously and waits
    on them only later."""
    p = len(orders)
    last = len(placement) - 1

    def send_fwd(s, stage, mb):
        return _comm(Msg("fwd", True, s, placement[stage + 1], mb, stage + 1)) \
            if stage < last and placement[stage + 1] != s else []

    def send_bwd(s, stage, mb):
        return _comm(Msg("bwd", True, s, placement[stage - 1], mb, stage - 1)) \
            if stage > 0 and placement[stage - 1] != s else []

    seconds = seconds or {}
    progs = []
    for s, order in enumerate(orders):
        explicit = any(op in ("SF", "SB") for op, _, _ in order)
        prog: list[Op] = []
        for op, stage, mb in order:
            if op not in ACTION_OPS or not 0 <= stage <= last:
                raise ValueError(f"position {s}: bad action {(op, stage, mb)!r}")
            chunk = stage // p
            if op == "F":
                if stage > 0 and placement[stage - 1] != s:
                    prog += _comm(Msg("fwd", False, placement[stage - 1], s, mb, stage))
                prog.append(Op("F", mb, chunk, duration=seconds.get(("F", stage))))
                prog += [] if explicit else send_fwd(s, stage, mb)
            elif op in ("B", "I"):
                if stage < last and placement[stage + 1] != s:
                    prog += _comm(Msg("bwd", False, placement[stage + 1], s, mb, stage))
                prog.append(Op(op, mb, chunk, duration=seconds.get((op, stage))))
                prog += [] if explicit else send_bwd(s, stage, mb)
            elif op == "W":
                prog.append(Op("W", mb, chunk, duration=seconds.get(("W", stage))))
            else:
                prog += (send_fwd if op == "SF" else send_bwd)(s, stage, mb)
        progs.append(prog)
    return progs


# ---------------------------------------------------------------------------------------
# durations and the simulation
# ---------------------------------------------------------------------------------------
@dataclass
class PipelineTimes:
    """Durations in seconds. ``fwd``/``bwd``/``wgrad`` are (p, m): one microbatch's forward,
    input-grad backward and weight-grad backward on a stage, summed over its virtual chunks
    (a chunk pass takes 1/v of it). Schedules without a separate W run B + W as one pass.
    ``latency_s`` is (p, p): a message src -> dst completes this long after both sides posted.
    ``overhead_s`` is host time after every op (launch, bookkeeping); ``post_s`` the host
    time to post an exchange that is waited later (ZB-H1, overlap_p2p_comm).
    ``latency_samples`` (optional, seconds): measured transfer times; when given, ``simulate``
    with an ``rng`` draws each message's latency from them instead of ``latency_s``, because a
    few slow transfers on the critical path lengthen a step more than the median suggests."""

    fwd: np.ndarray
    bwd: np.ndarray
    wgrad: np.ndarray
    latency_s: np.ndarray
    overhead_s: float = 0.0
    latency_samples: np.ndarray | None = None
    post_s: float = 0.0
    #: eager sends: the host time a recv takes when its message has already landed
    recv_s: float = 0.0

    def __post_init__(self):
        self.fwd, self.bwd, self.wgrad = (np.asarray(a, dtype=float) for a in (self.fwd, self.bwd, self.wgrad))
        if self.fwd.ndim != 2 or self.bwd.shape != self.fwd.shape or self.wgrad.shape != self.fwd.shape:
            raise ValueError(
                f"fwd/bwd/wgrad must share one (p, m) shape, got {self.fwd.shape}, {self.bwd.shape}, {self.wgrad.shape}"
            )
        p = self.fwd.shape[0]
        lat = np.asarray(self.latency_s, dtype=float)
        self.latency_s = np.full((p, p), float(lat)) if lat.ndim == 0 else lat
        if self.latency_s.shape != (p, p):
            raise ValueError(f"latency_s must be a scalar or ({p}, {p}), got shape {self.latency_s.shape}")
        for name in ("fwd", "bwd", "wgrad", "latency_s"):
            if np.any(getattr(self, name) < 0) or not np.all(np.isfinite(getattr(self, name))):
                raise ValueError(f"PipelineTimes.{name} must be finite and >= 0")
        if self.latency_samples is not None:
            self.latency_samples = np.asarray(self.latency_samples, dtype=float).ravel()
            if not self.latency_samples.size or np.any(self.latency_samples < 0):
                raise ValueError("latency_samples must be a non-empty array of times >= 0")
        if self.overhead_s < 0 or self.post_s < 0 or self.recv_s < 0:
            raise ValueError(f"overhead_s, post_s and recv_s must be >= 0, got {self.overhead_s}, {self.post_s} "
                             f"and {self.recv_s}")

    @property
    def p(self) -> int:
        return self.fwd.shape[0]

    @property
    def m(self) -> int:
        return self.fwd.shape[1]

    @classmethod
    def uniform(cls, p: int, m: int, t_f: float, t_b: float, t_w: float = 0.0,
                latency_s: float = 0.0, overhead_s: float = 0.0) -> "PipelineTimes":
        full = lambda t: np.full((p, m), float(t))  # noqa: E731
        return cls(full(t_f), full(t_b), full(t_w), latency_s, overhead_s)


@dataclass
class Timeline:
    """The simulated step: ``ops`` (stage, kind, mb, chunk, start_s, end_s, transfer_s) and
    per-stage totals in ``stages`` (stage, compute_s, transfer_s, bubble_s)."""

    schedule: str
    vpp: int
    makespan_s: float
    ops: pd.DataFrame
    stages: pd.DataFrame = field(repr=False)


def _duration(op: Op, times: PipelineTimes, stage: int, split_w: bool, v: int) -> float:
    if op.duration is not None:
        return op.duration
    if op.kind == "F":
        return times.fwd[stage, op.mb] / v
    if op.kind == "W":
        return times.wgrad[stage, op.mb] / v
    # "I" (input grad of an action order) is always followed by its own W
    extra = 0.0 if split_w or op.kind == "I" else times.wgrad[stage, op.mb]
    return (times.bwd[stage, op.mb] + extra) / v


SEND_MODES = ("rendezvous", "eager")


def _exchange_end(msgs: tuple, start: float, partner: list, latency, sends: str) -> float:
    if sends == "rendezvous":
        return max(max(start, t) + latency(msg) for t, msg in zip(partner, msgs))
    # eager: a send is done once posted; a recv when the message has landed.
    return max(
        start if msg.is_send else max(start, t + latency(msg))
        for t, msg in zip(partner, msgs)
    )


def _latency_model(times: PipelineTimes, rng):
    """msg -> latency; a drawn latency is kept per message so both sides see the same one."""
    if rng is None or times.latency_samples is None:
        return lambda msg: times.latency_s[msg.src, msg.dst]
    drawn: dict = {}
    samples = times.latency_samples

    def latency(msg):
        if msg.key not in drawn:
            drawn[msg.key] = samples[rng.integers(samples.size)]
        return drawn[msg.key]

    return latency


def simulate(schedule: str, times: PipelineTimes, vpp: int = 1, sends: str = "rendezvous",
             rng: np.random.Generator | None = None, overlap_p2p_comm: bool = False,
             programs: list | None = None) -> Timeline:
    """Run every stage's program against the others; raises ValueError on a deadlock (a
    program set that could not run in the trainer either). With ``rng`` and
    ``times.latency_samples``, message latencies are drawn (one replication). ``programs``
    (e.g. :func:`action_programs`) replaces the schedule's own, for schedules without a table."""
    if programs is None and schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    p, m, v = times.p, times.m, vpp
    if programs is None:
        programs = [stage_program(schedule, p, r, m, v, overlap_p2p_comm) for r in range(p)]
    elif len(programs) != p:
        raise ValueError(f"{len(programs)} programs for {p} stages")
    split_w = schedule == "zb-h1"
    rows = replay(programs, lambda op, stage: _duration(op, times, stage, split_w, v), _latency_model(times, rng),
                  sends, times.overhead_s, times.post_s, name=schedule, recv=times.recv_s)
    ops = pd.DataFrame(rows, columns=["stage", "kind", "mb", "chunk", "start_s", "end_s", "transfer_s"])
    makespan = float(ops["end_s"].max()) if len(ops) else 0.0
    compute = ops[ops["kind"] != "comm"].assign(d=lambda d: d.end_s - d.start_s).groupby("stage")["d"].sum()
    transfer = ops.groupby("stage")["transfer_s"].sum()
    stages = pd.DataFrame({"stage": range(p)})
    stages["compute_s"] = stages["stage"].map(compute).fillna(0.0)
    stages["transfer_s"] = stages["stage"].map(transfer).fillna(0.0)
    stages["bubble_s"] = makespan - stages["compute_s"] - stages["transfer_s"]
    return Timeline(schedule, v, makespan, ops, stages)


def replay(programs: list, duration, latency, sends: str = "rendezvous", overhead=0, post=0,
           name: str = "replay", recv=0) -> list[tuple]:
    """The engine: run every program against the others. ``duration(op, stage)``: a pass's
    or run's time; ``latency(msg)``: a message's, from the later of its two posts; ``overhead``
    follows every op (host time), ``post`` every op posted to be waited later, ``recv`` (eager
    sends) is the least a wait holding a recv takes, its message landed or not. -> rows
    (stage, kind, mb, chunk, start, end, transfer), an exchange's from its post to its end.
    Raises ValueError on a deadlock. Times are in whatever unit the durations are."""
    if sends not in SEND_MODES:
        raise ValueError(f"sends={sends!r} is not one of {SEND_MODES}")
    p = len(programs)
    pos, clock = [0] * p, [0] * p
    posted: dict[tuple, float] = {}  # (message key, is_send) -> post time
    pending: dict[tuple, tuple] = {}  # (stage, handle) -> (messages, post time) of an open exchange
    rows = []
    while any(pos[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(programs[s]):
                op = programs[s][pos[s]]
                start = clock[s]
                if op.kind in ("F", "B", "I", "W", "run"):
                    end = start + duration(op, s)
                    rows.append((s, op.kind, op.mb, op.chunk, start, end, 0.0))
                else:
                    if op.kind in ("comm", "post") and (s, op.handle) not in pending:
                        pending[(s, op.handle)] = (op.msgs, start)
                        for msg in op.msgs:
                            posted.setdefault((msg.key, msg.is_send), start)
                    if op.kind == "post":
                        clock[s] = start + post
                        pos[s] += 1
                        moved = True
                        continue
                    msgs, t_post = pending[(s, op.handle)]
                    partner = [posted.get((msg.key, not msg.is_send)) for msg in msgs]
                    if sends == "eager":  # sends never wait for the receiver
                        partner = [t_post if msg.is_send else t for t, msg in zip(partner, msgs)]
                    if any(t is None for t in partner):
                        break  # blocked until the peers reach their side
                    end = max(start, _exchange_end(msgs, t_post, partner, latency, sends))
                    if recv and sends == "eager" and not all(msg.is_send for msg in msgs):
                        end = max(end, start + recv)
                    # Moving data = the blocked part after both sides were there; the rest was waiting.
                    last_match = max(max(t_post, t) for t in partner)
                    rows.append((s, "comm", -1, 0, t_post, end, max(0.0, end - max(start, last_match))))
                    del pending[(s, op.handle)]
                clock[s] = end + overhead
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: programs[s][pos[s]] for s in range(p) if pos[s] < len(programs[s])}
            raise ValueError(f"{name}: the stage programs deadlock at {stuck}")
    return rows
