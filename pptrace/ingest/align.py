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


def _async_key(rank, kind, op, bucket, layer) -> tuple:
    return (int(rank), str(kind), str(op), None if pd.isna(bucket) else int(bucket),
            None if pd.isna(layer) else int(layer))


def collective_edges(instances: pd.DataFrame, events=None) -> dict:
    """(a, b) -> list of leave_b - leave_a over the given (blocking) instances."""
    edges: dict = {}
    if instances is None or instances.empty:
        return edges
    for _, rows in instances.groupby("instance", sort=False):
        if len(rows) < 2:
            continue
        ranks = rows["rank"].to_numpy(np.int64)
        leave = rows["leave_ns"].to_numpy(np.int64)
        order = np.argsort(ranks)
        ranks, leave = ranks[order], leave[order]
        # A star on the lowest rank plus a chain: O(group size) edges, not all pairs.
        for j in range(1, len(ranks)):
            for i in {0, j - 1}:
                edges.setdefault((int(ranks[i]), int(ranks[j])), []).append(int(leave[j] - leave[i]))
    return edges


def _soft_estimates(edges: dict) -> dict:
    """(a, b) -> (median leave_b - leave_a, spread) from blocking collectives."""
    out = {}
    for (a, b), diffs in edges.items():
        if len(diffs) < MIN_INSTANCES:
            continue
        d = np.asarray(diffs, dtype=np.float64)
        # Half the 10-90% spread: how far one instance's release strays from the median.
        spread = float(np.percentile(d, 90) - np.percentile(d, 10)) / 2
        out[(a, b)] = (float(np.median(d)), max(spread, MIN_BOUND_NS))
    return out


def hard_constraints(instances: pd.DataFrame | None, pairs: pd.DataFrame | None, events) -> dict:
    """(a, b) -> c such that offset_b - offset_a <= c must hold (raw clocks).

    - p2p: the recv on b ends after the send on a started.
    - blocking collectives: nobody leaves before everybody arrived, so for ranks a, b of an
      instance, leave_b >= arrive_a on true time.
    """
    cons: dict = {}

    def add(a, b, c):
        if a != b and c < cons.get((a, b), np.inf):
            cons[(a, b)] = c

    if pairs is not None and len(pairs) and "kind" in pairs.columns:
        # Only pipeline ranges span posting to completion (contract 1). CP's ring exchange is
        # posted async and completed by a later cp:wait, so its recv range ends before the
        # data arrives and would fake a causality violation of tens of ms.
        pairs = pairs[pairs["kind"].astype(str) == "pp"]
    if pairs is not None and len(pairs):
        slack = (pairs["recv_end_ns"] - pairs["send_start_ns"]).to_numpy(np.int64)
        frame = pd.DataFrame({"src": pairs["src"].to_numpy(), "dst": pairs["dst"].to_numpy(), "c": slack})
        for (src, dst), c in frame.groupby(["src", "dst"])["c"].min().items():
            add(int(src), int(dst), float(c))
    for _, rows in _blocking(instances, events).groupby("instance", sort=False):
        ranks = rows["rank"].to_numpy(np.int64)
        arrive, leave = rows["arrive_ns"].to_numpy(np.int64), rows["leave_ns"].to_numpy(np.int64)
        if len(ranks) < 2 or not rows["op"].iloc[0] in _SYNCHRONIZING_OPS:
            continue
        # All pairs for small groups; for big ones each rank against the last arrival.
        partners = range(len(ranks)) if len(ranks) <= 16 else [int(np.argmax(arrive))]
        for i in range(len(ranks)):
            for j in partners:
                add(int(ranks[i]), int(ranks[j]), float(leave[j] - arrive[i]))
                add(int(ranks[j]), int(ranks[i]), float(leave[i] - arrive[j]))
    return cons


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


def _waits(events: pd.DataFrame) -> pd.DataFrame:
    """Wait ranges with the key of the async collective they complete."""
    from .schema import tags_of

    w = events[(events["op"] == "wait").to_numpy()]
    ops = [tags_of(t).get("op") if isinstance(t, str) else None for t in w["tags"].astype(object)]
    keys = [
        _async_key(r, k, o, b, lay)
        for r, k, o, b, lay in zip(w["rank"], w["kind"].astype(str), ops, w["bucket"], w["layer"])
    ]
    return pd.DataFrame({"key": keys, "step": w["step"].to_numpy(), "start": w["start_ns"].to_numpy(),
                         "wait_end": w["end_ns"].to_numpy(np.int64)})


def _blocking(instances, events) -> pd.DataFrame:
    """Instances with ``leave_ns`` at completion. A sync range ends at completion; an async
    call (one that a ``<kind>:wait op=<op>`` range completes) leaves when its wait ends: the
    k-th wait of a key in a step completes the k-th call of that key. Instances with an
    async call whose wait is missing are dropped."""
    if instances is None or instances.empty or events is None:
        return instances if instances is not None else pd.DataFrame(
            columns=["instance", "rank", "op", "arrive_ns", "leave_ns"])
    waits = _waits(events)
    if waits.empty:
        return instances
    idx = instances["index"].to_numpy()
    bucket = events["bucket"].to_numpy(dtype=object, na_value=None)[idx]
    layer = events["layer"].to_numpy(dtype=object, na_value=None)[idx]
    keys = [
        _async_key(r, k, o, b, lay)
        for r, k, o, b, lay in zip(instances["rank"], instances["kind"], instances["op"], bucket, layer)
    ]
    wait_keys = set(waits["key"])
    inst = instances.assign(key=keys, is_async=[k in wait_keys for k in keys])
    calls = inst[inst["is_async"]].sort_values("arrive_ns", kind="stable")
    calls = calls.assign(occ=calls.groupby(["key", "step"], sort=False).cumcount())
    waits = waits.sort_values("start", kind="stable")
    waits = waits.assign(occ=waits.groupby(["key", "step"], sort=False).cumcount())
    done = calls.merge(waits[["key", "step", "occ", "wait_end"]], on=["key", "step", "occ"], how="left")
    done.index = calls.index
    inst.loc[done.index, "leave_ns"] = done["wait_end"].fillna(-1).astype(np.int64).to_numpy()
    bad = set(inst.loc[inst["leave_ns"] < 0, "instance"])
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


def estimate_offsets(ranks, instances=None, pairs=None, events=None, reference=None, hosts=None):
    """-> (DataFrame OFFSET_COLUMNS, warnings). ``offset_ns`` of a rank is relative to the
    reference rank (lowest loaded rank unless given).

    Hard constraints (causality of p2p and of blocking collectives) give each rank an
    interval [lo, hi] for its offset (shortest paths through all constraints). The estimate
    is the interval's midpoint and ``uncertainty_ns`` its half-width (the largest error still
    possible); where the interval is open, the collective leave-time median (clamped into
    it) and its spread. Ranks with no evidence keep their
    epoch clock (offset 0, NaN bound). ``hosts`` (rank -> hostname): ranks of one host keep
    offset 0 unless their recorded times break causality.
    """
    ranks = sorted(int(r) for r in ranks)
    warnings: list[str] = []
    if not ranks:
        return pd.DataFrame(columns=list(OFFSET_COLUMNS)), warnings
    reference = ranks[0] if reference is None else int(reference)
    cons = hard_constraints(instances, pairs, events)
    same_host = _same_host_offsets(ranks, hosts, cons)
    if same_host is not None:
        return same_host, warnings
    upper, ok_up = _bounds_from(reference, cons, ranks)
    reverse = {(b, a): c for (a, b), c in cons.items()}
    lower_neg, ok_low = _bounds_from(reference, reverse, ranks)
    if not (ok_up and ok_low):
        warnings.append(
            "clock constraints from p2p and collectives contradict each other (clock drift "
            "during profiling, or mismatched ranges); offsets use collective medians only"
        )
        upper, lower_neg = {reference: 0.0}, {reference: 0.0}
    soft = _soft_offsets(reference, _soft_estimates(collective_edges(_blocking(instances, events), events)
                                                     if events is not None else {}))
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
    rows = _project(rows, cons, reference)
    lost = [row[0] for row in rows if row[3] == "epoch"]
    if lost:
        warnings.append(
            f"ranks {lost} share no matched communication with rank {reference}; their clocks "
            "are used as recorded (fine on one host, only as good as NTP across hosts)"
        )
    table = pd.DataFrame(rows, columns=list(OFFSET_COLUMNS))
    table["offset_ns"] = table["offset_ns"].astype(np.int64)
    table["uncertainty_ns"] = table["uncertainty_ns"].astype("Float64")
    return table, warnings


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


def apply_offsets(events: pd.DataFrame, offsets: pd.DataFrame, inplace: bool = False) -> pd.DataFrame:
    """Shift start_ns/end_ns onto the reference clock; keep raw_start_ns/raw_end_ns."""
    shift = offsets.set_index("rank")["offset_ns"]
    per_row = shift.reindex(events["rank"].to_numpy()).fillna(0).to_numpy(np.int64)
    out = events.copy(deep=False) if not inplace else events
    raw_start, raw_end = events["start_ns"].to_numpy(np.int64), events["end_ns"].to_numpy(np.int64)
    out["raw_start_ns"] = raw_start
    out["raw_end_ns"] = raw_end
    out["start_ns"] = raw_start - per_row
    out["end_ns"] = raw_end - per_row
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
