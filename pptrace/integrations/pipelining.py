"""PyTorch's ``torch.distributed.pipelining`` (torchtitan's pipeline) as contract-1 ranges.

torch writes at most ``PP:0F3`` / ``Forward 3`` ranges of its own (none at all for 1F1B), with
no peer, and p2p only as ``gloo:send`` / ``nccl:send``. This integration patches the places
its schedules go through (checked against torch 2.13):

- ``_PipelineStageBase.forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk`` -> ``compute:fwd|bwd|bwd_input|bwd_weight mb=<mb> chunk=<c>``;
  ``backward_one_chunk(full_backward=False)`` (the I of zero-bubble schedules) is
  ``bwd_input``, a full one ``bwd``. On stage 0 torch skips I (its input needs no grad) and
  its W runs the whole backward: the ranges show what ran where.
- ``_PipelineSchedule._maybe_compute_loss`` on the last stage -> ``compute:loss mb=<mb>
  chunk=<c>``: the loss forward runs there, between the stage's forward and its backward
  (torchtitan's loss wrapper runs the output head and cross entropy in it); the analyses
  count it as part of that microbatch's forward, as Megatron's forward_step computes it.
- ``get_fwd_recv_ops`` / ``get_fwd_send_ops`` / ``get_bwd_recv_ops`` / ``get_bwd_send_ops``
  tag the P2POps they return; ``schedules._batch_p2p`` (every schedule posts through it,
  ``_sorted_batch_p2p`` included) opens one ``pp:send_fwd|recv_fwd|send_bwd|recv_bwd
  peer=<global rank> mb= chunk= bytes=`` range per tagged op at the post, and the returned
  requests close it when their ``wait()`` returns (a request still open when a later hook
  finds it completed closes then: the runtime schedules wait on their sends only at the end
  of the step).
- ``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step`` note the schedule object,
  from which ``metadata()`` reads the layout, schedule class, microbatches, stages per rank,
  stage -> rank map and this rank's action order: for the runtime schedules (Interleaved1F1B,
  LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, the CSV one) the order they run,
  ``pipeline_order_with_comms``, with its send posts (SEND_F / SEND_B -> "SF" / "SB"); GPipe
  and 1F1B post each send right after its pass, so their order lists the passes only.

Tags follow pptrace's p2p convention (``instrumented_model/pp_communications.py``): ``mb`` is
the microbatch, ``chunk`` the local index (among its rank's stages, by stage index) of the
stage that *consumes* the tensor on the receiving rank, on both sides, so a send pairs with
its recv. ``chunk`` is left out when every rank holds one stage. The local chunk of a global
stage is its position among that rank's stages: ``s // pp`` for looped schedules, 0 / 1 for
the two arms of a V.

A torch whose hooks are missing or changed gives one warning and ``None`` (plain-trace path);
a failure inside a hook stops the tagging with one warning and never reaches the training.
Ranges exit out of nesting order (a recv posted before a forward closes after it); torch.profiler
records them as they are, NVTX push/pop ranges would not nest, so use the trace, not Nsight.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from contextlib import nullcontext

from ..ranges import region
from ._requests import Open, Pending, nbytes
from ..vocab import BWD, BWD_INPUT, BWD_WEIGHT, FWD, LAYOUT_ORDERS, LOSS, RECV_BWD, RECV_FWD, SEND_BWD, SEND_FWD

NAME = "torch.distributed.pipelining"
_MODULE = "torch.distributed.pipelining"

#: stage method -> (contract op or None for p2p tagging, parameters the hook reads)
_STAGE_HOOKS = {
    "forward_one_chunk": ("fwd_chunk_id",),
    "backward_one_chunk": ("bwd_chunk_id", "full_backward"),
    "backward_weight_one_chunk": ("bwd_chunk_id",),
    "get_fwd_recv_ops": ("fwd_chunk_id",),
    "get_fwd_send_ops": ("fwd_chunk_id",),
    "get_bwd_recv_ops": ("bwd_chunk_id",),
    "get_bwd_send_ops": ("bwd_chunk_id",),
}
#: get_*_ops -> (contract op, which stage consumes the tensor: this one (0), next (+1), previous (-1))
_P2P = {
    "get_fwd_recv_ops": (RECV_FWD, 0),
    "get_fwd_send_ops": (SEND_FWD, 1),
    "get_bwd_recv_ops": (RECV_BWD, 0),
    "get_bwd_send_ops": (SEND_BWD, -1),
}
_SCHEDULE_CLASSES = ("PipelineScheduleSingle", "PipelineScheduleMulti")
#: _PipelineSchedule._maybe_compute_loss(stage, output, target_mbs, mb_index): timed when torch has it
_LOSS_PARAMS = {"stage", "mb_index"}
_TAG_ATTR = "_pptrace_tags"


def instrument(import_library: bool = False):
    """Patch torch.distributed.pipelining; returns the handle, or None when this process does
    not use it. Unless ``import_library``, a process that has not imported the package is not
    running a pipeline schedule and is left alone (importing it costs about a second)."""
    if _MODULE not in sys.modules and not import_library:
        return None
    try:
        import torch
        from torch.distributed.pipelining import schedules, stage
    except ImportError:
        return None
    owner = getattr(getattr(stage, "_PipelineStageBase", None), "forward_one_chunk", None)
    active = getattr(owner, "__pptrace_owner__", None)
    if active is not None:  # already on (instrument() by hand, then profile()): share it
        return _Shared(active)
    problem = _unrecognised(stage, schedules)
    if problem:
        warnings.warn(f"pptrace: torch {torch.__version__}'s pipelining is not one the integration recognises "
                      f"({problem}); its runs are analyzed as plain traces", stacklevel=2)
        return None
    return PipeliningInstrumentation(stage, schedules, torch.__version__)


def _params(fn) -> set | None:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _unrecognised(stage, schedules) -> str | None:
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:
        return "no stage._PipelineStageBase"
    for fn, params in _STAGE_HOOKS.items():
        target = base.__dict__.get(fn)
        if target is None:
            return f"no _PipelineStageBase.{fn}"
        names = _params(target)
        if names is None or not set(params) <= names:
            return f"_PipelineStageBase.{fn} takes no {', '.join(sorted(set(params) - (names or set())))}"
    batch = getattr(schedules, "_batch_p2p", None)
    if batch is None or "p2p_ops" not in (_params(batch) or ()):
        return "no schedules._batch_p2p(p2p_ops)"
    for cls in _SCHEDULE_CLASSES:
        if "step" not in getattr(schedules, cls, object).__dict__:
            return f"no schedules.{cls}.step"
    return None


def _local_chunk(stage, index: int) -> int | None:
    """The position of global stage ``index`` among its rank's stages; None when every rank
    holds one stage (no chunk tag then, as pptrace's trainer does)."""
    mapping = stage.stage_index_to_group_rank
    if stage.num_stages <= stage.group_size:
        return None
    where = mapping[index]
    return sorted(s for s, r in mapping.items() if r == where).index(index)


class PipeliningInstrumentation:
    """The patches, the schedule last stepped and the p2p ranges still open."""

    name = NAME

    def __init__(self, stage_module, schedules_module, torch_version: str):
        self._torch_version = torch_version
        self._schedule = None  # weakref to the schedule object last stepped
        self._pending: set = set()
        self._broken = False
        self._patches: list = []  # (owner, attribute, original)
        base = stage_module._PipelineStageBase
        for fn in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            self._patch(base, fn, self._compute_hook)
        for fn in _P2P:
            self._patch(base, fn, self._ops_hook)
        self._patch(schedules_module, "_batch_p2p", self._post_hook)
        loss_owner = getattr(schedules_module, "_PipelineSchedule", None)
        if _LOSS_PARAMS <= (_params(getattr(loss_owner, "_maybe_compute_loss", None)) or set()):
            self._patch(loss_owner, "_maybe_compute_loss", self._loss_hook)
        for cls in _SCHEDULE_CLASSES:
            self._patch(getattr(schedules_module, cls), "step", self._step_hook)

    # -- patching ---------------------------------------------------------------------------
    def _patch(self, owner, attr: str, hook) -> None:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

        @functools.wraps(original)
        def patched(*args, **kwargs):
            return hook(attr, original, *args, **kwargs)

        patched.__pptrace_original__ = original
        patched.__pptrace_owner__ = self
        setattr(owner, attr, patched)
        self._patches.append((owner, attr, original))

    def remove(self) -> None:
        for entry in list(self._pending):
            entry.close()
        for owner, attr, original in reversed(self._patches):
            setattr(owner, attr, original)
        self._patches = []

    def _fail(self, where: str, exc: BaseException) -> None:
        if not self._broken:
            self._broken = True
            warnings.warn(f"pptrace: the {NAME} integration stopped tagging ({where}: {exc!r}); "
                          "the rest of the run is analyzed as a plain trace", stacklevel=4)

    def _poll(self) -> None:
        """Close the ranges of requests that completed without being waited on yet."""
        for entry in [e for e in self._pending if e.completed()]:
            entry.close()

    # -- hooks ------------------------------------------------------------------------------
    @staticmethod
    def _chunk_id(fn, args, kwargs):
        """(stage, microbatch) of a stage method's call, however torch passed them."""
        return args[0], (args[1] if len(args) > 1 else kwargs[_STAGE_HOOKS[fn][0]])

    def _compute_hook(self, fn, original, *args, **kwargs):
        scope = nullcontext()
        if not self._broken:
            try:
                self._poll()
                stage, mb = self._chunk_id(fn, args, kwargs)
                if fn == "forward_one_chunk":
                    op = FWD
                elif fn == "backward_weight_one_chunk":
                    op = BWD_WEIGHT
                else:  # backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, ...)
                    full = kwargs.get("full_backward", args[3] if len(args) > 3 else True)
                    op = BWD if full else BWD_INPUT
                scope = region(f"compute:{op}", mb=mb, chunk=_local_chunk(stage, stage.stage_index))
            except Exception as exc:  # noqa: BLE001 - never break the user's training
                self._fail(fn, exc)
        with scope:
            return original(*args, **kwargs)

    def _loss_hook(self, fn, original, schedule, *args, **kwargs):
        """The last stage's loss: compute of that stage between its forward and backward of
        the microbatch (torchtitan runs its output head and cross entropy there)."""
        scope = nullcontext()
        if not self._broken:
            try:
                stage = args[0] if args else kwargs["stage"]
                mb = args[3] if len(args) > 3 else kwargs["mb_index"]
                if stage.is_last and getattr(schedule, "_loss_fn", None) is not None:
                    scope = region(f"compute:{LOSS}", mb=mb, chunk=_local_chunk(stage, stage.stage_index))
            except Exception as exc:  # noqa: BLE001 - never break the user's training
                self._fail(fn, exc)
        with scope:
            return original(schedule, *args, **kwargs)

    def _ops_hook(self, fn, original, *args, **kwargs):
        ops = original(*args, **kwargs)
        if not self._broken:
            try:
                stage, mb = self._chunk_id(fn, args, kwargs)
                self._tag(stage, fn, mb, ops)
            except Exception as exc:  # noqa: BLE001
                self._fail(fn, exc)
        return ops

    def _tag(self, stage, fn, mb, ops) -> None:
        op_name, step = _P2P[fn]
        mapping = stage.stage_index_to_group_rank
        for p2p in ops:
            consumer = stage.stage_index + step
            if step and mapping.get(consumer) != p2p.group_peer:
                # not the adjacent stage: the nearest stage on the peer in that direction
                on_peer = [s for s, r in mapping.items() if r == p2p.group_peer and (s - stage.stage_index) * step > 0]
                consumer = min(on_peer, key=lambda s: abs(s - stage.stage_index)) if on_peer else None
            tags = {"peer": p2p.peer, "mb": mb,
                    "chunk": None if consumer is None else _local_chunk(stage, consumer),
                    "bytes": nbytes(p2p.tensor)}
            setattr(p2p, _TAG_ATTR, (op_name, tags))

    def _post_hook(self, fn, original, *args, **kwargs):
        p2p_ops = args[0] if args else kwargs.get("p2p_ops")
        if self._broken or not p2p_ops:
            return original(*args, **kwargs)
        regions = []
        try:
            self._poll()
            for p2p in p2p_ops:
                tagged = getattr(p2p, _TAG_ATTR, None)
                r = None
                if tagged is not None:
                    r = region(f"pp:{tagged[0]}", **tagged[1])
                    r.__enter__()
                regions.append(r)
        except Exception as exc:  # noqa: BLE001
            self._fail(fn, exc)
            for r in regions:
                if r is not None:
                    r.__exit__(None, None, None)
            return original(*args, **kwargs)
        try:
            works = original(*args, **kwargs)
        except BaseException:
            for r in reversed(regions):
                if r is not None:
                    r.__exit__(None, None, None)
            raise
        try:
            return self._wrap(works, regions)
        except Exception as exc:  # noqa: BLE001
            self._fail(fn, exc)
            return works

    def _wrap(self, works, regions):
        opened = [r for r in regions if r is not None and r._open is not None]
        if not opened:  # nothing is recording: hand torch its own requests
            return works
        works = list(works)
        if len(works) == len(regions):  # one request per op, in posting order (gloo, or not coalesced)
            out = []
            for work, r in zip(works, regions):
                if r is None or r._open is None:
                    out.append(work)
                else:
                    out.append(Pending(work, Open([r], [work], self._pending)))
            return out
        # coalesced (NCCL batch_isend_irecv): every range ends with the batch
        entry = Open(opened, works, self._pending)
        return [Pending(w, entry) for w in works]

    def _step_hook(self, fn, original, schedule, *args, **kwargs):
        if not self._broken:
            self._schedule = weakref.ref(schedule)
        try:
            return original(schedule, *args, **kwargs)
        finally:
            if not self._broken:
                try:
                    self._poll()
                except Exception as exc:  # noqa: BLE001
                    self._fail(fn, exc)

    # -- metadata ---------------------------------------------------------------------------
    def metadata(self) -> dict:
        schedule = self._schedule() if self._schedule is not None else None
        if schedule is None:
            return {}
        import torch.distributed as dist

        stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
        first = stages[0]
        group = first.group or dist.distributed_c10d._get_default_group()
        pp_ranks = dist.get_process_group_ranks(group)
        pp, pp_rank = len(pp_ranks), dist.get_rank(group)
        mapping = first.stage_index_to_group_rank
        num_stages = first.num_stages
        return {
            "layout": _layout(pp_ranks),
            "schedule": type(schedule).__name__,
            "microbatches": int(schedule._n_microbatches),
            "vpp": num_stages // pp if num_stages % pp == 0 else len(stages),
            "pipeline_actions": _actions(schedule, pp_rank, stages),
            "stage_ranks": [int(pp_ranks[mapping[s]]) for s in range(num_stages)],
            "integration": {"name": NAME, "torch": self._torch_version},
        }


class _Shared:
    """A second ``instrument()`` while one is on: the same facts, and removing it is a no-op."""

    name = NAME

    def __init__(self, active: PipeliningInstrumentation):
        self._active = active

    def metadata(self) -> dict:
        return self._active.metadata()

    def remove(self) -> None:
        pass


# --------------------------------------------------------------------------------------
# What the schedule object knows
# --------------------------------------------------------------------------------------


#: torch _ComputationType value -> pipeline_actions op (SEND_F / SEND_B: the post of the
#: send, whose _Action.stage_index is the sending stage, as for the pass it follows)
_OPS = {"F": "F", "B": "B", "I": "I", "W": "W", "SEND_F": "SF", "SEND_B": "SB"}


def _rows(actions, sends: bool = False) -> list:
    """torch _Actions -> [op, stage, mb] of the compute ones, OVERLAP_F_B as its sub-actions;
    with ``sends``, the posts of the sends too ("SF" / "SB"), where the schedule placed them
    (the runtime schedules post a send where its SEND_* stands, not right after the pass).
    Recvs, UNSHARD / RESHARD / REDUCE_GRAD are left out."""
    rows = []
    for action in actions or ():
        if action is None:
            continue
        for a in action.sub_actions or (action,):
            op = _OPS.get(getattr(a.computation_type, "value", str(a.computation_type)))
            if op is None or a.microbatch_index is None or (op in ("SF", "SB") and not sends):
                continue
            rows.append([op, int(a.stage_index), int(a.microbatch_index)])
    return rows


def _single_order(schedule, stage_index: int, p: int, m: int) -> list | None:
    """What GPipe and 1F1B's ``_step_microbatches`` run (torch 2.13's ``pipeline_order`` for
    1F1B's last stage lists F1..F8, not what runs)."""
    name = type(schedule).__name__
    if name == "ScheduleGPipe":
        return [["F", stage_index, i] for i in range(m)] + [["B", stage_index, i] for i in range(m)]
    if name != "Schedule1F1B":
        return None
    warmup = min(m, p - stage_index)
    rows = [["F", stage_index, i] for i in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < m:
        rows.append(["B", stage_index, bwd])
        bwd += 1
        if fwd < m:
            rows.append(["F", stage_index, fwd])
            fwd += 1
    return rows


def _actions(schedule, pp_rank: int, stages) -> list | None:
    if len(stages) == 1 and not hasattr(schedule, "_stages"):
        stage = stages[0]
        rows = _single_order(schedule, stage.stage_index, stage.num_stages, int(schedule._n_microbatches))
        if rows is not None:
            return rows
        order = getattr(schedule, "pipeline_order", None) or {}
        return _rows(order.get(stage.stage_index)) or None
    # The runtime executes pipeline_order_with_comms, its send posts included.
    comms = getattr(schedule, "pipeline_order_with_comms", None)
    if comms:
        return _rows(comms.get(pp_rank), sends=True) or None
    return _rows((getattr(schedule, "pipeline_order", None) or {}).get(pp_rank)) or None


def _mesh_groups(rank: int) -> dict:
    """DeviceMesh dimension name -> global ranks of this rank's group along it (from the
    groups DeviceMesh creates, described ``mesh_<dim>``)."""
    import torch.distributed as dist

    out = {}
    try:
        for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items():
            desc = getattr(pg, "group_desc", "") or ""
            if desc.startswith("mesh_") and rank in ranks and desc != "mesh_default":
                out[desc[5:]] = sorted(ranks, key=ranks.get)
    except Exception:  # noqa: BLE001 - private registry; no mesh names then
        return {}
    return out


def _layout(pp_ranks: list) -> dict | None:
    """The run's Layout as a dict: pp from the stage group; tp / cp from DeviceMesh dims of
    those names, every other dim (dp, dp_shard, dp_replicate, ...) folded into dp; the order
    is the first whose groups are the real ones (Megatron's tp-cp-dp-pp first)."""
    import torch.distributed as dist

    from ..topology import Layout

    world, rank = dist.get_world_size(), dist.get_rank()
    pp = len(pp_ranks)
    if world % pp:
        return None
    mesh = {n: r for n, r in _mesh_groups(rank).items() if r != pp_ranks}
    found = {d: mesh[d] for d in ("tp", "cp") if d in mesh and len(mesh[d]) > 1}
    sizes = {"pp": pp, **{d: len(r) for d, r in found.items()}}
    rest = world // pp
    for d in found:
        rest //= sizes[d]
    sizes["dp"] = max(rest, 1)
    # the data-parallel dims (flattened ones naming tp/cp/pp, e.g. dp_shard_cp, are not)
    others = [r for n, r in mesh.items() if not {"tp", "cp", "pp"} & set(n.split("_"))]
    for order in LAYOUT_ORDERS:
        layout = Layout(**sizes, order=order)
        if layout.world_size != world:
            return None
        if layout.group_ranks("pp", rank) != list(pp_ranks):
            continue
        if any(layout.group_ranks(d, rank) != r for d, r in found.items()):
            continue
        dp_group = set(layout.group_ranks("dp", rank))
        if any(not set(r) <= dp_group for r in others):
            continue
        return layout.to_dict()
    warnings.warn("pptrace: the pipeline group's ranks match no tp/cp/dp/pp rank order; "
                  "the layout is left to the trace", stacklevel=3)
    return None
