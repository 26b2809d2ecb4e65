"""Megatron-Core's own range names -> contract-1 (kind, op, tags).

Megatron-Core emits these to NVTX only (``torch.cuda.nvtx`` / the ``nvtx`` package), never to
torch.profiler, so they reach pptrace through an Nsight export, not a Chrome trace (a Megatron
run profiled with torch.profiler is tagged by :mod:`pptrace.integrations.megatron` instead).
The exact strings, as megatron-core 0.16.1 builds them:

- p2p: ``@nvtx_decorator()`` on each ``P2PCommunicator`` method
  (``pipeline_parallel/p2p_communication.py``) names the range
  ``f"{module.__name__}.{func.__name__}"`` (``core/utils.py`` ``_nvtx_decorator_get_func_path``):
  module and function name, no class, e.g.
  ``megatron.core.pipeline_parallel.p2p_communication.send_forward_recv_backward``. The
  decorator is applied at import, so only when ``configure_nvtx_profiling(True)`` (Megatron-LM's
  ``--nvtx-ranges``) ran before that module was imported.
- interleaved schedule phases: ``nvtx_range_push(suffix="warmup")`` etc. in
  ``forward_backward_pipelining_with_interleaving`` (``pipeline_parallel/schedules.py``) names
  ``f"{module}.{caller}.{suffix}"``, e.g.
  ``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving.steady``
  (warmup, steady, cooldown, misc); same ``configure_nvtx_profiling`` switch. The 1F1B schedule
  pushes none.
- combined-1F1B schedule nodes (EP communication overlap): ``ScheduleNode._forward`` /
  ``_backward`` (``pipeline_parallel/utils.py``) push ``f"{self.name} forward"`` /
  ``f"{self.name} backward"`` unconditionally, and ``TransformerLayerNode.backward_dw``
  (``models/gpt/fine_grained_callables.py``) ``f"{self.name} wgrad"``. Node names: ``attn``,
  ``mlp``, ``moe_dispatch``, ``moe_combine``, ``mtp_post_process``
  (``models/common/model_chunk_schedule_plan.py``), ``pre_process``, ``post_process``
  (``models/gpt/fine_grained_callables.py``), ``loss_func`` (``pipeline_parallel/combined_1f1b.py``).
  ``moe_dispatch`` / ``moe_combine`` move tokens (expert-parallel all-to-all); the rest compute.

Left alone: the ``layer_{i}f`` / ``layer_{n}b`` / ``layer_{i}f-layer_{n}b`` ranges that enclose
those nodes (reading both would count the same compute twice), the transformer layer's
``....self_attention`` / ``.mlp`` sub-ranges, and Megatron's timers (``forward-compute`` ...),
which write to its log, not to any trace.

No Megatron name carries a microbatch or a peer, so its p2p ranges cannot be paired across
ranks. A combined p2p call is ONE range whose op joins the contract ops with ``+``
(``send_fwd+recv_bwd``): one host range, one row, still category ``p2p``.
"""
from __future__ import annotations

import re

from ..naming import RangeName
from ..vocab import BWD, BWD_WEIGHT, FWD, RECV_BWD, RECV_FWD, SEND_BWD, SEND_FWD

#: P2PCommunicator method -> contract ops, in the order Megatron posts them.
P2P_OPS = {
    "recv_forward": (RECV_FWD,),
    "recv_backward": (RECV_BWD,),
    "send_forward": (SEND_FWD,),
    "send_backward": (SEND_BWD,),
    "send_forward_recv_backward": (SEND_FWD, RECV_BWD),
    "send_backward_recv_forward": (SEND_BWD, RECV_FWD),
    "send_forward_recv_forward": (SEND_FWD, RECV_FWD),
    "send_backward_recv_backward": (SEND_BWD, RECV_BWD),
    "send_forward_backward_recv_forward_backward": (SEND_FWD, SEND_BWD, RECV_FWD, RECV_BWD),
}
SCHEDULE_PHASES = ("warmup", "steady", "cooldown", "misc")
#: ScheduleNode names that compute, and those that are expert-parallel all-to-all.
COMPUTE_NODES = ("attn", "mlp", "mtp_post_process", "pre_process", "post_process", "loss_func")
EP_NODES = ("moe_dispatch", "moe_combine")
_NODE_PASSES = {"forward": FWD, "backward": BWD, "wgrad": BWD_WEIGHT}

_P2P = re.compile(r"^megatron\.core\.pipeline_parallel\.p2p_communication\.(\w+)$")
_PHASE = re.compile(
    r"^megatron\.core\.pipeline_parallel\.schedules\.forward_backward_pipelining_with_interleaving\.(\w+)$"
)
_NODE = re.compile(r"^(\w+) (forward|backward|wgrad)$")


def parse_megatron_name(name: str) -> RangeName | None:
    """The contract reading of a Megatron-Core range name, or None for any other name."""
    if not isinstance(name, str) or not name:
        return None
    name = name.strip()
    match = _P2P.match(name)
    if match and match.group(1) in P2P_OPS:
        return RangeName("pp", "+".join(P2P_OPS[match.group(1)]), {"megatron": match.group(1)})
    match = _PHASE.match(name)
    if match and match.group(1) in SCHEDULE_PHASES:
        # A phase of the schedule: a marker, not work of its own (category "other").
        return RangeName("schedule", match.group(1), {"schedule": "interleaved"})
    match = _NODE.match(name)
    if match:
        node, which = match.groups()
        if node in COMPUTE_NODES:
            return RangeName("compute", _NODE_PASSES[which], {"megatron": node})
        if node in EP_NODES and which != "wgrad":
            return RangeName("ep", "all_to_all", {"megatron": node, "dir": _NODE_PASSES[which]})
    return None
