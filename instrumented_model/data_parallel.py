"""Gradient synchronisation after backward (Megatron's ``finalize_model_grads``, minus the
embedding all-reduce: embedding and LM head are untied here).

Gradients are SUMMED over the dp_cp group (an expert's over its expert-data-parallel group): the caller already divides each microbatch's loss
by the global token count, so the sum is the gradient of the global-mean loss. Parameters
marked ``param.sequence_parallel`` (LayerNorms, RowParallel biases and positions under SP)
saw only this tp rank's sequence slice and are also summed over the tp group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pptrace import region

from .tensor_parallel import group_size

DEFAULT_BUCKET_BYTES = 1 << 20


def _params(chunks, expert: bool = False) -> list:
    """The dense parameters (or the experts': replicated over edp, not dp x cp)."""
    # Reverse registration order approximates the order backward produces gradients in.
    return [p for chunk in reversed(chunks) for p in reversed(list(chunk.parameters()))
            if p.requires_grad and getattr(p, "expert_parallel", False) == expert]


def _grad(param) -> torch.Tensor:
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def make_buckets(params, bucket_bytes: int) -> list[list]:
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets, current, size = [], [], 0
    for param in params:
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _flatten(params) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in params])


def _unflatten_into(flat, params) -> None:
    offset = 0
    for param in params:
        n = param.numel()
        param.grad.copy_(flat[offset : offset + n].view_as(param.grad))
        offset += n


def _nbytes(x) -> int:
    return x.numel() * x.element_size()


def _sum_flat(params, process_group, name: str, **tags) -> None:
    """Sum ``params``' gradients over ``process_group`` in one flat all-reduce."""
    if not params:
        return
    flat = _flatten(params)
    with region(name, bytes=_nbytes(flat), **tags):
        dist.all_reduce(flat, group=process_group)
    _unflatten_into(flat, params)


def sync_sequence_parallel_grads(chunks, pstate) -> None:
    """Sum the SP-partial gradients over the tp group (one flat all-reduce)."""
    if not pstate.sequence_parallel or group_size(pstate.tp_group) == 1:
        return
    params = [p for chunk in chunks for p in chunk.parameters() if getattr(p, "sequence_parallel", False)]
    _sum_flat(params, pstate.tp_group, "tp:all_reduce", what="sp_grads")


def sync_expert_grads(chunks, pstate) -> None:
    """Sum the experts' gradients over the expert-data-parallel group (one flat all-reduce):
    each replica of an expert saw the tokens its own ep group routed to it. Tagged
    ``group=edp``: it spans that group, not dp's."""
    if group_size(pstate.edp_group) == 1:
        return
    _sum_flat(_params(chunks, expert=True), pstate.edp_group, "dp:all_reduce", what="expert_grads",
              group="edp" if pstate.ep_size > 1 else None)


def finish_grad_sync(chunks, pstate, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """After the last backward: bucketed all-reduce over dp_cp (the experts' over edp), then
    the SP grads over tp."""
    if group_size(pstate.dp_cp_group) > 1:
        for i, bucket in enumerate(make_buckets(_params(chunks), bucket_bytes)):
            flat = _flatten(bucket)
            with region("dp:all_reduce", bucket=i, bytes=_nbytes(flat)):
                dist.all_reduce(flat, group=pstate.dp_cp_group)
            _unflatten_into(flat, bucket)
    sync_expert_grads(chunks, pstate)
    sync_sequence_parallel_grads(chunks, pstate)


class OverlappedGradReducer:
    """Launch each bucket's async all-reduce as soon as backward has produced all of its
    gradients, so DP communication overlaps the rest of backward (Megatron's
    ``overlap_grad_reduce``). Only armed for the last microbatch's backward (``enable``),
    because earlier microbatches only accumulate (Megatron's ``no_sync``)."""

    def __init__(self, chunks, pstate, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.chunks, self.pstate = chunks, pstate
        self.active = group_size(pstate.dp_cp_group) > 1
        self.buckets = make_buckets(_params(chunks), bucket_bytes)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._enabled = False
        self._reset()
        self._hooks = []
        if self.active:
            for bucket in self.buckets:
                for param in bucket:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _reset(self):
        self._ready = [0] * len(self.buckets)
        self._inflight = {}  # bucket index -> (work, flat buffer)
        self._next = 0  # the next bucket to launch

    @property
    def launched_buckets(self) -> int:
        """Buckets whose all-reduce is already in flight (before ``finish``: launched by backward)."""
        return len(self._inflight)

    def enable(self, on: bool) -> None:
        self._enabled = bool(on)

    def _on_grad(self, param) -> None:
        if not self._enabled:
            return
        i = self._bucket_of[id(param)]
        self._ready[i] += 1
        # Launch in bucket order, never out of it: collectives must be issued in the same
        # order on every rank, and backward may finish buckets in a rank-dependent order.
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        flat = _flatten(self.buckets[i])
        with region("dp:all_reduce", bucket=i, bytes=_nbytes(flat)):
            work = dist.all_reduce(flat, group=self.pstate.dp_cp_group, async_op=True)
        self._inflight[i] = (work, flat)

    def finish(self) -> None:
        """Wait for every bucket (launching any backward did not complete), then SP grads."""
        if self.active:
            for i in range(len(self.buckets)):
                if i not in self._inflight:
                    self._launch(i)
            for i in range(len(self.buckets)):
                work, flat = self._inflight[i]
                with region("dp:wait", op="all_reduce", bucket=i):
                    work.wait()
                _unflatten_into(flat, self.buckets[i])
        self._reset()
        self._enabled = False
        sync_expert_grads(self.chunks, self.pstate)
        sync_sequence_parallel_grads(self.chunks, self.pstate)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
