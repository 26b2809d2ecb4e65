"""Balanced experts: how much shorter each pass would have been had every rank's experts
got its ep group's mean number of tokens (``whatif --balanced-experts``).

An ep all-to-all ends for every rank of its group when the last of them arrives, so each
MoE layer call (one ``compute:expert`` range per rank of the group, then the all-to-all that
hands its tokens back) ends, for all of them alike, at the latest arrival. With each rank's
expert time rescaled to the group's mean tokens (its own measured time plus what the tokens
it gains or loses cost, at the run's per-token cost), a rank arrives ``expert - balanced``
earlier (a cold rank later), and the call ends at the latest of those new arrivals: every
rank's pass moves by ``max(new arrivals) - max(arrivals)``. The waits the hot rank caused
go with it, and a wait it did not cause (a rank late for other reasons) stays, since only the
expert time moves. Passes are then replayed as any measured pass (predict.py).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..analyzers.experts import expert_tags

#: what the result's ``predicted.experts`` holds, per step: MoE layer calls (each ep
#: group's own), the largest share of its group's mean tokens a rank's experts got, and the
#: pass time balancing takes off a rank (mean over ranks)
SUMMARY_KEYS = ("layer_calls", "max_over_mean_tokens", "pass_time_saved_s")


class NotBalanceable(ValueError):
    """The run has no expert-parallel work the what-if could rebalance."""


def _ep_groups(run) -> tuple[np.ndarray, np.ndarray]:
    """(id of its ep group: its lowest rank, that group's size) per rank, arrays indexed by
    rank; a rank outside the layout is a group of its own."""
    layout = run.layout
    ranks = np.asarray(run.ranks, np.int64)
    group = np.arange(int(ranks.max()) + 1 if ranks.size else 0, dtype=np.int64)
    size = np.ones_like(group)
    for r in ranks.tolist():
        if r < layout.world_size:
            members = layout.group_ranks("ep", r)
            group[r], size[r] = min(members), len(members)
    return group, size


def check_balanceable(run) -> None:
    """NotBalanceable unless the run has ep > 1 and tagged compute:expert ranges: said before
    anything else is measured, so that a run without experts hears that, not another reason."""
    ev = run.events
    rows = ev[(ev["category"] == "compute").to_numpy() & (ev["op"] == "expert").to_numpy()]
    _check(run, rows, expert_tags(rows["tags"]).tokens if len(rows) else np.zeros(0))
    if ((ev["category"] == "wait").to_numpy() & (ev["kind"] == "ep").to_numpy()).any():
        # posted, then waited after other work: the wait for the last arrival may hide under
        # that work, so moving the arrival need not move the pass by as much
        raise NotBalanceable(f"{run.path}: --balanced-experts cannot predict this run: its all-to-alls are waited "
                             "apart from their posts (ep:wait ranges, an overlapped dispatch such as --ep-overlap), "
                             "and the rescaling needs each expert range's all-to-all to hold its group to the last "
                             "arrival")


def _check(run, experts: pd.DataFrame, tokens: np.ndarray) -> None:
    where = f"{run.path}: --balanced-experts"
    if run.layout.ep <= 1:
        if experts.empty:
            raise NotBalanceable(f"{where} needs an expert-parallel run; this one has ep=1 and no compute:expert ranges")
        raise NotBalanceable(f"{where} needs ep > 1: with ep=1 each rank runs all of its own tokens' experts, "
                             "so no rank waits for another's and spreading the tokens changes nothing")
    if experts.empty:
        raise NotBalanceable(f"{where}: the traces show no compute:expert ranges (ep={run.layout.ep}); the time of "
                             "each rank's experts is needed to rescale it (pptrace.region('compute:expert', "
                             "layer=L, tokens=N))")
    if np.isnan(tokens).all():
        raise NotBalanceable(f"{where}: the compute:expert ranges carry no tokens= tag; the tokens each rank's "
                             "experts got are needed to spread them evenly")


def balanced_shifts(run, main: pd.DataFrame, passes: pd.DataFrame, notes: list) -> tuple[np.ndarray, dict]:
    """Per row of ``passes`` (the main threads' passes of the steps measured), the ns its
    duration changes by with the experts balanced, and a summary (SUMMARY_KEYS; the saving
    is per step, mean over ranks). ``main``: every main-thread range of those steps.
    Raises NotBalanceable for a run without ep > 1 and tagged expert ranges."""
    is_expert = (main["category"] == "compute").to_numpy() & (main["op"] == "expert").to_numpy()
    # the tags and layer of the run's own rows (the measured selection keeps only timing columns)
    experts = run.events.loc[main.index[is_expert], ["rank", "step", "layer", "tags", "start_ns", "end_ns"]]
    tokens, backward, _ = expert_tags(experts["tags"]) if len(experts) else (np.zeros(0), np.zeros(0, bool), None)
    _check(run, experts, tokens)
    keep = ~np.isnan(tokens)
    if not keep.all():
        notes.append(f"{int((~keep).sum())} compute:expert ranges without a tokens= tag kept as measured")
    e = pd.DataFrame({
        "rank": experts["rank"].to_numpy(np.int64), "step": experts["step"].to_numpy(np.int64),
        "layer": experts["layer"].fillna(-1).to_numpy(np.int64), "backward": backward,
        "tokens": tokens, "start": experts["start_ns"].to_numpy(np.int64), "end": experts["end_ns"].to_numpy(np.int64),
    })[keep].sort_values(["rank", "start"], kind="stable").reset_index(drop=True)
    e["dur"] = e["end"] - e["start"]
    group_of, size_of = _ep_groups(run)
    e["group"] = group_of[e["rank"].to_numpy()]
    # a group's ranks run the same program, so the n-th call of a layer in a step is the same
    # call on each of them: the mb tag is not needed (the real model's ranges have none)
    e["call"] = e.groupby(["rank", "step", "layer", "backward"], sort=False).cumcount()
    e["arrival"] = _arrivals(main, e)

    key = ["group", "step", "layer", "backward", "call"]
    g = e.groupby(key, sort=False)
    size = g["rank"].transform("size").to_numpy()
    whole = size == size_of[e["rank"].to_numpy()]
    if not whole.all():
        notes.append(f"{int((~whole).sum())} compute:expert ranges whose layer call is missing on a rank of its "
                     "ep group kept as measured")
    dur = e["dur"].to_numpy(float)
    mean = g["tokens"].transform("mean").to_numpy()
    per_token = _per_token_ns(e[whole])
    # the rank's own measured time (its speed, its noise) plus the tokens it gains or loses
    balanced = np.where(whole, np.maximum(dur + per_token.reindex(e["backward"]).fillna(0.0).to_numpy()
                                          * (mean - e["tokens"].to_numpy()), 0.0), dur)
    # from the call's latest arrival, in int64: epoch ns as float64 are 256 ns apart
    late = (e["arrival"] - g["arrival"].transform("max")).to_numpy(np.int64)
    e["moved"] = late - dur + balanced
    shift = e.groupby(key, sort=False)["moved"].transform("max").to_numpy()
    shift = np.where(whole, shift, 0.0)

    owner = _owning_pass(passes, e)
    inside = owner >= 0
    if not inside.all():
        notes.append(f"{int((~inside).sum())} compute:expert ranges outside any pass left out")
    out = np.zeros(len(passes))
    np.add.at(out, owner[inside], shift[inside])
    if not e["backward"].any():
        notes.append("the compute:expert ranges are forward only: the experts' backward is not rescaled, "
                     "and the waits its imbalance causes stay in the prediction")
    n_steps = max(e["step"].nunique(), 1)
    n_ranks = max(e["rank"].nunique(), 1)
    share = (e["tokens"] / np.where(mean > 0, mean, np.nan))[whole]
    summary = {
        "layer_calls": g.ngroups / n_steps,
        "max_over_mean_tokens": float(np.nanmax(share)) if share.notna().any() else None,
        "pass_time_saved_s": float(-out.sum()) / n_steps / n_ranks / 1e9,
    }
    return np.rint(out).astype(np.int64), summary


def _per_token_ns(e: pd.DataFrame) -> pd.Series:
    """What one token more costs an expert range, forward and backward apart (index: the
    ``backward`` flag): the least-squares slope of duration over tokens across every call
    of the run. Not duration / tokens: on a small real model an expert call costs about the
    same with 20 tokens as with 100 (launches, Python), and the rate would have the cold
    ranks slow down fivefold. Where the tokens never vary (a balanced run, which balancing
    does not move), duration / tokens; never below zero (noise on a flat cost)."""
    t, d = e["tokens"].to_numpy(float), e["dur"].to_numpy(float)
    frame = pd.DataFrame({"backward": e["backward"].to_numpy(), "t": t, "d": d, "tt": t * t, "td": t * d})
    m = frame.groupby("backward").mean()
    var, cov = m["tt"] - m["t"] ** 2, m["td"] - m["t"] * m["d"]
    # variance under a token's square in float noise counts as none
    flat = var <= 1e-9 * np.maximum(m["tt"], 1.0)
    slope = (cov / var.where(~flat)).where(~flat, m["d"] / m["t"].where(m["t"] > 0))
    return slope.fillna(0.0).clip(lower=0.0)


def _arrivals(main: pd.DataFrame, e: pd.DataFrame) -> np.ndarray:
    """Each expert range's arrival at the all-to-all that follows it: the start of the
    rank's next ep range (the host work between them is the rank's own, kept), else the
    expert's end."""
    comm = main[(main["category"] == "comm:ep").to_numpy()]
    probe = pd.DataFrame({"rank": e["rank"].to_numpy(), "end": e["end"].to_numpy(), "row": np.arange(len(e))})
    if comm.empty:
        return probe["end"].to_numpy(np.int64)
    nxt = pd.DataFrame({"rank": comm["rank"].to_numpy(np.int64), "next": comm["start_ns"].to_numpy(np.int64)})
    found = pd.merge_asof(probe.sort_values("end", kind="stable"), nxt.sort_values("next", kind="stable"),
                          left_on="end", right_on="next", by="rank", direction="forward").sort_values("row")
    return found["next"].fillna(found["end"]).to_numpy(np.int64)


def _owning_pass(passes: pd.DataFrame, e: pd.DataFrame) -> np.ndarray:
    """Position in ``passes`` of the pass each expert range runs inside, -1 for none."""
    p = pd.DataFrame({"rank": passes["rank"].to_numpy(np.int64), "start": passes["start_ns"].to_numpy(np.int64),
                      "stop": passes["end_ns"].to_numpy(np.int64), "pos": np.arange(len(passes))})
    probe = pd.DataFrame({"rank": e["rank"].to_numpy(), "at": e["start"].to_numpy(), "until": e["end"].to_numpy(),
                          "row": np.arange(len(e))})
    found = pd.merge_asof(probe.sort_values("at", kind="stable"), p.sort_values("start", kind="stable"),
                          left_on="at", right_on="start", by="rank", direction="backward").sort_values("row")
    ok = found["pos"].notna().to_numpy() & (found["until"].to_numpy() <= found["stop"].fillna(-1).to_numpy())
    return np.where(ok, found["pos"].fillna(-1).to_numpy(), -1).astype(np.int64)
