"""The cross-rank critical path of one step: which rank's work, in which phase, the step waited on.

The dependency graph has one node per *unit* of a rank's main thread — a stretch of work
(a compute range, a collective; overlapping ranges merge, so tp collectives inside
``compute:fwd`` are part of it) or a p2p exchange (pptrace.timeline.exchanges: the ranges
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

from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..timeline import exchanges
from ..timeline.programs import main_thread_work
from ..sweeps import running_max

SEGMENT_COLUMNS = ("rank", "stage", "phase", "start_ns", "end_ns", "dur_ns")
#: A segment's phase: "<kind>:<op>" of work (COMPUTE_PREFIX: a pass), "<kind>" + TRANSFER_SUFFIX
#: of a p2p exchange, OVERHEAD_PHASE for time in no unit. The summary adds them up by these.
COMPUTE_PREFIX, TRANSFER_SUFFIX, OVERHEAD_PHASE = "compute:", ":transfer", "other"
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
class _Graph:
    """The units of every (step, rank) of some rows, all at once, as flat lists the walk reads
    with bisect. Group ``k = step code * n_ranks + rank`` owns work units
    ``w_at[k]:w_at[k + 1]`` (disjoint, in time order, so their ends ascend too) and exchange
    units ``x_at[k]:x_at[k + 1]``, in order of their end, then exchange id (so the first open
    one is the one waited on: the earliest to end, of a tie the first posted). Unit ``u``
    (work) or ``n_work + j`` (exchange) synchronised with its p2p peers ``wait_rank``/
    ``wait_t`` (peer post ns) ``wait_at[u]:wait_at[u + 1]``, in order of ``wait_t``, and among
    equal times in reverse partner order: the last one at or before t is then the latest
    peer, of a tie the first partner (see _entries); ``wait_key`` is each one's partner
    order. Its collectives are ``ref_*[ref_at[u]:ref_at[u + 1]]``: each names its instance's
    members ``inst_*[inst_at[g]:inst_at[g + 1]]`` (by arrival, of a tie the first member
    last) and the rank to skip there, its own. Listing every member against every other, as
    the p2p peers are, would take n**2 entries for an instance of n ranks (1M per step for
    a global all-reduce on 1,024 ranks); the walk searches the instance instead."""

    steps: np.ndarray  # step code -> step
    n_ranks: int
    w_start: list
    w_end: list
    w_phase: list
    w_at: list
    x_start: list
    x_start_arr: np.ndarray
    x_end: list
    x_phase: list
    x_at: list
    wait_rank: list
    wait_t: list
    wait_at: list
    wait_key: list
    ref_inst: list   # the instance's group g
    ref_rank: list   # the member's own rank, skipped among the others
    ref_key: list    # its partner order before its co-member's position
    ref_at: list
    inst_t: list
    inst_rank: list
    inst_pos: list
    inst_at: list
    p2p_index: pd.Index      # the p2p ranges, in row order ...
    p2p_step: np.ndarray     # ... their step ...
    p2p_exchange: np.ndarray  # ... and exchange, numbered per step as exchanges.exchange_ids does


def _phases(rows: pd.DataFrame, at: np.ndarray, p2p: bool) -> list:
    """The phase of the units named after ``rows`` at positions ``at``."""
    def text(col):  # as f"{value}" writes it: a missing one reads "nan"
        return rows[col].iloc[at].astype(str).fillna("nan").to_numpy(dtype=object)
    return (text("kind") + (TRANSFER_SUFFIX if p2p else ":" + text("op"))).tolist()


def _exchange_ids(step_code, rank, start, end, kind, n_ranks) -> tuple:
    """Per p2p range, its exchange as exchanges.exchange_ids numbers each step's ranges on
    their own (by rank, then kind in order of first appearance in the step, a missing kind
    first, then start), offset so that the ids of all steps run on; and each step's first id."""
    kinds = pd.factorize(np.asarray(kind, dtype=object))[0].astype(np.int64)
    n_kinds = int(kinds.max()) + 2
    key = step_code * n_kinds + kinds + 1
    seen, first = np.unique(key, return_index=True)
    by = np.lexsort((first, seen % n_kinds == 0, seen // n_kinds))
    step_of = seen[by] // n_kinds
    code = np.empty(len(seen), np.int64)
    code[by] = np.arange(len(seen)) - np.searchsorted(step_of, step_of)
    code[seen % n_kinds == 0] = -1
    lane = (step_code * n_ranks + rank) * n_kinds + 1 + code[np.searchsorted(seen, key)]
    ids = exchanges.exchange_ids(lane, start, end)
    step_first = np.full(int(step_code.max()) + 1, np.iinfo(np.int64).max)
    np.minimum.at(step_first, step_code, ids)
    return ids, step_first


#: Collectives of up to this many members list every member against every other (a bisect
#: over one list answers the walk fastest); larger ones are searched per instance (_members),
#: which keeps the graph linear in members (a global all-reduce of 1,024 ranks would list 1M).
_PAIRWISE_MAX = 32


def _member_order(coll) -> tuple:
    """The members in instance order (step, instance, row): step, instance, rank, event
    index, arrival, and each member's instance number and that instance's size."""
    c_step, inst = coll["step"].to_numpy(np.int64), coll["instance"].to_numpy(np.int64)
    order = np.lexsort((np.arange(len(coll)), inst, c_step))
    c_step, inst = c_step[order], inst[order]
    new = np.r_[True, (c_step[1:] != c_step[:-1]) | (inst[1:] != inst[:-1])]
    group = np.cumsum(new) - 1
    size = np.bincount(group)[group]
    return (c_step, inst, coll["rank"].to_numpy(np.int64)[order], coll["index"].to_numpy(np.int64)[order],
            coll["arrive_ns"].to_numpy(np.int64)[order], group, size)


def _entries(pairs: pd.DataFrame, coll) -> tuple:
    """Partner entries (step, event index, peer rank, peer post ns), then the keys of their
    order, which picks among peers that posted at one instant: p2p peers by pair (a send's
    before its recv's), then collective co-members by instance, the event's row, the
    member's row. Collectives of more than _PAIRWISE_MAX members are left to _members."""
    n = len(pairs)
    pos = np.arange(n, dtype=np.int64)
    parts = [(np.tile(pairs["step"].to_numpy(np.int64), 2),
              np.r_[pairs["send_index"].to_numpy(np.int64), pairs["recv_index"].to_numpy(np.int64)],
              np.r_[pairs["dst"].to_numpy(np.int64), pairs["src"].to_numpy(np.int64)],
              np.r_[pairs["recv_start_ns"].to_numpy(np.int64), pairs["send_start_ns"].to_numpy(np.int64)],
              np.zeros(2 * n, np.int64), np.r_[2 * pos, 2 * pos + 1], np.zeros(2 * n, np.int64),
              np.zeros(2 * n, np.int64))]
    if coll is not None and len(coll):
        c_step, inst, c_rank, c_index, arrive, group, size = _member_order(coll)
        small = np.flatnonzero(size <= _PAIRWISE_MAX)
        head = small[np.r_[True, group[small][1:] != group[small][:-1]]] if len(small) else small
        size = size[head]
        # every member against every member of its instance
        m = np.repeat(size, size)
        own = np.repeat(small, m)
        begin = np.repeat(np.repeat(head, size), m)
        member = begin + np.arange(len(own)) - np.repeat(np.cumsum(m) - m, m)
        other = c_rank[own] != c_rank[member]
        own, member = own[other], member[other]
        parts.append((c_step[own], c_index[own], c_rank[member], arrive[member], np.ones(len(own), np.int64),
                      inst[own], own, member))
    return tuple(np.concatenate(col) for col in zip(*parts))


def _members(coll) -> tuple:
    """The members of collectives of more than _PAIRWISE_MAX ranks, in instance order: per
    member its step, event index, rank, instance id, position (in _member_order) and
    instance number g, and each instance's members by arrival (of a tie the first position
    last: the walk's last one at or before t is then the latest, of a tie the first) as
    (arrival, rank, position) with where each instance begins. A member's co-members come
    in partner order as in _entries: by instance, own position, co-member position."""
    c_step, inst, c_rank, c_index, arrive, group, size = _member_order(coll)
    big = np.flatnonzero(size > _PAIRWISE_MAX)
    group = np.unique(group[big], return_inverse=True)[1].astype(np.int64) if len(big) else big
    by_arrival = np.lexsort((-big, arrive[big], group))
    inst_at = np.searchsorted(group[by_arrival], np.arange((int(group.max()) + 2) if len(big) else 1)).tolist()
    return (c_step[big], c_index[big], c_rank[big], inst[big], big, group,
            (arrive[big][by_arrival].tolist(), c_rank[big][by_arrival].tolist(), big[by_arrival].tolist(), inst_at))


def _graph(rows: pd.DataFrame, pairs: pd.DataFrame, coll) -> _Graph:
    """The units of ``rows`` (main-thread ranges of any steps), with the partners of the
    steps' ``pairs`` and collectives ``coll`` (None: none)."""
    n = len(rows)
    steps, step_code = np.unique(rows["step"].to_numpy(np.int64), return_inverse=True)
    step_code = step_code.astype(np.int64)
    rank = rows["rank"].to_numpy(np.int64)
    start, end = rows["start_ns"].to_numpy(np.int64), rows["end_ns"].to_numpy(np.int64)
    n_ranks = int(rank.max()) + 1 if n else 0
    group = step_code * n_ranks + rank
    n_groups = len(steps) * n_ranks
    is_p2p = (rows["category"] == "p2p").to_numpy()
    # each rank's rows in time order, longest first at one start, then in row order
    order = np.lexsort((np.arange(n), -end, start, group))
    time_pos = np.empty(n, np.int64)
    time_pos[order] = np.arange(n)

    # work: overlapping ranges merge; a unit is named after its first range
    wo = order[~is_p2p[order]]
    wg, ws, we = group[wo], start[wo], end[wo]
    reach = running_max(wg, we)
    new = np.r_[True, (wg[1:] != wg[:-1]) | (ws[1:] >= reach[:-1])] if len(wo) else np.zeros(0, bool)
    heads = np.flatnonzero(new)
    w_unit = np.cumsum(new) - 1
    w_start, w_group = ws[heads], wg[heads]
    w_end = np.maximum.reduceat(we, heads) if len(heads) else we
    n_work = len(heads)

    # exchanges: the p2p ranges nested in their first one
    pf = np.flatnonzero(is_p2p)
    if len(pf):
        ids, step_first = _exchange_ids(step_code[pf], rank[pf], start[pf], end[pf], rows["kind"].iloc[pf].astype(str),
                                        n_ranks)
    else:
        ids, step_first = np.zeros(0, np.int64), np.zeros(len(steps), np.int64)
    n_ex = int(ids.max()) + 1 if len(ids) else 0
    by_id = pf[np.argsort(ids, kind="stable")]
    id_sorted = np.sort(ids)
    id_head = np.flatnonzero(np.r_[True, id_sorted[1:] != id_sorted[:-1]]) if n_ex else np.zeros(0, np.int64)
    x_start = np.minimum.reduceat(start[by_id], id_head) if n_ex else np.zeros(0, np.int64)
    x_end = np.maximum.reduceat(end[by_id], id_head) if n_ex else np.zeros(0, np.int64)
    x_group = group[by_id[id_head]]
    # named after its first range in time order
    xo = order[is_p2p[order]]
    ex_of_row = np.full(n, -1, np.int64)
    ex_of_row[pf] = ids
    x_name = xo[np.unique(ex_of_row[xo], return_index=True)[1]]
    x_phase = np.array(_phases(rows, x_name, True), dtype=object)

    # An exchange inside work (cp's ring inside compute:fwd) is part of that work: the last
    # work unit of its rank starting at or before it (work first at one start).
    both = np.lexsort((np.r_[np.zeros(n_work, np.int64), np.ones(n_ex, np.int64)], np.r_[w_start, x_start],
                       np.r_[w_group, x_group]))
    work_before = np.cumsum(both < n_work) - 1
    k = np.empty(n_ex, np.int64)
    k[both[both >= n_work] - n_work] = work_before[both >= n_work]
    k_ok = np.maximum(k, 0)
    inside = (k >= 0) & (w_group[k_ok] == x_group) & (x_end <= w_end[k_ok]) if n_work else np.zeros(n_ex, bool)
    kept = np.flatnonzero(~inside)
    kept = kept[np.lexsort((kept, x_end[kept], x_group[kept]))]
    x_pos = np.full(n_ex, -1, np.int64)
    x_pos[kept] = np.arange(len(kept))

    # each row's unit, and where its partners rank in that unit's: a work unit has its ranges'
    # partners, then those of the exchanges inside it by id, each's ranges in time order
    row_unit = np.empty(n, np.int64)
    row_unit[wo] = w_unit
    row_ex = ex_of_row[pf]
    row_unit[pf] = np.where(inside[row_ex], k_ok[row_ex], n_work + x_pos[row_ex])
    row_part = np.zeros(n, np.int64)  # 0: own ranges, 1 + id: an exchange inside work
    row_part[pf] = np.where(inside[row_ex], 1 + row_ex, 0)

    def in_rows(step, index):  # the rows of these event indices, -1 where not a step's own
        row = rows.index.get_indexer(index)
        ok = row >= 0
        ok[ok] = steps[step_code[row[ok]]] == step[ok]  # a step's partners only
        return np.where(ok, row, -1)

    e_step, e_index, e_rank, e_t, *e_order = _entries(pairs, coll)
    e_row = in_rows(e_step, e_index)
    ok = e_row >= 0
    e_row, e_rank, e_t, e_order = e_row[ok], e_rank[ok], e_t[ok], [o[ok] for o in e_order]
    e_unit = row_unit[e_row]
    listed = np.lexsort((*e_order[::-1], time_pos[e_row], row_part[e_row], e_unit))
    place = np.empty(len(listed), np.int64)
    place[listed] = np.arange(len(listed))
    final = np.lexsort((-place, e_t, e_unit))
    n_units = n_work + len(kept)
    at = lambda keys, n_keys: np.searchsorted(keys, np.arange(n_keys + 1)).tolist()  # noqa: E731
    wait_key: list = []  # needed beside large collectives only: built then
    if coll is not None and len(coll):
        c_step, c_index, c_rank, inst, pos, group, members = _members(coll)
        c_row = in_rows(c_step, c_index)
        mine = np.flatnonzero(c_row >= 0)
        c_row = c_row[mine]
        r_unit = row_unit[c_row]
        by_unit = np.argsort(r_unit, kind="stable")
        mine, c_row, r_unit = mine[by_unit], c_row[by_unit], r_unit[by_unit]
        refs = (group[mine].tolist(), c_rank[mine].tolist(),
                list(zip(row_part[c_row].tolist(), time_pos[c_row].tolist(), [1] * len(mine), inst[mine].tolist(),
                         pos[mine].tolist())), at(r_unit, n_units))
        if len(mine):
            wait_key = list(zip(row_part[e_row][final].tolist(), time_pos[e_row][final].tolist(),
                                *(o[final].tolist() for o in e_order)))
    else:
        members, refs = ([], [], [], [0]), ([], [], [], [0] * (n_units + 1))
    return _Graph(
        steps=steps, n_ranks=n_ranks,
        w_start=w_start.tolist(), w_end=w_end.tolist(), w_phase=_phases(rows, wo[heads], False),
        w_at=at(w_group, n_groups),
        x_start=x_start[kept].tolist(), x_start_arr=x_start[kept], x_end=x_end[kept].tolist(),
        x_phase=x_phase[kept].tolist(), x_at=at(x_group[kept], n_groups),
        wait_rank=e_rank[final].tolist(), wait_t=e_t[final].tolist(), wait_at=at(e_unit[final], n_units),
        wait_key=wait_key, ref_inst=refs[0], ref_rank=refs[1], ref_key=refs[2], ref_at=refs[3],
        inst_t=members[0], inst_rank=members[1], inst_pos=members[2], inst_at=members[3],
        p2p_index=rows.index[pf], p2p_step=steps[step_code[pf]], p2p_exchange=ids - step_first[step_code[pf]],
    )


def _main_rows(run) -> pd.DataFrame:
    return run.events.loc[main_thread_work(run.events), _COLUMNS]


#: the columns of _windows' rows
_W_RANK, _W_STEP, _W_START, _W_END = range(4)


def _windows(run) -> np.ndarray:
    """run.step_windows as rows (rank, step, start, end): one array, searched by step."""
    sw = run.step_windows
    keys = np.array(list(sw.keys()), dtype=np.int64).reshape(-1, 2)
    return np.c_[keys, np.array(list(sw.values()), dtype=np.int64).reshape(-1, 2)]


def critical_path(run, step: int | None = None) -> CriticalPath:
    """The critical path of ``step`` (default: the first profiled step) of ``run``."""
    step = run.steps[0] if step is None else step
    if step not in run.steps:
        raise ValueError(f"step {step} was not profiled; profiled steps: {run.steps}")
    rows = _main_rows(run)
    pairs = run.pairs
    coll = run.collectives
    rows = rows[(rows["step"] == step).to_numpy()]
    graph = _graph(rows, pairs[(pairs["step"] == step).to_numpy()],
                   None if coll is None else coll[(coll["step"] == step).to_numpy()])
    return _path(_walk(run, step, graph, _windows(run)))


@dataclass
class _Walk:
    """One step's walk: its segments (SEGMENT_COLUMNS tuples, in time order) and what the
    step's ranges say, before any frame is built (step_bounds needs no frames)."""

    step: int
    segments: list
    span_ns: int
    step_time_s: float
    graph: _Graph

    def arrays(self) -> tuple:
        """(rank, stage, phase, dur_ns) of the segments as arrays."""
        if not self.segments:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, object), np.zeros(0, np.int64)
        rank, stage, phase, _, _, dur = zip(*self.segments)
        return (np.array(rank, np.int64), np.array(stage, np.int64), np.array(phase, object),
                np.array(dur, np.int64))


def _compute_stages(stage: np.ndarray, phase: np.ndarray) -> list:
    """The stages whose compute the path ran through, ascending."""
    computing = np.array([p.startswith(COMPUTE_PREFIX) for p in phase], bool)
    return sorted(int(s) for s in np.unique(stage[computing]))


def _path(walk: _Walk) -> CriticalPath:
    """The walk as a CriticalPath, its frames built."""
    step, g = walk.step, walk.graph
    seg = pd.DataFrame(walk.segments, columns=list(SEGMENT_COLUMNS))
    length = int(seg["dur_ns"].sum()) if len(seg) else 0
    by = seg.groupby(["rank", "stage", "phase"], as_index=False)["dur_ns"].sum()
    by["time_s"] = by.pop("dur_ns") / 1e9
    by["fraction"] = by["time_s"] / (length / 1e9) if length else 0.0
    _, stage, phase, _ = walk.arrays()
    mine = g.p2p_step == step
    return CriticalPath(
        step=step, segments=seg, by_rank_phase=by.sort_values("time_s", ascending=False).reset_index(drop=True),
        length_s=length / 1e9, span_s=walk.span_ns / 1e9, step_time_s=walk.step_time_s,
        stages=_compute_stages(stage, phase),
        exchanges=pd.Series(g.p2p_exchange[mine], index=g.p2p_index[mine], dtype=np.int64),
    )


def _walk(run, step: int, graph: _Graph, windows: np.ndarray) -> _Walk:
    windows = windows[windows[:, _W_STEP] == step]
    if not len(windows):
        raise ValueError(f"step {step} has no ProfilerStep range on any rank")
    w_rank, w_first, w_last = windows[:, _W_RANK], windows[:, _W_START], windows[:, _W_END]
    top = np.lexsort((w_rank, -w_last))[0]  # the last rank to end; of a tie, the lowest
    rank, t = int(w_rank[top]), int(w_last[top])
    floor = int(w_first.min())

    def began(r):  # the rank's step start, floor if it has none
        at = np.flatnonzero(w_rank == r)
        return max(int(w_first[at[0]]), floor) if len(at) else floor

    g = graph
    si = np.searchsorted(g.steps, step)
    base = int(si) * g.n_ranks if si < len(g.steps) and g.steps[si] == step else None
    n_work = len(g.w_start)
    stage_of = lambda r: run.layout.coords(r).pp if r < run.layout.world_size else -1  # noqa: E731
    stage: dict = {}
    segments = []

    def emit(r, phase, a, b):
        if b > a:
            if r not in stage:
                stage[r] = stage_of(r)
            segments.append((r, stage[r], phase, a, b, b - a))

    if base is None:
        n_units = 0
    else:
        end = base + g.n_ranks
        n_units = g.w_at[end] - g.w_at[base] + g.x_at[end] - g.x_at[base]
    w_start, w_end, x_start, x_end = g.w_start, g.w_end, g.x_start, g.x_end
    for _ in range(10 * n_units + 10):  # each turn lowers t or moves to a peer that posted earlier
        k = base + rank if base is not None and 0 <= rank < g.n_ranks else None
        if k is None or t <= floor or (g.w_at[k] == g.w_at[k + 1] and g.x_at[k] == g.x_at[k + 1]):
            emit(rank, OVERHEAD_PHASE, began(rank), t)
            break
        w_lo, w_hi, x_lo, x_hi = g.w_at[k], g.w_at[k + 1], g.x_at[k], g.x_at[k + 1]
        i = bisect_left(w_end, t, w_lo, w_hi)  # the first work ending at or after t
        if i < w_hi and w_start[i] < t:
            lo, phase, unit = w_start[i], g.w_phase[i], i
        else:
            j = bisect_left(x_end, t, x_lo, x_hi)  # the first exchange ending at or after t
            last = [e for e in (w_end[i - 1] if i > w_lo else None, x_end[j - 1] if j > x_lo else None)
                    if e is not None]  # when the rank last finished something, work or exchange
            if j < x_hi and not x_start[j] < t:  # not open at t: is a later-ending one?
                later = np.flatnonzero(g.x_start_arr[j + 1:x_hi] < t)
                j = j + 1 + int(later[0]) if len(later) else x_hi
            if j == x_hi:  # between units: host overhead
                if not last:
                    emit(rank, OVERHEAD_PHASE, began(rank), t)
                    break
                emit(rank, OVERHEAD_PHASE, max(last), t)
                t = max(last)
                continue
            # the exchange being waited on, blocked in since the rank last finished something
            lo, phase, unit = max([x_start[j], *last]), g.x_phase[j], n_work + j
        # a == t: the message arrived the instant the peer posted (no latency), still a wait
        peer = _latest_partner(g, unit, t)
        if peer is not None and peer[0] > lo:
            emit(rank, phase, peer[0], t)
            t, rank = peer
        else:
            emit(rank, phase, lo, t)
            t = lo
    return _Walk(step=step, segments=segments[::-1], span_ns=int(w_last.max()) - floor,
                 step_time_s=float(np.median(w_last - w_first)) / 1e9, graph=g)


def _latest_partner(g: _Graph, unit: int, t: int):
    """(post ns, rank) of the partner of ``unit`` that posted last at or before ``t`` (of a
    tie the first in partner order), None when none had: its latest p2p peer, against the
    latest other member of each of its collectives."""
    p = bisect_right(g.wait_t, t, g.wait_at[unit], g.wait_at[unit + 1]) - 1
    found = p >= g.wait_at[unit]
    if g.ref_at[unit] == g.ref_at[unit + 1]:  # no large collective: the list has every partner
        return (g.wait_t[p], g.wait_rank[p]) if found else None
    best = (g.wait_t[p], g.wait_key[p], g.wait_rank[p]) if found else None
    for r in range(g.ref_at[unit], g.ref_at[unit + 1]):
        lo, hi = g.inst_at[g.ref_inst[r]], g.inst_at[g.ref_inst[r] + 1]
        q = bisect_right(g.inst_t, t, lo, hi) - 1
        while q >= lo and g.inst_rank[q] == g.ref_rank[r]:  # its own rank's rows are no partners
            q -= 1
        if q < lo:
            continue
        key = (*g.ref_key[r], g.inst_pos[q])
        if best is None or g.inst_t[q] > best[0] or (g.inst_t[q] == best[0] and key < best[1]):
            best = (g.inst_t[q], key, g.inst_rank[q])
    return None if best is None else (best[0], best[2])


def step_bounds(run) -> list[dict]:
    """Per profiled step, what bounded it: the critical path's length and the measured step
    (s), how much of the path was compute, p2p (pipeline and cp exchanges), collectives and
    host overhead (s, summing to the length), the ranks and the stages it ran through, and
    one line saying it. [] for a run without a pipeline; steps the traces cannot walk
    (no step range on any rank) are left out."""
    if run.layout.pp < 2 or not run.steps:
        return []
    graph = _graph(_main_rows(run), run.pairs, run.collectives)
    windows = _windows(run)
    walked = set(graph.steps.tolist()) & set(windows[:, _W_STEP].tolist())
    return [_bound(_walk(run, step, graph, windows)) for step in run.steps if step in walked]


def _largest(rank: np.ndarray, stage: np.ndarray, phase: np.ndarray, dur: np.ndarray) -> tuple:
    """(rank, phase, ns) of the largest (rank, stage, phase) sum of ``dur``: the first row of
    CriticalPath.by_rank_phase, ties broken as its groupby and descending sort_values do
    (key order; the same quicksort on the same array, reversed twice)."""
    _, code = np.unique(phase, return_inverse=True)  # phases in sorted order, as groupby's keys
    order = np.lexsort((code, stage, rank))
    key = np.c_[rank, stage, code][order]
    first = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]).any(axis=1)])
    total = np.add.reduceat(dur[order], first)
    time = total / 1e9
    at = np.arange(len(time))[::-1][time[::-1].argsort(kind="quicksort")][::-1][0]
    row = order[first[at]]
    return int(rank[row]), phase[row], int(total[at])


def _bound(walk: _Walk) -> dict:
    rank, stage, phase, dur_ns = walk.arrays()
    length = int(dur_ns.sum())
    length_s = length / 1e9
    dur = dur_ns / 1e9
    parts = {
        "compute_s": float(dur[np.array([p.startswith(COMPUTE_PREFIX) for p in phase], bool)].sum()),
        "p2p_s": float(dur[np.array([p.endswith(TRANSFER_SUFFIX) for p in phase], bool)].sum()),
        "other_s": float(dur[phase == OVERHEAD_PHASE].sum()),
    }
    parts["comm_s"] = max(length_s - sum(parts.values()), 0.0)
    ranks = sorted(int(r) for r in np.unique(rank))
    names = {"compute_s": "compute", "p2p_s": "p2p", "comm_s": "collectives", "other_s": "host overhead"}
    line = f"step {walk.step}: no critical path"
    if length_s > 0:
        main = max(parts, key=parts.get)
        top_rank, top_phase, top_ns = _largest(rank, stage, phase, dur_ns)
        shares = ", ".join(f"{name} {parts[k] / length_s:.0%}" for k, name in names.items()
                           if parts[k] >= 0.005 * length_s)
        line = (f"step {walk.step} bound by {names[main]}: {length_s * 1e3:.1f} ms path through "
                f"{len(ranks)} rank(s) ({shares}); largest: rank {top_rank} {top_phase} "
                f"{top_ns / 1e9 / length_s:.0%}")
    return {"step": walk.step, "length_s": length_s, "step_time_s": walk.step_time_s,
            **{k: parts[k] for k in ("compute_s", "p2p_s", "comm_s", "other_s")},
            "ranks": ranks, "stages": _compute_stages(stage, phase), "summary": line}
