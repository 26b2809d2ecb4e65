"""The cross-rank critical path of one step: which rank's work, in which phase, the step waited on.

The dependency graph has one node per *unit* of a rank's main thread — a stretch of work
(a compute range, a collective; overlapping ranges merge, so tp collectives inside
``compute:fwd`` are part of it) or a p2p exchange (pptrace.ingest.exchanges: the ranges
nested in its first one) — with edges between consecutive units of a rank, from a send to
its matched recv (and, rendezvous, from a recv to its send), and from every arrival at a
collective instance to its leave. Its longest path is found by walking back from the step's
end. Inside work, the path stays on the rank, unless the unit waited for a peer (a
collective co-member arrived after it began): then it leaves through the latest such peer
at the moment it arrived. Outside work, the rank sat in the open exchange that ended first
(the one it was waiting on) since its last work or exchange ended: if a peer of that
exchange posted meanwhile, the path leaves through the latest one; else it stays. Passes run
while an exchange is open (ZB-H1's W's, overlap_p2p_comm's forward and backward exchanges,
open at once, each waited on its own) are work like any other, so a peer that posted while
the rank computed does not pull the path away. Time outside every unit is host overhead
(``other``). The segments tile the path without overlap, so their durations add up to its
length.

Limits: communication nested inside compute is part of the compute unit, so a path through
tp peers is not followed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..ingest import exchanges
from ..ingest.schema import COMM_CATEGORIES

SEGMENT_COLUMNS = ("rank", "stage", "phase", "start_ns", "end_ns", "dur_ns")
_UNIT_CATEGORIES = ("compute", "p2p", "wait", *COMM_CATEGORIES)
_COLUMNS = ["rank", "step", "category", "kind", "op", "start_ns", "end_ns", "dur_ns"]


@dataclass
class CriticalPath:
    """``segments``: SEGMENT_COLUMNS in time order; ``by_rank_phase``: rank, stage, phase,
    time_s, fraction (of the path); ``length_s`` the path, ``step_time_s`` the measured step
    (median over ranks of their step range); ``exchanges``: p2p event index -> the exchange
    it was walked as."""

    step: int
    segments: pd.DataFrame
    by_rank_phase: pd.DataFrame
    length_s: float
    step_time_s: float
    span_s: float  # first rank's step start to last rank's step end
    stages: list
    exchanges: pd.Series

    def summary(self) -> dict:
        return {
            "step": self.step, "length_s": self.length_s, "step_time_s": self.step_time_s,
            "span_s": self.span_s,
            "stages": self.stages,
            "by_rank_phase": self.by_rank_phase.to_dict(orient="records"),
        }


@dataclass
class _Units:
    """One rank's units in a step: ``start``, ``end`` (ns arrays), ``phase`` and ``waits``
    ((peer rank, peer post ns) of the peers each synchronised with) per unit."""

    start: np.ndarray
    end: np.ndarray
    phase: list
    waits: list


@dataclass
class _Rank:
    work: _Units       # disjoint, in time order
    exchanges: _Units  # in order of their start; open at once where overlap_p2p_comm posted both


def _phase(category: str, kind: str, op: str) -> str:
    if category == "p2p":
        return f"{kind}:transfer"
    return f"{kind}:{op}"


def _partners(pairs: pd.DataFrame, coll: pd.DataFrame | None) -> dict:
    """event index -> [(peer rank, peer post ns)]: p2p peers and collective co-members."""
    out: dict = {}
    for s_idx, r_idx, src, dst, s0, r0 in zip(pairs["send_index"], pairs["recv_index"], pairs["src"],
                                               pairs["dst"], pairs["send_start_ns"], pairs["recv_start_ns"]):
        out.setdefault(int(s_idx), []).append((int(dst), int(r0)))
        out.setdefault(int(r_idx), []).append((int(src), int(s0)))
    if coll is not None:
        for _, inst in coll.groupby("instance"):
            members = list(zip(inst["rank"].astype(int), inst["arrive_ns"].astype(np.int64)))
            for idx, rank in zip(inst["index"], inst["rank"]):
                out.setdefault(int(idx), []).extend((r, int(t)) for r, t in members if r != rank)
    return out


def _group(rows: pd.DataFrame, ids: np.ndarray, partners: dict) -> _Units:
    """Units of ``rows`` grouped by ``ids`` (rows in time order): a unit spans its rows and
    is named after its first."""
    if not len(rows):
        return _Units(np.zeros(0, np.int64), np.zeros(0, np.int64), [], [])
    g = pd.DataFrame({"id": ids, "start": rows["start_ns"].to_numpy(np.int64),
                      "end": rows["end_ns"].to_numpy(np.int64)}).groupby("id", sort=True)
    first = g.cumcount().to_numpy() == 0
    heads = rows[first]
    phase = [_phase(c, k, o) for c, k, o in zip(heads["category"].astype(str), heads["kind"].astype(str),
                                                 heads["op"].astype(str))]
    order = {u: i for i, u in enumerate(np.unique(ids))}
    waits: list = [[] for _ in order]
    for i in np.flatnonzero(rows.index.isin(list(partners))):
        waits[order[ids[i]]].extend(partners[int(rows.index[i])])
    return _Units(g["start"].min().to_numpy(), g["end"].max().to_numpy(), phase, waits)


def _units(rows: pd.DataFrame, exchange: pd.Series, partners: dict) -> _Rank:
    """A rank's units in one step; ``exchange``: its p2p ranges' exchanges (event index -> id)."""
    rows = rows.sort_values(["start_ns", "end_ns"], ascending=[True, False], kind="stable")
    p2p = (rows["category"] == "p2p").to_numpy()
    ex_rows, work_rows = rows[p2p], rows[~p2p]
    ex = _group(ex_rows, exchange.reindex(ex_rows.index).to_numpy(), partners)
    end = work_rows["end_ns"].to_numpy(np.int64)
    reach = np.maximum.accumulate(end) if len(end) else end
    work_ids = np.cumsum(np.r_[True, work_rows["start_ns"].to_numpy(np.int64)[1:] >= reach[:-1]]) \
        if len(end) else np.zeros(0, np.int64)
    work = _group(work_rows, work_ids, partners)
    # An exchange inside work (cp's ring inside compute:fwd) is part of that work.
    k = np.searchsorted(work.start, ex.start, side="right") - 1
    inside = (k >= 0) & (ex.end <= work.end[np.maximum(k, 0)]) if len(work.start) else np.zeros(len(ex.start), bool)
    for i in np.flatnonzero(inside):
        work.waits[k[i]].extend(ex.waits[i])
    keep = ~inside
    ex = _Units(ex.start[keep], ex.end[keep], [p for p, o in zip(ex.phase, keep) if o],
                [w for w, o in zip(ex.waits, keep) if o])
    return _Rank(work, ex)


def _main_rows(run) -> pd.DataFrame:
    ev = run.events
    keep = (ev["lane"] == "main").to_numpy() & ev["category"].isin(list(_UNIT_CATEGORIES)).to_numpy()
    return ev.loc[keep, _COLUMNS]


def critical_path(run, step: int | None = None) -> CriticalPath:
    """The critical path of ``step`` (default: the first profiled step) of ``run``."""
    step = run.steps[0] if step is None else step
    if step not in run.steps:
        raise ValueError(f"step {step} was not profiled; profiled steps: {run.steps}")
    rows = _main_rows(run)
    pairs = run.pairs
    coll = run.collectives
    return _path(run, step, rows[(rows["step"] == step).to_numpy()], pairs[(pairs["step"] == step).to_numpy()],
                 None if coll is None else coll[(coll["step"] == step).to_numpy()])


def _path(run, step: int, rows: pd.DataFrame, pairs: pd.DataFrame, coll) -> CriticalPath:
    windows = {r: w for (r, s), w in run.step_windows.items() if s == step}
    if not windows:
        raise ValueError(f"step {step} has no ProfilerStep range on any rank")
    work = rows[rows["category"].isin(_UNIT_CATEGORIES).to_numpy()]
    partners = _partners(pairs, coll)
    p2p = work[(work["category"] == "p2p").to_numpy()]
    ids = pd.Series(exchanges.exchange_ids(p2p["rank"], p2p["start_ns"], p2p["end_ns"], p2p["kind"].astype(str)),
                    index=p2p.index, dtype=np.int64)
    units = {int(r): _units(g, ids, partners) for r, g in work.groupby("rank", observed=True)}
    starts = {r: w[0] for r, w in windows.items()}
    rank, t = max(((r, w[1]) for r, w in windows.items()), key=lambda x: (x[1], -x[0]))
    floor = min(starts.values())
    stage_of = lambda r: run.layout.coords(r).pp if r < run.layout.world_size else -1  # noqa: E731

    segments = []

    def emit(r, phase, a, b):
        if b > a:
            segments.append((r, stage_of(r), phase, a, b, b - a))

    def latest_before(times: np.ndarray, t: int) -> int | None:
        before = times[times < t]
        return int(before.max()) if before.size else None

    n_units = sum(len(u.work.start) + len(u.exchanges.start) for u in units.values())
    for _ in range(10 * n_units + 10):  # each turn lowers t or moves to a peer that posted earlier
        mine = units.get(rank)
        if mine is None or t <= floor:
            emit(rank, "other", max(starts.get(rank, floor), floor), t)
            break
        w, x = mine.work, mine.exchanges
        i = int(np.searchsorted(w.end, t, side="left"))  # the first work ending at or after t
        if i < len(w.start) and w.start[i] < t:
            lo, phase, waits = int(w.start[i]), w.phase[i], w.waits[i]
        else:
            open_ = np.flatnonzero((x.start < t) & (x.end >= t))
            if not len(open_):  # between units: host overhead
                last = [e for e in (latest_before(w.end, t), latest_before(x.end, t)) if e is not None]
                if not last:
                    emit(rank, "other", max(starts.get(rank, floor), floor), t)
                    break
                emit(rank, "other", max(last), t)
                t = max(last)
                continue
            j = int(open_[np.argmin(x.end[open_])])  # the exchange being waited on
            # blocked in it since the rank last finished something, work or another exchange
            lo = max(e for e in (int(x.start[j]), latest_before(w.end, t), latest_before(x.end, t)) if e is not None)
            phase, waits = x.phase[j], x.waits[j]
        # a == t: the message arrived the instant the peer posted (no latency), still a wait
        waited = [(r, a) for r, a in waits if lo < a <= t]
        if waited:
            peer, arrival = max(waited, key=lambda p: p[1])
            emit(rank, phase, arrival, t)
            rank, t = peer, arrival
        else:
            emit(rank, phase, lo, t)
            t = lo
    seg = pd.DataFrame(segments[::-1], columns=list(SEGMENT_COLUMNS))
    length = int(seg["dur_ns"].sum()) if len(seg) else 0
    by = seg.groupby(["rank", "stage", "phase"], as_index=False)["dur_ns"].sum()
    by["time_s"] = by.pop("dur_ns") / 1e9
    by["fraction"] = by["time_s"] / (length / 1e9) if length else 0.0
    stages = sorted(int(s) for s in seg.loc[seg["phase"].str.startswith("compute:"), "stage"].unique())
    return CriticalPath(
        step=step, segments=seg, by_rank_phase=by.sort_values("time_s", ascending=False).reset_index(drop=True),
        length_s=length / 1e9, span_s=(max(w[1] for w in windows.values()) - floor) / 1e9,
        step_time_s=float(np.median([e - s for s, e in windows.values()])) / 1e9,
        stages=stages, exchanges=ids,
    )


def step_bounds(run) -> list[dict]:
    """Per profiled step, what bounded it: the critical path's length and the measured step
    (s), how much of the path was compute, p2p (pipeline and cp exchanges), collectives and
    host overhead (s, summing to the length), the ranks and the stages it ran through, and
    one line saying it. [] for a run without a pipeline; steps the traces cannot walk
    (no step range on any rank) are left out."""
    if run.layout.pp < 2 or not run.steps:
        return []
    rows = _main_rows(run)
    pairs = run.pairs
    coll = run.collectives
    by_step = {s: g for s, g in rows.groupby("step", observed=True)}
    pairs_by = {s: g for s, g in pairs.groupby("step")}
    coll_by = {s: g for s, g in coll.groupby("step")} if coll is not None else {}
    out = []
    for step in run.steps:
        mine = by_step.get(step)
        if mine is None or not any(s == step for _, s in run.step_windows):
            continue
        path = _path(run, step, mine, pairs_by.get(step, pairs.iloc[:0]), coll_by.get(step))
        out.append(_bound(path))
    return out


def _bound(path: CriticalPath) -> dict:
    seg = path.segments
    phase, dur = seg["phase"], seg["dur_ns"].to_numpy() / 1e9
    parts = {
        "compute_s": float(dur[phase.str.startswith("compute:").to_numpy()].sum()),
        "p2p_s": float(dur[phase.str.endswith(":transfer").to_numpy()].sum()),
        "other_s": float(dur[(phase == "other").to_numpy()].sum()),
    }
    parts["comm_s"] = max(path.length_s - sum(parts.values()), 0.0)
    ranks = sorted(int(r) for r in seg["rank"].unique())
    names = {"compute_s": "compute", "p2p_s": "p2p", "comm_s": "collectives", "other_s": "host overhead"}
    line = f"step {path.step}: no critical path"
    if path.length_s > 0:
        main = max(parts, key=parts.get)
        top = path.by_rank_phase.iloc[0]
        shares = ", ".join(f"{name} {parts[k] / path.length_s:.0%}" for k, name in names.items()
                           if parts[k] >= 0.005 * path.length_s)
        line = (f"step {path.step} bound by {names[main]}: {path.length_s * 1e3:.1f} ms path through "
                f"{len(ranks)} rank(s) ({shares}); largest: rank {int(top['rank'])} {top['phase']} "
                f"{top['fraction']:.0%}")
    return {"step": path.step, "length_s": path.length_s, "step_time_s": path.step_time_s,
            **{k: parts[k] for k in ("compute_s", "p2p_s", "comm_s", "other_s")},
            "ranks": ranks, "stages": path.stages, "summary": line}
