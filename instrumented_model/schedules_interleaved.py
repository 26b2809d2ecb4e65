"""Megatron's interleaved 1F1B (virtual pipeline) schedule.

Each stage holds v model chunks; chunk c of stage r is virtual stage c*p + r, so activations
travel a ring: stage p-1's chunk c feeds stage 0's chunk c+1 (and gradients the other way).
Which pass runs when, and which p2p op follows it with which (microbatch, chunk) in each
direction, is ``pptrace.schedules.tables.InterleavedStage.program``: Megatron's order, written
once for this trainer and for the what-if simulator that replays it. Here it is executed:
without overlap_p2p_comm, every pass is followed by one combined op that sends its result and
receives the next pass's input (``send_forward_recv_forward``, the steady state's
``send_forward_backward_recv_forward_backward``, ``send_backward_recv_backward``); with it,
each direction's op is posted after its pass and waited right before its tensor is used.
"""
from __future__ import annotations

from . import pp_communications as p2p
from .pp_communications import Message
from pptrace.schedules.tables import Exchange, InterleavedStage


def forward_backward_pipelining_with_interleaving(run) -> None:
    """One step of ``run`` (a ``pipeline_parallel.PipelineRun``) under the interleaved schedule."""
    ctx = run.comm
    stage = InterleavedStage(run.pp_size, run.pp_rank, run.num_microbatches, run.vpp)
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

    for step in stage.program(run.overlap_p2p_comm):
        if not isinstance(step, Exchange):
            op, mb, chunk = step
            if op == "F":
                output = run.forward(mb, chunk, inputs.pop(("F", mb, chunk), None))
            else:
                grad_input = run.backward(mb, chunk, inputs.pop(("B", mb, chunk), None))
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
