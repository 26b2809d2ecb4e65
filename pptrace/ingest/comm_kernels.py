"""GPU kernels that communicate without NCCL, known by name.

MoE trainers move tokens with their own all-to-all libraries (DeepEP, pplx-kernels, MORI,
NVSHMEM-based kernels), inference stacks reduce with custom all-reduce kernels (vLLM,
SGLang, TensorRT-LLM, MSCCL++). torch.profiler records these as plain kernels on their own
streams with no ``record_param_comms`` beside them, so without a name table they count as
compute and their overlap with the compute on other streams is lost. :data:`KNOWN` names
them; a user adds the ones it does not know (``--comm-kernel 'REGEX=DIM'``, or
``load_run(..., comm_kernels=[...])``), which take precedence.

A kernel a rule matches becomes ``kernel_comm`` of the rule's dim (its ``kind``), never
compute; a contract range projected around it still names its dim first (activity.py).
The rules run on the events table after the trace cache (never at parse time), so adding
one needs no re-parse, and once per distinct kernel name, never per event.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..vocab import COMM_DIMS


@dataclass(frozen=True)
class CommKernel:
    """Kernels whose demangled name ``pattern`` finds (``re.search``) communicate for ``dim``."""

    pattern: str
    dim: str
    library: str = "user"

    def __post_init__(self):
        if self.dim not in COMM_DIMS:
            raise ValueError(f"comm kernel {self.pattern!r}: dim {self.dim!r} is not one of {', '.join(COMM_DIMS)}")
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"comm kernel pattern {self.pattern!r} is not a regular expression: {exc}") from None


#: Communication kernels of the libraries pptrace knows, from their sources' kernel names.
#: Compute kernels of the same libraries (DeepEP's ``layout::get_dispatch_layout``, which
#: counts tokens locally) stay compute.
KNOWN = (
    # DeepEP: normal (NVLink intranode, RDMA internode) and low-latency dispatch / combine
    # and the notify kernels that exchange the token counts before them
    CommKernel(r"\bdeep_ep::(intranode|internode|internode_ll)::\w*(dispatch|combine|notify|barrier)"
               r"|\bdeep_ep::internode_ll::clean_low_latency_buffer", "ep", "DeepEP"),
    # the same kernels under DeepSeek's internal namespace, as their published DualPipe
    # training trace (deepseek-ai/profile-data train.json, EP64) names them:
    # dpsk::ep::internode::{dispatch, combine, notify_dispatch, cached_notify}
    CommKernel(r"\bdpsk::ep::(intranode|internode|internode_ll)::\w*(dispatch|combine|notify|barrier)",
               "ep", "DeepEP (dpsk::ep)"),
    CommKernel(r"\bpplx::\w*(dispatch|combine)\w*", "ep", "pplx-kernels"),
    CommKernel(r"\bmori::moe::Ep(Dispatch|Combine)\w*", "ep", "MORI"),
    # NVSHMEM's own device kernels (barriers, collectives, proxy transfers): the MoE
    # all-to-all libraries are its users in training
    CommKernel(r"\bnvshmemi?x?_\w+|\bnvshmem\w*::\w+", "ep", "NVSHMEM"),
    # custom all-reduce kernels over NVLink, used for the tensor-parallel all-reduce
    CommKernel(r"\bcross_device_reduce_(1|2)stage", "tp", "vLLM/SGLang custom all-reduce"),
    CommKernel(r"\btensorrt_llm::\w*(::\w+)*::\w*(oneShot|twoShot|lamport)\w*AllReduce\w*"
               r"|\btensorrt_llm::\w*(::\w+)*::allreduce_fusion_kernel\w*", "tp", "TensorRT-LLM all-reduce"),
    CommKernel(r"\bmscclpp::\w+", "tp", "MSCCL++"),
)


def parse_rule(text: str) -> CommKernel:
    """``'REGEX=DIM'`` (the CLI's ``--comm-kernel``) as a rule; the last ``=`` splits, so the
    pattern may hold one. ValueError naming the bad part."""
    pattern, sep, dim = str(text).rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"--comm-kernel {text!r}: expected REGEX=DIM, e.g. 'my_a2a_kernel=ep' "
                         f"(DIM one of {', '.join(COMM_DIMS)})")
    return CommKernel(pattern, dim.strip().lower())


def rules(extra=()) -> tuple[CommKernel, ...]:
    """The user's rules (strings 'REGEX=DIM' or CommKernel), first, then :data:`KNOWN`."""
    return (*(r if isinstance(r, CommKernel) else parse_rule(r) for r in extra or ()), *KNOWN)


def _first_match(names: pd.Index, table: tuple[CommKernel, ...]) -> np.ndarray:
    """Index in ``table`` of the first rule that matches each name, -1 for none (names are
    the distinct kernel names: a run has hundreds, whatever its event count)."""
    hit = np.full(len(names), -1)
    for k, rule in enumerate(table):
        open_ = np.flatnonzero(hit < 0)
        if not len(open_):
            break
        search = re.compile(rule.pattern).search
        found = np.fromiter((isinstance(n, str) and search(n) is not None for n in names[open_]), bool, len(open_))
        hit[open_[found]] = k
    return hit


def _set(events: pd.DataFrame, column: str, rows: np.ndarray, values: np.ndarray) -> None:
    """``events[column][rows] = values`` on a categorical column, through its codes."""
    col = events[column]
    if not isinstance(col.dtype, pd.CategoricalDtype):
        col = col.astype("category")
    new = pd.Index(pd.unique(values)).difference(col.cat.categories)
    col = col.cat.add_categories(new) if len(new) else col
    codes = col.cat.codes.to_numpy().astype(np.int64)
    codes[rows] = col.cat.categories.get_indexer(values)
    events[column] = pd.Categorical.from_codes(codes, col.cat.categories)


def mark(events: pd.DataFrame, table: tuple[CommKernel, ...]) -> tuple[pd.DataFrame, dict]:
    """``events`` with the compute kernels a rule of ``table`` names recategorised as
    ``kernel_comm`` of its dim (in ``kind``); and what was found: library -> {dim, kernels}
    (events counted), for the report's ``inferred``. The frame's columns are replaced when
    something matches (the caller's own, freshly assembled)."""
    if events.empty or "category" not in events:
        return events, {}
    compute = np.flatnonzero((events["category"] == "kernel_compute").to_numpy())
    if not len(compute):
        return events, {}
    codes, names = pd.factorize(events["name"].array[compute])
    hit = _first_match(pd.Index(names, dtype=object), table)
    if not (hit >= 0).any():
        return events, {}
    rule_of_row = hit[codes]
    matched = rule_of_row >= 0
    rows, rule = compute[matched], rule_of_row[matched]
    _set(events, "category", rows, np.full(len(rows), "kernel_comm", dtype=object))
    _set(events, "kind", rows, np.array([r.dim for r in table], dtype=object)[rule])
    found: dict = {}
    for k in np.flatnonzero(np.bincount(rule, minlength=len(table))):
        entry = found.setdefault(table[k].library, {"dim": table[k].dim, "kernels": 0})
        entry["kernels"] += int((rule == k).sum())
    return events, found


def describe(found: dict) -> str:
    """One line for the report: which kernels were counted as which communication."""
    return "; ".join(f"{n} {lib} kernel{'s' if n != 1 else ''} as {v['dim']} communication"
                     for lib, v in found.items() for n in (v["kernels"],))
