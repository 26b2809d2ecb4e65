"""Megatron-Core's own range names -> contract-1 (kind, op, tags).

Megatron pushes NVTX / record_function ranges named after the code that runs: every p2p
method as ``megatron.core.pipeline_parallel.p2p_communication.send_forward_recv_backward``
(newer releases insert the class: ``...p2p_communication.P2PCommunicator.recv_forward``),
the interleaved schedule's phases as
``...schedules.forward_backward_pipelining_with_interleaving.warmup|steady|cooldown|misc``,
and its timer names ``forward-backward`` / ``forward-compute`` / ``backward-compute``.
Traces of an uninstrumented Megatron job then still show pipeline communication and
compute, only without the ``mb``/``peer`` tags (Megatron does not name them), so such
p2p ranges cannot be paired across ranks.

A combined p2p call becomes ONE range whose op joins the contract ops with ``+``
(``send_fwd+recv_bwd``): one host range, one row, and still category ``p2p``.
"""
from __future__ import annotations

import re

from .naming import RangeName

#: Megatron p2p function -> contract ops, in the order Megatron posts them.
P2P_OPS = {
    "recv_forward": ("recv_fwd",),
    "recv_backward": ("recv_bwd",),
    "send_forward": ("send_fwd",),
    "send_backward": ("send_bwd",),
    "send_forward_recv_backward": ("send_fwd", "recv_bwd"),
    "send_backward_recv_forward": ("send_bwd", "recv_fwd"),
    "send_forward_recv_forward": ("send_fwd", "recv_fwd"),
    "send_backward_recv_backward": ("send_bwd", "recv_bwd"),
    "send_forward_backward_recv_forward_backward": ("send_fwd", "send_bwd", "recv_fwd", "recv_bwd"),
}
#: Megatron's level-2 timers that are pure compute.
COMPUTE_TIMERS = {"forward-compute": "fwd", "backward-compute": "bwd"}
SCHEDULE_PHASES = ("warmup", "steady", "cooldown", "misc")
_SCHEDULES = {
    "forward_backward_pipelining_with_interleaving": "interleaved",
    "forward_backward_pipelining_without_interleaving": "1f1b",
    "forward_backward_no_pipelining": "no_pipelining",
}

_P2P = re.compile(r"(?:^|\.)p2p_communication\.(?:\w+\.)?(\w+)$")
_PHASE = re.compile(r"(?:^|\.)(forward_backward_\w+)\.(\w+)$")


def parse_megatron_name(name: str) -> RangeName | None:
    """The contract reading of a Megatron range name, or None for any other name."""
    if not isinstance(name, str) or not name:
        return None
    name = name.strip()
    match = _P2P.search(name)
    if match and match.group(1) in P2P_OPS:
        return RangeName("pp", "+".join(P2P_OPS[match.group(1)]), {"megatron": match.group(1)})
    if name in COMPUTE_TIMERS:
        return RangeName("compute", COMPUTE_TIMERS[name], {"megatron": name})
    if name == "forward-backward":
        # The whole schedule of one step: a marker, not work of its own.
        return RangeName("schedule", "forward_backward", {"megatron": name})
    match = _PHASE.search(name)
    if match and match.group(1) in _SCHEDULES and match.group(2) in SCHEDULE_PHASES:
        return RangeName("schedule", match.group(2), {"schedule": _SCHEDULES[match.group(1)]})
    return None
