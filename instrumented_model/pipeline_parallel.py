"""Pipeline schedules with Megatron's names: no pipelining, GPipe, 1F1B, ZB-H1; the interleaved
schedule lives in ``schedules_interleaved.py`` (which needs nothing from here: a schedule gets
its ``PipelineRun`` as an argument).

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

from . import pp_communications as p2p
from .pp_communications import Message, P2PContext
from .schedules_interleaved import forward_backward_pipelining_with_interleaving
from pptrace.schedules.tables import num_warmup_microbatches, ws_after_backward


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


def _msg(mb: int, tensor=None) -> Message:
    return Message(mb=mb, chunk=0, tensor=tensor)


def forward_backward_no_pipelining(run: PipelineRun) -> None:
    """pp=1: F and B of each microbatch back to back (the 1F1B table with no warm-up)."""
    for mb in range(run.num_microbatches):
        run.forward(mb, 0, None)
        run.backward(mb, 0, None)


def forward_backward_gpipe(run: PipelineRun) -> None:
    """GPipe: all forwards, then all backwards (in microbatch order)."""
    ctx, m = run.comm, run.num_microbatches
    for mb in range(m):
        x = p2p.recv_forward(ctx, _msg(mb))
        y = run.forward(mb, 0, x)
        p2p.send_forward(ctx, _msg(mb, y))
    for mb in range(m):
        g = p2p.recv_backward(ctx, _msg(mb))
        dx = run.backward(mb, 0, g)
        p2p.send_backward(ctx, _msg(mb, dx))


def forward_backward_pipelining_without_interleaving(run: PipelineRun, zero_bubble: bool = False) -> None:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule), or ZB-H1 when
    ``zero_bubble``: the same F/B order with each backward split into B (input grad, on the
    critical path, sent upstream at once) and W (weight grad), W deferred per
    ``schedule_table("zb-h1", ...)`` to fill the cool-down bubble."""
    ctx, m, p, r = run.comm, run.num_microbatches, run.pp_size, run.pp_rank
    w = num_warmup_microbatches("1f1b", p, r, m)
    remaining = m - w
    w_after_b = ws_after_backward(p, r, m) if zero_bubble else {}

    def backward_and_send(mb: int, grad, recv_fwd_mb: Optional[int]):
        """B of ``mb`` then its send upstream, combined with the next forward's recv as
        Megatron does. Under ZB-H1 the W's run between posting and waiting, so neither the
        upstream stage (waiting for this grad) nor this one (blocked in a send until the
        peer posts its recv) idles while weight grads are pending."""
        if not zero_bubble:
            dx = run.backward(mb, 0, grad)
            if recv_fwd_mb is None:
                p2p.send_backward(ctx, _msg(mb, dx))
                return None
            return p2p.send_backward_recv_forward(ctx, _msg(mb, dx), _msg(recv_fwd_mb))
        dx = run.backward_input(mb, 0, grad)
        recv = None if recv_fwd_mb is None else _msg(recv_fwd_mb)
        pending = p2p.post(ctx, send_prev=_msg(mb, dx), recv_prev=recv)
        for j in w_after_b.get(mb, []):
            run.backward_weight(j, 0)
        return pending.wait()[0]

    # Warm-up: fill the pipeline with the forwards of the first w microbatches.
    for mb in range(w):
        x = p2p.recv_forward(ctx, _msg(mb))
        y = run.forward(mb, 0, x)
        p2p.send_forward(ctx, _msg(mb, y))

    x = p2p.recv_forward(ctx, _msg(w)) if remaining > 0 else None

    # Steady state: one forward (microbatch w+i), one backward (microbatch i).
    for i in range(remaining):
        fwd_mb = w + i
        y = run.forward(fwd_mb, 0, x)
        grad = p2p.send_forward_recv_backward(ctx, _msg(fwd_mb, y), _msg(i))
        last = i == remaining - 1
        x = backward_and_send(i, grad, None if last else fwd_mb + 1)

    # Cool-down: the backwards of the warm-up microbatches, as their grads come back.
    for mb in range(remaining, m):
        grad = p2p.recv_backward(ctx, _msg(mb))
        backward_and_send(mb, grad, None)


def forward_backward_zero_bubble_h1(run: PipelineRun) -> None:
    forward_backward_pipelining_without_interleaving(run, zero_bubble=True)


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
