"""What one rank is doing, as interval sets: computing, and which dimension's communication
is in progress. The step partition (analyzers/partition.py) sweeps these.

Host (CPU/gloo) traces: the thread is *computing* inside ``compute:*`` ranges except where a
communication range is nested in them (model-mode forward contains its TP all-reduces).
A dimension's communication is *in progress* during its ranges and waits, from the launch
of an async op to the end of its annotated wait (the span in which the data may be moving
while the thread does other work), and during gloo worker-thread work enqueued from inside
one of its ranges. GPU traces: non-NCCL kernels (any stream) compute; NCCL collective
kernels communicate, their dimension read, in this order, from a contract range projected
around them on the stream (gpu_user_annotation), the pg_desc of their process group
(distributedInfo.pg_config), the layout group with exactly their ranks; NCCL send/recv
kernels (by their launching op, ingest/nccl.py) are pipeline p2p; memcpy/memset are kept
apart, being neither compute nor communication.

All ranks are computed together, as whole arrays: every row carries the index of its rank
(its *group*), and each step is one sort or search over all of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import re

import numpy as np
import pandas as pd

from ..ingest.schema import tags_of
from ..ingest.nccl import group_members, is_p2p_collective
from .projection import KERNEL_CATEGORIES, gpu_extent
from .intervals import Intervals, union_by_group
from ..sweeps import ascending, budget_groups, cover_max, dense_ranks, dominance_max, isin, lane_keys
from ..vocab import COMM_DIMS, collective_key, is_step_end

_IDENTITY = ("ring_step", "layer", "bucket", "mb", "chunk")


@dataclass(frozen=True)
class Activity:
    rank: int
    compute: Intervals
    comm: dict            # dim -> Intervals (in progress, step-final collective excluded)
    step_final: dict      # dim -> Intervals of the step-final collective
    gpu: bool             # compute/comm came from GPU kernels
    p2p: Intervals = field(default_factory=Intervals.empty)     # NCCL send/recv kernels (GPU)
    memcpy: Intervals = field(default_factory=Intervals.empty)  # memcpy/memset (GPU): neither
    unknown_groups: int = 0   # NCCL collective kernels whose dim was guessed


# -- array tools ------------------------------------------------------------------------------

def per_value(values, fn, missing, dtype=object) -> np.ndarray:
    """fn(value) of each row, evaluated once per distinct value (per category of a
    categorical); ``missing`` for nulls."""
    values = values if isinstance(values, pd.Series) else pd.Series(values)
    if isinstance(values.dtype, pd.CategoricalDtype):
        codes, uniques = values.cat.codes.to_numpy(), values.cat.categories
        # marked, not counted: bincount would copy the codes to intp (66 MB at 8 M rows)
        seen = np.zeros(len(uniques) + 1, bool)
        seen[codes] = True  # a null's -1 marks the extra last slot
        used = np.flatnonzero(seen[:-1])
    else:
        codes, uniques = pd.factorize(values)
        used = range(len(uniques))
    out = np.empty(len(uniques) + 1, dtype)
    for i in used:  # element by element: a tuple is one value
        out[i] = fn(uniques[i])
    out[-1] = missing
    return out[codes]


def str_test(values, fn) -> np.ndarray:
    """fn(str(value)) of each row, once per distinct value; False for nulls (as the .str
    methods of pandas answer for them)."""
    return per_value(values, lambda v: bool(fn(str(v))), False, bool)


def row_codes(*columns) -> np.ndarray:
    """One int per row, 0, 1, ... in order of first appearance, equal for rows equal in all
    columns (nulls equal each other)."""
    # a column at a time, each pair of codes made one again (first appearance is kept):
    # a groupby over all of them cost more than the hashing
    code = None
    for column in columns:
        c_code, uniques = pd.factorize(column.array if isinstance(column, pd.Series) else column, use_na_sentinel=False)
        c_code = c_code.astype(np.int64, copy=False)
        code = c_code if code is None else pd.factorize(code * (len(uniques) + 1) + c_code)[0].astype(np.int64, copy=False)
    return np.zeros(0, np.int64) if code is None else code


def _runs(n_groups: int, group: np.ndarray) -> np.ndarray:
    """For rows sorted by group: the first row of each group."""
    count = np.bincount(group, minlength=n_groups)
    return np.cumsum(count) - count


# -- host ranges --------------------------------------------------------------------------------

def _host_ranges(ev: pd.DataFrame) -> np.ndarray:
    return ((ev["lane_kind"] == "host") & ~ev["gpu_annotation"] & ev["kind"].notna()).to_numpy()


def _host_range_table(ev: pd.DataFrame, group: np.ndarray) -> pd.DataFrame:
    """The contract ranges on host threads, one row each: their row in ``ev``, group,
    times, kind (str, None when null), what their category says (``launch``: comm:*,
    ``wait``, ``compute``, ``contract``: any of those or p2p; one test per category, not
    per row), tags, whether they end the step, and their thread (``lane``: a code, -1
    for none)."""
    rows = np.flatnonzero(_host_ranges(ev))
    sub = ev[["start_ns", "end_ns", "category", "kind", "tags", "lane", *_IDENTITY]].iloc[rows]
    kind = sub["kind"].to_numpy(object)
    category = sub["category"]
    # kind and tags as object Series: from a bare object array pandas 3 builds pyarrow strings,
    # slower to build here and to index and test in every use below
    return pd.DataFrame({
        "row": rows, "group": group[rows],
        "start": sub["start_ns"].to_numpy(np.int64), "end": sub["end_ns"].to_numpy(np.int64),
        "kind": pd.Series(np.where(pd.isna(kind), None, kind), dtype=object),
        "launch": str_test(category, lambda c: c.startswith("comm:")),
        "wait": str_test(category, lambda c: c == "wait"),
        "compute": str_test(category, lambda c: c == "compute"),
        "contract": str_test(category, lambda c: c.startswith(("comm:", "wait", "compute", "p2p"))),
        "final": per_value(sub["tags"], is_step_end, False, bool),
        "tags": pd.Series(sub["tags"].to_numpy(object), dtype=object), "lane": pd.factorize(sub["lane"].array)[0],
        **{c: sub[c].array for c in _IDENTITY},
    })


def _identity_rest(tags) -> tuple:
    """The identity tags of a range beyond its columns (all but op and what)."""
    return tuple(sorted((k, str(v)) for k, v in tags_of(tags).items() if k not in ("op", "what")))


def _async_spans(rng: pd.DataFrame) -> tuple:
    """(group, dim, start, end, step_final) from each wait back to the launches it waits for:
    the ranges of its dimension with the same identity tags posted since the previous such
    wait (waits of one identity in order of start, then of rows)."""
    launch = rng[rng["launch"].to_numpy()]
    waits = rng[(rng["wait"] & rng["kind"].isin(COMM_DIMS)).to_numpy()]
    if waits.empty:
        return ()
    both = pd.concat([launch, waits], ignore_index=True)
    rest_id: dict = {(): 0}  # equal identity tags, one code
    rest_code = per_value(both["tags"], lambda t: rest_id.setdefault(_identity_rest(t), len(rest_id)), 0, np.int64)
    key = row_codes(both["group"].to_numpy(), both["kind"].to_numpy(object), *(both[c] for c in _IDENTITY), rest_code)
    l_key, w_key = key[:len(launch)], key[len(launch):]
    order = np.lexsort((launch["start"].to_numpy(), l_key))
    l_key, l_start = l_key[order], launch["start"].to_numpy()[order]
    order = np.lexsort((waits["row"].to_numpy(), waits["start"].to_numpy(), w_key))
    w_key, waits = w_key[order], waits.iloc[order]
    w_start = waits["start"].to_numpy()
    previous = np.full(len(w_key), np.iinfo(np.int64).min)
    same = np.r_[False, w_key[1:] == w_key[:-1]]
    previous[same] = w_start[:-1][same[1:]]
    (l_rank, p_rank, w_rank), size = dense_ranks(l_start, previous, w_start)
    l_sorted = l_key * size + l_rank
    first = np.searchsorted(l_sorted, w_key * size + p_rank, "right")  # launches after the previous wait
    upto = np.searchsorted(l_sorted, w_key * size + w_rank, "right")   # ... up to this one
    hit = first < upto
    waits = waits[hit]
    return (waits["group"].to_numpy(), waits["kind"].to_numpy(object), l_start[first[hit]],
            waits["end"].to_numpy(), waits["final"].to_numpy())


def _family(name: str) -> str:
    base = collective_key(name)
    for fam, words in (("all_reduce", ("allreduce", "reducescatter")), ("all_gather", ("allgather",)),
                       ("all_to_all", ("alltoall",)), ("broadcast", ("broadcast",))):
        if any(base.startswith(w) for w in words):
            return fam
    return base


def _worker_spans(ev: pd.DataFrame, group: np.ndarray, host: np.ndarray, rng: pd.DataFrame) -> tuple:
    """gloo collectives run on ``pt_gloo_runloop`` threads; the main thread only enqueues
    them (``c10d::*``). Pair each worker event with the oldest unclaimed enqueue of the same
    collective family posted before it (each group's queue is FIFO), and give it the
    dimension of the innermost contract range around that enqueue (the latest started, the
    first in rows on ties). Only rows of groups in ``host`` (no GPU kernels) take part."""
    lane, name = ev["lane"], ev["name"]
    host = host[group]
    # the names tested only where the lanes passed: over every row it was most of this
    work = np.flatnonzero(host & str_test(lane, lambda s: re.search("gloo", s, re.IGNORECASE) and s != "main"))
    work = work[str_test(name.iloc[work], lambda s: s.startswith("gloo:"))]
    if not len(work):
        return ()
    enq = np.flatnonzero(host & str_test(lane, lambda s: s == "main") & str_test(
        name, lambda s: s.startswith("c10d::") and not re.search("send|recv|barrier", s)))
    start, end = ev["start_ns"].to_numpy(np.int64), ev["end_ns"].to_numpy(np.int64)
    families = {None: 0}  # null names: a family of their own, 0
    family = per_value(name.iloc[np.r_[work, enq]], lambda v: families.setdefault(_family(str(v)), len(families)),
                       0, np.int64)
    # one FIFO queue per rank and family, numbered 0, 1, ...: their order does not matter
    (queue,), _ = dense_ranks(np.r_[group[work], group[enq]] * len(families) + family)
    w_q, e_q = queue[:len(work)], queue[len(work):]
    order = np.lexsort((work, start[work], w_q))
    work, w_q = work[order], w_q[order]
    order = np.lexsort((start[enq], e_q))
    e_q, e_start = e_q[order], start[enq][order]
    # The greedy pairing (each worker event takes the head of its queue if it was posted by
    # then) leaves head_i = min(head_{i-1} + 1, posted_i) after a queue's i-th event, posted_i
    # the count of its enqueues up to that event's start: head_i = i + min(0, min over
    # j <= i of posted_j - j), a running minimum.
    n_q = int(queue.max()) + 1
    w_first, e_first = _runs(n_q, w_q), _runs(n_q, e_q)
    e_key, w_key = lane_keys([e_q, w_q], [e_start, start[work]])
    posted = np.searchsorted(e_key, w_key, "right") - e_first[w_q]
    i = np.arange(len(work)) - w_first[w_q] + 1
    spread = 2 * (len(work) + len(enq)) + 2  # later queues lie below earlier ones: a running min per queue
    head = i + np.minimum(np.minimum.accumulate(posted - i - w_q * spread) + w_q * spread, 0)
    before = np.zeros(len(work), np.int64)
    later = i > 1
    before[later] = head[:-1][later[1:]]
    took = head > before
    work, t = work[took], e_start[e_first[w_q[took]] + before[took]]
    r_start, r_end = rng["start"].to_numpy(), rng["end"].to_numpy()
    contract = np.flatnonzero(rng["contract"].to_numpy() & (r_end > r_start))
    # innermost: the latest start, then the first row, as weights ranking the ranges
    contract = contract[np.lexsort((-rng["row"].to_numpy()[contract], r_start[contract]))]
    inner = cover_max(rng["group"].to_numpy()[contract], r_start[contract], r_end[contract],
                      np.arange(len(contract)), group[work], t)
    found = inner >= 0
    work, inner = work[found], contract[inner[found]]  # rows of rng
    kind = rng["kind"].iloc[inner]
    is_comm = (rng["launch"].to_numpy()[inner] | rng["wait"].to_numpy()[inner]) & kind.isin(COMM_DIMS).to_numpy()
    work, inner = work[is_comm], inner[is_comm]
    return (group[work], kind.to_numpy(object)[is_comm], start[work], end[work], rng["final"].to_numpy()[inner])


def _depths(lane: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Nesting depth of each range as a stack sweep over its thread finds it: ranges sorted
    by (lane, start, longer first on ties); each pops the ranges that ended by its start off
    the top of the stack, and its depth is what stays.

    Range p is popped by the first later range k of its lane starting at or after the end of
    every range pushed since p. Along the chain of next strictly later-ending ranges from p
    (next_greater), that is the first start at or after the end (first_after) of the first
    link r whose first_after comes no later than r's next link."""
    n = len(starts)
    idx = np.arange(n)
    lane_start = np.searchsorted(lane, lane, "left")
    lane_end = np.searchsorted(lane, lane, "right")
    s_key, e_key = lane_keys([lane, lane], [starts, ends])
    first_after = np.maximum(np.searchsorted(s_key, e_key, "left"), idx + 1)
    # next_greater by binary lifting over a sparse table of maxima of the ends
    table = [ends]
    while (1 << len(table)) <= n:
        half = 1 << (len(table) - 1)
        table.append(np.maximum(table[-1][:-half], table[-1][half:]))
    next_greater = idx + 1
    for level in range(len(table) - 1, -1, -1):
        step = 1 << level
        can = np.flatnonzero(next_greater + step <= lane_end)
        can = can[table[level][next_greater[can]] <= ends[can]]
        next_greater[can] += step
    jump = np.where(first_after <= next_greater, idx, next_greater)
    while True:
        further = jump[jump]
        if np.array_equal(further, jump):
            break
        jump = further
    popped_at = first_after[jump]  # lane_end: never popped
    gone = np.cumsum(np.bincount(popped_at[popped_at < lane_end], minlength=n))
    gone_before = np.where(lane_start > 0, gone[np.maximum(lane_start - 1, 0)], 0)
    return (idx - lane_start) - (gone - gone_before)


def _by_lane_start_longest(lane, starts, ends, row) -> np.ndarray:
    """The order of np.lexsort((row, -ends, starts, lane)). A rank's table is sorted by
    (start, longest first) with ties in row order, so each lane's rows in row order usually
    are in that order already: then a stable sort by lane is the answer (checked, not assumed:
    rows appended by inference are not)."""
    order = np.argsort(lane, kind="stable")
    if ascending(lane[order], starts[order], -ends[order]) and ascending(row):
        return order
    return np.lexsort((row, -ends, starts, lane))


def _innermost_compute(rng: pd.DataFrame) -> tuple:
    """(group, start, end) of the pieces where a thread's innermost contract range is a
    compute range: a TP all-reduce nested in a forward is not compute, and a weight-gradient
    computed while a p2p range waits (ZB-H1 fills the wait with W) is. Per thread and depth
    d: the compute ranges of depth d less every range deeper; so a piece is compute where
    the deepest range over it, compute first on ties, is a compute range."""
    rng = rng[(rng["lane"] >= 0).to_numpy()]  # no thread, no sweep (as groupby drops it)
    lane = row_codes(rng["group"].to_numpy(), rng["lane"].to_numpy())
    lane_group = np.zeros(int(lane.max()) + 1 if len(lane) else 0, np.int64)
    lane_group[lane] = rng["group"].to_numpy()
    starts, ends = rng["start"].to_numpy(), rng["end"].to_numpy()
    order = _by_lane_start_longest(lane, starts, ends, rng["row"].to_numpy())
    lane, starts, ends = lane[order], starts[order], ends[order]
    weight = 2 * _depths(lane, starts, ends) + rng["compute"].to_numpy()[order]
    real = ends > starts
    lane, starts, ends, weight = lane[real], starts[real], ends[real], weight[real]
    b_lane, b_time = np.r_[lane, lane], np.r_[starts, ends]
    # lexsort((b_time, b_lane)) as one key: a stable sort merges its runs (the starts are sorted)
    order = np.argsort(lane_keys([b_lane], [b_time])[0], kind="stable")
    b_lane, b_time = b_lane[order], b_time[order]
    seg = np.flatnonzero((b_lane[1:] == b_lane[:-1]) & (b_time[1:] > b_time[:-1]))
    # the pieces lie between consecutive bounds: a range over a piece's start spans all of it
    best = cover_max(lane, starts, ends, weight, b_lane[seg], b_time[seg])
    seg = seg[(best >= 0) & (best % 2 == 1)]
    return lane_group[b_lane[seg]], b_time[seg], b_time[seg + 1]


# -- GPU kernels -------------------------------------------------------------------------------

_DESC_WORDS = (  # pg_desc words -> dim; Megatron's group_desc names first, checked in order
    ("ep", ("expert", "ep", "moe")), ("cp", ("context", "cp")), ("tp", ("tensor", "tp")),
    ("dp", ("data", "dp", "fsdp", "zero")),
)


def dim_of_desc(desc) -> str | None:
    """``pg_desc`` of distributedInfo.pg_config -> dim, or None when it does not say (one
    group named after two dims, like Megatron's TENSOR_AND_DATA_PARALLEL_GROUP, says nothing)."""
    if not isinstance(desc, str):
        return None
    words = set(re.split(r"[^a-z]+", desc.lower())) - {""}
    if "expert" in words:
        # Megatron's expert groups: EXPERT_DATA_PARALLEL_GROUP reduces the experts' gradients
        # (dp), EXPERT_TENSOR_PARALLEL_GROUP splits an expert (tp); the all-to-all runs on
        # EXPERT_MODEL_PARALLEL_GROUP, or EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP with TP (ep)
        return "dp" if "data" in words else "tp" if "tensor" in words and "model" not in words else "ep"
    found = [dim for dim, keys in _DESC_WORDS if words & set(keys)]
    return found[0] if len(found) == 1 else None


def kernel_dim(group_ranks, rank: int, layout, collective=None, pg_name=None, groups=None):
    """(dim, known) of one NCCL collective kernel: the pg_desc of its process group when it
    names a dim, else the layout dim whose group has exactly its ranks; unknown groups count
    as dp (grad sync, norms over the world), all_to_all on an unknown group as ep."""
    group = (groups or {}).get(str(pg_name)) if pg_name is not None else None
    if group:
        dim = dim_of_desc(group.get("desc"))
        if dim:
            return dim, True
        if group_ranks is None or pd.isna(group_ranks):
            group_ranks = group.get("ranks")
    members = group_members(group_ranks)
    fam = collective_key(collective) if isinstance(collective, str) else ""
    fits = [d for d in COMM_DIMS if layout.size(d) > 1 and rank < layout.world_size
            and tuple(sorted(layout.group_ranks(d, rank))) == members]
    if fits:
        # ep's group may be dp's (ep = dp): an all-to-all on it is the experts' dispatch
        return ("ep" if "ep" in fits and (fam.startswith("alltoall") or fits == ["ep"]) else fits[0]), True
    return ("ep" if fam.startswith("alltoall") else "dp"), False


def _is_p2p_kernel(names: pd.Series, collectives: pd.Series) -> np.ndarray:
    """Point-to-point NCCL kernels: by their linked collective (send/recv) when known; a
    SendRecv kernel of an all_to_all is a collective. Unlinked kernels: by name."""
    known = collectives.notna().to_numpy()
    by_coll = per_value(collectives, is_p2p_collective, False, bool)
    by_name = str_test(names, lambda s: re.search("SendRecv|Send_|Recv_", s) is not None)
    return np.where(known, by_coll, by_name)


def _kernel_spans(ev: pd.DataFrame, group: np.ndarray, nccl: np.ndarray, ranks: list, layout, pg: list):
    """(group, dim, start, end) of the communication kernels (rows ``nccl``: NCCL's, and those
    known by name), and the count per group of those whose dim was guessed. A kernel's dim is
    that of the last contract range (in rows) projected around it on its stream, or on no
    stream; else a named kernel's own (its ``kind``); else kernel_dim, once per distinct rank,
    group ranks, collective and process group."""
    start, end = ev["start_ns"].to_numpy(np.int64), ev["end_ns"].to_numpy(np.int64)
    ann = np.flatnonzero(ev["gpu_annotation"].to_numpy(bool))
    ann = ann[np.isin(ev["kind"].iloc[ann].to_numpy(object), COMM_DIMS)
              & str_test(ev["category"].iloc[ann], lambda c: c.startswith(("comm:", "wait")))]
    stream, _ = pd.factorize(ev["stream"].array[np.r_[ann, nccl]])  # -1: no stream
    lane = row_codes(np.r_[group[ann], group[nccl], group[nccl]], np.r_[stream, np.full(len(nccl), -1)])
    a_lane, k_lane, any_lane = np.split(lane, [len(ann), len(ann) + len(nccl)])
    ks, ke, weight = start[nccl], end[nccl], np.arange(len(ann))
    last = np.maximum(dominance_max(a_lane, start[ann], end[ann], weight, k_lane, ks, ke),
                      dominance_max(a_lane, start[ann], end[ann], weight, any_lane, ks, ke))
    dim = np.empty(len(nccl), object)
    annotated = last >= 0
    dim[annotated] = ev["kind"].iloc[ann[last[annotated]]].to_numpy(object)
    # a kernel known by name (comm_kernels.py) carries its dim: no group to look up
    is_nccl = ev["is_nccl"].to_numpy(bool)[nccl] if "is_nccl" in ev else np.ones(len(nccl), bool)
    named = ~annotated & ~is_nccl
    dim[named] = ev["kind"].iloc[nccl[named]].to_numpy(object)
    rest = nccl[~annotated & ~named]
    cols = [ev[c].iloc[rest].astype(object).to_numpy() for c in ("group_ranks", "collective", "pg_name")]
    combo = row_codes(group[rest], *cols)
    firsts = np.unique(combo, return_index=True)[1]  # combo counts 0, 1, ...
    found = [kernel_dim(gr, ranks[g], layout, coll, name, pg[g])
             for g, gr, coll, name in zip(group[rest][firsts], *(c[firsts] for c in cols))]
    dims, known = np.empty(len(found), object), np.array([k for _, k in found], bool)
    dims[:] = [d for d, _ in found]
    dim[~annotated & ~named] = dims[combo]
    unknown = np.bincount(group[rest][~known[combo]], minlength=len(ranks)) if len(found) else np.zeros(len(ranks), int)
    return (group[nccl], dim, ks, ke), unknown


# -- all ranks at once -------------------------------------------------------------------------

def _activities(ev: pd.DataFrame, group: np.ndarray, ranks: list, layout, pg: list) -> list[Activity]:
    """The Activity of each group of rows (``group``: 0..len(ranks)-1 per row of ``ev``;
    ``pg``: each group's process groups)."""
    n = len(ranks)
    start, end = ev["start_ns"].to_numpy(np.int64), ev["end_ns"].to_numpy(np.int64)
    category = ev["category"]
    is_kernel = isin(category, KERNEL_CATEGORIES)
    gpu = np.bincount(group[is_kernel], minlength=n) > 0
    rng = _host_range_table(ev, group)

    spans = []  # (group, dim, start, end, step_final) arrays
    # Host-side ranges mark communication in both modes; on GPU, where Kineto projected
    # them onto a stream, their GPU-side extent (the host side is only the launch).
    marked = rng[(rng["launch"] | rng["wait"]).to_numpy()]
    m_start, m_end = marked["start"].to_numpy().copy(), marked["end"].to_numpy().copy()
    projected = gpu[marked["group"].to_numpy()]
    if projected.any():
        m_start[projected], m_end[projected], _ = gpu_extent(ev, ev.iloc[marked["row"].to_numpy()[projected]])
    spans.append((marked["group"].to_numpy(), marked["kind"].to_numpy(object), m_start, m_end, marked["final"].to_numpy()))
    spans.append(_async_spans(rng))
    spans.append(_worker_spans(ev, group, ~gpu, rng))
    nccl = np.flatnonzero((category == "kernel_comm").to_numpy())
    p2p = _is_p2p_kernel(ev["name"].iloc[nccl], ev["collective"].iloc[nccl]) if len(nccl) else np.zeros(0, bool)
    unknown = np.zeros(n, int)
    if (~p2p).any():
        (g, dim, s, e), unknown = _kernel_spans(ev, group, nccl[~p2p], ranks, layout, pg)
        spans.append((g, dim, s, e, np.zeros(len(g), bool)))
    spans = [part for part in spans if len(part)]
    g, dim, s, e, final = (np.concatenate(a) for a in zip(*spans))
    code = np.full(len(dim), -1)
    for k, d in enumerate(COMM_DIMS):
        code[dim == d] = k
    keep = code >= 0
    comm = union_by_group(n * len(COMM_DIMS) * 2, (g[keep] * len(COMM_DIMS) + code[keep]) * 2 + final[keep], s[keep], e[keep])

    kernels = (category == "kernel_compute").to_numpy()
    c_group, c_start, c_end = _innermost_compute(rng[~gpu[rng["group"].to_numpy()]])
    # the kernels alone where no rank computes on its host (a GPU run): no concatenated copies
    compute = union_by_group(n, *((group[kernels], start[kernels], end[kernels]) if not len(c_group) else
                                  (np.r_[group[kernels], c_group], np.r_[start[kernels], c_start],
                                   np.r_[end[kernels], c_end])))
    del kernels
    p2p_sets = union_by_group(n, group[nccl[p2p]], start[nccl[p2p]], end[nccl[p2p]])
    memcpy = np.flatnonzero((category == "memcpy").to_numpy() & gpu[group])
    memcpy_sets = union_by_group(n, group[memcpy], start[memcpy], end[memcpy])
    return [Activity(
        rank=rank, compute=compute[i],
        comm={d: comm[(i * len(COMM_DIMS) + k) * 2] for k, d in enumerate(COMM_DIMS)},
        step_final={d: comm[(i * len(COMM_DIMS) + k) * 2 + 1] for k, d in enumerate(COMM_DIMS)},
        gpu=bool(gpu[i]), p2p=p2p_sets[i], memcpy=memcpy_sets[i], unknown_groups=int(unknown[i]),
    ) for i, rank in enumerate(ranks)]


def rank_activity(ev: pd.DataFrame, rank: int, layout, groups: dict | None = None) -> Activity:
    """The activity of one rank from its (aligned) events; ``groups`` maps its process-group
    names to {"desc", "ranks"} (distributedInfo.pg_config), when the trace has them."""
    return _activities(ev, np.zeros(len(ev), np.int64), [rank], layout, [groups])[0]


#: Rows taken at a time by :func:`activities` when the table comes in rank order (as the
#: loader assembles it): whole ranks, about this many rows of them, so that the pass's
#: temporaries (~30 bytes a row at its peak) stay bounded whatever the run's size.
ACTIVITY_ROWS = 4_000_000


def activities(events: pd.DataFrame, ranks, layout, groups_by_rank: dict | None = None) -> dict:
    """rank -> Activity for each of ``ranks`` (None: every rank in ``events``, ascending), as
    rank_activity gives it from that rank's rows, many ranks in each pass over the frame
    (ACTIVITY_ROWS). ``groups_by_rank``: rank -> its process groups (rank_activity's ``groups``)."""
    rank_of_row = events["rank"].to_numpy()
    ranks = [int(r) for r in (np.sort(pd.unique(rank_of_row)) if ranks is None else ranks)]
    groups_by_rank = groups_by_rank or {}
    out: dict = {}
    for rows, mine in _rank_slices(rank_of_row, ranks, ACTIVITY_ROWS):
        ev = events if rows is None else events.iloc[rows]
        # int32: a row each, held through the whole pass (an int64 was 60 MB at 7.5 M rows)
        group = pd.Index(mine).get_indexer(ev["rank"].to_numpy()).astype(np.int32)
        if (group < 0).any():
            ev, group = ev[group >= 0], group[group >= 0]
        out.update(zip(mine, _activities(ev, group, mine, layout, [groups_by_rank.get(r) for r in mine])))
    return {r: out[r] for r in ranks}


def _rank_slices(rank_of_row: np.ndarray, ranks: list, budget: int) -> list[tuple]:
    """(rows, ranks) passes: each a slice of rows holding whole ranks, about ``budget`` rows
    of them, with the ``ranks`` it holds (a rank without rows goes with the pass its number
    falls in), where the rows come in rank order; else one pass over every row (rows None)."""
    if len(rank_of_row) <= budget or not ascending(rank_of_row):
        return [(None, ranks)]
    first = np.flatnonzero(np.r_[True, rank_of_row[1:] != rank_of_row[:-1]])  # in rank order: no sort
    present = rank_of_row[first]
    heads = budget_groups(np.diff(np.r_[first, len(rank_of_row)]), budget)
    bounds = [*first[heads].tolist(), len(rank_of_row)]
    wanted = np.asarray(ranks, np.int64)
    pass_of = np.maximum(np.searchsorted(present[heads], wanted, side="right") - 1, 0)
    return [(slice(bounds[i], bounds[i + 1]), [int(r) for r in wanted[pass_of == i]]) for i in range(len(heads))]
