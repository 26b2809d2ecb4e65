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

Overlapped (``--ep-overlap``, after DeepSeek-V3's two-microbatch overlap / DualPipe): each
layer's tokens are cut into two halves whose exchanges are posted as async all-to-alls on a
group of their own (``overlap_group``) and run on that group's gloo worker thread, the CPU's
comm stream, while the main thread computes the other half's experts: dispatch of half 1
under the experts of half 0, then the combine of half 0 under the experts of half 1 (and the
same with the roles of the exchanges swapped in backward). Only half 0's first and half 1's
second exchange are exposed. The main thread posts each exchange in its ``ep:dispatch`` /
``ep:combine`` range and waits for it in ``ep:wait op=dispatch|combine``; the transfer itself
is gloo's ``gloo:all_to_all`` on the worker thread. A Python thread of our own could not be
seen: torch.profiler (as pptrace.profile starts it) records only the threads that inherit its
thread-local state, which gloo's workers do and a ``threading.Thread`` does not.

Sleep mode (``SleepMoE``): the same all-to-alls move real zeros with split sizes from a
synthetic routing (``--moe-imbalance RANK:FACTOR`` sends FACTOR times the mean share of every
rank's token copies to the experts of ep rank RANK), and an expert pass sleeps
``us_per_token`` per token it received (twice that in backward), so the cost of imbalance
is known exactly. With the overlap the truth logs each call from post to completion and the
main thread's posts and waits: the hidden EP time is the calls' intersection with the passes
less those (``overlap_ns``).
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


def splits_tag(counts) -> str:
    """Per-peer (or per-expert) row counts as one tag value, ``12,12,30,12``: in group-rank
    order, which is the ranks' sorted order (``new_group`` sorts them)."""
    return ",".join(str(int(n)) for n in counts)


# -- communication -------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group, op: str, layer, direction=None,
                log: list | None = None, **tags) -> torch.Tensor:
    """alltoallv of rows of ``x`` inside an ``ep:<op>`` range (identity on a group of one);
    ``log`` gets the call's (start, end) in time_ns (sleep mode's truth)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with region(f"ep:{op}", layer=layer, bytes=_nbytes(x), tokens=int(x.shape[0]), send=splits_tag(in_splits),
                recv=splits_tag(out_splits), dir=direction, **tags):
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


# -- overlapped communication (--ep-overlap) ---------------------------------------------------
def overlap_group(pstate):
    """This rank's ep group again, as a group of its own: the overlapped exchanges get their
    own gloo worker threads (their "comm stream"), so an exchange in flight never queues
    behind, or sits in front of, the synchronous ep traffic on ``pstate.ep_group``.
    Collective over the world, like every ``new_group``: call it on every rank alike."""
    from .parallel_state import _create_groups

    if pstate.ep_size == 1:
        return None
    return _create_groups(pstate.layout.groups("ep"), pstate.rank, "ep_overlap")


class _Posted:
    """An all-to-all in flight; ``wait()`` (in its ``ep:wait`` range) gives its output."""

    def __init__(self, out, work, op, tags, blocked=None):
        self.out, self.work, self.op, self.tags, self.blocked = out, work, op, tags, blocked

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with region("ep:wait", op=self.op, **self.tags):
                start = time.time_ns()
                self.work.wait()
                if self.blocked is not None:
                    self.blocked.append((start, time.time_ns()))
        return self.out


def _post(x: torch.Tensor, out_splits: list, in_splits: list, group, op: str, layer, direction=None,
          log: list | None = None, blocked: list | None = None, **tags) -> _Posted:
    """Post the alltoallv of ``_all_to_all`` without waiting for it. Sleep mode's truth:
    ``log`` gets its (post, completion) in time_ns, the completion stamped by gloo's worker
    as it finishes, whatever the main thread is doing then; ``blocked`` the spans this thread
    spent posting it and waiting for it (the rest of its pass is its own work: compute),
    taken inside their ranges: formatting a range's name comes before it opens, and is the
    thread's own work like the rest."""
    ident = dict(layer=layer, dir=direction, **tags)
    if group_size(group) == 1:
        return _Posted(x, None, op, ident)
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with region(f"ep:{op}", layer=layer, bytes=_nbytes(x), tokens=int(x.shape[0]), send=splits_tag(in_splits),
                recv=splits_tag(out_splits), dir=direction, **tags):
        start = time.time_ns()
        work = dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=group, async_op=True)
        if blocked is not None:
            blocked.append((start, time.time_ns()))
    if log is not None:
        work.get_future().then(lambda _: log.append((start, time.time_ns())))
    return _Posted(out, work, op, ident, blocked)


def run_overlapped(first, second, experts, inputs):
    """Two halves through exchange -> experts -> exchange, each exchange hidden under the
    other half's experts where there is one. ``first(h, x)`` / ``second(h, x)`` post half
    h's exchange (a ``_Posted``); ``experts(h, y)`` is half h's work on this thread."""
    # phase 1: half 0's first exchange: nothing to compute yet, so it is exposed
    arrived0 = first(0, inputs[0]).wait()
    # phase 2: half 1's first exchange under half 0's experts
    posted = first(1, inputs[1])
    done0 = experts(0, arrived0)
    arrived1 = posted.wait()
    # phase 3: half 0's second exchange under half 1's experts
    posted = second(0, done0)
    done1 = experts(1, arrived1)
    out0 = posted.wait()
    # phase 4: half 1's second exchange: nothing left to compute under it, exposed
    return out0, second(1, done1).wait()


def halve(splits: list) -> tuple[list, list]:
    """Per-peer split sizes of sleep mode's two halves: each peer's rows cut in two."""
    return [n // 2 for n in splits], [n - n // 2 for n in splits]


def _union(spans) -> list:
    out = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        elif end > start:
            out.append([start, end])
    return out


def _intersect(a, b) -> list:
    a, b, out = _union(a), _union(b), []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_ns(calls, computes, blocked=()) -> int:
    """ns during which an all-to-all (``calls``: (start, end) pairs) was in flight while this
    thread computed: inside ``computes``, outside ``blocked``."""
    under = _intersect(calls, computes)
    return sum(e - s for s, e in under) - sum(e - s for s, e in _intersect(under, blocked))


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


@dataclass
class _Plan:
    """How one batch of token copies crosses the ep group: the alltoallv's split sizes (to
    each peer, from each peer) and, on arrival, the order that groups the rows by local
    expert with each expert's row count."""

    in_splits: list
    out_splits: list
    by_expert: torch.Tensor
    per_expert: list


class MoELayer(nn.Module):
    """Replaces a decoder layer's MLP; (s, b, h) -> (s, b, h). Parameters are named by the
    global expert id (``experts.5.fc1.weight``), so any ep layout starts from one process's
    weights. ``overlap``: the ``overlap_group`` of --ep-overlap (``enable_overlap``), None
    for the serial layer."""

    def __init__(self, config, pstate, layer: int):
        super().__init__()
        self.pstate, self.layer, self.topk = pstate, layer, config.topk
        self.experts_total, ep = config.experts, pstate.ep_size
        self.local = config.experts // ep
        self.overlap = None
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

    # -- the steps of a layer, shared by the serial and the overlapped forward ---------------
    def _permute(self, tokens, chosen):
        """Token copies sorted by global expert (stable: token order within one) -> (copies,
        the order to undo, copies per global expert)."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        permuted = tokens.repeat_interleave(self.topk, dim=0)[order]
        return permuted, order, torch.bincount(flat, minlength=self.experts_total)

    def _plan(self, counts, **tags) -> _Plan:
        group, ep = self.pstate.ep_group, self.pstate.ep_size
        received = exchange_counts(counts, group, self.layer, **tags).view(ep, self.local)  # by source, local expert
        # by (source, local expert) -> by local expert, each expert's rows together
        expert_of = torch.repeat_interleave(torch.arange(self.local).repeat(ep), received.reshape(-1))
        return _Plan(in_splits=counts.view(ep, self.local).sum(1).tolist(), out_splits=received.sum(1).tolist(),
                     by_expert=torch.argsort(expert_of, stable=True),
                     per_expert=torch.bincount(expert_of, minlength=self.local).tolist())

    def _experts(self, arrived, plan: _Plan, **tags):
        grouped = arrived[plan.by_expert]
        outs = []
        with region("compute:expert", layer=self.layer, tokens=int(grouped.shape[0]),
                    per_expert=splits_tag(plan.per_expert), **tags):
            for part, expert in zip(torch.split(grouped, plan.per_expert), self.experts.values()):
                outs.append(expert(part))
        done = torch.empty_like(grouped)
        return done.index_copy(0, plan.by_expert, torch.cat(outs) if outs else grouped)

    def _unpermute(self, back, order, weights, n: int):
        """Each copy back to its token, weighted by its router probability -> (n, h)."""
        copies = torch.empty_like(back).index_copy(0, order, back).view(n, self.topk, back.shape[-1])
        return (copies * weights.unsqueeze(-1)).sum(1)

    def forward(self, x):
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs = torch.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.topk, dim=-1)  # (T, k)
        if self.overlap is not None:
            return self._forward_overlapped(tokens, weights, chosen).view(s, b, h)
        permuted, order, counts = self._permute(tokens, chosen)
        plan = self._plan(counts)
        group = self.pstate.ep_group
        arrived = _AllToAll.apply(permuted, plan.out_splits, plan.in_splits, group, "dispatch", self.layer)
        done = self._experts(arrived, plan)
        back = _AllToAll.apply(done, plan.in_splits, plan.out_splits, group, "combine", self.layer)
        return self._unpermute(back, order, weights, s * b).view(s, b, h)

    def _forward_overlapped(self, tokens, weights, chosen):
        # Router and top-k are per token: cutting the tokens in two after them changes no
        # token's experts or weights, so each half is a small serial layer of its own.
        cut = tokens.shape[0] // 2
        halves = [slice(0, cut), slice(cut, tokens.shape[0])]
        permuted, orders, plans = [], [], []
        for half, rows in enumerate(halves):
            copies, order, counts = self._permute(tokens[rows], chosen[rows])
            permuted.append(copies)
            orders.append(order)
            plans.append(self._plan(counts, half=half))
        params = tuple(self.experts.parameters())
        backs = _OverlappedExperts.apply(self, plans, *permuted, *params)
        return torch.cat([self._unpermute(back, order, weights[rows], rows.stop - rows.start)
                          for back, order, rows in zip(backs, orders, halves)])


class _OverlappedExperts(torch.autograd.Function):
    """dispatch -> experts -> combine of both halves, overlapped by ``run_overlapped``, and
    a backward overlapped the same way. Autograd alone would run the backward's exchanges
    one after another in its own order; here the backward is written out: each half's
    experts are a graph of their own (built in forward from a detached input), walked with
    ``autograd.grad`` while the other half's exchange is in flight. The expert parameters
    are inputs, so their grads reach ``.grad`` through the engine as any other grads (with
    its hooks and ``inputs=``)."""

    @staticmethod
    def forward(ctx, moe, plans, x0, x1, *params):
        group, layer = moe.overlap, moe.layer
        ctx.moe, ctx.plans, ctx.params = moe, plans, params
        ctx.leaves, ctx.outs = [None, None], [None, None]

        def experts(half, arrived):
            with torch.enable_grad():
                leaf = arrived.detach().requires_grad_()
                done = moe._experts(leaf, plans[half], half=half)
            ctx.leaves[half], ctx.outs[half] = leaf, done
            return done.detach()

        return run_overlapped(
            lambda h, x: _post(x, plans[h].out_splits, plans[h].in_splits, group, "dispatch", layer, half=h),
            lambda h, x: _post(x, plans[h].in_splits, plans[h].out_splits, group, "combine", layer, half=h),
            experts, (x0, x1))

    @staticmethod
    def backward(ctx, grad0, grad1):
        moe, plans, params = ctx.moe, ctx.plans, ctx.params
        group, layer = moe.overlap, moe.layer
        param_grads = [torch.zeros_like(p) for p in params]

        def experts(half, grad):
            with region("compute:expert", layer=layer, tokens=int(grad.shape[0]),
                        per_expert=splits_tag(plans[half].per_expert), half=half, dir="bwd"):
                # kept: ZB-H1's weight pass walks this backward again after its input pass
                grads = torch.autograd.grad(ctx.outs[half], (ctx.leaves[half], *params), grad,
                                            retain_graph=True, allow_unused=True)
            for acc, g in zip(param_grads, grads[1:]):
                if g is not None:
                    acc += g
            return grads[0] if grads[0] is not None else torch.zeros_like(ctx.leaves[half])

        # the combine's grads go out to the experts, the dispatch's come back to the tokens
        back0, back1 = run_overlapped(
            lambda h, g: _post(g, plans[h].out_splits, plans[h].in_splits, group, "combine", layer, "bwd", half=h),
            lambda h, g: _post(g, plans[h].in_splits, plans[h].out_splits, group, "dispatch", layer, "bwd", half=h),
            experts, (grad0.contiguous(), grad1.contiguous()))
        return None, None, back0, back1, *param_grads


def enable_overlap(chunks, group) -> None:
    """--ep-overlap on a built model: every MoE layer of ``chunks`` overlaps its exchanges on
    ``group`` (``overlap_group``; None leaves the layers serial)."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.overlap = group


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
    combine; backward the combine's and the dispatch's grads around twice the sleep. With
    ``overlap_group`` (--ep-overlap) each layer runs as two halves through
    ``run_overlapped``, each half's experts sleeping for the tokens of that half."""

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
    overlap_group: object = None
    #: experts per ep rank: a pass's tokens spread evenly over them (the ``per_expert`` tag)
    local_experts: int = 1
    #: where the all-to-all calls' (start, end) go, time_ns (the train loop points it at the
    #: step's truth); within their ranges, so a pass less its calls bounds its compute. With
    #: the overlap: from the post to the completion, as gloo's worker saw it
    calls: list | None = None
    #: where the experts' sleeps' (start, end) go, time_ns, within their compute:expert ranges
    computes: list | None = None
    #: with the overlap: where this thread's spans posting and waiting for the calls go
    blocked: list | None = None

    def __post_init__(self):
        self.in_splits = token_splits(self.tokens * self.topk, self.ep, self.imbalance)
        # every source sends the same split, so this rank receives ep times its own share
        self.out_splits = [self.in_splits[self.ep_rank]] * self.ep

    @property
    def received(self) -> int:
        """Tokens this rank's experts process per layer per microbatch."""
        return sum(self.out_splits)

    def expert_s(self, phase: str, tokens: int | None = None) -> float:
        """Seconds this rank's experts sleep per MoE layer of a pass of ``phase`` (for
        ``tokens`` of them, default all it received)."""
        tokens = self.received if tokens is None else tokens
        return tokens * self.us_per_token / 1e6 * (BWD_PER_FWD if phase != "fwd" else 1.0)

    def _sleep_experts(self, sleep, seconds: float, tokens: int, **tags) -> None:
        share = [tokens // self.local_experts + (i < tokens % self.local_experts) for i in range(self.local_experts)]
        with region("compute:expert", tokens=tokens, per_expert=splits_tag(share), **tags):
            start = time.time_ns()
            sleep(seconds)
            if self.computes is not None:
                self.computes.append((start, time.time_ns()))

    def run(self, mb: int, chunk: int, phase: str, sleep) -> None:
        # backward moves the same rows the same way: the combine's grads out to the experts,
        # the dispatch's back to their tokens
        send, recv = self.in_splits, self.out_splits
        direction = None if phase == "fwd" else "bwd"
        first, second = ("dispatch", "combine") if phase == "fwd" else ("combine", "dispatch")
        for layer in self.layers_of_chunk[chunk]:
            if self.overlap_group is not None:
                self._run_overlapped(mb, layer, phase, sleep)
                continue
            x = torch.zeros((sum(send), self.hidden), device=self.device)
            y = _all_to_all(x, recv, send, self.group, first, layer, direction, self.calls, mb=mb)
            self._sleep_experts(sleep, self.expert_s(phase), int(y.shape[0]), layer=layer, mb=mb, dir=direction)
            _all_to_all(y, send, recv, self.group, second, layer, direction, self.calls, mb=mb)

    def _run_overlapped(self, mb: int, layer: int, phase: str, sleep) -> None:
        sends, recvs = halve(self.in_splits), halve(self.out_splits)
        direction = None if phase == "fwd" else "bwd"
        first, second = ("dispatch", "combine") if phase == "fwd" else ("combine", "dispatch")
        group, log, blocked = self.overlap_group, self.calls, self.blocked

        def experts(half, arrived):
            self._sleep_experts(sleep, self.expert_s(phase, int(arrived.shape[0])), int(arrived.shape[0]),
                                layer=layer, mb=mb, half=half, dir=direction)
            return arrived

        run_overlapped(
            lambda h, x: _post(x, recvs[h], sends[h], group, first, layer, direction, log, blocked, mb=mb, half=h),
            lambda h, y: _post(y, sends[h], recvs[h], group, second, layer, direction, log, blocked, mb=mb, half=h),
            experts, [torch.zeros((sum(sends[h]), self.hidden), device=self.device) for h in (0, 1)])
