"""The compact event table: what the analyses read, not every ``aten::`` op.

A training step on one thread is a few hundred top-level CPU ops, each the root of a tree of
``aten::`` calls (``aten::linear`` > ``aten::t`` > ``aten::transpose`` > ``aten::as_strided``):
three quarters of a host trace's events, and no analysis looks inside those trees. A host
thread's busy time is the union of its top-level ops, which the nested ones cannot change;
passes and communication come from contract ranges, p2p posts, collectives and runtime calls,
which are kept wherever they sit. So a plain CPU op nested in another CPU op of its thread
folds into that op at load time: dropped from the table, counted in the rank's
``meta["folded"]``. The cache holds the compact table; ``pptrace merge`` reads the source
files again (``compact=False``), so the merged timeline still shows every op.

Kept, nested or not: every event that is not a ``cpu_op`` on a host thread (user ranges,
runtime calls, kernels), contract and Megatron names (``kind``), collectives
(record_param_comms and what carries their args), and ops a plain trace's inference reads
by name (:data:`SIGNIFICANT_PREFIXES`).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..sweeps import reach_before

#: CPU ops that mean something by their name alone: c10d posts and enqueues (pairing,
#: gloo worker attribution), gloo's own work, autograd's engine (backward passes of plain
#: traces), torch.distributed.pipelining's ``PP:`` actions.
SIGNIFICANT_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms", "autograd::engine", "PP:")


def foldable_names(names: pd.Categorical) -> np.ndarray:
    """Per event: its name may fold (decided once per distinct name)."""
    cats = pd.Index(names.categories.astype(str))
    ok = ~cats.str.startswith(SIGNIFICANT_PREFIXES)
    codes = names.codes
    return np.where(codes >= 0, np.asarray(ok, bool)[codes], False)


def nested_cpu_ops(cpu: np.ndarray, plain: np.ndarray, pid: np.ndarray, tid: np.ndarray,
                   start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Mask of the ``plain`` ops (foldable: no contract name, collective, tags or significant
    name) among the ``cpu`` ops (``cpu_op`` on a host thread) that lie inside another CPU op
    of the same thread. Called by the loader before the derived columns exist, so that
    they are computed for the compact table only.

    Ops of a thread nest properly; in (thread, start, longest first) order an op is inside
    an earlier one exactly when the latest end of the CPU ops before it on its thread
    reaches its own end: one sort and one grouped running max."""
    n = len(cpu)
    plain = cpu & plain
    if not plain.any():
        return np.zeros(n, bool)
    idx = np.flatnonzero(cpu)
    start, end = np.asarray(start, np.int64)[idx], np.asarray(end, np.int64)[idx]
    pid, tid = np.asarray(pid, np.int64)[idx], np.asarray(tid, np.int64)[idx]
    order = np.lexsort((-end, start, tid, pid))
    idx, end = idx[order], end[order]
    thread = np.r_[0, np.cumsum((pid[order][1:] != pid[order][:-1]) | (tid[order][1:] != tid[order][:-1]))]
    out = np.zeros(n, bool)
    out[idx[reach_before(thread, end) >= end]] = True
    return out & plain
