"""What one rank is doing, as interval sets: computing, and which dimension's communication
is in progress. The step partition (breakdown.py) sweeps these.

Host (CPU/gloo) traces: the thread is *computing* inside ``compute:*`` ranges except where a
communication range is nested in them (model-mode forward contains its TP all-reduces).
A dimension's communication is *in progress* during its ranges and waits, from the launch
of an async op to the end of its annotated wait (the span in which the data may be moving
while the thread does other work), and during gloo worker-thread work enqueued from inside
one of its ranges. GPU traces: non-NCCL kernels compute; NCCL kernels communicate, their
dimension read from the process-group ranks of the collective.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..events import tags_of
from .intervals import Intervals, union

DIMS = ("tp", "cp", "dp", "ep")
#: the step-final collective over all ranks (gradient clipping's norm); DESIGN contract 3.
STEP_FINAL_TAG = ("what", "grad_norm")
_IDENTITY = ("ring_step", "layer", "bucket", "mb", "chunk")


@dataclass(frozen=True)
class Activity:
    rank: int
    compute: Intervals
    comm: dict            # dim -> Intervals (in progress, step-final collective excluded)
    step_final: dict      # dim -> Intervals of the step-final collective
    gpu: bool             # compute/comm came from GPU kernels


def _host_ranges(ev: pd.DataFrame) -> pd.DataFrame:
    return ev[(ev["lane_kind"] == "host") & ~ev["gpu_annotation"] & ev["kind"].notna()]


def _is_step_final(tags_json) -> bool:
    # cheap pre-check: most ranges have no tags or other tags
    if not isinstance(tags_json, str) or STEP_FINAL_TAG[1] not in tags_json:
        return False
    return tags_of(tags_json).get(STEP_FINAL_TAG[0]) == STEP_FINAL_TAG[1]


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
        if row.kind not in DIMS:
            continue
        key = _identity(row, tags_of(row.tags))
        starts = np.asarray(launches.get(key, []), dtype=np.int64)
        lo = previous.get(key, np.iinfo(np.int64).min)
        posted = starts[(starts > lo) & (starts <= row.start_ns)]
        previous[key] = row.start_ns
        if len(posted):
            spans.append((row.kind, int(posted.min()), int(row.end_ns), _is_step_final(row.tags)))
    return spans


def _family(name: str) -> str:
    base = name.split("::")[-1].split(":")[-1].strip("_").replace("_", "").lower()
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
    cfinal = np.array([_is_step_final(t) for t in contract["tags"]], dtype=bool)
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
            if ckind[inner] in DIMS:
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


def _gpu_dim(group_ranks, rank: int, layout) -> str:
    try:
        members = sorted(int(x) for x in str(group_ranks).strip("[]() ").split(",") if x.strip())
    except ValueError:
        members = []
    for dim in ("tp", "cp", "dp"):
        if layout.size(dim) > 1 and rank < layout.world_size and sorted(layout.group_ranks(dim, rank)) == members:
            return dim
    return "dp"  # the world group and unknown groups: data-parallel-like (grad sync, norms)


def rank_activity(ev: pd.DataFrame, rank: int, layout) -> Activity:
    """The activity of one rank from its (aligned) events."""
    ranges = _host_ranges(ev)
    kernels = ev[ev["category"].isin(["kernel_compute", "kernel_comm"])]
    comm_parts = {d: ([], []) for d in DIMS}
    final_parts = {d: ([], []) for d in DIMS}

    def add(dim, s, e, final):
        target = final_parts if final else comm_parts
        target[dim][0].append(s)
        target[dim][1].append(e)

    gpu = not kernels.empty
    if gpu:
        comp = kernels[kernels["category"] == "kernel_compute"]
        compute = union(comp["start_ns"].to_numpy(), comp["end_ns"].to_numpy())
        nccl = kernels[kernels["category"] == "kernel_comm"]
        p2p_like = nccl["name"].astype(str).str.contains("SendRecv|Send_|Recv_", regex=True) | \
            nccl["collective"].astype(str).isin(["send", "recv"])
        for row in nccl[~p2p_like].itertuples():
            add(_gpu_dim(row.group_ranks, rank, layout), row.start_ns, row.end_ns, False)
    else:
        compute = Intervals.empty()
        for _, lane in ranges.groupby("lane", observed=True):
            compute = compute | _innermost_compute(lane)
    # Host-side ranges mark communication in both modes (on GPU they add the launch side).
    for row in ranges[ranges["category"].astype(str).str.startswith("comm:") | (ranges["category"] == "wait")].itertuples():
        if row.kind in DIMS:
            add(row.kind, row.start_ns, row.end_ns, _is_step_final(row.tags))
    for dim, s, e, final in _async_spans(ranges) + ([] if gpu else _worker_spans(ev, ranges)):
        add(dim, s, e, final)
    return Activity(
        rank=rank,
        compute=compute,
        comm={d: union(*comm_parts[d]) for d in DIMS},
        step_final={d: union(*final_parts[d]) for d in DIMS},
        gpu=gpu,
    )


def gpu_p2p_kernels(ev: pd.DataFrame) -> Intervals:
    """NCCL point-to-point kernels (GPU traces): transfer and wait cannot be told apart."""
    nccl = ev[ev["category"] == "kernel_comm"]
    m = nccl["name"].astype(str).str.contains("SendRecv|Send_|Recv_", regex=True) | \
        nccl["collective"].astype(str).isin(["send", "recv"])
    return union(nccl.loc[m, "start_ns"].to_numpy(), nccl.loc[m, "end_ns"].to_numpy())
