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
"""
from __future__ import annotations

from dataclasses import dataclass, field

import re

import numpy as np
import pandas as pd

from .schema import tags_of
from .nccl import group_members, is_p2p_collective
from .projection import gpu_extent
from .intervals import Intervals, union
from ..vocab import COMM_DIMS, LAYOUT_DIMS, collective_key, is_step_end

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


def _host_ranges(ev: pd.DataFrame) -> pd.DataFrame:
    return ev[(ev["lane_kind"] == "host") & ~ev["gpu_annotation"] & ev["kind"].notna()]


def _identity(row, tags: dict) -> tuple:
    rest = tuple(sorted((k, str(v)) for k, v in tags.items() if k not in ("op", "what")))
    return (row.kind, *(None if pd.isna(getattr(row, c)) else int(getattr(row, c)) for c in _IDENTITY), rest)


def _async_spans(ranges: pd.DataFrame) -> list[tuple]:
    """(dim, start, end, step_final) from each wait back to the launches it waits for: the
    ranges of its dimension with the same identity tags posted since the previous such wait."""
    comm = ranges[ranges["category"].astype(str).str.startswith("comm:")]
    waits = ranges[ranges["category"] == "wait"]
    if waits.empty:
        return []
    launches: dict = {}
    for row in comm.itertuples():
        tags = tags_of(row.tags)
        launches.setdefault(_identity(row, tags), []).append(row.start_ns)
    spans, previous = [], {}
    for row in waits.sort_values("start_ns").itertuples():
        if row.kind not in COMM_DIMS:
            continue
        key = _identity(row, tags_of(row.tags))
        starts = np.asarray(launches.get(key, []), dtype=np.int64)
        lo = previous.get(key, np.iinfo(np.int64).min)
        posted = starts[(starts > lo) & (starts <= row.start_ns)]
        previous[key] = row.start_ns
        if len(posted):
            spans.append((row.kind, int(posted.min()), int(row.end_ns), is_step_end(row.tags)))
    return spans


def _family(name: str) -> str:
    base = collective_key(name)
    for fam, words in (("all_reduce", ("allreduce", "reducescatter")), ("all_gather", ("allgather",)),
                       ("all_to_all", ("alltoall",)), ("broadcast", ("broadcast",))):
        if any(base.startswith(w) for w in words):
            return fam
    return base


def _worker_spans(ev: pd.DataFrame, ranges: pd.DataFrame) -> list[tuple]:
    """gloo collectives run on ``pt_gloo_runloop`` threads; the main thread only enqueues
    them (``c10d::*``). Pair each worker event with the oldest unclaimed enqueue of the same
    collective family posted before it (each group's queue is FIFO), and give it the
    dimension of the innermost contract range around that enqueue."""
    lanes = ev["lane"].astype(str)
    work = ev[lanes.str.contains("gloo", case=False) & (lanes != "main")
              & ev["name"].astype(str).str.startswith("gloo:")]
    if work.empty:
        return []
    enq = ev[(lanes == "main") & ev["name"].astype(str).str.startswith("c10d::")]
    enq = enq[~enq["name"].astype(str).str.contains("send|recv|barrier")]
    contract = ranges[ranges["category"].astype(str).str.startswith(("comm:", "wait", "compute", "p2p"))]
    cs, ce = contract["start_ns"].to_numpy(), contract["end_ns"].to_numpy()
    ckind, ccat = contract["kind"].astype(str).to_numpy(), contract["category"].astype(str).to_numpy()
    cfinal = np.array([is_step_end(t) for t in contract["tags"]], dtype=bool)
    queues: dict = {}
    for r in enq.sort_values("start_ns").itertuples():
        queues.setdefault(_family(str(r.name)), []).append(int(r.start_ns))
    heads = {fam: 0 for fam in queues}
    spans = []
    for row in work.sort_values("start_ns").itertuples():
        fam = _family(str(row.name))
        queue, head = queues.get(fam, []), heads.get(fam, 0)
        if head >= len(queue) or queue[head] > row.start_ns:
            continue
        heads[fam] = head + 1
        t = queue[head]
        inside = np.flatnonzero((cs <= t) & (ce > t))
        if len(inside) == 0:
            continue
        inner = inside[np.argmax(cs[inside])]  # nested ranges: the latest start is innermost
        if ccat[inner].startswith("comm:") or ccat[inner] == "wait":
            if ckind[inner] in COMM_DIMS:
                spans.append((ckind[inner], int(row.start_ns), int(row.end_ns), bool(cfinal[inner])))
    return spans


def _depths(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Nesting depth of each range of one thread (ranges on a thread nest properly);
    inputs sorted by start, longer first on ties."""
    depth = np.zeros(len(starts), np.int64)
    stack: list = []
    for i, (s, e) in enumerate(zip(starts, ends)):
        while stack and stack[-1] <= s:
            stack.pop()
        depth[i] = len(stack)
        stack.append(e)
    return depth


def _innermost_compute(lane: pd.DataFrame) -> Intervals:
    """Where the innermost contract range of one thread is a compute range: a TP
    all-reduce nested in a forward is not compute, and a weight-gradient computed while a
    p2p range waits (ZB-H1 fills the wait with W) is."""
    lane = lane.sort_values(["start_ns", "end_ns"], ascending=[True, False], kind="stable")
    starts, ends = lane["start_ns"].to_numpy(np.int64), lane["end_ns"].to_numpy(np.int64)
    depth = _depths(starts, ends)
    is_compute = (lane["category"] == "compute").to_numpy()
    out = Intervals.empty()
    for d in np.unique(depth[is_compute]):
        mine = is_compute & (depth == d)
        deeper = depth > d
        out = out | (union(starts[mine], ends[mine]) - union(starts[deeper], ends[deeper]))
    return out


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
    found = [dim for dim, keys in _DESC_WORDS if words & set(keys)]
    return found[0] if len(found) == 1 else None


def _gpu_dim(group_ranks, rank: int, layout, collective=None, pg_name=None, groups=None):
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
    for dim in (d for d in COMM_DIMS if d in LAYOUT_DIMS):  # ep has no layout group
        if layout.size(dim) > 1 and rank < layout.world_size and tuple(sorted(layout.group_ranks(dim, rank))) == members:
            return dim, True
    fam = collective_key(collective) if isinstance(collective, str) else ""
    return ("ep" if fam.startswith("alltoall") else "dp"), False


def _is_p2p_kernel(names: pd.Series, collectives: pd.Series) -> np.ndarray:
    """Point-to-point NCCL kernels: by their linked collective (send/recv) when known; a
    SendRecv kernel of an all_to_all is a collective. Unlinked kernels: by name."""
    coll = collectives.astype(object)
    known = coll.notna().to_numpy()
    by_coll = np.array([is_p2p_collective(c) for c in coll], dtype=bool)
    by_name = names.astype(str).str.contains("SendRecv|Send_|Recv_", regex=True).to_numpy()
    return np.where(known, by_coll, by_name)


def _annotation_dims(ev: pd.DataFrame) -> list[tuple]:
    """(dim, stream, start, end) of contract communication ranges projected on GPU streams
    (gpu_user_annotation): the kernels inside run that dim's communication."""
    ann = ev[ev["gpu_annotation"] & ev["kind"].isin(list(COMM_DIMS)) & ev["category"].astype(str).str.startswith(("comm:", "wait"))]
    return [(str(r.kind), r.stream, int(r.start_ns), int(r.end_ns)) for r in ann.itertuples()]


def rank_activity(ev: pd.DataFrame, rank: int, layout, groups: dict | None = None) -> Activity:
    """The activity of one rank from its (aligned) events; ``groups`` maps its process-group
    names to {"desc", "ranks"} (distributedInfo.pg_config), when the trace has them."""
    ranges = _host_ranges(ev)
    kernels = ev[ev["category"].isin(["kernel_compute", "kernel_comm"])]
    comm_parts = {d: ([], []) for d in COMM_DIMS}
    final_parts = {d: ([], []) for d in COMM_DIMS}

    def add(dim, s, e, final):
        target = final_parts if final else comm_parts
        target[dim][0].append(s)
        target[dim][1].append(e)

    gpu = not kernels.empty
    p2p, memcpy, unknown = Intervals.empty(), Intervals.empty(), 0
    if gpu:
        comp = kernels[kernels["category"] == "kernel_compute"]
        compute = union(comp["start_ns"].to_numpy(), comp["end_ns"].to_numpy())
        mem = ev[ev["category"] == "memcpy"]
        memcpy = union(mem["start_ns"].to_numpy(), mem["end_ns"].to_numpy())
        nccl = kernels[kernels["category"] == "kernel_comm"]
        is_p2p = _is_p2p_kernel(nccl["name"], nccl["collective"])
        p2p = union(nccl.loc[is_p2p, "start_ns"].to_numpy(), nccl.loc[is_p2p, "end_ns"].to_numpy())
        annotated = _annotation_dims(ev)
        for row in nccl[~is_p2p].itertuples():
            inside = [d for d, stream, s, e in annotated
                      if s <= row.start_ns and row.end_ns <= e and (pd.isna(stream) or stream == row.stream)]
            if inside:
                dim = inside[-1]
            else:
                dim, known = _gpu_dim(row.group_ranks, rank, layout, row.collective, row.pg_name, groups)
                unknown += not known
            add(dim, row.start_ns, row.end_ns, False)
    else:
        compute = Intervals.empty()
        for _, lane in ranges.groupby("lane", observed=True):
            compute = compute | _innermost_compute(lane)
    # Host-side ranges mark communication in both modes; on GPU, where Kineto projected
    # them onto a stream, their GPU-side extent (the host side is only the launch).
    marked = ranges[ranges["category"].astype(str).str.startswith("comm:") | (ranges["category"] == "wait")]
    starts, ends, _ = gpu_extent(ev, marked) if gpu else (marked["start_ns"], marked["end_ns"], None)
    for row, s, e in zip(marked.itertuples(), starts, ends):
        if row.kind in COMM_DIMS:
            add(row.kind, int(s), int(e), is_step_end(row.tags))
    for dim, s, e, final in _async_spans(ranges) + ([] if gpu else _worker_spans(ev, ranges)):
        add(dim, s, e, final)
    return Activity(
        rank=rank,
        compute=compute,
        comm={d: union(*comm_parts[d]) for d in COMM_DIMS},
        step_final={d: union(*final_parts[d]) for d in COMM_DIMS},
        gpu=gpu, p2p=p2p, memcpy=memcpy, unknown_groups=unknown,
    )
