"""DualPipe-style phase annotations -> contract-1 (kind, op, tags).

DeepSeek's DualPipe trainers wrap each phase of an overlapped forward/backward chunk pair in
a ``record_function`` named ``<phase>(<pass>)``, as their published training trace shows
(deepseek-ai/profile-data ``train.json``, EP64: ``attn(F)``, ``dispatch(F)``, ``mlp(F)``,
``combine(F)``, ``combine(B)``, ``mlp(B)``, ``dispatch(B)``, ``attn(B)``, ``mlp(W)``,
``attn(W)`` inside a ``1F1B`` range). F is the forward, B the backward for the inputs, W the
weight gradients (zero-bubble style). ``dispatch`` / ``combine`` move tokens over the
expert-parallel group (their kernels are DeepEP's, on streams of their own); ``attn`` and
``mlp`` compute. The host ranges say which pass a phase belongs to; the GPU kernels say
when the work ran, so time still comes from the kernels: an exchange's host range is a marker
(kind ``phase``, foreign to the analyses), not communication of its own. On the host it spans
the launches and the CPU's wait for the token counts (20 ms of one ``dispatch(F)`` in that
trace), which the GPU's ep kernels, known by name (comm_kernels.py), already hold where they
really ran.
"""
from __future__ import annotations

import re

from ..naming import RangeName
from ..vocab import BWD, BWD_WEIGHT, FWD

_PHASE = re.compile(r"^(attn|mlp|dispatch|combine)\((F|B|W)\)$")
_PASSES = {"F": FWD, "B": BWD, "W": BWD_WEIGHT}


def parse_dualpipe_name(name: str) -> RangeName | None:
    """The contract reading of a DualPipe phase name, or None for any other name."""
    match = _PHASE.match(name) if isinstance(name, str) else None
    if match is None:
        return None
    phase, which = match.groups()
    if phase in ("attn", "mlp"):
        return RangeName("compute", _PASSES[which], {"dualpipe": phase})
    if which == "W":  # an exchange has no weight pass
        return None
    return RangeName("phase", phase, {"dualpipe": phase, "dir": "bwd" if which == "B" else "fwd"})
