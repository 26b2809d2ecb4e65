"""pptrace's vocabulary: the one place for the names the trainer, the ingest, the analyzers,
the what-if and the dashboards must agree on (dimensions, step parts, pipeline ops and
schedules, the step-end marker, collective names). Pure Python with no third-party
imports, so that the trainer and ``pptrace.naming`` can use it without pulling in the
analysis stack.
"""
from __future__ import annotations

import json
from itertools import permutations
from types import MappingProxyType

# -- dimensions -------------------------------------------------------------------------------
#: The dense layout's parallel dimensions (topology.Layout): each has a size and a coordinate.
LAYOUT_DIMS = ("tp", "cp", "pp", "dp")
#: Dimensions whose communication the step partition tells apart (``<dim>_exposed`` /
#: ``<dim>_hidden``); pp is not one: its p2p is split into transfer and bubble instead.
COMM_DIMS = ("tp", "cp", "dp", "ep")
#: The events table's category of a contract range of each communication dimension.
COMM_CATEGORIES = tuple(f"comm:{d}" for d in COMM_DIMS)
#: Kinds of contract-1 range names; other kinds parse but are foreign to the analyses.
RANGE_KINDS = ("compute", "tp", "cp", "pp", "dp", "ep")
#: The layout dimensions whose group a collective of each range kind spans. Megatron syncs
#: gradients over the data-parallel group *with* context parallelism, so dp spans dp x cp.
KIND_GROUP_DIMS = MappingProxyType({"tp": ("tp",), "cp": ("cp",), "dp": ("dp", "cp"), "ep": ("ep",), "pp": ("pp",)})

#: Tags that say how much a rank moved, not which call it is: an all-to-all's (alltoallv)
#: differ from rank to rank within one instance (``send`` / ``recv``: its rows to / from
#: each peer of its group, ``12,12,30,12`` in group-rank order).
SIZE_TAGS = ("bytes", "tokens", "send", "recv")

#: Megatron's default rank order (fastest-varying first).
DEFAULT_ORDER = "tp-cp-dp-pp"
#: Every rank order, Megatron's default first: where a run does not say its order, the first
#: one whose groups fit is taken.
LAYOUT_ORDERS = tuple(dict.fromkeys((DEFAULT_ORDER, *("-".join(p) for p in permutations(LAYOUT_DIMS)))))

# -- the step partition (DESIGN.md contract 3), in the JSON's order -----------------------------
PARTS = ("compute", *(f"{d}_exposed" for d in COMM_DIMS), "pp_transfer", "pp_bubble", "other")

# -- pipeline ops (the <op> of compute:<op> and pp:<op>) ---------------------------------------
FWD, BWD, BWD_INPUT, BWD_WEIGHT, LOSS, OPTIMIZER = "fwd", "bwd", "bwd_input", "bwd_weight", "loss", "optimizer"
FWD_OPS = (FWD,)
#: a whole backward, or the two halves ZB-H1 splits it into
BWD_OPS = (BWD, BWD_INPUT, BWD_WEIGHT)
PASS_OPS = FWD_OPS + BWD_OPS
#: pipeline work: what opens and closes a step's pipeline window
PIPELINE_COMPUTE = (*PASS_OPS, LOSS)
SEND_FWD, RECV_FWD, SEND_BWD, RECV_BWD = "send_fwd", "recv_fwd", "send_bwd", "recv_bwd"
PP_SENDS = (SEND_FWD, SEND_BWD)
#: p2p op -> the direction its tensor travels: fwd (activation) or bwd (gradient)
DIRECTION_OF = MappingProxyType({SEND_FWD: FWD, RECV_FWD: FWD, SEND_BWD: BWD, RECV_BWD: BWD})

#: pass op <-> the action letter of schedule tables and PyTorch's ``PP:<stage><action><mb>``
ACTION_OF = MappingProxyType({FWD: "F", BWD: "B", BWD_INPUT: "I", BWD_WEIGHT: "W"})
OP_OF_ACTION = MappingProxyType({a: op for op, a in ACTION_OF.items()})
#: Ops of an action order: the passes' letters, and the post of the send of a stage's
#: activation (SF) or input gradient (SB), where an order places them itself (torch's runtime
#: schedules post a send after a later pass: DualPipeV's overlapped F;B sends the forward's
#: output once the backward is done too).
ACTION_OPS = (*ACTION_OF.values(), "SF", "SB")

# -- schedules ---------------------------------------------------------------------------------
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1 = "gpipe", "1f1b", "interleaved", "zb-h1"
#: the schedules pptrace has tables and closed-form theory for (schedules/tables.py)
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1)
#: Other trainers' names for schedules whose order is one of pptrace's, so that their closed
#: forms hold (torch.distributed.pipelining's class names).
ALIASES = MappingProxyType({"ScheduleGPipe": GPIPE, "Schedule1F1B": ONE_F_ONE_B})
#: torch.distributed.pipelining schedules that place a rank's two stages in a V (stage s on
#: rank s, stage 2p-1-s on rank s too); every other multi-stage schedule loops (s on s % p).
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def canonical(schedule: str | None) -> str | None:
    """pptrace's name for a schedule whose order it knows, else the name as given."""
    return ALIASES.get(schedule, schedule) if schedule else schedule


def has_closed_form(schedule: str | None) -> bool:
    return canonical(schedule) in SCHEDULES


# -- the step-end marker -----------------------------------------------------------------------
#: The tag of the collective over all ranks that ends every step (gradient clipping's grad-norm
#: all-reduce, DESIGN.md contract 3): its wait is the pipeline draining, not that collective's
#: cost. Emit it with ``region("dp:all_reduce", **STEP_END_TAGS, bytes=...)``.
STEP_END_TAGS = MappingProxyType({"what": "grad_norm"})


def is_step_end(tags) -> bool:
    """Whether a range's tags carry STEP_END_TAGS: a dict (``parse_name(name).tags``) or the
    events table's JSON text of one."""
    if isinstance(tags, str):
        # most ranges carry no tags or other ones: skip the parse unless the values are there
        if not all(value in tags for value in STEP_END_TAGS.values()):
            return False
        tags = json.loads(tags)
    return isinstance(tags, dict) and all(tags.get(k) == v for k, v in STEP_END_TAGS.items())


# -- collective names --------------------------------------------------------------------------
def collective_key(name) -> str:
    """One spelling of a collective's name whoever wrote it: ``nccl:all_reduce``,
    ``c10d::allreduce_``, ``gloo:all_reduce``, ``AllReduce`` -> ``allreduce``."""
    return str(name).split(":")[-1].strip('"').replace("_", "").lower()
