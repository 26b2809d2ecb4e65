"""Per-rank timeline lanes and blocks for the pipeline view, from the ranges the caller hands
in (``pptrace.timeline.projection.drawn_ranges``: each where its work ran).

This is display geometry only: which range goes on which row, where, in what colour group.
Nothing here attributes time. The windows and the grey idle are the analysis' own: each
step's x origin is the earliest of the ranks' step windows (``Run.step_windows``, the ones
the partition covers), and the idle of a (rank, step) is exactly its partition's
``pp_bubble`` intervals, so the page and the report cannot disagree about where the bubble is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd

from pptrace.vocab import ACTION_OF, COMM_CATEGORIES, COMM_DIMS

#: compute ops -> the phase letter of the Megatron / Zero Bubble pipeline diagrams, which draw
#: a split backward's input-gradient half as B
PIPELINE_PHASES = {op: "B" if action == "I" else action for op, action in ACTION_OF.items()}
#: the phases drawn as passes, labelled with their microbatch
PASS_PHASES = ("F", "B", "W")
#: a lane's rows, top to bottom: the row of index i sits at Lane.y + i
COMPUTE_ROW, P2P_ROW, COMM_ROW = "compute", "p2p", "comm"
ROWS = (COMPUTE_ROW, P2P_ROW, COMM_ROW)
_COMM_CATEGORIES = {**dict(zip(COMM_CATEGORIES, COMM_DIMS)), "wait": "wait"}
BLOCK_COLUMNS = (
    "step", "rank", "row", "phase", "start_ms", "end_ms", "dur_ns", "name", "mb", "chunk", "peer",
    "bytes", "merged",
)


@dataclass(frozen=True)
class Lane:
    """One rank's rows on the y axis (compute row at ``y``, p2p at ``y + 1``, comm at ``y + 2``)."""

    rank: int
    stage: int
    label: str
    y: float


class Span(NamedTuple):
    """A step's span or its pipeline window on the x axis: ms since the step's origin."""

    start_ms: float
    end_ms: float


@dataclass
class Timeline:
    blocks: pd.DataFrame  # BLOCK_COLUMNS, times in ms since the step's start
    idle: pd.DataFrame  # step, rank, start_ms, end_ms: the step partition's pp_bubble intervals
    lanes: list[Lane]
    steps: list[int]
    has_comm: bool
    merged_blocks: int = 0  # blocks folded into neighbours by decimation (0 = every op drawn)
    merged_idle: int = 0  # pp_bubble intervals folded likewise (0 = every interval drawn)
    step_spans_ms: dict = field(default_factory=dict)  # step -> Span (0, end of that step)
    pipeline_ms: dict = field(default_factory=dict)  # step -> Span of the analysis' pipeline window

    def __post_init__(self):
        missing = set(BLOCK_COLUMNS) - set(self.blocks.columns)
        if missing:
            raise ValueError(f"timeline blocks lack columns {sorted(missing)}")


def _phase_and_row(events: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    category = events["category"].astype(object)
    op = events["op"].astype(object)
    phase = pd.Series(None, index=events.index, dtype=object)
    row = pd.Series(None, index=events.index, dtype=object)

    compute = category == "compute"
    phase[compute] = op[compute].map(PIPELINE_PHASES).fillna("compute")
    row[compute] = COMPUTE_ROW

    p2p = category == "p2p"
    op_text = op.fillna("").astype(str)
    phase[p2p] = np.where(op_text[p2p].str.startswith("send"), "send",
                          np.where(op_text[p2p].str.startswith("recv"), "recv", "p2p"))
    row[p2p] = P2P_ROW

    comm = category.isin(list(_COMM_CATEGORIES))
    phase[comm] = category[comm].map(_COMM_CATEGORIES)
    row[comm] = COMM_ROW
    return phase, row


def _kernel_phase_and_row(kernels: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Kernels drawn in place of ranges (plain GPU traces): compute kernels on the compute
    row, NCCL kernels on the comm row."""
    comm = (kernels["category"].astype(object) == "kernel_comm").to_numpy()
    return np.where(comm, "nccl", "kernel"), np.where(comm, COMM_ROW, COMPUTE_ROW)


def lanes_for(layout, ranks) -> list[Lane]:
    """Ranks grouped by pipeline stage (pp coordinate), stage 0 on top; a small gap between stages."""
    ordered = sorted(ranks, key=lambda r: (layout.coords(r).pp, r))
    lanes, y, previous_stage = [], 0.0, None
    for r in ordered:
        stage = layout.coords(r).pp
        if previous_stage is not None and stage != previous_stage:
            y += 0.6
        lanes.append(Lane(rank=int(r), stage=stage, label=layout.label(r), y=y))
        y += len(ROWS)
        previous_stage = stage
    return lanes


BLOCK_KEYS = ("step", "rank", "row", "phase")  # blocks merge only with their own kind on their row
IDLE_KEYS = ("step", "rank")
# how a merged block's columns come from its parts (the rest: the first part's)
_MERGED = {"start_ms": "min", "end_ms": "max", "dur_ns": "sum", "bubble_ms": "sum", "bytes": "sum", "merged": "sum"}


def decimate(blocks: pd.DataFrame, max_blocks: int, keys=BLOCK_KEYS) -> tuple[pd.DataFrame, int]:
    """Fold neighbouring blocks of one ``keys`` group (default (step, rank, row, phase)) that are
    closer than a pixel at full view, until at most about ``max_blocks`` remain. Nobody can see
    them apart unzoomed, and the drawing and the HTML size stay bounded on large runs. Merged
    blocks say how many ops they hold (``merged``) and what they sum (``dur_ns``, ``bubble_ms``)."""
    if len(blocks) <= max_blocks:
        return blocks, 0
    span = max(float(blocks["end_ms"].max() - blocks["start_ms"].min()), 1e-9)
    out, gap = blocks, span / 20000.0
    while len(out) > max_blocks and gap < span:
        out = _merge_close(out, gap, list(keys))
        gap *= 4
    return out, len(blocks) - len(out)


def _merge_close(blocks: pd.DataFrame, gap: float, keys: list) -> pd.DataFrame:
    b = blocks.sort_values([*keys, "start_ms"]).reset_index(drop=True)
    key = b[keys]
    same = (key == key.shift()).all(axis=1).to_numpy()
    running_end = b.groupby(keys)["end_ms"].cummax().shift().to_numpy()
    joins = same & (b["start_ms"].to_numpy() - np.nan_to_num(running_end, nan=-np.inf) <= gap)
    group = np.cumsum(~joins)
    agg = b.groupby(group).agg(**{c: (c, _MERGED.get(c, "first")) for c in b.columns})
    return agg.reset_index(drop=True)


def _origins(step_windows: dict) -> dict[int, tuple[int, int]]:
    """step -> (earliest start, latest end) of that step's windows over the ranks: one x
    origin per step, so that every rank's lane reads on the same aligned clock."""
    out = {}
    for (_, step), (start, end) in step_windows.items():
        lo, hi = out.get(step, (start, end))
        out[step] = (min(lo, start), max(hi, end))
    return out


def _bubble_intervals(partitions, origin_ns: dict) -> pd.DataFrame:
    """The partition's pp_bubble of every (rank, step), in ms since the step's origin
    (``origin_ns``: step -> its x origin); ``partitions``: analyzers.partition.Partitions."""
    if not len(partitions):
        row = starts = ends = np.zeros(0, np.int64)
        step = rank = row
    else:
        row, starts, ends = partitions.intervals("pp_bubble")
        step, rank = partitions.step[row], partitions.rank[row]
    known = np.array(sorted(origin_ns), dtype=np.int64)
    keep = np.isin(step, known)
    step, rank, starts, ends = step[keep], rank[keep], starts[keep], ends[keep]
    origin = np.array([origin_ns[int(s)] for s in known], dtype=np.int64)[np.searchsorted(known, step)]
    return pd.DataFrame({
        "step": step, "rank": rank,
        # subtract in int64 first: epoch ns do not fit a float64 exactly
        "start_ms": (starts - origin) / 1e6, "end_ms": (ends - origin) / 1e6,
        "bubble_ms": (ends - starts) / 1e6, "merged": np.ones(len(starts), dtype=np.int64),
    })


def build_timeline(ranges: pd.DataFrame, layout, step_windows: dict, pipeline_windows=None,
                   partitions=(), *, ranks=None, steps=None, max_blocks: int = 60000) -> Timeline:
    """Blocks per (step, rank, row) with times in ms since that step's start on aligned clocks.

    ``ranges``: what to draw, where it ran (``projection.drawn_ranges`` of the run's events:
    contract ranges, or kernels where a trace has none). The windows are the analysis' own
    (``Run.step_windows``: (rank, step) -> (start_ns, end_ns); ``Run.pipeline_windows``:
    step -> (start_ns, end_ns)); ``partitions`` are the Partitions (analyzers.partition) the report was built
    from, whose pp_bubble is the grey idle. ``ranks``: the lanes (default: those in ``ranges``)."""
    origins = _origins(step_windows)
    wanted = sorted(origins) if steps is None else [s for s in sorted(set(steps)) if s in origins]
    origins = {s: origins[s] for s in wanted}
    origin_ns = {s: lo for s, (lo, _) in origins.items()}
    picked = ranges[ranges["step"].isin(wanted)]
    kernels = picked["category"].astype(object).isin(["kernel_compute", "kernel_comm"])
    if len(picked) and kernels.all():
        phase, row = _kernel_phase_and_row(picked)
    else:
        picked = picked[~kernels.to_numpy()]
        phase, row = _phase_and_row(picked)
    picked = picked.assign(phase=phase, row=row)

    start0 = picked["step"].map(origin_ns).astype("int64")
    blocks = pd.DataFrame({
        "step": picked["step"].astype(int).to_numpy(),
        "rank": picked["rank"].astype(int).to_numpy(),
        "row": picked["row"].astype(str).to_numpy(),
        "phase": picked["phase"].astype(str).to_numpy(),
        # subtract in int64 first: epoch ns do not fit a float64 exactly
        "start_ms": (picked["start_ns"] - start0).to_numpy() / 1e6,
        "end_ms": (picked["end_ns"] - start0).to_numpy() / 1e6,
        "dur_ns": picked["dur_ns"].astype("int64").to_numpy(),
        "name": picked["name"].astype(str).to_numpy(),
        "mb": picked["mb"].to_numpy(dtype=float, na_value=np.nan),
        "chunk": picked["chunk"].to_numpy(dtype=float, na_value=np.nan),
        "peer": picked["peer"].to_numpy(dtype=float, na_value=np.nan),
        "bytes": picked["bytes"].to_numpy(dtype=float, na_value=np.nan),
        "merged": np.ones(len(picked), dtype=np.int64),
    })
    blocks, merged = decimate(blocks, max_blocks)
    # a GPU trace's bubble can be every gap between two kernels: as many intervals as kernels
    idle, merged_idle = decimate(_bubble_intervals(partitions, origin_ns), max_blocks, IDLE_KEYS)
    ranks = sorted(int(r) for r in (ranges["rank"].unique() if ranks is None else ranks))
    pipes = {s: Span((lo - origin_ns[s]) / 1e6, (hi - origin_ns[s]) / 1e6)
             for s, (lo, hi) in (pipeline_windows or {}).items() if s in origins}
    return Timeline(
        blocks=blocks.reset_index(drop=True),
        idle=idle.reset_index(drop=True), merged_idle=merged_idle,
        lanes=lanes_for(layout, ranks), steps=wanted, has_comm=bool((blocks["row"] == COMM_ROW).any()),
        merged_blocks=merged, step_spans_ms={s: Span(0.0, (hi - lo) / 1e6) for s, (lo, hi) in origins.items()},
        pipeline_ms=pipes,
    )
