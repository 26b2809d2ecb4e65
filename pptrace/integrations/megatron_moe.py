"""Megatron-Core's MoE layer with its alltoall token dispatcher as contract-1 ranges.

Installed by :mod:`pptrace.integrations.megatron` beside its schedule hooks. Patched (checked
against megatron-core 0.16.1):

- ``MoELayer.preprocess`` / ``dispatch`` / ``routed_experts_compute`` / ``combine`` (its
  ``forward`` calls them, and so do the combined-1F1B callables, untested here): which layer
  (``layer_number``) and which step of it the dispatcher's communication below belongs to.
  ``routed_experts_compute`` (the local sort, the experts, the unsort) is
  ``compute:expert layer= mb= tokens= per_expert=``, the counts from the dispatcher's
  ``tokens_per_expert`` (on the host by then: it syncs its copy before its all-to-all when
  ep > 1; with ep = 1 on a GPU the copy may be in flight, and the range has no counts).
- ``token_dispatcher.all_to_all`` (``tensor_parallel.mappings.all_to_all`` as the dispatcher
  imported it) -> ``ep:dispatch`` / ``ep:combine layer= mb= bytes= tokens= send= recv=``: its
  ``input_split_sizes`` / ``output_split_sizes``, rows to / from each ep rank in group-rank
  order. Of ``token_dispatch``'s two all-to-alls the second moves the router probabilities of
  the same rows: ``ep:dispatch what=probs bytes=``, no rows, so a pair's tokens count each row
  once per exchange.
- ``token_dispatcher.gather_from_sequence_parallel_region`` inside ``preprocess`` (the count
  exchange, an all-gather over the tp x ep group) -> ``ep:dispatch what=counts bytes=``.
- ``mappings._AllToAll.backward`` -> the same ranges with ``dir=bwd`` (splits swapped, as the
  backward sends them) for the all-to-alls whose forward was tagged here (marked on their
  autograd node); from a layer call's combine backward to its dispatch backward,
  ``compute:expert dir=bwd``.

Refused, with one warning each and no MoE ranges: the other dispatchers (allgather, flex /
DeepEP), whose communication is not these calls, and expert tensor parallelism (expert tp > 1:
the counts and the experts' all-gather / reduce-scatter run over tp x ep, which pptrace's
layout has no group for). ``mb`` is the microbatch of the pass the call runs in (the schedule
hooks'), forward and backward alike. A Megatron without these hooks gives one warning and no MoE
tags (its pipeline stays instrumented); a failure inside a hook stops the MoE tagging with one
warning and never reaches the training.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from contextlib import ExitStack, nullcontext

import torch

from ..ranges import region
from ._requests import nbytes

#: (module, class or None for a module global, attribute, parameters the hook reads).
_HOOKS = (
    ("moe_layer", "MoELayer", "preprocess", ("self", "hidden_states", "probs", "routing_map")),
    ("moe_layer", "MoELayer", "dispatch", ("self", "hidden_states", "probs")),
    ("moe_layer", "MoELayer", "routed_experts_compute", ("self", "hidden_states", "probs")),
    ("moe_layer", "MoELayer", "combine", ("self", "output")),
    ("token_dispatcher", None, "all_to_all", ("group", "input_", "output_split_sizes_", "input_split_sizes")),
    ("token_dispatcher", None, "gather_from_sequence_parallel_region", ("input_", "group")),
    ("mappings", "_AllToAll", "backward", ("ctx",)),
)
#: what ``_AllToAll.backward`` reads from its ctx is what its forward stores under these names
_ALLTOALL_FORWARD = ("ctx", "group", "input", "output_split_sizes", "input_split_sizes")
#: MoELayer method -> the step of a layer call it is
_PHASES = {"preprocess": "counts", "dispatch": "dispatch", "routed_experts_compute": "experts",
           "combine": "combine"}


class Guard:
    """Runs the hooks' bookkeeping: the first exception stops it for good, with one warning."""

    def __init__(self, what: str):
        self.what, self.failed = what, False

    def __call__(self, fn, *args):
        if self.failed:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - never break the user's training
            self.failed = True
            warnings.warn(f"pptrace: the {self.what} stopped tagging ({type(exc).__name__}: {exc}); "
                          "the rest of this run is a plain trace", stacklevel=4)
            return None


def modules():
    """Megatron-Core's MoE modules by the names ``_HOOKS`` uses, or None without them."""
    try:
        from megatron.core.tensor_parallel import mappings
        from megatron.core.transformer.moe import moe_layer, token_dispatcher
    except ImportError:
        return None
    return {"moe_layer": moe_layer, "token_dispatcher": token_dispatcher, "mappings": mappings}


def unrecognised(mods) -> str | None:
    """What these modules lack of what the hooks read, or None."""
    for module, owner, attr, params in _HOOKS:
        holder = getattr(mods[module], owner, None) if owner else mods[module]
        target = getattr(holder, attr, None)
        where = f"{module}.{owner + '.' if owner else ''}{attr}"
        if target is None:
            return f"no {where}"
        if getattr(target, "__pptrace_original__", None) is not None:
            return f"{where} is already instrumented"
        problem = _lacks(target, params, where)
        if problem:
            return problem
    return (_lacks(getattr(mods["mappings"]._AllToAll, "forward", None), _ALLTOALL_FORWARD, "mappings._AllToAll.forward")
            or (None if hasattr(mods["token_dispatcher"], "MoEAlltoAllTokenDispatcher")
                else "no token_dispatcher.MoEAlltoAllTokenDispatcher"))


def _lacks(target, params, where) -> str | None:
    try:
        names = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return f"{where} has no signature"
    missing = [p for p in params if p not in names]
    return f"{where} takes no {', '.join(missing)}" if missing else None


def _ints(splits):
    """Split sizes (a list, numpy array or host tensor) as a tag value, or None."""
    if splits is None:
        return None
    return ",".join(str(int(n)) for n in (splits.tolist() if hasattr(splits, "tolist") else splits))


class _Call:
    """One forward call of one MoE layer: what its backward's ranges need."""

    __slots__ = ("layer", "mb", "tokens", "per_expert")

    def __init__(self, layer, mb):
        self.layer, self.mb = layer, mb
        self.tokens = self.per_expert = None


class _Phase:
    __slots__ = ("op", "call", "count")

    def __init__(self, op: str, call: _Call):
        self.op, self.call, self.count = op, call, 0


class MoeInstrumentation:
    """The installed MoE patches; ``remove()`` puts the originals back."""

    def __init__(self, mods, current_mb):
        self._current_mb = current_mb  # () -> the microbatch of the running pass, or None
        self._alltoall = mods["token_dispatcher"].MoEAlltoAllTokenDispatcher
        self._guard = Guard("Megatron-Core MoE integration")
        self._refused: set = set()
        self._phase = None
        self._calls: dict = {}  # id(MoELayer) -> its running forward call
        self._open: set = set()  # the backward expert range not closed yet (ExitStack)
        self.seen = False  # an alltoall MoE layer ran here
        self._patches = []
        for module, owner, attr, _ in _HOOKS:
            holder = getattr(mods[module], owner) if owner else mods[module]
            raw = holder.__dict__[attr] if owner else getattr(holder, attr)
            original = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapper = self._wrapper(owner, attr, original)
            wrapper.__pptrace_original__ = original
            self._patches.append((holder, attr, raw))
            setattr(holder, attr, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)

    def remove(self) -> None:
        for holder, attr, raw in reversed(self._patches):
            setattr(holder, attr, raw)
        self._patches = []
        self._close_backward_experts()

    def _wrapper(self, owner, attr, original):
        if owner == "MoELayer":
            phase = _PHASES[attr]

            def hook(layer, *args, **kwargs):
                return self._in_phase(phase, original, layer, args, kwargs)
        elif attr == "backward":
            def hook(ctx, *grads):
                return self._backward(original, ctx, grads)
        else:
            signature = inspect.signature(original)
            method = self._all_to_all if attr == "all_to_all" else self._gather

            def hook(*args, **kwargs):
                return method(original, signature, args, kwargs)
        return functools.update_wrapper(hook, original)

    # -- a layer call's steps ---------------------------------------------------------------
    def _in_phase(self, phase, original, layer, args, kwargs):
        previous = self._phase
        entered = self._guard(self._enter, phase, layer)
        try:
            with entered or nullcontext():
                return original(layer, *args, **kwargs)
        finally:
            self._phase = previous

    def _enter(self, phase: str, layer):
        """Set the step the calls below belong to; the ``compute:expert`` range of the experts'
        step (or None)."""
        self._phase = None
        dispatcher = layer.token_dispatcher
        if not self._tagged(dispatcher):
            return None
        self.seen = True
        key = id(layer)
        call = self._calls.get(key)
        if phase == "counts" or call is None:  # a layer call starts with its preprocess
            call = self._calls[key] = _Call(layer.layer_number, self._current_mb())
        self._phase = _Phase(phase, call)
        if phase != "experts":
            return None
        counts = getattr(dispatcher, "tokens_per_expert", None)
        # host values only once Megatron has synchronised its copy of them: before its
        # all-to-all (ep > 1), or at once in a process without CUDA; never a device sync here
        settled = dispatcher.ep_size > 1 or not torch.cuda.is_available()
        if counts is not None and settled and not getattr(counts, "is_cuda", True):
            call.per_expert = [int(n) for n in counts.tolist()]
            call.tokens = sum(call.per_expert)
        return region("compute:expert", layer=call.layer, mb=call.mb, tokens=call.tokens,
                      per_expert=_ints(call.per_expert))

    def _tagged(self, dispatcher) -> bool:
        if not isinstance(dispatcher, self._alltoall):
            why = f"its {type(dispatcher).__name__} is not the alltoall token dispatcher"
        elif dispatcher.tp_size > 1:
            why = f"expert tensor parallelism ({dispatcher.tp_size}) splits tokens over tp x ep"
        else:
            return True
        if why not in self._refused:
            self._refused.add(why)
            warnings.warn(f"pptrace: Megatron-Core's MoE layer is not tagged ({why}); its "
                          "communication is analyzed as untagged work", stacklevel=5)
        return False

    # -- the communication ------------------------------------------------------------------
    def _all_to_all(self, original, signature, args, kwargs):
        opened = self._guard(self._open_all_to_all, signature, args, kwargs)
        with opened[0] if opened else nullcontext():
            out = original(*args, **kwargs)
        if opened:
            self._guard(self._mark, out, opened[1])
        return out

    def _open_all_to_all(self, signature, args, kwargs):
        phase = self._phase
        if phase is None or phase.op not in ("dispatch", "combine"):
            return None
        bound = signature.bind(*args, **kwargs).arguments
        group, x = bound["group"], bound["input_"]
        if group is None or group.size() == 1:  # Megatron returns the input: nothing moves
            return None
        self._close_backward_experts()
        what = "probs" if phase.op == "dispatch" and phase.count else None
        phase.count += 1
        call = phase.call
        rows = {} if what else dict(tokens=int(x.shape[0]), send=_ints(bound.get("input_split_sizes")),
                                    recv=_ints(bound.get("output_split_sizes_")))
        return (region(f"ep:{phase.op}", layer=call.layer, mb=call.mb, what=what, bytes=nbytes(x), **rows),
                (phase.op, what, call))

    @staticmethod
    def _mark(out, info) -> None:
        node = getattr(out, "grad_fn", None)
        if node is not None:  # the ctx _AllToAll.backward is handed
            node._pptrace_a2a = info

    def _gather(self, original, signature, args, kwargs):
        opened = self._guard(self._open_counts, signature, args, kwargs)
        with opened or nullcontext():
            return original(*args, **kwargs)

    def _open_counts(self, signature, args, kwargs):
        phase = self._phase
        if phase is None or phase.op != "counts":
            return None
        bound = signature.bind(*args, **kwargs).arguments
        group = bound.get("group")
        if group is None or group.size() == 1:
            return None
        self._close_backward_experts()
        call = phase.call
        return region("ep:dispatch", layer=call.layer, mb=call.mb, what="counts", bytes=nbytes(bound["input_"]))

    def _backward(self, original, ctx, grads):
        info = getattr(ctx, "_pptrace_a2a", None)
        if info is None:  # not one of the dispatcher's (or tagging stopped)
            return original(ctx, *grads)
        opened = self._guard(self._open_backward, ctx, info, grads)
        with opened or nullcontext():
            result = original(ctx, *grads)
        if opened and info[0] == "combine":
            self._guard(self._open_backward_experts, info[2])
        return result

    def _open_backward(self, ctx, info, grads):
        op, what, call = info
        self._close_backward_experts()
        grad = grads[0] if grads else None
        # the backward sends what the forward received, and receives what it sent
        rows = {} if what else dict(tokens=int(grad.shape[0]), send=_ints(ctx.output_split_sizes),
                                    recv=_ints(ctx.input_split_sizes))
        return region(f"ep:{op}", layer=call.layer, mb=call.mb, what=what, bytes=nbytes(grad), dir="bwd", **rows)

    def _open_backward_experts(self, call: _Call) -> None:
        """Between a combine's backward and its dispatch's run the experts' backward."""
        r = region("compute:expert", layer=call.layer, mb=call.mb, tokens=call.tokens,
                   per_expert=_ints(call.per_expert), dir="bwd")
        stack = ExitStack()
        stack.enter_context(r)
        self._open.add(stack)

    def _close_backward_experts(self) -> None:
        """Close the open backward expert range: the next exchange of any layer call ends it."""
        for stack in list(self._open):
            stack.close()
        self._open.clear()
