"""``pptrace diff``: what changed between two runs, why, and a verdict CI can gate on.

    >>> doc = pptrace.diff("runs/before", "runs/after/analysis.json", gates=["step>+3%"])
    >>> doc["summary"], doc["verdict"]["line"]

The step time's change is split into the report's parts per stage (``decompose``), judged
against each run's own noise (``noise``), with the set-up changes (``setup``), the bubble
against the schedule's theory (``pipeline``), the comparisons beside (``compare``), the
sentences (``explain``) and the gate (``gate``); ``document`` assembles the whole.
"""
from __future__ import annotations

import sys
import types

from .document import SCHEMA, diff, diff_documents
from .gate import Gate, parse_gate
from .sides import Side, load_side

__all__ = ["SCHEMA", "Gate", "Side", "diff", "diff_documents", "load_side", "parse_gate"]


class _CallableModule(types.ModuleType):
    """``pptrace.diff(base, new)`` is the function and ``pptrace.diff`` this package: once the
    package is imported, Python binds the name ``diff`` on ``pptrace`` to the package, so the
    package itself answers the call."""

    def __call__(self, base, new, **options):
        return diff(base, new, **options)


sys.modules[__name__].__class__ = _CallableModule
