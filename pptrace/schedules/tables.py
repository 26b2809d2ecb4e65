"""The order in which one pipeline stage runs its forward (F), backward (B) and weight-grad (W)
passes, and the p2p ops between them, as pure functions of (schedule, p, r, m, v). Each
schedule is written once, as a stage *program* (``stage_steps``: ``FlatStage`` for GPipe,
1F1B, ZB-H1 and no pipelining, ``InterleavedStage`` for Megatron's interleaved schedule): the
reference trainer (``instrumented_model/pipeline_parallel.py``) executes it, the what-if
simulator replays it (``replay.stage_program``), and the tests compare traced order with its
passes (``schedule_table``), so the three cannot drift apart. They live in pptrace, not in
the trainer, so that analysing a run never needs the trainer package. Torch-free.

Notation: p pipeline stages, r this stage, m microbatches, v virtual chunks per stage.
Entries are ``(op, microbatch, chunk)``; op "B" is the whole backward except in ZB-H1,
where "B" is the input gradient and "W" the weight gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..vocab import SCHEDULES, V_SCHEDULES


def stage_placement(schedule: str | None, p: int, v: int) -> list[int]:
    """Global stage index (0 .. p*v-1) -> pipeline position (the rank's pp coordinate)."""
    if v == 2 and schedule in V_SCHEDULES:
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def _check(schedule: str, p: int, r: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p} m={m} v={v}")
    if not 0 <= r < p:
        raise ValueError(f"stage r={r} outside 0..{p - 1}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"v={v} > 1 needs schedule 'interleaved', got {schedule!r}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"interleaved needs microbatches % pp == 0, got m={m} p={p}")


def num_warmup_microbatches(schedule: str, p: int, r: int, m: int, v: int = 1) -> int:
    """Forwards run before the first backward (for interleaved: counted in (mb, chunk) units)."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        # Megatron: 2(p-r-1) + (v-1)*g with group size g = p, capped at m*v.
        return min(2 * (p - r - 1) + (v - 1) * p, m * v)
    return min(p - r - 1, m)


def interleaved_forward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward: groups of p microbatches, chunk 0 over the
    group, then chunk 1, ... (Megatron's get_schedule_table)."""
    order = []
    for group_start in range(0, m, p):
        for chunk in range(v):
            order.extend((mb, chunk) for mb in range(group_start, group_start + p))
    return order


def interleaved_backward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    # Backward walks the chunks in reverse: the k-th backward uses chunk v-1-c.
    return [(mb, v - 1 - c) for mb, c in interleaved_forward_order(p, m, v)]


def zb_h1_deferred_w(r: int) -> int:
    """ZB-H1 (Qi et al. 2023): stage r runs W(j) right after B(j + r), so later stages keep
    more weight grads pending, every stage holds at most p microbatches (same peak memory as
    1F1B's stage 0), and the deferred W's fill the cool-down bubble. Simulated with any
    t_w <= t_f this order gives the paper's bubble (p-1)(t_f+t_b-t_w)."""
    return r


def schedule_table(schedule: str, p: int, r: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Execution order on stage r: list of ("F"|"B"|"W", microbatch, chunk)."""
    return [step for step in stage_steps(schedule, p, r, m, v) if not isinstance(step, Exchange)]


def stage_steps(schedule: str, p: int, r: int, m: int, v: int = 1, overlap_p2p_comm: bool = False) -> list:
    """Stage r's program: its passes ("F"|"B"|"W", mb, chunk) and the ``Exchange``s between
    them, in execution order. ``overlap_p2p_comm``: Megatron's option, interleaved only."""
    _check(schedule, p, r, m, v)
    if schedule == "interleaved":
        return InterleavedStage(p, r, m, v).program(overlap_p2p_comm)
    return FlatStage(schedule, p, r, m).program()


# ---------------------------------------------------------------------------------------
# Stage programs: the passes and the p2p ops between them
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One p2p op of a stage program. Each direction holds the (microbatch, chunk) its message
    carries, chunk being the one that *consumes* the tensor on the receiving stage (the
    trainer's tag convention), or None where the op has no such direction. "comm" posts and
    waits at once (Megatron's combined ops: a stage is held until every direction is done);
    "post" leaves the op open under ``handle`` until the "wait" of that handle (ZB-H1 runs
    its W's in between; overlap_p2p_comm keeps a forward and a backward one open at once)."""

    kind: str  # "comm" | "post" | "wait"
    handle: str = ""
    send_next: tuple | None = None
    send_prev: tuple | None = None
    recv_prev: tuple | None = None
    recv_next: tuple | None = None


class FlatStage:
    """Stage r of a schedule without virtual chunks, with the p2p ops of Megatron's
    non-interleaved schedules: GPipe, 1F1B (PipeDream-flush) or ZB-H1. With p = 1 the 1F1B
    program is Megatron's ``forward_backward_no_pipelining`` (each microbatch's F, then its B)."""

    def __init__(self, schedule: str, p: int, r: int, m: int):
        _check(schedule, p, r, m, 1)
        if schedule == "interleaved":
            raise ValueError("the interleaved schedule's program is InterleavedStage's")
        self.schedule, self.p, self.r, self.m = schedule, p, r, m

    # A pipeline end has no peer on that side: None leaves the direction out of its op.
    def recv_prev(self, mb: int | None) -> tuple | None:
        return None if mb is None or self.r == 0 else (mb, 0)

    def send_next(self, mb: int) -> tuple | None:
        return None if self.r == self.p - 1 else (mb, 0)

    def recv_next(self, mb: int) -> tuple | None:
        return None if self.r == self.p - 1 else (mb, 0)

    def send_prev(self, mb: int) -> tuple | None:
        return None if self.r == 0 else (mb, 0)

    def program(self) -> list:
        return self._gpipe() if self.schedule == "gpipe" else self._one_f_one_b()

    def _forward(self, mb: int) -> list:
        return (_exchange("comm", recv_prev=self.recv_prev(mb)) + [("F", mb, 0)]
                + _exchange("comm", send_next=self.send_next(mb)))

    def _gpipe(self) -> list:
        steps: list = []
        for mb in range(self.m):  # all forwards
            steps += self._forward(mb)
        for mb in range(self.m):  # then all backwards, in microbatch order
            steps += _exchange("comm", recv_next=self.recv_next(mb)) + [("B", mb, 0)]
            steps += _exchange("comm", send_prev=self.send_prev(mb))
        return steps

    def _one_f_one_b(self) -> list:
        m = self.m
        w = num_warmup_microbatches("1f1b", self.p, self.r, m)
        steps: list = []
        for mb in range(w):  # warm-up: fill the pipeline with the first w forwards
            steps += self._forward(mb)
        if w < m:
            steps += _exchange("comm", recv_prev=self.recv_prev(w))
        for i in range(m - w):  # steady state: forward w+i, then backward i
            steps.append(("F", w + i, 0))
            steps += _exchange("comm", send_next=self.send_next(w + i), recv_next=self.recv_next(i))
            steps += self._backward(i, w + i + 1 if i < m - w - 1 else None)
        for mb in range(m - w, m):  # cool-down: the warm-up's backwards, as their grads come back
            steps += _exchange("comm", recv_next=self.recv_next(mb)) + self._backward(mb, None)
        return steps

    def _backward(self, mb: int, recv_fwd_mb: int | None) -> list:
        """B of ``mb``, then its grad upstream together with the next forward's input (one
        combined op, as Megatron). ZB-H1 posts that op and runs the W's due after this B
        before waiting, so neither the upstream stage (waiting for the grad) nor this one
        (a send is held until its peer posts the recv) idles while weight grads are pending."""
        directions = {"send_prev": self.send_prev(mb), "recv_prev": self.recv_prev(recv_fwd_mb)}
        if self.schedule != "zb-h1":
            return [("B", mb, 0)] + _exchange("comm", **directions)
        posted = _exchange("post", **directions)
        ws = [("W", j, 0) for j in self._ws_after(mb)]
        return [("B", mb, 0)] + posted + ws + ([Exchange("wait")] if posted else [])

    def _ws_after(self, mb: int) -> list[int]:
        delay = zb_h1_deferred_w(self.r)
        ws = [mb - delay] if mb >= delay else []
        if mb == self.m - 1:  # after the last B, the W's still deferred
            ws += list(range(max(self.m - delay, 0), self.m))
        return ws


class InterleavedStage:
    """Stage r of Megatron's interleaved schedule (p stages, m microbatches, v chunks). Chunk c
    of stage r is virtual stage c*p + r, so activations travel a ring: stage p-1's chunk c
    feeds stage 0's chunk c+1, and gradients go the other way. Position k counts passes in
    (microbatch, chunk) units: the k-th forward runs ``fwd[k]``, the k-th backward ``bwd[k]``."""

    def __init__(self, p: int, r: int, m: int, v: int):
        _check("interleaved", p, r, m, v)
        self.p, self.r, self.v, self.total = p, r, v, m * v
        self.warmup = num_warmup_microbatches("interleaved", p, r, m, v)
        self.fwd, self.bwd = interleaved_forward_order(p, m, v), interleaved_backward_order(p, m, v)

    def first_virtual(self, chunk: int) -> bool:  # takes token ids, receives no activation
        return self.r == 0 and chunk == 0

    def last_virtual(self, chunk: int) -> bool:  # computes the loss, sends no activation on
        return self.r == self.p - 1 and chunk == self.v - 1

    def send_next(self, k: int) -> tuple | None:
        """The activation forward k sends on; crossing the ring p-1 -> 0 it feeds the next chunk."""
        mb, c = self.fwd[k]
        return None if self.last_virtual(c) else (mb, c + 1 if self.r == self.p - 1 else c)

    def send_prev(self, k: int) -> tuple | None:
        """The input gradient backward k sends back; crossing the ring 0 -> p-1 to the chunk before."""
        mb, c = self.bwd[k]
        return None if self.first_virtual(c) else (mb, c - 1 if self.r == 0 else c)

    def recv_prev(self, k: int) -> tuple | None:
        """The input of forward k (none past the last one)."""
        return None if k >= self.total or self.first_virtual(self.fwd[k][1]) else self.fwd[k]

    def recv_next(self, k: int) -> tuple | None:
        """The output gradient backward k starts from (none past the last one)."""
        return None if k >= self.total or self.last_virtual(self.bwd[k][1]) else self.bwd[k]

    def program(self, overlap_p2p_comm: bool = False) -> list:
        """The stage's passes ("F"|"B", mb, chunk) and ``Exchange``s in execution order, as
        Megatron's ``forward_backward_pipelining_with_interleaving`` runs them: one combined
        op after every pass, sending its result and receiving the next pass's input; or, with
        ``overlap_p2p_comm``, a forward and a backward op posted right after their pass and
        waited right before the tensor they bring is used, so the other direction's pass
        runs while they are in flight."""
        steps = _exchange("comm", recv_prev=self.recv_prev(0))
        return steps + (self._overlapped() if overlap_p2p_comm else self._blocking())

    def _blocking(self) -> list:
        w, total = self.warmup, self.total
        steps: list = []
        for k in range(w):  # warm-up: forwards only; the last also receives the first grad
            steps.append(("F", *self.fwd[k]))
            first_grad = self.recv_next(0) if k == w - 1 and w < total else None
            steps += _exchange("comm", send_next=self.send_next(k), recv_prev=self.recv_prev(k + 1),
                               recv_next=first_grad)
        if w == total:
            steps += _exchange("comm", recv_next=self.recv_next(0))
        for k in range(total - w):  # steady state: forward k+w, backward k, one four-way op
            steps += [("F", *self.fwd[k + w]), ("B", *self.bwd[k])]
            steps += _exchange("comm", send_next=self.send_next(k + w), send_prev=self.send_prev(k),
                               recv_prev=self.recv_prev(k + w + 1), recv_next=self.recv_next(k + 1))
        for k in range(total - w, total):  # cool-down: the remaining backwards
            steps.append(("B", *self.bwd[k]))
            steps += _exchange("comm", send_prev=self.send_prev(k), recv_next=self.recv_next(k + 1))
        return steps

    def _overlapped(self) -> list:
        w, total = self.warmup, self.total
        steps: list = []
        open_handles: set = set()

        def post(handle, **directions):
            posted = _exchange("post", handle, **directions)
            if posted:
                steps.extend(posted)
                open_handles.add(handle)

        def wait(handle):
            if handle in open_handles:
                steps.append(Exchange("wait", handle))
                open_handles.discard(handle)

        for k in range(w):  # warm-up: forwards only; the last also posts the first grad's recv
            wait("fwd")
            steps.append(("F", *self.fwd[k]))
            post("fwd", send_next=self.send_next(k), recv_prev=self.recv_prev(k + 1))
            if k == w - 1 and w < total:
                post("bwd", recv_next=self.recv_next(0))
        if w == total:
            wait("fwd")
            post("bwd", recv_next=self.recv_next(0))
        for k in range(total - w):  # steady state: forward k+w, backward k, each its own op
            wait("fwd")
            steps.append(("F", *self.fwd[k + w]))
            post("fwd", send_next=self.send_next(k + w), recv_prev=self.recv_prev(k + w + 1))
            wait("bwd")
            steps.append(("B", *self.bwd[k]))
            post("bwd", send_prev=self.send_prev(k), recv_next=self.recv_next(k + 1))
        wait("fwd")
        for k in range(total - w, total):  # cool-down: the remaining backwards
            wait("bwd")
            steps.append(("B", *self.bwd[k]))
            post("bwd", send_prev=self.send_prev(k), recv_next=self.recv_next(k + 1))
        wait("bwd")
        return steps


def _exchange(kind: str, handle: str = "", **directions) -> list:
    """[the op] when it carries anything, else [] (a pipeline end has no peer that side)."""
    return [Exchange(kind, handle, **directions)] if any(d is not None for d in directions.values()) else []
