"""What a replay's time model takes from the trace beside the passes: the p2p latency of
each link (blocking exchanges, or eager sends from their post: left-censored where the recv
found its message landed), the host gap after an op, and the cost of posting an exchange
that is waited later. Whole-array work over the main threads' pipeline ops (predict.py)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..timeline import exchanges
from ..sweeps import lane_keys

#: the columns of the latency observations (exchange_latencies, eager_latencies; latency_of reads them)
LATENCY_COLUMNS = ("rank", "exchange", "link", "latency_ns")


def exchange_spans(rank, exchange, start, end, ops: pd.DataFrame) -> pd.DataFrame:
    """Per exchange (ids of exchanges.exchange_ids): rank, exchange, lo, hi (its span) and
    ``passes``: whether a pass of the rank starts inside it (posted, then waited after other
    work: ZB-H1's W's, overlap_p2p_comm, torch's sends waited at the end of the step)."""
    ranges = pd.DataFrame({"rank": np.asarray(rank, np.int64), "exchange": np.asarray(exchange, np.int64),
                           "start": np.asarray(start, np.int64), "end": np.asarray(end, np.int64)})
    g = ranges.groupby("exchange", sort=True)
    spans = pd.DataFrame({"rank": g["rank"].first(), "lo": g["start"].min(), "hi": g["end"].max()}).reset_index()
    compute = ops.loc[(ops["category"] == "compute").to_numpy(), ["rank", "start_ns"]]
    compute = compute.astype({"rank": np.int64, "start_ns": np.int64}).sort_values("start_ns")
    nxt = pd.merge_asof(spans.sort_values("lo", kind="stable"), compute, left_on="lo", right_on="start_ns",
                        by="rank", direction="forward")
    nxt["passes"] = (nxt["start_ns"] < nxt["hi"]).to_numpy()
    return nxt.drop(columns="start_ns").sort_values("exchange").reset_index(drop=True)


def _pipeline_pairs(run, steps) -> pd.DataFrame:
    """The run's pipeline p2p pairs of ``steps``: what both latency models observe."""
    pairs = run.pairs
    return pairs[(pairs["kind"] == "pp").to_numpy() & pairs["step"].isin(steps).to_numpy()]


def exchange_latencies(run, steps, ops: pd.DataFrame, stage_of) -> pd.DataFrame:
    """One latency observation per p2p exchange (exchanges.py; the loader's pairs carry each
    side's): its end minus the moment its last message was ready. The ranges of one combined
    exchange all close when its last direction completes, so a pair's own recv_end -
    max(starts) would count the wait for the *other* directions as transfer; the exchange's
    tail after its last match does not. Exchanges with passes inside (exchange_spans) are
    left out: their tail is the passes'. Rows in order of rank and exchange start (the order
    latency draws index)."""
    columns = list(LATENCY_COLUMNS)
    pairs = _pipeline_pairs(run, steps)
    if pairs.empty:
        return pd.DataFrame(columns=columns)
    link = list(zip(pairs["src"].map(stage_of), pairs["dst"].map(stage_of)))
    sides = pd.DataFrame({
        "rank": np.concatenate([pairs["src"], pairs["dst"]]).astype(np.int64),
        "exchange": np.concatenate([pairs["send_exchange"], pairs["recv_exchange"]]).astype(np.int64),
        "start": np.concatenate([pairs["send_start_ns"], pairs["recv_start_ns"]]).astype(np.int64),
        "end": np.concatenate([pairs["send_end_ns"], pairs["recv_end_ns"]]).astype(np.int64),
        "ready": np.concatenate(exchanges.sides_ready(pairs)),
        "link": link + link,
    }).sort_values(["rank", "start"], kind="stable").reset_index(drop=True)
    # the first of the latest-ready ranges, in range order, names the link
    last = sides.loc[sides.groupby("exchange", sort=True)["ready"].idxmax().to_numpy()]
    spans = exchange_spans(sides["rank"], sides["exchange"], sides["start"], sides["end"], ops)
    quiet = ~spans["passes"].to_numpy()
    return pd.DataFrame({"rank": spans["rank"].to_numpy()[quiet], "exchange": spans["exchange"].to_numpy()[quiet],
                         "link": last["link"].to_numpy()[quiet],
                         "latency_ns": np.maximum(0, spans["hi"].to_numpy() - last["ready"].to_numpy())[quiet]},
                        columns=columns)


#: A recv that lasted more than this many times a recv's own cost waited for its message, so
#: its end is the message's arrival (an exact eager latency); a shorter one found it landed.
WAITED_FACTOR = 2.0


def left_censored_cdf(value: np.ndarray, exact: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distribution of observations of which the inexact ones are upper bounds (reverse
    Kaplan-Meier: ``value`` read backwards is right-censored): (support ascending, its CDF)."""
    flipped = value.max() - value
    order = np.lexsort((~exact, flipped))  # at ties, events before censorings
    flipped, exact = flipped[order], exact[order]
    at_risk = len(flipped) - np.arange(len(flipped))
    survive = np.cumprod(np.where(exact, 1.0 - 1.0 / at_risk, 1.0))
    mass = np.where(exact, np.r_[1.0, survive[:-1]] - survive, 0.0)
    support = (value.max() - flipped)[::-1]
    cdf = np.cumsum(mass[::-1])
    return support, cdf / cdf[-1] if cdf[-1] > 0 else cdf


def eager_latencies(run, steps, ops: pd.DataFrame, stage_of) -> pd.DataFrame:
    """One latency per p2p message for a replay with eager sends (torch's runtime schedules
    post a send and wait on it later; a recv ends once its message landed): from the send's
    post to the recv's end. Exact when the recv waited for it: it was posted before the send,
    or, posted within 4 typical latencies of it, it lasted over :data:`WAITED_FACTOR` times a
    recv's own cost (the median recv posted later than that, which found its message there).
    Otherwise the message had landed before the recv was posted, and
    that span is only an upper bound: such a message gets the median of the distribution
    below its bound (reverse Kaplan-Meier over all of them), not the bound, which would
    count the receiver's own lateness as latency, nor the recv's own span, which would drop
    the time the message took. Recvs with passes inside (posted, waited later) are left out."""
    columns = list(LATENCY_COLUMNS)
    pairs = _pipeline_pairs(run, steps)
    if pairs.empty:
        return pd.DataFrame(columns=columns)
    dst = pairs["dst"].to_numpy(np.int64)
    recv_start, recv_end = pairs["recv_start_ns"].to_numpy(np.int64), pairs["recv_end_ns"].to_numpy(np.int64)
    send_start = pairs["send_start_ns"].to_numpy(np.int64)
    spans = exchange_spans(dst, np.arange(len(pairs)), recv_start, recv_end, ops)
    quiet = ~spans["passes"].to_numpy()
    if not quiet.any():
        return pd.DataFrame(columns=columns)
    bound = np.maximum(recv_end - send_start, 0)[quiet].astype(float)
    lasted = (recv_end - recv_start)[quiet].astype(float)
    before = (recv_start <= send_start)[quiet]
    # a recv posted long after its send (beyond 4 typical latencies) found its message there;
    # typical: of the recvs posted first, whose bound is exact (the bounds of late recvs
    # hold their lateness: a few posted 20-50 ms late made a recv's own cost look like a wait)
    typical = np.median(bound[before]) if before.any() else np.median(bound)
    landed = (recv_start - send_start)[quiet] > 4 * typical
    cost = float(np.median(lasted[landed])) if landed.any() else float(np.percentile(lasted, 10))
    # a landed recv's span is its own cost, however it varied (0.1-0.8 ms on a quiet box)
    exact = before | (~landed & (lasted > WAITED_FACTOR * cost))
    latency = bound
    if (~exact).any() and exact.any():
        support, cdf = left_censored_cdf(bound, exact)
        below = cdf[np.clip(np.searchsorted(support, bound[~exact], side="right") - 1, 0, len(cdf) - 1)]
        median_below = support[np.clip(np.searchsorted(cdf, below / 2), 0, len(support) - 1)]
        latency = bound.copy()
        latency[~exact] = np.minimum(median_below, bound[~exact])
    link = list(zip(pairs["src"].map(stage_of)[quiet], pairs["dst"].map(stage_of)[quiet]))
    out = pd.DataFrame({"rank": dst[quiet], "exchange": np.flatnonzero(quiet), "link": link,
                        "latency_ns": latency}, columns=columns)
    # what a recv costs when its message is there (PipelineTimes.recv_s): on a loaded box
    # ms, not the quiet 0.3, and paid by every recv the replay makes
    out.attrs["recv_ns"] = cost if landed.any() else 0.0
    return out


def latency_of(observed: pd.DataFrame, p: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per link median latency, and all observations (the empirical distribution)."""
    lat = np.zeros((p, p))
    if observed.empty:
        return lat, None
    seconds = observed["latency_ns"].to_numpy(dtype=float) / 1e9
    lat[:] = float(np.median(seconds))  # links the run never used (e.g. interleaved's wrap)
    per_link = observed.groupby("link")["latency_ns"].median()
    ends = np.array(per_link.index.tolist(), dtype=np.int64).reshape(-1, 2)
    lat[ends[:, 0], ends[:, 1]] = per_link.to_numpy(dtype=float) / 1e9
    return lat, seconds


def overhead(ops: pd.DataFrame) -> float:
    """Median host gap after a pipeline op of a rank ends until its next op starts. A p2p
    exchange (exchanges.py) blocks as one op; one with passes inside (exchange_spans) was
    posted and waited apart, so its ranges are ops of their own (each a post, later a wait).
    It is an op's end, not the end of all opened before it, that the next start is measured
    from: an exchange open across passes hides no gap between them."""
    p2p = ops[(ops["category"] == "p2p").to_numpy()]
    ids = exchanges.exchange_ids(p2p["rank"], p2p["start_ns"], p2p["end_ns"])
    spans = exchange_spans(p2p["rank"], ids, p2p["start_ns"], p2p["end_ns"], ops)
    apart = spans["passes"].to_numpy()[np.searchsorted(spans["exchange"].to_numpy(), ids)]
    steps = p2p.groupby(ids)["step"].first()
    blocking = spans[~spans["passes"]]
    units = pd.concat([
        ops.loc[(ops["category"] != "p2p").to_numpy(), ["rank", "step", "start_ns", "end_ns"]],
        p2p.loc[apart, ["rank", "step", "start_ns", "end_ns"]],
        pd.DataFrame({"rank": blocking["rank"], "step": steps.reindex(blocking["exchange"]).to_numpy(),
                      "start_ns": blocking["lo"], "end_ns": blocking["hi"]}),
    ])
    group = pd.MultiIndex.from_arrays([units["rank"].to_numpy(), units["step"].to_numpy()]).factorize()[0]
    start_key, end_key = lane_keys([group, group], [units["start_ns"].to_numpy(np.int64),
                                                    units["end_ns"].to_numpy(np.int64)])
    s_order, e_order = np.argsort(start_key, kind="stable"), np.argsort(end_key, kind="stable")
    start_key, end_key = start_key[s_order], end_key[e_order]
    start, end = units["start_ns"].to_numpy(np.int64)[s_order], units["end_ns"].to_numpy(np.int64)[e_order]
    g_start, g_end = group[s_order], group[e_order]
    first_end = np.searchsorted(g_end, g_start, side="left")  # where each start's group begins among ends
    later = np.r_[False, g_start[1:] == g_start[:-1]]  # every start but its group's first
    done = np.searchsorted(end_key, start_key, side="right")  # ops of the group ended by each start
    ended = end[np.maximum(done - 1, 0)]
    prev_start = np.r_[start[:1], start[:-1]]
    # a start with no op ended since the previous start opened inside that one: no gap
    gap = np.where(later & (done > first_end) & (ended >= prev_start), start - ended, 0)
    gaps = gap[gap > 0]
    return float(np.median(gaps)) / 1e9 if gaps.size else 0.0


def post_cost(main: pd.DataFrame) -> float:
    """Median host time from posting an exchange that is waited later to the pass run
    meanwhile (ZB-H1's W, overlap_p2p_comm): the earliest p2p range opened since the rank's
    previous pass, up to the start of the pass nested in it."""
    groups = pd.MultiIndex.from_arrays([main["rank"].to_numpy(), main["step"].to_numpy()]).factorize()[0]
    is_pass = (main["category"] == "compute").to_numpy()
    is_p2p = (main["category"] == "p2p").to_numpy() & (main["kind"] == "pp").to_numpy()
    if not is_pass.any() or not is_p2p.any():
        return 0.0
    g_pass, g_p2p = groups[is_pass], groups[is_p2p]
    pass_start, pass_end = main["start_ns"].to_numpy(np.int64)[is_pass], main["end_ns"].to_numpy(np.int64)[is_pass]
    p_start, p_end = main["start_ns"].to_numpy(np.int64)[is_p2p], main["end_ns"].to_numpy(np.int64)[is_p2p]
    (keys,) = lane_keys([np.r_[g_pass, g_p2p]], [np.r_[pass_start, p_start]])
    pass_key, p2p_key = keys[:len(g_pass)], keys[len(g_pass):]
    order = np.argsort(pass_key, kind="stable")
    pass_key, g_pass, pass_start, pass_end = pass_key[order], g_pass[order], pass_start[order], pass_end[order]
    # previous pass of the same rank and step (by start): a range posted after it ended and
    # still open when the next pass starts was posted to be waited later
    prev_end = np.where(np.r_[False, g_pass[1:] == g_pass[:-1]], np.r_[0, pass_end[:-1]], np.iinfo(np.int64).min)
    nxt = np.searchsorted(pass_key, p2p_key, side="right")  # the first pass starting after each post
    ok = nxt < len(pass_key)
    nxt = np.minimum(nxt, len(pass_key) - 1)
    opened = ok & (g_pass[nxt] == g_p2p) & (p_start >= prev_end[nxt]) & (p_start < pass_start[nxt]) \
        & (p_end > pass_start[nxt])
    if not opened.any():
        return 0.0
    earliest = np.full(len(pass_key), np.iinfo(np.int64).max)
    np.minimum.at(earliest, nxt[opened], p_start[opened])
    hit = earliest < np.iinfo(np.int64).max
    costs = pass_start[hit] - earliest[hit]
    return float(np.median(costs)) / 1e9
