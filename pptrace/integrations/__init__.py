"""Zero-code instrumentation of other trainers' pipelines.

Each integration patches a library's own functions so that its pipeline work becomes
contract-1 ranges (``compute:fwd mb=3 chunk=1``, ``pp:send_fwd peer=5 mb=3 chunk=1 bytes=...``)
and reports what it learnt about the run (layout, schedule, microbatches, action order) for
the ``pptrace`` metadata block. ``pptrace.profile`` turns them all on by default
(``integrations=()`` turns them off); each is also usable on its own::

    handle = pptrace.integrations.pipelining.instrument()
    ...
    handle.remove()

Contract of an integration module: ``instrument() -> Instrumentation | None`` (None when the
library is not installed, or not imported by this process unless ``import_library=True``; a
version it does not recognise gives a warning and None, never an exception), and
the handle's ``metadata()`` returns keys to merge into the ``pptrace`` block:

- ``layout``: ``Layout.to_dict()`` of the run, when the library knows it
- ``schedule``: the schedule's name as the library calls it (``Schedule1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``1f1b``, ``interleaved``)
- ``microbatches``, ``vpp`` (model chunks per rank)
- ``pipeline_actions``: this rank's execution order, a list of ``[op, stage, mb]`` with op one
  of ``F`` (forward), ``B`` (whole backward), ``I`` (input grad), ``W`` (weight grad), ``SF`` /
  ``SB`` (the post of the send of ``stage``'s output / input grad for ``mb``, where the schedule
  posts it; an order without them posts each send right after its pass) and ``stage`` the
  global stage index (0 .. pp*vpp-1)
- ``stage_ranks``: global stage index -> global rank (list)
- ``integration``: the integration's name and the library version
"""
from __future__ import annotations

import importlib
import warnings
from typing import Protocol

#: Integrations ``pptrace.profile`` turns on by default, by module name.
DEFAULT = ("pipelining", "megatron")


class Instrumentation(Protocol):
    name: str

    def metadata(self) -> dict: ...

    def remove(self) -> None: ...


def instrument_all(names=DEFAULT) -> list:
    """Turn on the named integrations; those whose library is absent are skipped, and any
    failure is a warning: profiling a user's training must never break it."""
    handles = []
    for name in names:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ImportError as exc:
            warnings.warn(f"pptrace: no integration named {name!r} ({exc})", stacklevel=3)
            continue
        try:
            handle = module.instrument()
        except Exception as exc:  # noqa: BLE001 - never break the user's training
            warnings.warn(f"pptrace: the {name} integration could not be installed ({exc}); "
                          "its runs are analyzed as plain traces", stacklevel=3)
            continue
        if handle is not None:
            handles.append(handle)
    return handles


def remove_all(handles) -> None:
    for handle in reversed(handles):
        try:
            handle.remove()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"pptrace: removing the {getattr(handle, 'name', '?')} integration failed ({exc})",
                          stacklevel=3)


def merged_metadata(handles) -> dict:
    out: dict = {}
    for handle in handles:
        try:
            out.update({k: v for k, v in handle.metadata().items() if v is not None})
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"pptrace: the {getattr(handle, 'name', '?')} integration's metadata failed ({exc})",
                          stacklevel=3)
    return out
