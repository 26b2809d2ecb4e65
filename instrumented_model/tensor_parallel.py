"""Tensor parallelism (+ sequence parallelism), after Megatron-LM's mappings.py and layers.py.

The mapping functions are the f / g operators of Shoeybi et al. (2019) and the SP g / g-bar of
Korthikanti et al. (2022). Every collective runs inside a ``pptrace.region`` named
``tp:<op> layer=L bytes=N`` (``dir=bwd`` in backward) so traces attribute it to TP.
Groups of size 1 (or ``None``) short-circuit, as in Megatron.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pptrace import region


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# -- raw collectives (no autograd) ---------------------------------------------------------
def _all_reduce(x, group, layer, direction=None, op=dist.ReduceOp.SUM, what=None):
    # Clone: the incoming grad of a residual branch is shared with the other branch.
    x = x.contiguous().clone()
    with region("tp:all_reduce", layer=layer, bytes=_nbytes(x), what=what, dir=direction):
        dist.all_reduce(x, op=op, group=group)
    return x


def _gather_along(x, dim, group, layer, direction=None):
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    with region("tp:all_gather", layer=layer, bytes=_nbytes(x) * len(parts), dir=direction):
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def _split_along(x, dim, group):
    return x.chunk(group_size(group), dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter_first_dim(x, group, layer, direction=None):
    chunks = [c.contiguous() for c in x.chunk(group_size(group), 0)]
    out = torch.empty_like(chunks[0])
    with region("tp:reduce_scatter", layer=layer, bytes=_nbytes(x), dir=direction):
        dist.reduce_scatter(out, chunks, group=group)
    return out


# -- autograd mappings ---------------------------------------------------------------------
class _CopyToModelParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.layer, "bwd"), None, None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        return _all_reduce(x, group, layer)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather on the last (hidden / vocab) dim forward, split backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group = group
        return _gather_along(x, -1, group, layer)

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, -1, ctx.group), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's sequence slice forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return _split_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, 0, ctx.group, ctx.layer, "bwd"), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """SP g: all-gather the sequence forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return _gather_along(x, 0, group, layer)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group, ctx.layer, "bwd"), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """SP g-bar: reduce-scatter over the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return _reduce_scatter_first_dim(x, group, layer)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along(grad, 0, ctx.group, ctx.layer, "bwd"), None, None


def _mapping(fn):
    def apply(input_, group, layer=-1):
        if group_size(group) == 1:
            return input_
        return fn.apply(input_, group, layer)

    apply.__name__ = fn.__name__
    return apply


copy_to_tensor_model_parallel_region = _mapping(_CopyToModelParallelRegion)
reduce_from_tensor_model_parallel_region = _mapping(_ReduceFromModelParallelRegion)
gather_from_tensor_model_parallel_region = _mapping(_GatherFromModelParallelRegion)
scatter_to_sequence_parallel_region = _mapping(_ScatterToSequenceParallelRegion)
gather_from_sequence_parallel_region = _mapping(_GatherFromSequenceParallelRegion)
reduce_scatter_to_sequence_parallel_region = _mapping(_ReduceScatterToSequenceParallelRegion)


# -- sharding of parameters ----------------------------------------------------------------
def set_tensor_model_parallel_attributes(param, is_parallel: bool, dim: int = 0, stride: int = 1):
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def shard_full_tensor(full: torch.Tensor, dim: int, stride: int, rank: int, size: int):
    """This rank's shard of an unsharded tensor. ``stride`` > 1 shards each of ``stride``
    equal blocks separately (fused QKV: every rank keeps its heads' q, k and v)."""
    if size == 1:
        return full
    shape = list(full.shape)
    n = shape[dim]
    if n % (stride * size):
        raise ValueError(f"dim {dim} of size {n} does not split into {stride}x{size} shards")
    blocks = full.reshape(shape[:dim] + [stride, size, n // (stride * size)] + shape[dim + 1 :])
    return blocks.select(dim + 1, rank).reshape(shape[:dim] + [n // size] + shape[dim + 1 :])


def full_shape(param) -> tuple[int, ...]:
    """The unsharded shape of a parameter made by the layers below."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= param.tp_size
    return tuple(shape)


# -- layers --------------------------------------------------------------------------------
def _parameter(shape, pstate, parallel, dim=0, stride=1):
    param = nn.Parameter(torch.empty(*shape, device=pstate.device))
    set_tensor_model_parallel_attributes(param, parallel, dim, stride)
    param.tp_size = pstate.tp_size
    param.sequence_parallel = False
    return param


def _divide(n: int, by: int, what: str) -> int:
    if n % by:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {by}")
    return n // by


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns (output features). Input: (s_part, b, in), output
    (s, b, out/tp) unless ``gather_output``. Under SP the input is sequence-sharded and is
    all-gathered first."""

    def __init__(self, in_f, out_f, pstate, layer=-1, bias=True, gather_output=False, stride=1):
        super().__init__()
        self.pstate, self.layer, self.gather_output = pstate, layer, gather_output
        out_local = _divide(out_f, pstate.tp_size, "output features")
        self.weight = _parameter((out_local, in_f), pstate, True, 0, stride)
        self.bias = _parameter((out_local,), pstate, True, 0, stride) if bias else None

    def forward(self, x):
        group = self.pstate.tp_group
        if self.pstate.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group, self.layer)  # (s, b, in)
        else:
            x = copy_to_tensor_model_parallel_region(x, group, self.layer)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, group, self.layer)
        return y


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows (input features); input already split (s, b, in/tp).
    The partial products are all-reduced, or reduce-scattered to (s/tp, b, out) under SP; the
    bias is added after that, so under SP its gradient is partial and is reduced over TP in
    ``finish_grad_sync`` (``param.sequence_parallel``)."""

    def __init__(self, in_f, out_f, pstate, layer=-1, bias=True):
        super().__init__()
        self.pstate, self.layer = pstate, layer
        in_local = _divide(in_f, pstate.tp_size, "input features")
        self.weight = _parameter((out_f, in_local), pstate, True, 1)
        self.bias = _parameter((out_f,), pstate, False) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = pstate.sequence_parallel

    def forward(self, x):
        y = F.linear(x, self.weight)
        group = self.pstate.tp_group
        if self.pstate.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, group, self.layer)
        else:
            y = reduce_from_tensor_model_parallel_region(y, group, self.layer)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split over the vocabulary. Token ids (b, s) -> (s, b, h), summed over
    TP (all-reduce, or reduce-scatter to (s/tp, b, h) under SP)."""

    def __init__(self, vocab, hidden, pstate):
        super().__init__()
        self.pstate = pstate
        self.vocab_local = _divide(vocab, pstate.tp_size, "vocab_size")
        self.vocab_start = pstate.tp_rank * self.vocab_local
        self.weight = _parameter((self.vocab_local, hidden), pstate, True, 0)

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0).transpose(0, 1).contiguous()  # (s, b, h)
        group = self.pstate.tp_group
        if self.pstate.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, group, -1)
        return reduce_from_tensor_model_parallel_region(out, group, -1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        # logits (s, b, v/tp), target (s, b): the softmax normaliser needs max and sum over
        # the whole vocabulary, hence two all-reduces (plus one for the target's logit).
        reduce = group_size(group) > 1
        logits_max = logits.max(dim=-1).values
        if reduce:
            logits_max = _all_reduce(logits_max, group, -1, op=dist.ReduceOp.MAX, what="ce_max")
        logits = logits - logits_max.unsqueeze(-1)
        local = target - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        if reduce:
            target_logit = _all_reduce(target_logit, group, -1, what="ce_target")
            sum_exp = _all_reduce(sum_exp, group, -1, what="ce_sum_exp")
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -(~outside).unsqueeze(-1).to(softmax.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, target, pstate) -> torch.Tensor:
    """Per-token cross-entropy (s, b) of vocab-sharded logits (s, b, v/tp)."""
    vocab_start = pstate.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, pstate.tp_group, vocab_start)
