"""Per-rank timeline lanes and blocks for the pipeline view, derived from ``Run.events``.

This is display geometry only: which range goes on which row, where, in what colour group.
Nothing here attributes time (that is the analyzers' job); the grey "idle" segments are simply the
gaps in a rank's compute row inside the step's pipeline window, drawn so that bubbles are visible.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

#: compute ops -> the phase letter of the Megatron / Zero Bubble pipeline diagrams
PIPELINE_PHASES = {"fwd": "F", "bwd": "B", "bwd_input": "B", "bwd_weight": "W"}
ROWS = ("compute", "p2p", "comm")
_COMM_CATEGORIES = {"comm:tp": "tp", "comm:cp": "cp", "comm:dp": "dp", "comm:ep": "ep", "wait": "wait"}
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


@dataclass
class Timeline:
    blocks: pd.DataFrame  # BLOCK_COLUMNS, times in ms since the step's start
    idle: pd.DataFrame  # step, rank, start_ms, end_ms: compute-row gaps inside the pipeline window
    lanes: list[Lane]
    steps: list[int]
    has_comm: bool
    merged_blocks: int = 0  # blocks folded into neighbours by decimation (0 = every op drawn)
    step_spans_ms: dict = field(default_factory=dict)  # step -> (0, end of that step in ms)

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
    row[compute] = "compute"

    p2p = category == "p2p"
    op_text = op.fillna("").astype(str)
    phase[p2p] = np.where(op_text[p2p].str.startswith("send"), "send",
                          np.where(op_text[p2p].str.startswith("recv"), "recv", "p2p"))
    row[p2p] = "p2p"

    comm = category.isin(list(_COMM_CATEGORIES))
    phase[comm] = category[comm].map(_COMM_CATEGORIES)
    row[comm] = "comm"
    return phase, row


def _kernel_fallback(events: pd.DataFrame) -> pd.DataFrame:
    """Traces without pptrace ranges (plain GPU traces): show kernels instead, so the page is
    still a timeline, with compute kernels on the compute row and NCCL kernels on the comm row."""
    kernels = events[events["category"].isin(["kernel_compute", "kernel_comm"])].copy()
    comm = kernels["category"].astype(object) == "kernel_comm"
    kernels["phase"] = np.where(comm, "nccl", "kernel")
    kernels["row"] = np.where(comm, "comm", "compute")
    return kernels


def step_origins(events: pd.DataFrame) -> dict[int, tuple[int, int]]:
    """step -> (start_ns, end_ns) over all ranks, from the ProfilerStep#N ranges (aligned clocks)."""
    marks = events[(events["category"] == "step") & (events["step"] >= 0)]
    if marks.empty:  # no ProfilerStep ranges: the step column still groups the events
        marks = events[events["step"] >= 0]
    spans = marks.groupby("step")[["start_ns", "end_ns"]].agg({"start_ns": "min", "end_ns": "max"})
    return {int(s): (int(r.start_ns), int(r.end_ns)) for s, r in spans.iterrows()}


def lanes_for(layout, ranks) -> list[Lane]:
    """Ranks grouped by pipeline stage (pp coordinate), stage 0 on top; a small gap between stages."""
    ordered = sorted(ranks, key=lambda r: (layout.coords(r).pp, r))
    lanes, y, previous_stage = [], 0.0, None
    for r in ordered:
        stage = layout.coords(r).pp
        if previous_stage is not None and stage != previous_stage:
            y += 0.6
        lanes.append(Lane(rank=int(r), stage=stage, label=f"rank {r} · {layout.describe(r)}", y=y))
        y += len(ROWS)
        previous_stage = stage
    return lanes


def _idle_gaps(blocks: pd.DataFrame) -> pd.DataFrame:
    """Gaps in each rank's compute row inside the pipeline window (first to last pipeline op of
    the step across all ranks)."""
    rows = []
    for step, sb in blocks.groupby("step", sort=True):
        pipeline = sb[sb["phase"].isin(["F", "B", "W", "send", "recv", "p2p"])]
        if pipeline.empty:
            continue
        lo, hi = pipeline["start_ms"].min(), pipeline["end_ms"].max()
        compute = sb[sb["row"] == "compute"]
        for rank in sb["rank"].unique():
            mine = compute[compute["rank"] == rank].sort_values("start_ms")
            cursor = lo
            for start, end in zip(mine["start_ms"].to_numpy(), mine["end_ms"].to_numpy()):
                if start > cursor:
                    rows.append((step, rank, cursor, min(start, hi)))
                cursor = max(cursor, end)
                if cursor >= hi:
                    break
            if cursor < hi:
                rows.append((step, rank, cursor, hi))
    idle = pd.DataFrame(rows, columns=["step", "rank", "start_ms", "end_ms"])
    return idle[idle["end_ms"] > idle["start_ms"]].reset_index(drop=True)


def decimate(blocks: pd.DataFrame, max_blocks: int) -> tuple[pd.DataFrame, int]:
    """Fold neighbouring blocks of one (step, rank, row, phase) that are closer than a pixel at
    full view, until at most about ``max_blocks`` remain. Nobody can see them apart unzoomed, and
    the drawing and the HTML size stay bounded on large runs. Merged blocks say how many ops they hold."""
    if len(blocks) <= max_blocks:
        return blocks, 0
    span = max(float(blocks["end_ms"].max() - blocks["start_ms"].min()), 1e-9)
    out, gap = blocks, span / 20000.0
    while len(out) > max_blocks and gap < span:
        out = _merge_close(out, gap)
        gap *= 4
    return out, len(blocks) - len(out)


def _merge_close(blocks: pd.DataFrame, gap: float) -> pd.DataFrame:
    b = blocks.sort_values(["step", "rank", "row", "phase", "start_ms"]).reset_index(drop=True)
    key = b[["step", "rank", "row", "phase"]]
    same = (key == key.shift()).all(axis=1).to_numpy()
    running_end = b.groupby(["step", "rank", "row", "phase"])["end_ms"].cummax().shift().to_numpy()
    joins = same & (b["start_ms"].to_numpy() - np.nan_to_num(running_end, nan=-np.inf) <= gap)
    group = np.cumsum(~joins)
    agg = b.groupby(group).agg(
        step=("step", "first"), rank=("rank", "first"), row=("row", "first"),
        phase=("phase", "first"), start_ms=("start_ms", "min"), end_ms=("end_ms", "max"),
        dur_ns=("dur_ns", "sum"), name=("name", "first"), mb=("mb", "first"),
        chunk=("chunk", "first"), peer=("peer", "first"), bytes=("bytes", "sum"),
        merged=("merged", "sum"),
    )
    return agg.reset_index(drop=True)


def build_timeline(events: pd.DataFrame, layout, steps=None, *, max_blocks: int = 60000) -> Timeline:
    """Blocks per (step, rank, row) with times in ms since that step's start on aligned clocks."""
    origins = step_origins(events)
    wanted = sorted(origins) if steps is None else [s for s in sorted(steps) if s in origins]
    ev = events[events["step"].isin(wanted)]
    contract = ev[ev["category"].isin(["compute", "p2p", *_COMM_CATEGORIES])]
    if "gpu_annotation" in contract.columns:  # GPU projections duplicate the host ranges
        contract = contract[~contract["gpu_annotation"].astype(bool)]
    contract = contract.copy()
    contract["phase"], contract["row"] = _phase_and_row(contract)
    picked = contract if not contract.empty else _kernel_fallback(ev)

    start0 = picked["step"].map({s: origins[s][0] for s in wanted}).astype("int64")
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
    idle = _idle_gaps(blocks)
    blocks, merged = decimate(blocks, max_blocks)
    ranks = sorted(int(r) for r in events["rank"].unique())
    spans = {s: (0.0, (origins[s][1] - origins[s][0]) / 1e6) for s in wanted}
    return Timeline(
        blocks=blocks.reset_index(drop=True), idle=idle, lanes=lanes_for(layout, ranks),
        steps=wanted, has_comm=bool((blocks["row"] == "comm").any()), merged_blocks=merged,
        step_spans_ms=spans,
    )
