"""Context parallelism for causal self-attention: ring attention and Ulysses.

Both work on the load-balanced sequence layout of ``data.cp_chunk_ids`` (cp rank i holds
sequence chunks i and 2cp-1-i). Tensors here are head-first: q, k, v are (b, n, s, d) with
n the heads local to this tensor-parallel rank.

Ring (Liu et al. 2023; Megatron/TE ``cp_comm_type=p2p``): cp steps; at step t a rank holds
the K/V of cp rank (i - t) mod cp and merges that block's attention into its output with the
log-sum-exp of the online softmax. With the load-balanced layout every off-diagonal block is
either "all my queries see the first half of the keys" or "my second half of queries sees all
keys", so only the diagonal step needs a mask (TE's scheme).

Ulysses (Jacobs et al. 2023; ``cp_comm_type=a2a``): one all-to-all trades heads for sequence
before attention, another trades them back after.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pptrace import region

from .data import cp_positions


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def attention_block(q, k, v, causal: bool):
    """Softmax attention of q (b, n, sq, d) over k, v (b, n, sk, d) -> (out, lse (b, n, sq)).

    Computed by hand (not SDPA) because merging blocks needs the log-sum-exp."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (b, n, sq, sk)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _merge(out, lse, block_out, block_lse):
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


class _Ring:
    """One attention layer's KV ring: send to the next cp rank, receive from the previous."""

    def __init__(self, pstate, layer):
        ranks, i = pstate.cp_ranks, pstate.cp_rank
        self.group, self.layer = pstate.cp_group, layer
        self.next, self.prev = ranks[(i + 1) % len(ranks)], ranks[(i - 1) % len(ranks)]
        self.pending = {}

    def post(self, send, send_to, recv, recv_from, step, direction=None):
        tags = dict(step=step, layer=self.layer, bytes=_nbytes(send), dir=direction)
        with region("cp:send_kv", peer=send_to, **tags):
            send_work = dist.isend(send, send_to, group=self.group)
        with region("cp:recv_kv", peer=recv_from, **tags):
            recv_work = dist.irecv(recv, recv_from, group=self.group)
        return [send_work, recv_work]

    def wait(self, works, step, direction=None):
        with region("cp:wait", op="send_recv_kv", step=step, layer=self.layer, dir=direction):
            for work in works:
                work.wait()


class _KVExchange(torch.autograd.Function):
    """Posts the forward exchange of step ``step`` and returns the (not yet filled) receive
    buffer; the caller waits through ``ring.pending``. Backward sends the gradient of the
    received K/V back to its sender and receives the gradient of what this rank sent."""

    @staticmethod
    def forward(ctx, kv, ring, step):
        ctx.ring, ctx.step = ring, step
        recv = torch.empty_like(kv)
        ring.pending[step] = ring.post(kv, ring.next, recv, ring.prev, step)
        return recv

    @staticmethod
    def backward(ctx, grad):
        ring = ctx.ring
        grad = grad.contiguous()
        grad_sent = torch.empty_like(grad)
        works = ring.post(grad, ring.prev, grad_sent, ring.next, ctx.step, "bwd")
        ring.wait(works, ctx.step, "bwd")
        return grad_sent, None, None


def ring_attention(q, k, v, pstate, layer: int):
    """Causal attention over the cp group; q, k, v (b, n, s_local, d) -> (b, n, s_local, d)."""
    cp, me = pstate.cp_size, pstate.cp_rank
    half = q.shape[2] // 2
    ring = _Ring(pstate, layer)
    kv = torch.stack([k, v])  # (2, b, n, s_local, d)
    out = lse = None
    for step in range(cp):
        exchange = step + 1 < cp
        if exchange and pstate.cp_overlap:
            # Posted before this step's compute so the transfer hides under it.
            next_kv = _KVExchange.apply(kv, ring, step + 1)
        src = (me - step) % cp
        with region("compute:attn", step=step, layer=layer):
            if step == 0:
                out, lse = attention_block(q, kv[0], kv[1], causal=True)
            elif src < me:
                # Their early chunk is in all my queries' past; their late chunk in none's.
                block = attention_block(q, kv[0, :, :, :half], kv[1, :, :, :half], causal=False)
                out, lse = _merge(out, lse, *block)
            else:
                # Only my late chunk sees their chunks, and it sees both entirely.
                block = attention_block(q[:, :, half:], kv[0], kv[1], causal=False)
                late, late_lse = _merge(out[:, :, half:], lse[:, :, half:], *block)
                out = torch.cat([out[:, :, :half], late], dim=2)
                lse = torch.cat([lse[:, :, :half], late_lse], dim=2)
        if exchange:
            if not pstate.cp_overlap:
                next_kv = _KVExchange.apply(kv, ring, step + 1)
            ring.wait(ring.pending.pop(step + 1), step + 1)
            kv = next_kv
    return out


def _all_to_all(x, group, scatter_dim, gather_dim, layer, direction=None):
    """Split ``scatter_dim`` over the cp group and concatenate what arrives along ``gather_dim``."""
    parts = [c.contiguous() for c in x.chunk(dist.get_world_size(group), scatter_dim)]
    received = [torch.empty_like(p) for p in parts]
    with region("cp:all_to_all", layer=layer, bytes=_nbytes(x), dir=direction):
        dist.all_to_all(received, parts, group=group)
    return torch.cat(received, gather_dim)


class _AllToAll(torch.autograd.Function):
    """All-to-all forward; the inverse all-to-all (dims swapped) backward."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, layer):
        # ctx is never written in backward: a retained graph (ZB-H1's B then W) replays it.
        ctx.args = (group, gather_dim, scatter_dim, layer)
        return _all_to_all(x, group, scatter_dim, gather_dim, layer)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.args, "bwd"), None, None, None, None


def ulysses_attention(q, k, v, pstate, layer: int):
    """Causal attention with heads scattered over cp; q, k, v (b, n, s_local, d), n % cp == 0."""
    cp = pstate.cp_size
    group = pstate.cp_group
    qkv = torch.stack([q, k, v])  # (3, b, n, s_local, d)
    qkv = _AllToAll.apply(qkv, group, 2, 3, layer)  # (3, b, n/cp, s, d), s in cp-rank order
    seq_len = qkv.shape[3]
    order = torch.cat([cp_positions(seq_len, cp, r) for r in range(cp)]).to(q.device)
    natural = torch.argsort(order)  # rank-order index of each position
    qkv = qkv.index_select(3, natural)
    out, _ = attention_block(qkv[0], qkv[1], qkv[2], causal=True)  # (b, n/cp, s, d)
    out = out.index_select(2, torch.argsort(natural))  # back to cp-rank order
    return _AllToAll.apply(out, group, 2, 1, layer)  # (b, n, s_local, d)


def core_attention(q, k, v, pstate, layer: int):
    if pstate.cp_size == 1:
        return attention_block(q, k, v, causal=True)[0]
    if pstate.cp_algo == "ulysses":
        return ulysses_attention(q, k, v, pstate, layer)
    return ring_attention(q, k, v, pstate, layer)
