"""Step windows: the one definition of when a step, and its pipeline, ran.

- A rank's **step window** is its ``ProfilerStep#N`` range on the main thread (host), or,
  for a rank with GPU work, the span of the GPU activity launched inside that range, cut
  where the next step's first activity starts (the GPU runs behind the host, so the host
  range would hand the tail of step N's kernels to step N+1; see analyzers/gpu_timeline.py).
- A step's **pipeline window** (DESIGN contract 3) runs from the first pass's start to the
  last pass's end across all stages, on aligned clocks; on GPU traces from where that work
  ran, not where it was launched. p2p ranges do not widen it: before the first pass no stage
  can wait for another's output, and after the last nothing is left to wait for. A recv posted
  early waits on its peer's set-up, and torch pipelining waits on its sends only once its
  schedule is done (after its FSDP gradient reduce): counting them put 30-90 ms of a
  torchtitan Interleaved1F1B step's own work into the bubble (issue 42 item 1).

The Run caches these (``run.step_windows``, ``run.pipeline_windows``, ``run.pipeline_spans``);
everything that needs a window (partition, bubble split, what-if, critical path, dashboard) takes it there.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from ..sweeps import isin
from ..vocab import PIPELINE_COMPUTE
from .projection import EXTENT_COLUMNS, KERNEL_CATEGORIES, gpu_extent

#: what a rank's GPU step is made of
GPU_ACTIVITY = (*KERNEL_CATEGORIES, "memcpy")


class Window(NamedTuple):
    """A step's or a pipeline's window, ns on aligned clocks; still a (start, end) pair to
    unpack, so that callers handing in plain pairs (tests, tools) read the same."""

    start_ns: int
    end_ns: int


def host_step_windows(events: pd.DataFrame, steps=None) -> dict:
    """(rank, step) -> Window of ProfilerStep#N on that rank's main thread."""
    marks = events[(events["category"] == "step").to_numpy() & (events["lane_kind"] == "host").to_numpy()]
    if "lane" in marks.columns:
        # a rank's marks on its main thread when it has any there, else on whichever thread
        # recorded them: decided per rank, as another rank's main-thread marks say nothing of it
        on_main = (marks["lane"].astype(str) == "main").to_numpy()
        rank = marks["rank"].to_numpy()
        marks = marks[on_main | ~np.isin(rank, np.unique(rank[on_main]))]
    if steps is not None:
        marks = marks[isin(marks["step"], steps)]
    keys = zip(marks["rank"].to_numpy(np.int64).tolist(), marks["step"].to_numpy(np.int64).tolist())
    spans = map(Window, marks["start_ns"].to_numpy(np.int64).tolist(), marks["end_ns"].to_numpy(np.int64).tolist())
    return dict(zip(keys, spans))


#: Rows read at a time by gpu_step_windows: its temporaries stay a few MB whatever the run.
_CHUNK_ROWS = 1 << 20
#: (rank, step) cells up to which gpu_step_windows keeps a table of them (else a groupby).
_MAX_CELLS = 1 << 24


def gpu_step_windows(events: pd.DataFrame, steps=None) -> dict:
    """(rank, step) -> Window of each step's GPU work, for ranks that have GPU work."""
    work = isin(events["category"], GPU_ACTIVITY) & (events["step"] >= 0).to_numpy()
    if not work.any():
        return {}
    rank_of, step_of = events["rank"].to_numpy(), events["step"].to_numpy()
    n_steps = int(step_of.max()) + 1
    cells = (int(rank_of.max()) + 1) * n_steps
    if rank_of.min() < 0 or cells > _MAX_CELLS:
        work = events.loc[work, ["rank", "step", "start_ns", "end_ns"]]
        g = (work.groupby(["rank", "step"], observed=True)
             .agg(start=("start_ns", "min"), end=("end_ns", "max")).sort_index())
        rank, step = g.index.get_level_values(0).to_numpy(np.int64), g.index.get_level_values(1).to_numpy(np.int64)
        start, end = g["start"].to_numpy(np.int64), g["end"].to_numpy(np.int64)
    else:
        # each (rank, step)'s first start and last end, a slice of rows at a time: a groupby
        # of the selected rows' four columns took 174 MB on a 32-rank MoE-sized GPU run
        first = np.full(cells, np.iinfo(np.int64).max)
        last = np.full(cells, np.iinfo(np.int64).min)
        starts, ends = events["start_ns"].to_numpy(np.int64), events["end_ns"].to_numpy(np.int64)
        for lo in range(0, len(work), _CHUNK_ROWS):
            rows = slice(lo, lo + _CHUNK_ROWS)
            mine = work[rows]
            cell = rank_of[rows][mine].astype(np.int64) * n_steps + step_of[rows][mine]
            np.minimum.at(first, cell, starts[rows][mine])
            np.maximum.at(last, cell, ends[rows][mine])
        cell = np.flatnonzero(last > np.iinfo(np.int64).min)  # (rank, step) order, as sort_index gives
        rank, step, start, end = cell // n_steps, cell % n_steps, first[cell], last[cell]
    # steps never overlap: a step's window stops where the same rank's next step starts
    same_rank_next = np.append(rank[1:] == rank[:-1], False)
    end = np.where(same_rank_next, np.minimum(end, np.append(start[1:], 0)), end)
    keep = np.isin(step, list(steps)) if steps is not None else np.ones(len(step), bool)
    return dict(zip(zip(rank[keep].tolist(), step[keep].tolist()), map(Window, start[keep].tolist(), end[keep].tolist())))


def step_windows(events: pd.DataFrame, steps=None, gpu_ranks=()) -> dict:
    """(rank, step) -> the Window the partition covers: the host step, replaced by the GPU
    step for ``gpu_ranks`` (ranks whose timeline is their GPU's)."""
    windows = host_step_windows(events, steps)
    if len(gpu_ranks):
        gpu = gpu_step_windows(events, set(steps) if steps is not None else None)
        windows.update({(rank, step): w for (rank, step), w in gpu.items()
                        if rank in gpu_ranks and (rank, step) in windows})
    return windows


def pipeline_passes(events: pd.DataFrame) -> np.ndarray:
    """Mask of the pipeline's passes (forward, backward, its halves, a last stage's loss):
    what the pipeline window spans, and where a replay's step ends."""
    return (events["category"] == "compute").to_numpy() & isin(events["op"], PIPELINE_COMPUTE)


def pipeline_windows(events: pd.DataFrame, pp: int, with_p2p: bool = False) -> dict:
    """step -> Window from the first pass's start to the last one's end, across all stages.
    ``with_p2p``: from the first pipeline op (pass or p2p range) to the last, the span a
    replay of the step's programs needs (every send its recvs wait on)."""
    if pp <= 1:
        return {}
    host = ((events["lane_kind"] == "host").to_numpy() & ~events["gpu_annotation"].to_numpy()
            & (events["step"] >= 0).to_numpy())
    pipe = pipeline_passes(events)
    if with_p2p:
        pipe |= (events["category"] == "p2p").to_numpy()
    ops = events.loc[host & pipe, ["step", *(c for c in EXTENT_COLUMNS if c in events.columns)]]
    if ops.empty:
        return {}
    start, end, _ = gpu_extent(events, ops)  # GPU traces: where the work ran, not its launch
    g = pd.DataFrame({"step": ops["step"].to_numpy(np.int64), "s": start, "e": end}).groupby("step")
    lo, hi = g["s"].min(), g["e"].max()
    return dict(zip(lo.index.tolist(), map(Window, lo.to_numpy(np.int64).tolist(), hi.to_numpy(np.int64).tolist())))


def profiled_steps(events: pd.DataFrame) -> tuple[int, ...]:
    """The steps that have a ProfilerStep range on some rank."""
    marks = events.loc[(events["category"] == "step").to_numpy(), "step"].to_numpy(np.int64)
    return tuple(int(s) for s in np.unique(marks[marks >= 0]))
