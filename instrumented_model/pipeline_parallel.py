"""Pipeline schedules with Megatron's names: no pipelining, GPipe, 1F1B, ZB-H1 and the
interleaved (virtual pipeline) schedule, every one the executed program of
``pptrace.schedules.tables.stage_steps``: the order of passes and the p2p ops between them are
written there once, for this trainer and for the what-if simulator that replays them.

A schedule only decides *order* and *communication*; the work itself is a ``StageCompute``
(the real model chunks, or sleeps) so the same schedule code runs in both modes. Every pass is
wrapped in a contract-1 region (``compute:fwd``, ``compute:bwd``, and for ZB-H1
``compute:bwd_input`` / ``compute:bwd_weight``) and the order of passes equals
``schedule_table`` for the stage (tests compare traces with it).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from pptrace import region
from pptrace.schedules.tables import Exchange, stage_steps

from . import pp_communications as p2p
from .pp_communications import Message, P2PContext


class StageCompute(Protocol):
    """The work of one stage. ``forward`` returns the tensor to send on (None on the last
    virtual stage); ``backward*`` take the grad of that output (None on the last virtual
    stage) and return the grad of the stage input (None on the first virtual stage)."""

    def forward(self, mb: int, chunk: int, input_tensor: Optional[torch.Tensor]): ...

    def backward(self, mb: int, chunk: int, output_grad: Optional[torch.Tensor]): ...

    def backward_input(self, mb: int, chunk: int, output_grad: Optional[torch.Tensor]): ...

    def backward_weight(self, mb: int, chunk: int) -> None: ...


@dataclass
class PipelineRun:
    """Everything a schedule needs for one step on one rank."""

    compute: StageCompute
    comm: P2PContext
    num_microbatches: int
    pp_rank: int
    pp_size: int
    vpp: int = 1
    # Megatron's overlap_p2p_comm (interleaved only): post each direction's exchange right
    # after its pass and wait for it right before its tensor is used.
    overlap_p2p_comm: bool = False

    # Sleep mode's known timeline: each pass's span, (op, mb, chunk, start, end) in time_ns,
    # taken outside its region so that it bounds the range a trace shows from above (the
    # sleeps bound it from below). None: not logged.
    passes: Optional[list] = None

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} outside 0..{self.pp_size - 1}")

    def _chunk_tag(self, chunk: int):
        return chunk if self.vpp > 1 else None

    @contextlib.contextmanager
    def _pass(self, op: str, mb: int, chunk: int):
        start = time.time_ns()
        with region(f"compute:{op}", mb=mb, chunk=self._chunk_tag(chunk)):
            yield
        if self.passes is not None:
            self.passes.append((op, mb, chunk, start, time.time_ns()))

    # Each pass in its region; the compute object does the work (and any injected delay).
    def forward(self, mb: int, chunk: int, x):
        with self._pass("fwd", mb, chunk):
            return self.compute.forward(mb, chunk, x)

    def backward(self, mb: int, chunk: int, grad):
        with self._pass("bwd", mb, chunk):
            return self.compute.backward(mb, chunk, grad)

    def backward_input(self, mb: int, chunk: int, grad):
        with self._pass("bwd_input", mb, chunk):
            return self.compute.backward_input(mb, chunk, grad)

    def backward_weight(self, mb: int, chunk: int) -> None:
        with self._pass("bwd_weight", mb, chunk):
            self.compute.backward_weight(mb, chunk)


def execute(run: PipelineRun, program: list) -> None:
    """Run a stage program of ``pptrace.schedules.tables`` (the one the what-if replays): its
    passes in order, and each exchange posted with the output of the latest pass of its
    direction, waited at once ("comm", Megatron's combined ops: ``send_forward_recv_backward``
    is the op sending the forward's output and receiving the backward's grad) or at its
    "wait" (ZB-H1, overlap_p2p_comm)."""
    ctx = run.comm
    # A program with W passes splits every backward: its B is then the input grad alone.
    split_backward = any(not isinstance(step, Exchange) and step[0] == "W" for step in program)
    # A pass's input is the tensor whose message names that pass's (microbatch, chunk): the
    # tag convention of pp_communications, so a pass finds its input whichever op brought it.
    inputs: dict = {}
    pending: dict = {}  # handle -> (the posted op, what it receives)
    output = grad_input = None  # what the last forward / backward produced, for the next send

    def received(exchange: Exchange, tensors) -> None:
        from_prev, from_next = tensors
        if exchange.recv_prev is not None:
            inputs[("F", *exchange.recv_prev)] = from_prev
        if exchange.recv_next is not None:
            inputs[("B", *exchange.recv_next)] = from_next

    for step in program:
        if not isinstance(step, Exchange):
            op, mb, chunk = step
            if op == "F":
                output = run.forward(mb, chunk, inputs.pop(("F", mb, chunk), None))
            elif op == "W":
                run.backward_weight(mb, chunk)
            else:
                backward = run.backward_input if split_backward else run.backward
                grad_input = backward(mb, chunk, inputs.pop(("B", mb, chunk), None))
        elif step.kind == "wait":
            posted, exchange = pending.pop(step.handle)
            received(exchange, posted.wait())
        else:
            posted = p2p.post(
                ctx,
                send_next=_message(step.send_next, output),
                send_prev=_message(step.send_prev, grad_input),
                recv_prev=_message(step.recv_prev),
                recv_next=_message(step.recv_next),
            )
            if step.kind == "post":
                pending[step.handle] = (posted, step)
            else:
                received(step, posted.wait())


def _message(carried, tensor=None):
    return None if carried is None else Message(*carried, tensor)


# -- Megatron's entry points: each the program of its schedule ----------------------------
def forward_backward_no_pipelining(run: PipelineRun) -> None:
    """pp=1: each microbatch's F then its B (1F1B's program on a one-stage pipeline)."""
    execute(run, stage_steps("1f1b", 1, 0, run.num_microbatches))


def forward_backward_gpipe(run: PipelineRun) -> None:
    """GPipe: all forwards, then all backwards (in microbatch order)."""
    execute(run, stage_steps("gpipe", run.pp_size, run.pp_rank, run.num_microbatches))


def forward_backward_pipelining_without_interleaving(run: PipelineRun, zero_bubble: bool = False) -> None:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule), or ZB-H1 when
    ``zero_bubble``: the same F/B order with each backward split into B (input grad, on the
    critical path, sent upstream at once) and W (weight grad), W deferred to fill the
    cool-down bubble."""
    schedule = "zb-h1" if zero_bubble else "1f1b"
    execute(run, stage_steps(schedule, run.pp_size, run.pp_rank, run.num_microbatches))


def forward_backward_zero_bubble_h1(run: PipelineRun) -> None:
    forward_backward_pipelining_without_interleaving(run, zero_bubble=True)


def forward_backward_pipelining_with_interleaving(run: PipelineRun) -> None:
    """Megatron's interleaved 1F1B (virtual pipeline): each stage holds ``run.vpp`` chunks and
    activations travel a ring (stage p-1's chunk c feeds stage 0's chunk c+1). Without
    overlap_p2p_comm every pass is followed by one combined op that sends its result and
    receives the next pass's input (``send_forward_recv_forward``, the steady state's
    ``send_forward_backward_recv_forward_backward``, ...); with it, each direction's op is
    posted after its pass and waited right before its tensor is used."""
    execute(run, stage_steps("interleaved", run.pp_size, run.pp_rank, run.num_microbatches, run.vpp,
                             run.overlap_p2p_comm))


def get_forward_backward_func(schedule: str, pp: int, vpp: int = 1):
    """The schedule function for a run, as Megatron's ``get_forward_backward_func``."""
    if schedule == "interleaved":
        return forward_backward_pipelining_with_interleaving
    if pp == 1 and schedule in ("1f1b", "gpipe"):
        return forward_backward_no_pipelining
    return {
        "gpipe": forward_backward_gpipe,
        "1f1b": forward_backward_pipelining_without_interleaving,
        "zb-h1": forward_backward_zero_bubble_h1,
    }[schedule]
