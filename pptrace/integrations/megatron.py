"""Megatron-Core's pipeline schedules as contract-1 ranges, with nothing but ``pptrace.profile``.

Megatron-Core writes no range of its own into a torch.profiler trace (its names go to NVTX
only, see :mod:`pptrace.ingest.megatron_names`). This integration patches the functions its
schedules call through module globals (checked against megatron-core 0.16.1):

- ``schedules.forward_step`` -> ``compute:fwd mb=<current_microbatch> chunk=<vp_stage>``
- ``schedules.backward_step`` -> ``compute:bwd mb= chunk=``; backward_step is told neither, so
  they come from the forward whose output tensor it is handed (by ``id``)
- ``p2p_communication._batched_p2p_ops`` (``batch_p2p_comm``, 1F1B's default) and ``_p2p_ops``
  (``overlap_p2p_comm``, interleaved's default) -> one ``pp:send_fwd|recv_fwd|send_bwd|recv_bwd
  peer=<global rank> mb= chunk= bytes=`` range per tensor, from the post until the request's
  ``wait()`` returns (the schedule waits on the handles itself under overlap_p2p_comm; a
  handle it never waits on closes at the first hook that finds it completed)
- ``schedules.get_schedule_table`` (start of the interleaved schedule) and
  ``schedules.get_tensor_shapes`` (start of 1F1B) mark the start of a schedule call.

Tags follow pptrace's p2p convention (``instrumented_model/pp_communications.py``): ``mb`` is
the microbatch the tensor belongs to and ``chunk`` the model chunk that consumes it on the
receiving rank, both sides alike, so a send pairs with its recv. A send's tensor is the output
of a forward (or the input grad of a backward) seen by the hooks, so its tags are exact. A
recv's buffer is fresh, so its tags come from the schedule's order: Megatron posts the recvs of
one direction in the order it consumes them, which is its schedule table (``(mb, chunk)`` of
the k-th forward; the k-th backward runs chunk ``vpp-1-c``), less the passes that receive
nothing (the first virtual stage's forwards, the last one's backwards). Chunks are ``vp_stage``,
global stage ``vp_stage * pp + pp_rank``; with no interleaving ``chunk`` is left out.

The rank layout (order found by matching ``parallel_state``'s groups), schedule, microbatches,
vpp, stage -> rank map and this rank's action order go to the ``pptrace`` metadata block.
A Megatron whose hooks are missing or have other parameters gives one warning and ``None``;
a failure inside a hook stops the tagging with one warning and never reaches the training.

MoE layers with the alltoall token dispatcher: :mod:`pptrace.integrations.megatron_moe`,
installed with these hooks (``ep:dispatch`` / ``ep:combine`` with their split sizes,
``compute:expert`` with the tokens per local expert; ``ep`` in the layout).
Not covered: ``use_ring_exchange_p2p`` and the combined-1F1B (EP overlap) schedule, whose
passes do not go through these functions (its MoE layers call the hooked MoELayer steps, but
that is untested); the allgather and flex (DeepEP) token dispatchers and expert tensor
parallelism (one warning, no MoE ranges).
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from contextlib import nullcontext

from ..ranges import region
from . import megatron_moe
from ._requests import Open, Pending, nbytes
from ..vocab import LAYOUT_DIMS, LAYOUT_ORDERS, RECV_BWD, RECV_FWD, SEND_BWD, SEND_FWD

NAME = "megatron-core"
#: (module, function, parameters the hook reads). A Megatron without them is not recognised.
_HOOKS = (
    ("schedules", "forward_step", ("num_microbatches", "current_microbatch", "vp_stage")),
    ("schedules", "backward_step", ("output_tensor",)),
    ("schedules", "get_schedule_table", ("num_microbatches", "num_model_chunks")),
    ("schedules", "get_tensor_shapes", ()),
    *(("p2p_communication", fn, ("tensor_send_prev", "tensor_recv_prev", "tensor_send_next",
                                 "tensor_recv_next", "group", "prev_pipeline_rank", "next_pipeline_rank"))
      for fn in ("_batched_p2p_ops", "_p2p_ops")),
)
#: p2p argument -> (contract op, which neighbour), in the order _batched_p2p_ops posts them.
_DIRECTIONS = (
    ("send_prev", SEND_BWD, "prev"),
    ("recv_prev", RECV_FWD, "prev"),
    ("send_next", SEND_FWD, "next"),
    ("recv_next", RECV_BWD, "next"),
)


def instrument(import_library: bool = False):
    """Patch Megatron-Core's schedules; returns the handle, or None when Megatron-Core is not
    installed. Unless ``import_library``, a process that has not imported ``megatron.core``
    is not running it and is left alone (importing it costs seconds and prints warnings)."""
    if "megatron.core" not in sys.modules and not import_library:
        return None
    try:
        from megatron.core.pipeline_parallel import p2p_communication, schedules
    except ImportError:
        return None
    modules = {"schedules": schedules, "p2p_communication": p2p_communication}
    problem = _unrecognised(modules)
    if problem:
        warnings.warn(f"pptrace: megatron-core {_version()} is not one the integration recognises "
                      f"({problem}); its runs are analyzed as plain traces", stacklevel=2)
        return None
    return MegatronInstrumentation(modules)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - a source checkout has no distribution metadata
        return getattr(sys.modules.get("megatron.core.package_info"), "__version__", "?")


def _unrecognised(modules) -> str | None:
    for module, fn, params in _HOOKS:
        target = getattr(modules[module], fn, None)
        if target is None:
            return f"no {module}.{fn}"
        if getattr(target, "__pptrace_original__", None) is not None:
            return f"{module}.{fn} is already instrumented"
        try:
            names = inspect.signature(target).parameters
        except (TypeError, ValueError):
            return f"{module}.{fn} has no signature"
        missing = [p for p in params if p not in names]
        if missing:
            return f"{module}.{fn} takes no {', '.join(missing)}"
    return None


def _first_tensor(value):
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    return value


class _Tracker:
    """Where this rank is in its schedule: the facts the hooks' names and the metadata need."""

    def __init__(self):
        self.schedule = None
        self.microbatches = None
        self.vpp = 1
        self.pp = self.pp_rank = None
        self.forward_order = None  # [(mb, chunk)] of the k-th forward; None: 1F1B (mb = k)
        self.recvs = {"recv_fwd": 0, "recv_bwd": 0}
        self._recv_orders = None  # op -> [(mb, chunk)] this rank receives, in order
        self.outputs: dict = {}  # id(forward output) -> (mb, chunk)
        self.grads: dict = {}  # id(input grad a backward returned) -> (mb, chunk)
        self.actions: list = []
        self.last_actions: list = []
        self.pending: set = set()
        self.current_mb = None  # the microbatch of the running forward_step / backward_step

    # -- schedule calls ---------------------------------------------------------------------
    def start(self, schedule: str, microbatches=None, vpp: int = 1, table=None) -> None:
        for entry in list(self.pending):  # a previous call's leftovers end here at the latest
            entry.close()
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():  # p2p calls refine it from their group
            self.pp, self.pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        if self.actions:
            self.last_actions = self.actions
        self.schedule, self.vpp, self.forward_order = schedule, vpp, table
        if microbatches is not None:
            self.microbatches = microbatches
        self.recvs = {"recv_fwd": 0, "recv_bwd": 0}
        self._recv_orders = None
        self.outputs.clear()
        self.grads.clear()
        self.actions = []

    def poll(self) -> None:
        """Close the ranges of requests that completed without anyone waiting on them."""
        for entry in [e for e in self.pending if e.completed()]:
            entry.close()

    def complete_actions(self) -> list:
        """The action order of the last whole schedule call (the running one once it is done)."""
        total = (self.microbatches or 0) * self.vpp
        ops = [a[0] for a in self.actions]
        if total and ops.count("F") == total and ops.count("B") == total:
            return self.actions
        return self.last_actions or self.actions

    def stage(self, chunk) -> int | None:
        if self.pp is None:
            return None
        return (chunk or 0) * self.pp + self.pp_rank

    def chunk_tag(self, chunk):
        return chunk if self.schedule == "interleaved" else None

    # -- messages -----------------------------------------------------------------------------
    def send_tags(self, op: str, tensor):
        """(mb, consumer chunk) of a tensor this rank produced, or (None, None)."""
        known = (self.outputs if op == "send_fwd" else self.grads).get(id(tensor))
        if known is None:
            return None, None
        mb, chunk = known
        chunk = chunk or 0
        if op == "send_fwd":  # the next virtual stage: same chunk, or the next one on rank 0
            chunk += 1 if self.pp_rank == self.pp - 1 else 0
        else:
            chunk -= 1 if self.pp_rank == 0 else 0
        return mb, chunk

    def recv_tags(self, op: str):
        """(mb, consumer chunk) of the k-th recv of this direction in this schedule call."""
        k = self.recvs[op]
        self.recvs[op] = k + 1
        if self.forward_order is None:  # 1F1B: the k-th recv carries microbatch k
            return k, 0
        if self._recv_orders is None:  # once per schedule call: recvs are per microbatch
            v, first, last = self.vpp, self.pp_rank == 0, self.pp_rank == self.pp - 1
            backward = [(mb, v - 1 - c) for mb, c in self.forward_order]
            self._recv_orders = {
                "recv_fwd": [(mb, c) for mb, c in self.forward_order if not (first and c == 0)],
                "recv_bwd": [(mb, c) for mb, c in backward if not (last and c == v - 1)],
            }
        order = self._recv_orders[op]
        return order[k] if k < len(order) else (None, None)


class MegatronInstrumentation:
    """The installed patches (``remove()`` puts the originals back) and what they learnt."""

    name = "megatron"

    def __init__(self, modules):
        self._modules = modules
        self._tracker = _Tracker()
        self._guard = megatron_moe.Guard("Megatron-Core integration")
        self._patches = []
        wrappers = {
            "forward_step": self._forward_step, "backward_step": self._backward_step,
            "get_schedule_table": self._schedule_table, "get_tensor_shapes": self._tensor_shapes,
            "_batched_p2p_ops": self._p2p, "_p2p_ops": self._p2p,
        }
        for module, fn, _ in _HOOKS:
            target = modules[module]
            original = getattr(target, fn)
            wrapper = functools.partial(wrappers[fn], original, inspect.signature(original))
            wrapper = functools.update_wrapper(wrapper, original)
            wrapper.__pptrace_original__ = original
            self._patches.append((target, fn, original))
            setattr(target, fn, wrapper)
        self._moe = _moe(lambda: self._tracker.current_mb)

    def remove(self) -> None:
        if self._moe is not None:
            self._moe.remove()
            self._moe = None
        for target, fn, original in reversed(self._patches):
            setattr(target, fn, original)
        self._patches = []
        for entry in list(self._tracker.pending):
            entry.close()

    # -- the hooks: bookkeeping never reaches the training ------------------------------------
    def _safe(self, fn, *args):
        return self._guard(fn, *args)

    def _around(self, before, after, original, signature, args, kwargs):
        """``original(*args, **kwargs)`` inside the range ``before`` opens; ``after`` notes
        what it returned. Neither can fail the call (see _safe)."""
        opened = self._safe(before, signature, args, kwargs)
        with opened[0] if opened else nullcontext():
            result = original(*args, **kwargs)
        if opened:
            self._safe(after, opened, result)
        return result

    def _forward_step(self, original, signature, *args, **kwargs):
        return self._around(self._before_forward, self._after_forward, original, signature, args, kwargs)

    def _before_forward(self, signature, args, kwargs):
        t = self._tracker
        t.poll()
        bound = signature.bind_partial(*args, **kwargs).arguments
        mb, chunk = bound.get("current_microbatch"), bound.get("vp_stage")
        if t.schedule == "1f1b" and bound.get("num_microbatches") is not None:
            t.microbatches = bound["num_microbatches"]
        t.current_mb = mb
        return region("compute:fwd", mb=mb, chunk=t.chunk_tag(chunk)), mb, chunk

    def _after_forward(self, opened, output):
        t = self._tracker
        _, mb, chunk = opened
        tensor = _first_tensor(output[0] if isinstance(output, tuple) else output)
        if tensor is not None:
            t.outputs[id(tensor)] = (mb, chunk)
        t.actions.append(["F", t.stage(chunk), mb])

    def _backward_step(self, original, signature, *args, **kwargs):
        return self._around(self._before_backward, self._after_backward, original, signature, args, kwargs)

    def _before_backward(self, signature, args, kwargs):
        t = self._tracker
        t.poll()
        output = signature.bind_partial(*args, **kwargs).arguments.get("output_tensor")
        mb, chunk = t.outputs.pop(id(_first_tensor(output)), (None, None))
        t.current_mb = mb
        return region("compute:bwd", mb=mb, chunk=t.chunk_tag(chunk)), mb, chunk

    def _after_backward(self, opened, grads):
        t = self._tracker
        _, mb, chunk = opened
        for grad in grads if isinstance(grads, (list, tuple)) else [grads]:
            if grad is not None:
                t.grads[id(grad)] = (mb, chunk)
        t.actions.append(["B", t.stage(chunk), mb])

    def _schedule_table(self, original, signature, *args, **kwargs):
        table = original(*args, **kwargs)
        self._safe(self._start_interleaved, signature, args, kwargs, table)
        return table

    def _start_interleaved(self, signature, args, kwargs, table):
        bound = signature.bind_partial(*args, **kwargs).arguments
        self._tracker.start("interleaved", bound.get("num_microbatches"), bound.get("num_model_chunks") or 1,
                            [tuple(entry) for entry in table])

    def _tensor_shapes(self, original, signature, *args, **kwargs):
        self._safe(self._tracker.start, "1f1b")
        return original(*args, **kwargs)

    def _p2p(self, original, signature, *args, **kwargs):
        opened = self._safe(self._open_p2p, signature, args, kwargs)
        try:
            requests = original(*args, **kwargs)
        except BaseException:
            for _, r in reversed(opened or []):
                r.__exit__(None, None, None)
            raise
        if not opened:
            return requests
        wrapped = self._safe(self._wrap_requests, opened, requests)
        return requests if wrapped is None else wrapped

    def _open_p2p(self, signature, args, kwargs):
        t = self._tracker
        t.poll()
        bound = signature.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        if group is not None:
            t.pp, t.pp_rank = group.size(), group.rank()
        opened = []
        for key, op, side in _DIRECTIONS:
            tensor = bound.get(f"tensor_{key}")
            if tensor is None:
                continue
            mb, chunk = t.send_tags(op, tensor) if op.startswith("send") else t.recv_tags(op)
            r = region(f"pp:{op}", peer=bound.get(f"{side}_pipeline_rank"), mb=mb, chunk=t.chunk_tag(chunk),
                       bytes=nbytes(tensor))
            r.__enter__()
            opened.append((key, r))
        return opened

    def _wrap_requests(self, opened, requests):
        t = self._tracker
        if isinstance(requests, dict):  # _p2p_ops: one request per direction, by name
            by_key = dict(opened)
            out = {}
            for key, work in requests.items():
                entry = Open([by_key.pop(key)] if key in by_key else [], [work], t.pending)
                out[key] = Pending(work, entry)
            for r in by_key.values():  # a direction with no request: nothing to wait for
                r.__exit__(None, None, None)
            return out
        opened = [r for _, r in opened]
        requests = list(requests or [])
        if not requests:
            for r in reversed(opened):
                r.__exit__(None, None, None)
            return requests
        if len(requests) == len(opened):  # gloo: one request per op, in posting order
            entries = [Open([r], [w], t.pending) for r, w in zip(opened, requests)]
        else:  # NCCL coalesces a batch into one request: every range ends with the batch
            entries = [Open(opened, requests, t.pending)] * len(requests)
        return [Pending(w, e) for w, e in zip(requests, entries)]

    # -- what the run is ------------------------------------------------------------------------
    def metadata(self) -> dict:
        t = self._tracker
        moe_ran = self._moe is not None and self._moe.seen
        if t.schedule is None and not (t.actions or t.last_actions or moe_ran):
            return {}  # imported, but none of its schedules or MoE layers ran here: nothing to claim
        out = {"integration": {"name": NAME, "version": _version()}}
        layout, pp_ranks = _layout()
        if layout is not None:
            out["layout"] = layout.to_dict()
        if t.schedule is not None:
            out.update(schedule=t.schedule, microbatches=t.microbatches, vpp=t.vpp)
        if t.schedule is None:  # no pipeline schedule ran (pp=1): no stages, no action order
            return out
        if pp_ranks:
            out["stage_ranks"] = [pp_ranks[s % len(pp_ranks)] for s in range(len(pp_ranks) * t.vpp)]
        actions = t.complete_actions()
        if actions:
            out["pipeline_actions"] = actions
        return out


def _moe(current_mb):
    """The MoE hooks (megatron_moe), or None with one warning where this Megatron lacks them."""
    mods = megatron_moe.modules()
    problem = "no megatron.core.transformer.moe" if mods is None else megatron_moe.unrecognised(mods)
    if problem:
        warnings.warn(f"pptrace: megatron-core {_version()}'s MoE layer is not one the integration recognises "
                      f"({problem}); its expert parallelism is analyzed as untagged work", stacklevel=4)
        return None
    return megatron_moe.MoeInstrumentation(mods, current_mb)


def _layout():
    """(Layout, this rank's pipeline group's global ranks) from ``parallel_state``, or (None, None).

    Megatron does not keep its rank order string, so the order is the first (Megatron's default
    ``tp-cp-dp-pp`` first) whose groups for this rank are the ones parallel_state built."""
    import torch.distributed as dist

    from ..topology import Layout

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None, None
    groups = {
        "tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group(),
    }
    ranks = {dim: dist.get_process_group_ranks(g) for dim, g in groups.items()}
    sizes = {dim: len(r) for dim, r in ranks.items()}
    rank = dist.get_rank()
    for order in LAYOUT_ORDERS:
        layout = Layout(**sizes, order=order)
        if layout.world_size != dist.get_world_size():
            break
        if all(layout.group_ranks(dim, rank) == ranks[dim] for dim in LAYOUT_DIMS):
            return _with_ep(layout, ps, rank), ranks["pp"]
    warnings.warn("pptrace: Megatron's parallel groups match no tp/cp/dp/pp rank order; "
                  "the layout is left to the trace", stacklevel=3)
    return None, ranks["pp"]


def _with_ep(layout, ps, rank: int):
    """``layout`` with parallel_state's expert-parallel size, where its ep group is the one
    pptrace's layout carves out of dp x cp (Megatron's default); else as it is, with a warning."""
    import dataclasses

    import torch.distributed as dist

    ep = ps.get_expert_model_parallel_world_size()
    if ep <= 1:
        return layout
    ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    try:
        with_ep = dataclasses.replace(layout, ep=ep)
    except ValueError:
        with_ep = None
    if with_ep is None or with_ep.group_ranks("ep", rank) != sorted(ranks):
        warnings.warn(f"pptrace: Megatron's expert-parallel group {sorted(ranks)} is not carved out of the "
                      "dp x cp ranks; the layout is written without ep", stacklevel=4)
        return layout
    return with_ep
