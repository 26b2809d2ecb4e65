"""Plain traces: each rank's passes (forward, backward, their split halves) with their
microbatch and chunk, from its pass ranges where it has any (torch's ``PP:<stage><F|B|I|W><mb>``,
GPipe's ``Forward <mb>``), else from its ops between p2p posts (Megatron-Core names nothing).
One step of the inference: :func:`pptrace.run.infer.infer_run` calls :func:`infer_passes`."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ...sweeps import inside, lane_keys
from ...vocab import BWD, FWD, OP_OF_ACTION

#: One sub-action of an overlapped pass name, ``<stage><F|B|I|W><mb>``.
SUB_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")

_PASS_COLUMNS = ["rank", "pid", "tid", "step", "start_ns", "end_ns", "op", "mb", "chunk"]


def infer_passes(rows: pd.DataFrame, ops: pd.DataFrame, work: pd.DataFrame, steps: pd.DataFrame, pp: int) -> pd.DataFrame:
    """The passes of every rank: from its pass ranges where it has any, else from its ops
    between p2p posts. ``work``: main-thread ops (no p2p, no pass names) with ``auto``
    (an autograd op); ``steps``: the ProfilerStep ranges."""
    named_ranks = set(rows.loc[rows["kind"].isin(["pass", "gpipe", "overlap"]), "rank"].unique().tolist())
    parts = [_named_passes(rows, work, pp)]
    rest = rows[~rows["rank"].isin(named_ranks)]
    if len(rest):
        parts.append(_passes_between_posts(rest, ops, work, steps))
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=_PASS_COLUMNS)
    return pd.concat(parts, ignore_index=True)


def _named_passes(rows: pd.DataFrame, work: pd.DataFrame, pp: int) -> pd.DataFrame:
    """Passes from named ranges, each cut to after the last recv ending inside it (the wait
    on its input; else from its first op) and before the first send posted inside it (GPipe
    posts its output in it), ending with the last op in it: Python between its ops is its
    compute."""
    named = rows[rows["kind"].isin(["pass", "gpipe"])]
    overlap = rows[rows["kind"] == "overlap"]
    if len(overlap):
        named = pd.concat([named, _split_overlaps(overlap, work)], ignore_index=True)
    if named.empty:
        return pd.DataFrame(columns=_PASS_COLUMNS)
    # a pass waits for its inputs (recvs) first and posts its outputs (sends) last
    recvs = rows[rows["kind"].isin(["wire", "post"]) & ~rows["send"].to_numpy(bool)]
    sends = rows[(rows["kind"] == "post") & rows["send"].to_numpy(bool)]
    start = named["start_ns"].to_numpy(np.int64)
    end = named["end_ns"].to_numpy(np.int64)
    rank = named["rank"].to_numpy()
    # an OVERLAP_F_B's forward part ends with the wait for its backward's input: its ops
    # alone bound it
    own = ~named["overlap"].fillna(False).to_numpy(bool) if "overlap" in named else np.ones(len(named), bool)
    found, got = _nearest(recvs, "end_ns", rank, end, after=False)  # the last recv of the rank ending by then
    waited = found & (got > start) & own
    start = np.where(waited, got, start)
    found, got = _nearest(sends, "start_ns", rank, start, after=True)  # its first send posted from then on
    sent = found & (got < end)
    end = np.where(sent, got, end)
    end = _with_loss(named, rows, work, rank, end, sent)
    # A pass runs from its wait's return (the pass function's Python before its first op:
    # hooks, FSDP's pre-forward, are its compute) to its last op; what the schedule runs
    # after it (building and posting the sends) is host cost between passes (whatif/costs.py),
    # as is its Python before the first op of an action that waited for nothing.
    op_start, end = _to_ops(work, rank, start, end)
    start = np.where(waited, start, op_start)
    stage = named["stage"].to_numpy(np.int64)
    return pd.DataFrame({
        "rank": rank, "pid": named["pid"].to_numpy(), "tid": named["tid"].to_numpy(), "step": named["step"].to_numpy(),
        "start_ns": start, "end_ns": np.maximum(end, start), "op": named["act"].map(OP_OF_ACTION).to_numpy(object),
        "mb": named["mb"].to_numpy(np.int64), "chunk": np.where(stage >= 0, stage // max(pp, 1), 0),
    })[_PASS_COLUMNS]


def _with_loss(named: pd.DataFrame, rows: pd.DataFrame, work: pd.DataFrame, rank, end, sent) -> np.ndarray:
    """GPipe computes the last stage's loss after its ``Forward i`` range, before the next
    range: a forward that posts no send (the last stage's) ends with the last op before the
    rank's next pass range, that microbatch's loss being part of its forward."""
    gpipe = rows[rows["kind"] == "gpipe"]
    last = (named["kind"] == "gpipe").to_numpy() & (named["act"] == "F").to_numpy() & ~sent
    if not last.any():
        return end
    q_rank, q_end = rank[last], named["end_ns"].to_numpy(np.int64)[last]
    has_next, next_start = _nearest(gpipe, "start_ns", q_rank, q_end, after=True)
    has_op, op_end = _nearest(work, "end_ns", q_rank, next_start, after=False)
    out = end.copy()
    out[last] = np.where(has_next & has_op & (op_end > end[last]), op_end, end[last])
    return out


def _nearest(frame: pd.DataFrame, column: str, rank: np.ndarray, t: np.ndarray, after: bool) -> tuple:
    """Per query (rank, time t): of the values of ``column`` of the rows of its rank, the
    first at or after t (``after``), else the last at or before t -> (found, value)."""
    mine, values = frame["rank"].to_numpy(np.int64), frame[column].to_numpy(np.int64)
    if not len(values):
        return np.zeros(len(t), bool), np.asarray(t, np.int64)
    order = np.lexsort((values, mine))
    mine, values = mine[order], values[order]
    key, q_key = lane_keys([mine, np.asarray(rank, np.int64)], [values, t])
    i = np.searchsorted(key, q_key, side="left") if after else np.searchsorted(key, q_key, side="right") - 1
    k = np.clip(i, 0, len(values) - 1)
    return (i >= 0) & (i < len(values)) & (mine[k] == rank), values[k]


def _to_ops(work: pd.DataFrame, rank: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple:
    """Spans cut to the ops of their rank inside them, from the first op start in the span
    to the last op end in it (unchanged where none is)."""
    has_first, first = _nearest(work, "start_ns", rank, start, after=True)
    has_last, last = _nearest(work, "end_ns", rank, end, after=False)
    ok = has_first & has_last & (first < end) & (last > start) & (first < last)
    return np.where(ok, first, start), np.where(ok, last, end)


def _split_overlaps(overlap: pd.DataFrame, work: pd.DataFrame) -> pd.DataFrame:
    """DualPipeV's ``PP:(1F6;6B2)OVERLAP_F_B`` runs its forward, then its backward (each
    after waiting for its own input): one named range per sub-action, split at the first
    autograd op inside (all forward when there is none)."""
    rank = overlap["rank"].to_numpy(np.int64)
    start, end = overlap["start_ns"].to_numpy(np.int64), overlap["end_ns"].to_numpy(np.int64)
    found, first_auto = _nearest(work[work["auto"].to_numpy(bool)], "start_ns", rank, start, after=True)
    cut = np.where(found & (first_auto < end), first_auto, end)
    # its forward and its backward: the first sub-action of each kind in its name
    subs = pd.Series(overlap["name"].to_numpy(object)).str.split(")").str[0].str.extractall(SUB_ACTION)
    subs.columns = ["stage", "act", "mb"]
    is_f = (subs["act"] == "F").to_numpy()
    parts = pd.concat([subs[is_f].groupby(level=0).first().add_prefix("f_"),
                       subs[~is_f].groupby(level=0).first().add_prefix("b_")], axis=1)
    parts = parts.reindex(range(len(overlap))).fillna({"f_act": "", "b_act": ""})
    n = len(overlap)
    side = np.repeat([0, 1], n)  # forward part, then backward part
    at = np.tile(np.arange(n), 2)
    keep = np.concatenate([(parts["f_act"].to_numpy(object) != "") & (cut > start),
                           (parts["b_act"].to_numpy(object) != "") & (end > cut)])
    # by rank, then as listed, each range's forward part first
    order = np.lexsort((side, at, rank[at]))
    order = order[keep[order]]
    side, at = side[order], at[order]
    if not len(at):
        return pd.DataFrame()

    def pick(fwd_column, bwd_column):
        return np.where(side == 0, parts[fwd_column].to_numpy()[at], parts[bwd_column].to_numpy()[at])

    return pd.DataFrame({
        "rank": rank[at], "pid": overlap["pid"].to_numpy(np.int64)[at], "tid": overlap["tid"].to_numpy(np.int64)[at],
        "step": overlap["step"].to_numpy(np.int64)[at],
        "start_ns": np.where(side == 0, start[at], cut[at]), "end_ns": np.where(side == 0, cut[at], end[at]),
        "kind": "pass", "stage": pick("f_stage", "b_stage").astype(np.int64), "act": pick("f_act", "b_act"),
        "mb": pick("f_mb", "b_mb").astype(np.int64), "overlap": True,
    })


def _passes_between_posts(rows: pd.DataFrame, ops: pd.DataFrame, work: pd.DataFrame,
                          steps: pd.DataFrame) -> pd.DataFrame:
    """Passes of schedules that name none (Schedule1F1B, Megatron): the main thread's ops
    between p2p posts (between two posts the thread may wait for a p2p range, then runs
    ops). The last run of autograd ops (``autograd::engine::evaluate_function`` and what
    they contain) between two posts is a backward, earlier ones its microbatch's loss, the
    runs between backwards forwards; a pass spans its first op to its last (Python between
    them is its compute) before a p2p wait returns inside it. A forward must hand its output
    on: a send posted next, or a backward right after it (the last stage); other runs of ops
    are not passes (set-up before a recv, the optimizer after the step's last post)."""
    ranks = np.unique(rows["rank"].to_numpy())
    ranks = ranks[np.isin(ranks, steps["rank"].to_numpy()) & np.isin(ranks, work["rank"].to_numpy())]
    post_dirs = dict(zip(ops["post_index"], ops["dir"])) if len(ops) else {}
    passes = _ops_passes(ranks, steps[steps["rank"].isin(ranks).to_numpy()],
                         rows[(rows["kind"] == "post").to_numpy() & rows["rank"].isin(ranks).to_numpy()],
                         work[work["rank"].isin(ranks).to_numpy()], post_dirs, ops[["rank", "end_ns"]])
    if passes.empty:
        return pd.DataFrame(columns=_PASS_COLUMNS)
    passes = _one_forward_per_backward(passes)
    passes = passes.sort_values(["rank", "start_ns"], kind="stable")
    passes["mb"] = passes.groupby(["rank", "step", "op"]).cumcount().to_numpy()
    passes.attrs["by_order"] = True
    return passes[_PASS_COLUMNS].reset_index(drop=True)


def _ops_passes(ranks: np.ndarray, steps: pd.DataFrame, posts: pd.DataFrame, work: pd.DataFrame,
                post_dirs: dict, wires: pd.DataFrame | None = None) -> pd.DataFrame:
    """The passes of _passes_between_posts, every rank at once (``ranks``: sorted, each with
    steps and ops), with ``unsure`` forwards. Each rank's timeline is cut at its posts and
    step bounds: the cuts of all ranks lie in one array, by rank, then time, and the
    interval after a cut is the stretch up to its rank's next cut."""
    def lane(frame):
        return np.searchsorted(ranks, frame["rank"].to_numpy())

    # cuts in time order: posts (1 a forward send, 4 a backward send, 5 a send of unknown
    # direction, 2 a recv) and zero-length step starts (0) / ends (3)
    st0, st1 = steps["start_ns"].to_numpy(np.int64), steps["end_ns"].to_numpy(np.int64)
    post_dir = posts.index.map(post_dirs).to_numpy(object) if post_dirs else np.full(len(posts), "", dtype=object)
    send_k = np.where(post_dir == "fwd", 1, np.where(post_dir == "bwd", 4, 5))
    post_k = np.where(posts["send"].to_numpy(bool), send_k, 2)
    cut_r = np.concatenate([lane(posts), lane(steps), lane(steps)])
    cut_s = np.concatenate([posts["start_ns"].to_numpy(np.int64), st0, st1])
    cut_e = np.concatenate([posts["end_ns"].to_numpy(np.int64), st0, st1])
    cut_k = np.concatenate([post_k, np.zeros(len(st0), int), np.full(len(st1), 3)])
    order = np.lexsort((cut_k, cut_s, cut_r))
    cut_r, cut_s, cut_e, cut_k = cut_r[order], cut_s[order], cut_e[order], cut_k[order]
    first_cut = np.searchsorted(cut_r, np.arange(len(ranks)), side="left")
    end_cut = np.searchsorted(cut_r, np.arange(len(ranks)), side="right")
    # interval i: from cut i's end to cut i+1's start (within one rank)
    iv_s, iv_e = cut_e[:-1], cut_s[1:]
    w_r = lane(work)
    ws, we = work["start_ns"].to_numpy(np.int64), work["end_ns"].to_numpy(np.int64)
    cut_key, w_key = lane_keys([cut_r, w_r], [cut_s, ws])
    iv = np.clip(np.searchsorted(cut_key, w_key, side="right") - 1, first_cut[w_r], end_cut[w_r] - 2)
    ok = (end_cut[w_r] - first_cut[w_r] >= 2) & (ws >= iv_s[iv]) & (we <= iv_e[iv]) & (cut_k[iv] != 3) \
        & (cut_k[iv + 1] != 0)
    # an op is backward when it is an autograd op or inside one (of its rank)
    is_auto = work["auto"].to_numpy(bool)
    in_auto = inside(w_r, ws, we, w_r[is_auto], ws[is_auto], we[is_auto])
    iv, ws, we, in_auto = iv[ok], ws[ok], we[ok], in_auto[ok]
    if not len(iv):
        return pd.DataFrame()
    o = np.lexsort((ws, iv))
    iv, ws, we, in_auto = iv[o], ws[o], we[o], in_auto[o]
    # a batch of posts: consecutive posts with no op between them; what the one after each
    # interval sends: 1 a forward output, 2 a backward output (to an earlier stage)
    has_ops = np.zeros(len(iv_s), bool)
    has_ops[np.unique(iv)] = True
    batch = np.cumsum(np.r_[True, has_ops | (cut_k[:-1] == 0) | (cut_k[:-1] == 3) | (cut_r[:-1] != cut_r[1:])])
    sends = pd.DataFrame({"fwd": np.isin(cut_k, (1, 5)), "bwd": cut_k == 4, "known": cut_k == 1})
    sends = sends.groupby(batch).transform("any")
    fwd_next, bwd_next, known_fwd_next = (sends[c].to_numpy(bool) for c in ("fwd", "bwd", "known"))
    runs = _runs(iv, ws, we, in_auto)
    # A loss may call backward() itself (torchtitan's ChunkedLossWrapper: once per sequence
    # chunk) between the last stage's forward and its backward, with no post in between:
    # the stage's backward is the last run of autograd ops before the post that follows,
    # the earlier ones are that microbatch's loss, part of its forward.
    nested = _nested_backwards(runs)
    if nested.any():
        in_auto = in_auto & ~nested[runs["id"]]
        runs = _runs(iv, ws, we, in_auto)
    # ops after a backward that end in a backward send belong to that backward (the last
    # stage hands its input grad on)
    r_iv, r_auto, first_in_iv, last_in_iv = runs["iv"], runs["auto"], runs["first_in_iv"], runs["last_in_iv"]
    tail = ~r_auto & last_in_iv & ~first_in_iv & np.r_[False, r_auto[:-1]] & bwd_next[r_iv + 1] & ~fwd_next[r_iv + 1]
    if tail.any():
        in_auto = in_auto | np.isin(runs["id"], np.flatnonzero(tail))
        runs = _runs(iv, ws, we, in_auto)
        r_iv, r_auto, first_in_iv, last_in_iv = runs["iv"], runs["auto"], runs["first_in_iv"], runs["last_in_iv"]
    r_first, r_last = runs["first"], runs["last"]
    send_next = fwd_next[r_iv + 1] & (cut_k[r_iv + 1] != 3)
    # a forward that hands its output to a send posted next is sure; other runs of ops may
    # be forwards too (the last stage's, right before its backward; a forward whose send
    # comes later, as with Megatron's overlap_p2p_comm) or bookkeeping: settled by count in
    # _one_forward_per_backward. Never one: the set-up before a step's first recv, and what
    # follows the step's last post (optimizer, logging)
    after_bwd = ~first_in_iv & np.r_[False, r_auto[:-1]]  # its send may be the backward's
    sure = ~r_auto & last_in_iv & send_next & (known_fwd_next[r_iv + 1] | ~after_bwd)
    setup = (cut_k[r_iv] == 0) & ~fwd_next[r_iv + 1]
    unsure = ~r_auto & ~sure & ~setup & (cut_k[r_iv + 1] != 3)
    # a wait that returns inside a run (the previous send's, which torch's 1F1B clears after
    # the next forward) is no compute: the pass ends with its last op before it
    r_last = _before_waits(runs, cut_r[r_iv], iv, ws, we, wires, ranks)
    # the first stage's first forward of a step has no recv before it, so its interval takes
    # in the step's set-up (data loading, masks) too: it starts where an op like its other
    # forwards' first begins, as many ops before its end as they hold. Those that open their
    # interval show how a forward begins; one after a backward in the same interval begins
    # with what the backward ran after its last autograd op.
    clean = sure & (cut_k[r_iv] != 0) & first_in_iv
    r_first = _without_setup(runs, sure & (cut_k[r_iv] == 0), clean if clean.any() else sure & (cut_k[r_iv] != 0),
                             cut_r[r_iv], ws, work["code"].to_numpy(np.int64)[ok][o], r_first, r_last)
    sel = (r_auto | sure | unsure) & (r_last > r_first)
    r_lane = cut_r[r_iv[sel]]
    # the rank's thread: that of its first op
    _, first_op = np.unique(w_r, return_index=True)
    # the step: of the rank's last step starting by the pass's start (its first step if none)
    s_order = np.lexsort((st0, lane(steps)))
    s_lane, s_start = lane(steps)[s_order], st0[s_order]
    s_key, q_key = lane_keys([s_lane, r_lane], [s_start, r_first[sel]])
    at = np.clip(np.searchsorted(s_key, q_key, side="right") - 1, np.searchsorted(s_lane, r_lane, side="left"),
                 np.searchsorted(s_lane, r_lane, side="right") - 1)
    return pd.DataFrame({
        "rank": ranks[r_lane], "pid": work["pid"].to_numpy(np.int64)[first_op][r_lane],
        "tid": work["tid"].to_numpy(np.int64)[first_op][r_lane], "step": steps["step"].to_numpy()[s_order][at],
        "start_ns": r_first[sel], "end_ns": r_last[sel], "op": np.where(r_auto[sel], BWD, FWD), "chunk": 0,
        "unsure": unsure[sel],
    })


def _nested_backwards(runs: dict) -> np.ndarray:
    """Per run: an autograd run with another autograd run after it in its interval."""
    auto = np.flatnonzero(runs["auto"])
    out = np.zeros(len(runs["iv"]), bool)
    if len(auto) > 1:
        later = auto[1:]
        out[auto[:-1]] = runs["iv"][later] == runs["iv"][auto[:-1]]
    return out


def _before_waits(runs: dict, r_lane, iv, ws, we, wires: pd.DataFrame, ranks) -> np.ndarray:
    """Each run's end, moved back to the end of its last op that starts before the first p2p
    wait returning inside it (a gloo range ends when its wait() returns on the main thread)."""
    last = runs["last"]
    if wires is None or wires.empty:
        return last
    wired = np.isin(wires["rank"].to_numpy(np.int64), ranks)
    w_rank = np.searchsorted(ranks, wires["rank"].to_numpy(np.int64)[wired])
    ends = wires["end_ns"].to_numpy(np.int64)[wired]
    found, w = _nearest(pd.DataFrame({"rank": w_rank, "end_ns": ends}), "end_ns", r_lane, runs["first"] + 1, after=True)
    cut = found & (w < last)
    if not cut.any():
        return last
    # ops are sorted by (interval, start): the last op of the run starting before w, and
    # the latest end of the run's ops up to it
    key, q_key = lane_keys([iv, runs["iv"][cut]], [ws, w[cut]])
    last_op = np.r_[runs["at"][1:], len(ws)] - 1
    k = np.clip(np.searchsorted(key, q_key, side="left") - 1, runs["at"][cut], last_op[cut])
    reach = pd.Series(we).groupby(runs["id"]).cummax().to_numpy(np.int64)
    out = last.copy()
    out[cut] = reach[k]
    return out


def _without_setup(runs: dict, setup: np.ndarray, other: np.ndarray, r_lane, ws, code, first, last) -> np.ndarray:
    """The start of each ``setup`` run (a forward that may hold the step's set-up before it)
    moved to the op that begins the rank's other forwards (``other``: their first op's name,
    the most common one) nearest to as many ops before the run's end as those hold (their
    median), where the run holds more; the other runs' starts as they are."""
    if not setup.any() or not other.any():
        return first
    at = runs["at"]
    count = np.diff(np.r_[at, len(ws)])
    ref = pd.DataFrame({"lane": r_lane[other], "n": count[other], "code": code[at[other]]})
    n_ref = ref.groupby("lane")["n"].median()
    common = ref.groupby(["lane", "code"]).size().reset_index(name="times")
    common = common.sort_values(["lane", "times"], ascending=[True, False], kind="stable").drop_duplicates("lane")
    code_ref = pd.Series(common["code"].to_numpy(), index=common["lane"].to_numpy())
    lanes = r_lane[setup]
    n = pd.Series(lanes).map(n_ref).to_numpy(float)
    c = pd.Series(lanes).map(code_ref).fillna(-1).to_numpy(np.int64)
    runs_at, runs_n = at[setup], count[setup]
    keep = np.isfinite(n) & (runs_n > n)
    if not keep.any():
        return first
    target = runs_at + runs_n - np.round(np.nan_to_num(n)).astype(np.int64)  # the op as many ops before its end
    # every op of the kept runs, with its distance to its run's target where its name fits
    which = np.flatnonzero(keep)
    span = runs_n[which]
    owner = np.repeat(which, span)
    pos = np.repeat(runs_at[which], span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
    fits = code[pos] == c[owner]
    dist = np.where(fits, np.abs(pos - target[owner]), np.iinfo(np.int64).max)
    best = pd.Series(dist).groupby(owner).idxmin().to_numpy()
    chosen = np.where(dist[best] < np.iinfo(np.int64).max, pos[best], target[np.unique(owner)])
    out = first.copy()
    idx = np.flatnonzero(setup)[np.unique(owner)]
    out[idx] = np.minimum(ws[chosen], last[idx])
    return out


def _one_forward_per_backward(passes: pd.DataFrame) -> pd.DataFrame:
    """Every microbatch a stage runs forward it runs backward: of a rank's unsure forwards
    in a step, the longest make up the count of its backwards (beside the sure ones); the
    others were not forwards."""
    n_b = passes[passes["op"] == "bwd"].groupby(["rank", "step"]).size()
    n_sure = passes[(passes["op"] == "fwd") & ~passes["unsure"]].groupby(["rank", "step"]).size()
    room = (n_b - n_sure.reindex(n_b.index, fill_value=0)).clip(lower=0)
    unsure = passes[passes["unsure"]]
    if unsure.empty:
        return passes
    unsure = unsure.assign(dur=unsure["end_ns"] - unsure["start_ns"]).sort_values("dur", ascending=False, kind="stable")
    rank_in = unsure.groupby(["rank", "step"]).cumcount().to_numpy()
    limit = pd.MultiIndex.from_arrays([unsure["rank"], unsure["step"]]).map(room).to_numpy(dtype=float)
    drop = unsure.index[rank_in >= np.nan_to_num(limit)]
    return passes.drop(index=drop)


def _runs(iv: np.ndarray, ws: np.ndarray, we: np.ndarray, auto: np.ndarray) -> dict:
    """Runs of consecutive ops (sorted by interval, then start) of one kind (autograd or
    not) within one interval: id of each op's run, and per run its interval, kind, first
    start, last end, and whether it is its interval's first / last."""
    new = np.r_[True, (iv[1:] != iv[:-1]) | (auto[1:] != auto[:-1])]
    at = np.flatnonzero(new)
    r_iv = iv[at]
    return {
        "id": np.cumsum(new) - 1, "iv": r_iv, "auto": auto[at], "first": ws[at], "at": at,
        "last": np.maximum.reduceat(we, at),
        "first_in_iv": np.r_[True, r_iv[1:] != r_iv[:-1]], "last_in_iv": np.r_[r_iv[1:] != r_iv[:-1], True],
    }
