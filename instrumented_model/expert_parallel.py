"""Expert parallelism: a top-k mixture-of-experts MLP whose experts are sharded over the ep
group, after Megatron-Core's ``MoELayer`` with its alltoall token dispatcher.

A layer runs: router (softmax over the experts, top-k), permute (token copies sorted by
expert), ``ep:dispatch`` (the count exchange, then ``all_to_all_single`` with per-peer split
sizes: alltoallv), the local experts (``compute:expert``), ``ep:combine`` (the reverse
all-to-all), unpermute (each token's k outputs weighted by its router probabilities).
Backward runs the two all-to-alls again with the splits swapped, in ranges tagged
``dir=bwd``.

Layout (Layout.ep): ep is carved out of the dp x cp ranks, as Megatron-Core does; expert e
lives on ep rank ``e // (experts / ep)``. Expert weights are replicated over the
expert-data-parallel group (edp), where their gradients are summed; dense weights are summed
over dp x cp as before (data_parallel.py). With tp > 1 the experts are not tensor-parallel
(Megatron's expert_tensor_parallel_size = 1): each tp rank routes its own tokens (its
sequence slice under SP, which makes the expert and router gradients partial over tp).

Sleep mode (``SleepMoE``): the same all-to-alls move real zeros with split sizes from a
synthetic routing (``--moe-imbalance RANK:FACTOR`` sends FACTOR times the mean share of every
rank's token copies to the experts of ep rank RANK), and an expert pass sleeps
``us_per_token`` per token it received (twice that in backward), so the cost of imbalance
is known exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pptrace import region

from .tensor_parallel import group_size

#: an expert's backward takes this many times its forward (sleep mode; two matmuls per one)
BWD_PER_FWD = 2.0


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# -- communication -------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group, op: str, layer, direction=None,
                log: list | None = None, **tags) -> torch.Tensor:
    """alltoallv of rows of ``x`` inside an ``ep:<op>`` range (identity on a group of one);
    ``log`` gets the call's (start, end) in time_ns (sleep mode's truth)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with region(f"ep:{op}", layer=layer, bytes=_nbytes(x), tokens=int(x.shape[0]), dir=direction, **tags):
        start = time.time_ns()
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        if log is not None:
            log.append((start, time.time_ns()))
    return out


def exchange_counts(counts: torch.Tensor, group, layer, **tags) -> torch.Tensor:
    """Every peer's token count per local expert: (ep * local experts,) in, same out, by
    source rank (Megatron's dispatcher preprocess: the split sizes of the token exchange)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    with region("ep:dispatch", layer=layer, what="counts", bytes=_nbytes(counts), **tags):
        dist.all_to_all_single(out, counts, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Dispatch or combine; backward is the reverse exchange, in a range of the same op."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, op, layer):
        ctx.args = (out_splits, in_splits, group, op, layer)
        return _all_to_all(x, out_splits, in_splits, group, op, layer)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, op, layer = ctx.args
        return _all_to_all(grad, in_splits, out_splits, group, op, layer, "bwd"), None, None, None, None, None


# -- the layer -----------------------------------------------------------------------------
class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int, device):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner, device=device)
        self.fc2 = nn.Linear(inner, hidden, device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoELayer(nn.Module):
    """Replaces a decoder layer's MLP; (s, b, h) -> (s, b, h). Parameters are named by the
    global expert id (``experts.5.fc1.weight``), so any ep layout starts from one process's
    weights."""

    def __init__(self, config, pstate, layer: int):
        super().__init__()
        self.pstate, self.layer, self.topk = pstate, layer, config.topk
        self.experts_total, ep = config.experts, pstate.ep_size
        self.local = config.experts // ep
        first = pstate.ep_rank * self.local
        self.router = nn.Linear(config.hidden, config.experts, bias=False, device=pstate.device)
        self.experts = nn.ModuleDict({str(e): Expert(config.hidden, config.mlp_ratio * config.hidden, pstate.device)
                                      for e in range(first, first + self.local)})
        sp = pstate.sequence_parallel
        for param in self.router.parameters():
            param.tensor_model_parallel, param.sequence_parallel = False, sp
        for param in self.experts.parameters():
            # summed over edp (data_parallel.py), and over tp where each tp rank routed its slice
            param.tensor_model_parallel, param.sequence_parallel, param.expert_parallel = False, sp, True

    def forward(self, x):
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs = torch.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.topk, dim=-1)  # (T, k)
        # permute: token copies sorted by global expert (stable: token order within one)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        permuted = tokens.repeat_interleave(self.topk, dim=0)[order]
        counts = torch.bincount(flat, minlength=self.experts_total)  # per global expert
        group, ep = self.pstate.ep_group, self.pstate.ep_size
        received = exchange_counts(counts, group, self.layer).view(ep, self.local)  # by source, local expert
        in_splits = counts.view(ep, self.local).sum(1).tolist()
        out_splits = received.sum(1).tolist()
        arrived = _AllToAll.apply(permuted, out_splits, in_splits, group, "dispatch", self.layer)
        # by (source, local expert) -> by local expert, each expert's rows together
        expert_of = torch.repeat_interleave(torch.arange(self.local).repeat(ep), received.reshape(-1))
        by_expert = torch.argsort(expert_of, stable=True)
        per_expert = torch.bincount(expert_of, minlength=self.local).tolist()
        grouped = arrived[by_expert]
        outs = []
        with region("compute:expert", layer=self.layer, tokens=int(grouped.shape[0])):
            for part, expert in zip(torch.split(grouped, per_expert), self.experts.values()):
                outs.append(expert(part))
        done = torch.empty_like(grouped)
        done = done.index_copy(0, by_expert, torch.cat(outs) if outs else grouped)
        back = _AllToAll.apply(done, in_splits, out_splits, group, "combine", self.layer)
        # unpermute: each copy back to its token, weighted by its router probability
        copies = torch.empty_like(back).index_copy(0, order, back).view(s * b, self.topk, h)
        return (copies * weights.unsqueeze(-1)).sum(1).view(s, b, h)


# -- sleep mode ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Imbalance:
    """``--moe-imbalance RANK:FACTOR``: the experts of ep rank RANK get FACTOR times the mean
    number of tokens; the rest spread evenly."""

    rank: int
    factor: float

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"--moe-imbalance rank {self.rank} must be >= 0")
        if not self.factor >= 0:
            raise ValueError(f"--moe-imbalance factor {self.factor} must be >= 0")

    @classmethod
    def parse(cls, text: str) -> "Imbalance":
        try:
            rank, factor = text.split(":")
            return cls(int(rank), float(factor))
        except ValueError as exc:
            if str(exc).startswith("--moe-imbalance"):
                raise
            raise ValueError(f"--moe-imbalance {text!r} must look like RANK:FACTOR, e.g. 2:2.0") from exc


def token_splits(copies: int, ep: int, imbalance: Imbalance | None) -> list[int]:
    """How many of a rank's ``copies`` token copies go to each ep rank (the same from every
    source): even, or FACTOR times the mean to the imbalanced rank and the rest even."""
    if imbalance is None or ep == 1:
        shares = [copies / ep] * ep
    else:
        heavy = min(imbalance.factor * copies / ep, copies)
        shares = [heavy if r == imbalance.rank else (copies - heavy) / (ep - 1) for r in range(ep)]
    splits = [int(round(x)) for x in shares]
    splits[-1] += copies - sum(splits)  # rounding: every copy goes somewhere
    return splits


@dataclass
class SleepMoE:
    """The ep work of one pass in sleep mode, for each MoE layer of a chunk: the dispatch
    all-to-all of zeros, the experts' sleep (``us_per_token`` per token received), the
    combine; backward the combine's and the dispatch's grads around twice the sleep."""

    layers_of_chunk: list  # chunk -> [layer ids that are MoE]
    tokens: int  # tokens per microbatch on this rank
    topk: int
    hidden: int
    us_per_token: float
    group: object
    ep: int
    ep_rank: int
    imbalance: Imbalance | None = None
    device: torch.device = torch.device("cpu")
    #: where the all-to-all calls' (start, end) go, time_ns (the train loop points it at the
    #: step's truth); within their ranges, so a pass less its calls bounds its compute
    calls: list | None = None

    def __post_init__(self):
        self.in_splits = token_splits(self.tokens * self.topk, self.ep, self.imbalance)
        # every source sends the same split, so this rank receives ep times its own share
        self.out_splits = [self.in_splits[self.ep_rank]] * self.ep

    @property
    def received(self) -> int:
        """Tokens this rank's experts process per layer per microbatch."""
        return sum(self.out_splits)

    def expert_s(self, phase: str) -> float:
        """Seconds this rank's experts sleep per MoE layer of a pass of ``phase``."""
        return self.received * self.us_per_token / 1e6 * (BWD_PER_FWD if phase != "fwd" else 1.0)

    def run(self, mb: int, chunk: int, phase: str, sleep) -> None:
        # backward moves the same rows the same way: the combine's grads out to the experts,
        # the dispatch's back to their tokens
        send, recv = self.in_splits, self.out_splits
        direction = None if phase == "fwd" else "bwd"
        first, second = ("dispatch", "combine") if phase == "fwd" else ("combine", "dispatch")
        for layer in self.layers_of_chunk[chunk]:
            x = torch.zeros((sum(send), self.hidden), device=self.device)
            y = _all_to_all(x, recv, send, self.group, first, layer, direction, self.calls, mb=mb)
            with region("compute:expert", layer=layer, mb=mb, tokens=int(y.shape[0]), dir=direction):
                sleep(self.expert_s(phase))
            _all_to_all(y, send, recv, self.group, second, layer, direction, self.calls, mb=mb)
