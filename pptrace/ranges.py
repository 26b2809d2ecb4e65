"""``region`` (``pptrace.region``): a span of work with a contract-1 name, sent to NVTX (for Nsight Systems) and to
torch.profiler (for Chrome traces) at once; under 1 µs when nothing records. Below ``profile``
(pptrace.instrument) and the integrations, which both name their ranges with it."""
from __future__ import annotations

import functools
import os

import torch

from .naming import format_name, parse_name
from .vocab import RANGE_KINDS


# Memo of names already validated, name -> parsed; hot loops reuse a few names.
_PARSED_NAMES: dict = {}


def _check_name(name: str) -> None:
    parsed = parse_name(name)
    if parsed is None:
        raise ValueError(
            f"region name {name!r} is not '<kind>:<op> [key=value ...]', e.g. 'pp:send_fwd peer=1 mb=0' "
            f"(kinds: {', '.join(RANGE_KINDS)})"
        )
    _PARSED_NAMES[name] = parsed


def _find_nvtx_domain():
    """The NVTX domain when a tool (Nsight, an injection library) is attached, else None.

    NVTX is a silent no-op without a tool, so skipping it then loses nothing and keeps
    ``region`` cheap. Tools attach through NVTX_INJECTION64_PATH before the process starts,
    so looking once at import is enough.
    """
    if not os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_DISABLE"):
        return None
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.get_domain("pptrace")


_NVTX_DOMAIN = _find_nvtx_domain()
profiler_enabled = torch._C._autograd._profiler_enabled


class region:
    """A named range: ``with region("pp:send_fwd", peer=5, mb=3): ...`` or ``@region("compute:optimizer")``.

    The name is a contract-1 name (``kind:op``, optionally with tags) and keyword tags are
    appended to it. When neither torch.profiler is recording nor an NVTX tool is attached,
    entering and leaving costs well under a microsecond and the name is never formatted.
    """

    __slots__ = ("_name", "_tags", "_open")

    def __init__(self, name: str, _parsed=_PARSED_NAMES, /, **tags):
        if name not in _parsed:
            _check_name(name)
        self._name = name
        self._tags = tags
        self._open = None

    @property
    def name(self) -> str:
        if not self._tags:
            return self._name
        parsed = _PARSED_NAMES[self._name]
        if not parsed.tags:
            return format_name(parsed.kind, parsed.op, **self._tags)
        return format_name(parsed.kind, parsed.op, **{**parsed.tags, **self._tags})

    def __enter__(self, _quiet=_NVTX_DOMAIN is None, _profiling=profiler_enabled):
        # Defaults bound at definition time: local lookups are cheaper on this hot path.
        if _quiet and not _profiling():
            return self
        name = self.name
        opened = []
        if _NVTX_DOMAIN is not None:
            kind = name.partition(":")[0]
            _NVTX_DOMAIN.push_range(_NVTX_DOMAIN.get_event_attributes(message=name, category=kind))
            opened.append(_NVTX_DOMAIN)
        if profiler_enabled():
            # record_function (not the faster _RecordFunctionFast) because only its
            # user_annotation events are projected onto GPU streams as gpu_user_annotation.
            record = torch.autograd.profiler.record_function(name)
            record.__enter__()
            opened.append(record)
        self._open = opened
        return self

    def __exit__(self, exc_type=None, exc=None, tb=None):
        if self._open is not None:
            for handle in reversed(self._open):
                if handle is _NVTX_DOMAIN:
                    handle.pop_range()
                else:
                    handle.__exit__(exc_type, exc, tb)
            self._open = None
        return False

    def __call__(self, fn):
        name, tags = self._name, self._tags

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with region(name, **tags):
                return fn(*args, **kwargs)

        return wrapper
