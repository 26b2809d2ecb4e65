"""The cross-rank critical path of one step: which rank's work, in which phase, the step waited on.

The dependency graph has one node per *unit* of a rank's main thread (a compute range, a p2p
exchange — overlapping send/recv ranges of one combined op form one unit —, a collective),
edges between consecutive units of a rank, from a send to its matched recv (and, rendezvous,
from a recv to its send), and from every arrival at a collective instance to its leave. Its
longest path is found by walking back from the step's end: inside a unit that waited for a
peer (the peer posted after the unit began) the path leaves through the latest such peer at
the moment it posted; otherwise it stays on the rank and continues with the previous unit.
Time between units is host overhead (``other``). The segments tile the path without overlap,
so their durations add up to its length.

Limits: communication nested inside compute (tp collectives inside ``compute:fwd``) is part
of the compute unit, so a path through tp peers is not followed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

SEGMENT_COLUMNS = ("rank", "stage", "phase", "start_ns", "end_ns", "dur_ns")
_UNIT_CATEGORIES = ("compute", "p2p", "wait", "comm:tp", "comm:cp", "comm:dp", "comm:ep")


@dataclass
class CriticalPath:
    """``segments``: SEGMENT_COLUMNS in time order; ``by_rank_phase``: rank, stage, phase,
    time_s, fraction (of the path); ``length_s`` the path, ``step_time_s`` the measured step
    (median over ranks of their step range)."""

    step: int
    segments: pd.DataFrame
    by_rank_phase: pd.DataFrame
    length_s: float
    step_time_s: float
    span_s: float  # first rank's step start to last rank's step end
    stages: list

    def summary(self) -> dict:
        return {
            "step": self.step, "length_s": self.length_s, "step_time_s": self.step_time_s,
            "span_s": self.span_s,
            "stages": self.stages,
            "by_rank_phase": self.by_rank_phase.to_dict(orient="records"),
        }


@dataclass
class _Unit:
    start: int
    end: int
    phase: str
    waits_on: list  # (peer rank, peer post time) of the peers this unit synchronised with
    nested: list  # (start, end, phase) of compute inside a communication unit (ZB-H1's W's)


def _phase(row) -> str:
    if row.category == "p2p":
        return "pp:transfer" if row.kind == "pp" else f"{row.kind}:transfer"
    return f"{row.kind}:{row.op}"


def _partners(run, step: int) -> dict:
    """event index -> [(peer rank, peer post ns)]: p2p peers and collective co-members."""
    out: dict = {}
    pairs = run.pairs[run.pairs["step"] == step]
    for s_idx, r_idx, src, dst, s0, r0 in zip(pairs["send_index"], pairs["recv_index"], pairs["src"],
                                               pairs["dst"], pairs["send_start_ns"], pairs["recv_start_ns"]):
        out.setdefault(int(s_idx), []).append((int(dst), int(r0)))
        out.setdefault(int(r_idx), []).append((int(src), int(s0)))
    coll = run.collectives[run.collectives["step"] == step]
    for _, inst in coll.groupby("instance"):
        members = list(zip(inst["rank"].astype(int), inst["arrive_ns"].astype(np.int64)))
        for idx, rank in zip(inst["index"], inst["rank"]):
            out.setdefault(int(idx), []).extend((r, int(t)) for r, t in members if r != rank)
    return out


def _units(events: pd.DataFrame, partners: dict) -> list:
    """A rank's main-thread units in time order: overlapping ranges merge into one unit, named
    after its outermost (first) range."""
    units: list = []
    for row in events.sort_values(["start_ns", "end_ns"], ascending=[True, False]).itertuples():
        peers = partners.get(row.Index, [])
        if units and row.start_ns < units[-1].end:
            units[-1].end = max(units[-1].end, int(row.end_ns))
            units[-1].waits_on.extend(peers)
            if row.category == "compute" and not units[-1].phase.startswith("compute:"):
                units[-1].nested.append((int(row.start_ns), int(row.end_ns), _phase(row)))
        else:
            units.append(_Unit(int(row.start_ns), int(row.end_ns), _phase(row), list(peers), []))
    return units


def critical_path(run, step: int | None = None) -> CriticalPath:
    """The critical path of ``step`` (default: the first profiled step) of ``run``."""
    step = run.steps[0] if step is None else step
    if step not in run.steps:
        raise ValueError(f"step {step} was not profiled; profiled steps: {run.steps}")
    ev = run.events
    in_step = (ev["step"] == step).to_numpy() & (ev["lane"] == "main").to_numpy()
    marks = ev[in_step & (ev["category"] == "step").to_numpy()]
    if marks.empty:
        raise ValueError(f"step {step} has no ProfilerStep range on any rank")
    work = ev[in_step & ev["category"].isin(_UNIT_CATEGORIES).to_numpy()]
    partners = _partners(run, step)
    units = {int(r): _units(g, partners) for r, g in work.groupby("rank", observed=True)}
    starts = {int(r): int(t) for r, t in marks.groupby("rank", observed=True)["start_ns"].min().items()}
    ends = marks.groupby("rank", observed=True)["end_ns"].max()
    rank, t = int(ends.idxmax()), int(ends.max())
    floor = min(starts.values())
    stage_of = lambda r: run.layout.coords(r).pp if r < run.layout.world_size else -1  # noqa: E731

    segments = []

    def emit(r, phase, a, b):
        if b > a:
            segments.append((r, stage_of(r), phase, a, b, b - a))

    def emit_unit(r, unit, a, b):
        """[a, b] of a unit, compute nested in it under its own phase (emitted latest first)."""
        for n0, n1, phase in sorted(unit.nested, reverse=True):
            if n1 <= a or n0 >= b:
                continue
            emit(r, unit.phase, min(max(n1, a), b), b)
            emit(r, phase, max(n0, a), min(n1, b))
            b = max(n0, a)
        emit(r, unit.phase, a, b)

    for _ in range(10 * sum(len(u) for u in units.values()) + 10):  # each turn lowers t or a unit index
        unit = next((u for u in reversed(units.get(rank, [])) if u.start < t), None)
        if unit is None or t <= floor:
            emit(rank, "other", max(starts.get(rank, floor), floor), t)
            break
        if unit.end < t:
            emit(rank, "other", unit.end, t)
            t = unit.end
        # a == t: the message arrived the instant the peer posted (no latency), still a wait
        waited = [(r, a) for r, a in unit.waits_on if unit.start < a <= t]
        if waited:
            peer, arrival = max(waited, key=lambda x: x[1])
            emit_unit(rank, unit, arrival, t)
            rank, t = peer, arrival
        else:
            emit_unit(rank, unit, unit.start, t)
            t = unit.start
    seg = pd.DataFrame(segments[::-1], columns=list(SEGMENT_COLUMNS))
    length = int(seg["dur_ns"].sum()) if len(seg) else 0
    by = seg.groupby(["rank", "stage", "phase"], as_index=False)["dur_ns"].sum()
    by["time_s"] = by.pop("dur_ns") / 1e9
    by["fraction"] = by["time_s"] / (length / 1e9) if length else 0.0
    stages = sorted(int(s) for s in seg.loc[seg["phase"].str.startswith("compute:"), "stage"].unique())
    return CriticalPath(
        step=step, segments=seg, by_rank_phase=by.sort_values("time_s", ascending=False).reset_index(drop=True),
        length_s=length / 1e9, span_s=(int(ends.max()) - floor) / 1e9, step_time_s=float(marks.groupby("rank", observed=True)["dur_ns"].max().median()) / 1e9,
        stages=stages,
    )
