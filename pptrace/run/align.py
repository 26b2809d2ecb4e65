"""Per-rank clock offsets and their uncertainty.

Every trace starts on its host's epoch clock (baseTimeNanoseconds + ts). Ranks on one host
agree; across hosts they are only as good as NTP. Matched communication refines that with
*hard constraints*, facts of causality that hold whatever the scheduling noise:

- **p2p** (pipeline ranges, which span posting to completion): a recv cannot end before its
  send started, so for a send a->b,
  ``offset_b - offset_a <= recv_end_b - send_start_a`` (raw clocks). Traffic both ways
  (forward activations, backward gradients) brackets the difference like NTP's round trip.
- **blocking collectives**: nobody leaves before everybody arrived, so for ranks a, b of one
  instance ``offset_b - offset_a <= leave_b - arrive_a``. An async collective (one that a
  ``<kind>:wait op=<op>`` range completes) leaves when its wait ends.

Shortest paths through all constraints give every rank an interval for its offset against
the reference rank; the estimate is its midpoint and the bound its half-width. Where the
interval stays open, the median difference of collective leave times (everyone is released
at once) is used instead; it is only a statistic: on a busy host ranks wake up ~0.5 ms
apart. ``offset_ns`` is subtracted from a rank's raw times.
"""
from __future__ import annotations

import heapq
import math

import numpy as np
import pandas as pd

#: A bound never claims better than this: leave times of one collective differ by at least
#: the release message's latency (tens of µs over loopback, more over a network).
MIN_BOUND_NS = 20_000
#: Fewer instances than this and a collective edge is not trusted on its own.
MIN_INSTANCES = 2
OFFSET_COLUMNS = ("rank", "offset_ns", "uncertainty_ns", "method", "via")
#: Ranks on one host read one system clock. Their recorded times may still break causality
#: by the profiler's rounding of timestamps (1 µs); more than this means the clocks differ.
SAME_HOST_SLACK_NS = 5_000


def _instance_groups(instances: pd.DataFrame, by_rank: bool = False):
    """The rows of ``instances`` grouped as ``groupby("instance", sort=False)`` meets them:
    instances in order of first appearance, rows in frame order (or by rank). Returns
    (row positions, instance of each, start and size of each instance in that order)."""
    codes, uniques = pd.factorize(instances["instance"].to_numpy())
    rows = np.flatnonzero(codes >= 0)
    if by_rank:
        rows = rows[np.lexsort((instances["rank"].to_numpy(np.int64)[rows], codes[rows]))]
    else:
        rows = rows[np.argsort(codes[rows], kind="stable")]
    group = codes[rows]
    size = np.bincount(group, minlength=len(uniques))
    return rows, group, np.cumsum(size) - size, size


def _edge_table(instances: pd.DataFrame | None) -> pd.DataFrame:
    """(a, b, diff = leave_b - leave_a) per edge of each instance, instances in order of
    first appearance: a star on the lowest rank plus a chain through the ranks, O(group
    size) edges rather than all pairs."""
    if instances is None or instances.empty:
        return pd.DataFrame({c: np.zeros(0, np.int64) for c in ("a", "b", "diff")})
    rows, group, start, _ = _instance_groups(instances, by_rank=True)
    rank = instances["rank"].to_numpy(np.int64)[rows]
    leave = instances["leave_ns"].to_numpy(np.int64)[rows]
    within = np.arange(len(rows)) - start[group]
    # the j-th rank of an instance gets an edge from its first rank and, from j = 2 on,
    # one from rank j - 1 (in that order)
    count = (within >= 1).astype(np.int64) + (within >= 2)
    to = np.repeat(np.arange(len(rows)), count)
    chain = np.arange(len(to)) - np.repeat(np.cumsum(count) - count, count) == 1
    frm = np.where(chain, to - 1, start[group[to]])
    return pd.DataFrame({"a": rank[frm], "b": rank[to], "diff": leave[to] - leave[frm]})


def _edge_keys(edges: pd.DataFrame):
    """Code of each edge's (a, b) in order of first appearance, and the count of each."""
    key = edges.groupby(["a", "b"], sort=False).ngroup().to_numpy()
    return key, np.bincount(key)


def collective_edges(instances: pd.DataFrame, events=None) -> dict:
    """(a, b) -> list of leave_b - leave_a over the given (blocking) instances."""
    edges = _edge_table(instances)
    if edges.empty:
        return {}
    key, count = _edge_keys(edges)
    order = np.argsort(key, kind="stable")
    cuts = np.cumsum(count)[:-1]
    first = order[np.r_[0, cuts]]
    a, b = edges["a"].to_numpy()[first].tolist(), edges["b"].to_numpy()[first].tolist()
    diffs = np.split(edges["diff"].to_numpy()[order], cuts)
    return {(x, y): d.tolist() for x, y, d in zip(a, b, diffs)}


def _percentile(values: np.ndarray, start: np.ndarray, n: np.ndarray, q: float) -> np.ndarray:
    """np.percentile(.., q) (its default linear method, its arithmetic) of each sorted run
    values[start:start + n]."""
    virtual = (n - 1) * (q / 100)
    floor = np.floor(virtual)
    above = virtual >= n - 1
    lo = np.where(above, n - 1, floor.astype(np.int64))
    hi = np.where(above, n - 1, lo + 1)
    a, b, t = values[start + lo], values[start + hi], virtual - floor
    return np.where(t >= 0.5, b - (b - a) * (1 - t), a + (b - a) * t)


def _soft_estimates(edges: pd.DataFrame) -> dict:
    """(a, b) -> (median leave_b - leave_a, spread) from the edges of blocking collectives
    (_edge_table), pairs in order of first appearance."""
    if edges.empty:
        return {}
    key, count = _edge_keys(edges)
    diff = edges["diff"].to_numpy(np.int64)
    order = np.lexsort((diff, key))
    values = diff[order].astype(np.float64)
    trusted = np.flatnonzero(count >= MIN_INSTANCES)
    n, start = count[trusted], (np.cumsum(count) - count)[trusted]
    half = start + n // 2
    median = np.where(n % 2 == 1, values[half], (values[half - 1] + values[half]) / 2)
    # Half the 10-90% spread: how far one instance's release strays from the median.
    spread = (_percentile(values, start, n, 90) - _percentile(values, start, n, 10)) / 2
    first = np.argsort(key, kind="stable")[(np.cumsum(count) - count)[trusted]]
    a, b = edges["a"].to_numpy()[first].tolist(), edges["b"].to_numpy()[first].tolist()
    return {(x, y): (m, max(s, MIN_BOUND_NS))
            for x, y, m, s in zip(a, b, median.tolist(), spread.tolist())}


def hard_constraints(instances: pd.DataFrame | None, pairs: pd.DataFrame | None, events) -> dict:
    """(a, b) -> c such that offset_b - offset_a <= c must hold (raw clocks).

    - p2p: the recv on b ends after the send on a started.
    - blocking collectives: nobody leaves before everybody arrived, so for ranks a, b of an
      instance, leave_b >= arrive_a on true time.
    """
    return _constraints(_blocking(instances, events), pairs)


def _constraints(blocking: pd.DataFrame | None, pairs: pd.DataFrame | None) -> dict:
    """hard_constraints from the blocking instances (_blocking). Keys in the order they are
    first met (p2p pairs by (src, dst), then instances in order), each with its tightest c;
    a rank is never constrained against itself."""
    found = []  # (a, b, c) arrays
    if pairs is not None and len(pairs) and "kind" in pairs.columns:
        # Only pipeline ranges span posting to completion (contract 1). CP's ring exchange is
        # posted async and completed by a later cp:wait, so its recv range ends before the
        # data arrives and would fake a causality violation of tens of ms.
        pairs = pairs[pairs["kind"].astype(str) == "pp"]
    if pairs is not None and len(pairs):
        slack = (pairs["recv_end_ns"] - pairs["send_start_ns"]).to_numpy(np.int64)
        frame = pd.DataFrame({"src": pairs["src"].to_numpy(), "dst": pairs["dst"].to_numpy(), "c": slack})
        tight = frame.groupby(["src", "dst"])["c"].min()
        found.append((tight.index.get_level_values(0).to_numpy(np.int64),
                      tight.index.get_level_values(1).to_numpy(np.int64), tight.to_numpy(np.int64)))
    if blocking is not None and len(blocking):
        found.append(_collective_constraints(blocking))
    if not found:
        return {}
    a, b, c = (np.concatenate(parts) for parts in zip(*found))
    keep = a != b
    tight = pd.DataFrame({"a": a[keep], "b": b[keep], "c": c[keep]}).groupby(["a", "b"], sort=False)["c"].min()
    keys = zip(tight.index.get_level_values(0).tolist(), tight.index.get_level_values(1).tolist())
    return dict(zip(keys, tight.to_numpy(np.float64).tolist()))


def _collective_constraints(blocking: pd.DataFrame):
    """(a, b, leave_b - arrive_a) for ranks a, b of each synchronizing instance (the op of its
    first row decides): all ordered pairs (i, j), each giving i -> j then j -> i, for groups
    of up to 16; for bigger ones each rank against the last arrival (the first on ties)."""
    rows, group, start, size = _instance_groups(blocking)
    if not len(rows):
        return (np.zeros(0, np.int64),) * 3
    rank = blocking["rank"].to_numpy(np.int64)[rows]
    arrive = blocking["arrive_ns"].to_numpy(np.int64)[rows]
    leave = blocking["leave_ns"].to_numpy(np.int64)[rows]
    syncing = blocking["op"].isin(sorted(_SYNCHRONIZING_OPS)).to_numpy()[rows][start]
    latest = np.maximum.reduceat(arrive, start)
    at_latest = np.flatnonzero(arrive == latest[group])
    firsts = np.r_[True, group[at_latest][1:] != group[at_latest][:-1]]
    last = np.zeros(len(size), np.int64)
    last[group[at_latest[firsts]]] = at_latest[firsts]
    small = size <= 16
    count = np.where((size >= 2) & syncing, np.where(small, size, 1), 0)[group]
    i = np.repeat(np.arange(len(rows)), count)
    k = np.arange(len(i)) - np.repeat(np.cumsum(count) - count, count)
    j = np.where(small[group[i]], start[group[i]] + k, last[group[i]])
    a = np.column_stack([rank[i], rank[j]]).ravel()
    b = np.column_stack([rank[j], rank[i]]).ravel()
    c = np.column_stack([leave[j] - arrive[i], leave[i] - arrive[j]]).ravel()
    return a, b, c


def _bounds_from(reference: int, cons: dict, nodes) -> tuple[dict, bool]:
    """Shortest paths (Bellman-Ford): the tightest upper bound of offset_r - offset_ref
    implied by the constraints. Returns ({rank: bound}, consistent)."""
    dist = {reference: 0.0}
    nodes = list(nodes)
    for _ in range(len(nodes)):
        changed = False
        for (a, b), c in cons.items():
            if a in dist and dist[a] + c < dist.get(b, np.inf):
                dist[b] = dist[a] + c
                changed = True
        if not changed:
            return dist, True
    return dist, False  # still relaxing after n rounds: a negative cycle


_SYNCHRONIZING_OPS = frozenset({
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier",
    "allreduce", "allgather", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_allv",
    "_allgather_base", "_reduce_scatter_base", "alltoall", "alltoall_base", "allgather_into_tensor_coalesced",
})


def _str_of(values) -> np.ndarray:
    """str() of each value, once per distinct value; nulls (rare) one by one, as None, NaN and
    NA spell differently."""
    values = pd.Series(values).astype(object)
    codes, uniques = pd.factorize(values)
    out = np.array([str(u) for u in uniques] + [""], dtype=object)[codes]
    missing = codes < 0
    out[missing] = [str(v) for v in values[missing]]
    return out


def _wait_ops(tags) -> np.ndarray:
    """str() of the ``op`` tag of each wait range ("None" without one), parsed once per
    distinct tags text."""
    from ..ingest.schema import tags_of

    codes, uniques = pd.factorize(pd.Series(tags).astype(object))
    ops = [str(tags_of(t).get("op") if isinstance(t, str) else None) for t in uniques]
    return np.array([*ops, "None"], dtype=object)[codes]


def _async_keys(parts) -> list[np.ndarray]:
    """One code per (rank, kind, op, bucket, layer) across the given key columns, equal
    codes for equal keys (missing bucket and layer equal each other)."""
    keys = pd.concat([pd.DataFrame({"rank": rank, "kind": kind, "op": op, "bucket": bucket, "layer": layer})
                      for rank, kind, op, bucket, layer in parts], ignore_index=True)
    code = keys.groupby(list(keys.columns), sort=False, dropna=False).ngroup().to_numpy()
    return np.split(code, np.cumsum([len(p[0]) for p in parts])[:-1])


def _blocking(instances, events) -> pd.DataFrame:
    """Instances with ``leave_ns`` at completion. A sync range ends at completion; an async
    call (one that a ``<kind>:wait op=<op>`` range completes) leaves when its wait ends: the
    k-th wait of a key in a step completes the k-th call of that key. Instances with an
    async call whose wait is missing are dropped."""
    if instances is None or instances.empty or events is None:
        return instances if instances is not None else pd.DataFrame(
            columns=["instance", "rank", "op", "arrive_ns", "leave_ns"])
    w = events[(events["op"] == "wait").to_numpy()]
    if w.empty:
        return instances
    idx = instances["index"].to_numpy()
    # an async key: (rank, kind, op, bucket, layer), kind and op spelt by str()
    wait_key, inst_key = _async_keys([
        (w["rank"].to_numpy(np.int64), _str_of(w["kind"].astype(str)), _wait_ops(w["tags"]),
         w["bucket"].astype("Int64").array, w["layer"].astype("Int64").array),
        (instances["rank"].to_numpy(np.int64), _str_of(instances["kind"]), _str_of(instances["op"]),
         events["bucket"].astype("Int64").array[idx], events["layer"].astype("Int64").array[idx]),
    ])
    waits = pd.DataFrame({"key": wait_key, "step": w["step"].to_numpy(), "start": w["start_ns"].to_numpy(),
                          "wait_end": w["end_ns"].to_numpy(np.int64)})
    inst = instances.assign(key=inst_key, is_async=np.isin(inst_key, wait_key))
    calls = inst[inst["is_async"]].sort_values("arrive_ns", kind="stable")
    calls = calls.assign(occ=calls.groupby(["key", "step"], sort=False).cumcount())
    waits = waits.sort_values("start", kind="stable")
    waits = waits.assign(occ=waits.groupby(["key", "step"], sort=False).cumcount())
    done = calls.merge(waits[["key", "step", "occ", "wait_end"]], on=["key", "step", "occ"], how="left")
    done.index = calls.index
    inst.loc[done.index, "leave_ns"] = done["wait_end"].fillna(-1).astype(np.int64).to_numpy()
    bad = inst.loc[inst["leave_ns"] < 0, "instance"].unique()
    return inst[~inst["instance"].isin(bad)].drop(columns=["key", "is_async"])


def _soft_offsets(reference, soft: dict) -> dict:
    """rank -> (offset, spread) chained along the most certain path of soft estimates."""
    graph: dict = {}
    for (a, b), (delta, bound) in soft.items():
        graph.setdefault(a, []).append((b, delta, bound))
        graph.setdefault(b, []).append((a, -delta, bound))
    best = {reference: (0.0, 0.0)}
    heap, done = [(0.0, reference)], set()
    while heap:
        bound, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        for nxt, delta, edge in graph.get(node, ()):
            if nxt not in best or bound + edge < best[nxt][1]:
                best[nxt] = (best[node][0] + delta, bound + edge)
                heapq.heappush(heap, (bound + edge, nxt))
    return best


def _project(rows: list, cons: dict, reference: int, rounds: int = 50) -> list:
    """Nudge offsets until every hard constraint holds jointly: per-rank midpoints each
    respect the reference, but two non-reference ranks may still disagree by a little."""
    offset = {r[0]: int(r[1]) for r in rows if r[3] not in ("epoch", "one-sided")}
    cons = [(a, b, int(np.floor(c))) for (a, b), c in cons.items() if a in offset and b in offset]
    for _ in range(rounds):
        worst = 0
        for a, b, c in cons:
            excess = offset[b] - offset[a] - c
            if excess <= 0:
                continue
            worst = max(worst, excess)
            if a == reference:
                offset[b] -= excess
            elif b == reference:
                offset[a] += excess
            else:
                offset[b] -= excess // 2
                offset[a] += excess - excess // 2
        if not worst:
            break
    return [(r[0], offset.get(r[0], r[1]), *r[2:]) for r in rows]


def _same_host_offsets(ranks, hosts, cons) -> pd.DataFrame | None:
    """Offsets of zero when every rank ran on one host and zero breaks no causality fact.

    One host means one epoch clock: refining it from communication could only add the
    scheduling noise of the constraints (ranks wake from a collective ~0.5 ms apart on a busy
    box). A trace whose clock was shifted after the fact still breaks causality at zero and
    goes through the estimation below."""
    if not hosts or any(not hosts.get(r) for r in ranks) or len({hosts[r] for r in ranks}) != 1:
        return None
    if cons and min(cons.values()) < -SAME_HOST_SLACK_NS:
        return None
    table = pd.DataFrame([(r, 0, 0.0, "same host", ranks[0]) for r in ranks], columns=list(OFFSET_COLUMNS))
    table["offset_ns"] = table["offset_ns"].astype(np.int64)
    table["uncertainty_ns"] = table["uncertainty_ns"].astype("Float64")
    return table


def estimate_offsets(ranks, instances=None, pairs=None, events=None, reference=None, hosts=None, free=()):
    """-> (DataFrame OFFSET_COLUMNS, warnings). ``offset_ns`` of a rank is relative to the
    reference rank (lowest loaded rank whose clock is known, unless given).

    Hard constraints (causality of p2p and of blocking collectives) give each rank an
    interval [lo, hi] for its offset (shortest paths through all constraints). The estimate
    is the interval's midpoint and ``uncertainty_ns`` its half-width (the largest error still
    possible); where the interval is open, the collective leave-time median (clamped into
    it) and its spread. Ranks with no evidence keep their
    epoch clock (offset 0, NaN bound). ``hosts`` (rank -> hostname): ranks of one host keep
    offset 0 unless their recorded times break causality. ``free``: ranks whose clock says
    nothing (a corrupt baseTimeNanoseconds, or hours off under --assume-same-run; run/build.py
    placed them near the others): no host vouches for them, they are placed from their
    communication alone, against the others as one clock when those share a host.
    """
    ranks = sorted(int(r) for r in ranks)
    warnings: list[str] = []
    if not ranks:
        return pd.DataFrame(columns=list(OFFSET_COLUMNS)), warnings
    free = sorted({int(r) for r in free} & set(ranks))
    known = [r for r in ranks if r not in free]
    reference = (known or ranks)[0] if reference is None else int(reference)
    blocking = _blocking(instances, events)
    cons = _constraints(blocking, pairs)
    among_known = {k: c for k, c in cons.items() if k[0] not in free and k[1] not in free}
    same_host = _same_host_offsets(known, hosts, among_known) if known else None
    if same_host is not None and not free:
        return same_host, warnings
    if same_host is not None:
        # one clock for the host's ranks (offset 0 each): the free ranks against it alone
        reference = known[0]
        one = {r: reference for r in known}
        blocking, pairs = _relabelled(blocking, ["rank"], one), _relabelled(pairs, ["src", "dst"], one)
        rows = _estimated([reference, *free], reference, blocking, _constraints(blocking, pairs),
                          events is not None, warnings)
        rows = [(r, 0, 0.0, "same host", reference) for r in known[1:]] + rows
    else:
        rows = _estimated(ranks, reference, blocking, cons, events is not None, warnings)
    rows.sort()
    lost = [row[0] for row in rows if row[3] == "epoch" and row[0] not in free]
    if lost:
        warnings.append(
            f"ranks {lost} share no matched communication with rank {reference}; their clocks "
            "are used as recorded (fine on one host, only as good as NTP across hosts)"
        )
    unplaced = [row[0] for row in rows if row[3] == "epoch" and row[0] in free]
    if unplaced:
        warnings.append(
            f"ranks {unplaced} have no clock to trust and share no matched communication with rank {reference}: "
            "their timelines are placed only roughly (the middle of their events on the others'); cross-rank "
            "times involving them are approximate"
        )
    table = pd.DataFrame(rows, columns=list(OFFSET_COLUMNS))
    table["offset_ns"] = table["offset_ns"].astype(np.int64)
    table["uncertainty_ns"] = table["uncertainty_ns"].astype("Float64")
    return table, warnings


def _relabelled(frame, columns, mapping: dict):
    """``frame`` with the ranks in ``columns`` renamed by ``mapping`` (others kept)."""
    if frame is None or frame.empty:
        return frame
    out = frame.copy(deep=False)
    keys = np.array(list(mapping), np.int64)
    values = np.array(list(mapping.values()), np.int64)
    for column in columns:
        rank = out[column].to_numpy(np.int64)
        at = np.searchsorted(keys, rank)  # mapping's keys are sorted (known ranks)
        hit = (at < len(keys)) & (keys[np.minimum(at, len(keys) - 1)] == rank)
        out[column] = np.where(hit, values[np.minimum(at, len(keys) - 1)], rank)
    return out


def _estimated(ranks, reference, blocking, cons, with_soft: bool, warnings: list) -> list:
    """(rank, offset, uncertainty, method, via) of each of ``ranks`` against ``reference``
    from the hard constraints ``cons`` and the soft leave-time medians of ``blocking``."""
    upper, ok_up = _bounds_from(reference, cons, ranks)
    reverse = {(b, a): c for (a, b), c in cons.items()}
    lower_neg, ok_low = _bounds_from(reference, reverse, ranks)
    if not (ok_up and ok_low):
        warnings.append(
            "clock constraints from p2p and collectives contradict each other (clock drift "
            "during profiling, or mismatched ranges); offsets use collective medians only"
        )
        upper, lower_neg = {reference: 0.0}, {reference: 0.0}
    soft = _soft_offsets(reference, _soft_estimates(_edge_table(blocking)) if with_soft else {})
    rows = []
    for rank in ranks:
        hi = upper.get(rank, np.inf)
        lo = -lower_neg.get(rank, np.inf)
        est, spread = soft.get(rank, (None, None))
        if rank == reference:
            rows.append((rank, 0, 0.0, "reference", rank))
        elif np.isfinite(lo) and np.isfinite(hi):
            # A closed interval is a guarantee; the collective median is only a statistic
            # (on a busy host, ranks are rescheduled after a collective ~0.5 ms apart).
            rows.append((rank, round((lo + hi) / 2), max((hi - lo) / 2, MIN_BOUND_NS / 2), "bounds", reference))
        elif est is not None:
            clamped = min(max(est, lo), hi)
            rows.append((rank, round(clamped), spread, "collective", reference))
        elif np.isfinite(lo) or np.isfinite(hi):
            edge = lo if np.isfinite(lo) else hi
            rows.append((rank, 0 if lo <= 0 <= hi else round(edge), np.nan, "one-sided", reference))
        else:
            rows.append((rank, 0, np.nan, "epoch", rank))
    return _project(rows, cons, reference)


def clock_drift_warnings(metas: dict) -> list[str]:
    """Warn when a rank's wall clock was stepped or slewed while it was profiled: the pptrace
    block holds wall/perf clock pairs from the start and end of the profiled window."""
    out = []
    for rank, meta in sorted(metas.items()):
        clock = ((meta or {}).get("pptrace") or {}).get("clock") or {}
        start, end = clock.get("start"), clock.get("end")
        try:
            drift = (end["wall_ns"] - start["wall_ns"]) - (end["perf_ns"] - start["perf_ns"])
            # each sample is exact only to its bracket (0 for traces from before brackets existed)
            slack = start.get("bracket_ns", 0) + end.get("bracket_ns", 0)
            if not math.isfinite(drift) or not math.isfinite(slack):  # a clock pair that is no clock
                continue
        except (TypeError, KeyError, AttributeError, OverflowError):
            continue
        if abs(drift) > 1_000_000 + slack:
            out.append(
                f"rank {rank}: its wall clock moved {drift / 1e6:+.1f} ms against its monotonic "
                "clock while profiling (NTP step?); its timeline may be stretched"
            )
    return out


def offsets_per_row(rank: np.ndarray, offsets: pd.DataFrame | None) -> np.ndarray:
    """Each row's rank's ``offset_ns`` (0 for a rank without one): a lookup table of the
    ranks' offsets, not a hash per row."""
    rank = np.asarray(rank)  # as it is: the events' int32 (an int64 copy took 0.2 s at 8 M rows)
    if offsets is None or not len(rank):
        return np.zeros(len(rank), np.int64)
    ranks, shift = offsets["rank"].to_numpy(np.int64), offsets["offset_ns"].to_numpy(np.int64)
    table = np.zeros(max(int(rank.max()), int(ranks.max(initial=-1))) + 1, np.int64)
    table[ranks] = shift
    return table[rank]


def apply_offsets(events: pd.DataFrame, offsets: pd.DataFrame, inplace: bool = False) -> pd.DataFrame:
    """Shift start_ns/end_ns onto the reference clock (Run.raw_ns shifts them back)."""
    per_row = offsets_per_row(events["rank"].to_numpy(), offsets)
    out = events.copy(deep=False) if not inplace else events
    for column in ("start_ns", "end_ns"):
        # a Series: pandas copies an ndarray set as a column (0.4 s of fresh pages at 8 M rows)
        out[column] = pd.Series(events[column].to_numpy(np.int64) - per_row, index=events.index, copy=False)
    return out


def large_bound_warnings(offsets: pd.DataFrame, typical_ns: float | None) -> list[str]:
    """One warning when some rank's bound exceeds the typical p2p transfer time: wait and
    transfer splits on its links are then only approximate."""
    if not typical_ns or offsets.empty:
        return []
    bounds = offsets.set_index("rank")["uncertainty_ns"].astype("float64").dropna()
    bad = bounds[bounds > max(typical_ns, MIN_BOUND_NS)]
    if bad.empty:
        return []
    worst = int(bad.idxmax())
    return [
        f"clock alignment of {len(bad)} rank(s) is uncertain by more than the typical p2p transfer "
        f"({typical_ns / 1e3:.0f} µs; worst: rank {worst}, ±{bad.max() / 1e3:.0f} µs); wait/transfer "
        "splits on their links are approximate"
    ]
