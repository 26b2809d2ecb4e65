"""Megatron's interleaved 1F1B (virtual pipeline) schedule.

Each stage holds v model chunks; chunk c of stage r is virtual stage c*p + r, so activations
travel a ring: stage p-1's chunk c feeds stage 0's chunk c+1 (and gradients the other way).
The order of (microbatch, chunk) passes is ``interleaved_forward_order`` /
``interleaved_backward_order``; the communication follows Megatron: every pass is followed by
one combined p2p op that sends its result and receives the input of the next pass.
"""
from __future__ import annotations

from . import pp_communications as p2p
from .pipeline_parallel import PipelineRun
from .pp_communications import Message
from pptrace.whatif.schedules import (
    interleaved_backward_order,
    interleaved_forward_order,
    num_warmup_microbatches,
)


def forward_backward_pipelining_with_interleaving(run: PipelineRun) -> None:
    ctx, m, p, r, v = run.comm, run.num_microbatches, run.pp_size, run.pp_rank, run.vpp
    if m % p:
        raise ValueError(f"interleaved schedule needs microbatches % pp == 0, got {m} and {p}")
    total = m * v
    warmup = num_warmup_microbatches("interleaved", p, r, m, v)
    fwd = interleaved_forward_order(p, m, v)
    bwd = interleaved_backward_order(p, m, v)

    def first_virtual(chunk: int) -> bool:  # takes token ids, receives nothing
        return r == 0 and chunk == 0

    def last_virtual(chunk: int) -> bool:  # computes the loss, sends nothing forward
        return r == p - 1 and chunk == v - 1

    # Tags name the chunk that consumes the tensor on the receiving side (see pp_communications).
    def fwd_send(k: int, y):
        mb, c = fwd[k]
        if last_virtual(c):
            return None
        return Message(mb, c + 1 if r == p - 1 else c, y)

    def bwd_send(k: int, dx):
        mb, c = bwd[k]
        if first_virtual(c):
            return None
        return Message(mb, c - 1 if r == 0 else c, dx)

    def fwd_recv(k: int):
        if k >= total or first_virtual(fwd[k][1]):
            return None
        return Message(*fwd[k])

    def bwd_recv(k: int):
        if k >= total or last_virtual(bwd[k][1]):
            return None
        return Message(*bwd[k])

    if run.overlap_p2p_comm:
        _run_overlapped(run, warmup, total, fwd, bwd, fwd_send, bwd_send, fwd_recv, bwd_recv)
        return

    x = p2p.recv_forward(ctx, fwd_recv(0)) if fwd_recv(0) else None
    grad = None

    # Warm-up: forwards only; the last one also receives the first backward's grad.
    for k in range(warmup):
        mb, c = fwd[k]
        y = run.forward(mb, c, x)
        if k == warmup - 1 and warmup < total:
            x, grad = p2p.send_forward_backward_recv_forward_backward(
                ctx, fwd_send(k, y), None, fwd_recv(k + 1), bwd_recv(0)
            )
        else:
            x = p2p.send_forward_recv_forward(ctx, fwd_send(k, y), fwd_recv(k + 1))
    if warmup == total and bwd_recv(0):
        grad = p2p.recv_backward(ctx, bwd_recv(0))

    # Steady state: forward k+warmup, backward k, then one four-way exchange.
    for k in range(total - warmup):
        fk = k + warmup
        mb, c = fwd[fk]
        y = run.forward(mb, c, x)
        bmb, bc = bwd[k]
        dx = run.backward(bmb, bc, grad)
        x, grad = p2p.send_forward_backward_recv_forward_backward(
            ctx, fwd_send(fk, y), bwd_send(k, dx), fwd_recv(fk + 1), bwd_recv(k + 1)
        )

    # Cool-down: the remaining backwards.
    for k in range(total - warmup, total):
        bmb, bc = bwd[k]
        dx = run.backward(bmb, bc, grad)
        grad = p2p.send_backward_recv_backward(ctx, bwd_send(k, dx), bwd_recv(k + 1))


def _run_overlapped(run, warmup, total, fwd, bwd, fwd_send, bwd_send, fwd_recv, bwd_recv) -> None:
    """Megatron's ``overlap_p2p_comm=True`` path of the interleaved schedule: the same passes
    and the same messages in the same per-direction order, but the forward exchange (send this
    output, recv the next input) and the backward exchange are posted asynchronously right
    after their pass and waited only right before the tensor they receive is used, so the
    other direction's pass runs while they are in flight. The pp regions still span posting
    to completion (passes run inside them, as ZB-H1's deferred W's do)."""
    ctx = run.comm
    _no_tensor = (None, None)

    def wait(pending):
        return pending.wait() if pending is not None else _no_tensor

    x = p2p.recv_forward(ctx, fwd_recv(0)) if fwd_recv(0) else None
    fwd_pending = bwd_pending = None

    # Warm-up (warmup >= 1 always: at least (v-1)*p forwards).
    for k in range(warmup):
        if k:
            x = wait(fwd_pending)[0]
        mb, c = fwd[k]
        y = run.forward(mb, c, x)
        fwd_pending = _post(ctx, send_next=fwd_send(k, y), recv_prev=fwd_recv(k + 1))
        if k == warmup - 1 and warmup < total:
            bwd_pending = _post(ctx, recv_next=bwd_recv(0))
    if warmup == total:
        wait(fwd_pending)
        fwd_pending = None
        if bwd_recv(0):
            bwd_pending = _post(ctx, recv_next=bwd_recv(0))

    # Steady state: F, post its exchange, then B on the grad that arrived meanwhile.
    for k in range(total - warmup):
        fk = k + warmup
        x = wait(fwd_pending)[0]
        mb, c = fwd[fk]
        y = run.forward(mb, c, x)
        fwd_pending = _post(ctx, send_next=fwd_send(fk, y), recv_prev=fwd_recv(fk + 1))
        grad = wait(bwd_pending)[1]
        bmb, bc = bwd[k]
        dx = run.backward(bmb, bc, grad)
        bwd_pending = _post(ctx, send_prev=bwd_send(k, dx), recv_next=bwd_recv(k + 1))

    # Cool-down: the remaining backwards.
    wait(fwd_pending)
    for k in range(total - warmup, total):
        grad = wait(bwd_pending)[1]
        bmb, bc = bwd[k]
        dx = run.backward(bmb, bc, grad)
        bwd_pending = _post(ctx, send_prev=bwd_send(k, dx), recv_next=bwd_recv(k + 1))
    wait(bwd_pending)


def _post(ctx, **directions):
    """Post the given directions (None ones are skipped); None when nothing is posted."""
    directions = {k: v for k, v in directions.items() if v is not None}
    return p2p.post(ctx, **directions) if directions else None
