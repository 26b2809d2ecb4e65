"""The pipeline of a plain trace: the stage of each rank and pp (from pg_config, the stage
ids of ``PP:`` names, the forward chain of first sends, or, with no peer in the trace, the
order in which the ranks start), the Layout that fits them, and the direction, peer and
microbatch of the p2p ops no name gave."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...sweeps import lane_keys
from ...topology import Layout
from ...vocab import BWD, FWD, LAYOUT_ORDERS
from .names import staged
from .p2p import dim_groups
from .result import Inference


def find_pipeline(rows: pd.DataFrame, ops: pd.DataFrame, metas: dict, out: Inference, clock: dict | None = None):
    """(rank -> pipeline position, pp, stages per rank), from pg_config, else the stage ids
    of PP: names, else the forward chain of first sends, else (no peer anywhere) the order
    the ranks start in on ``clock`` (rank -> ns to subtract; None: the traces' own, one
    host's); (None, None, 1) when none says. ``out.groups``: each rank's pipeline, by
    position, where known."""
    named = rows[staged(rows)]
    v = 1
    if len(named):
        per_rank = named.groupby("rank")["stage"].agg(["min", "nunique"])
        v = int(per_rank["nunique"].max())
    groups = dim_groups(metas).get("pp", {})
    if groups and len({len(g) for g in groups.values()}) == 1 and len(next(iter(groups.values()))) > 1:
        stage_of = {r: g.index(r) for r, g in groups.items()}
        pp = len(next(iter(groups.values())))
        out.inferred["layout"] = f"pp{pp} from the pipeline process group in distributedInfo.pg_config"
        out.groups = {r: list(g) for r, g in groups.items()}
        return stage_of, pp, v
    if len(named):
        n_stages = int(named["stage"].nunique())
        pp = max(1, n_stages // max(v, 1))
        stage_of = {int(r): int(s) for r, s in per_rank["min"].items()}
        out.inferred["layout"] = f"pp{pp} from the stage ids of PyTorch's PP: ranges ({n_stages} stages, {v} per rank)"
        return stage_of, pp, v
    chain = _chains(ops)
    if chain is not None:
        stage_of, pp, chains = chain
        out.inferred["layout"] = f"pp{pp} from the forward chain of each rank's first send ({_said(chains)})"
        out.groups = {r: c for c in chains for r in c}
        return stage_of, pp, 1
    timed = _timing_chain(ops, clock)
    if timed is not None:
        stage_of, pp, chains = timed
        out.inferred["layout"] = (
            f"pp{pp} inferred from timing, the trace naming no p2p peer: the ranks in the order their pipeline "
            f"starts ({_said(chains)}; the first stage sends before it receives, each next stage's first recv "
            f"completes after its predecessor's first send, on {'aligned clocks' if clock else 'one clock'})")
        out.groups = {r: c for c in chains for r in c}
        return stage_of, pp, 1
    if len(ops):
        out.warnings.append(
            "pipeline stage order unknown: no stage names, no pipeline group in pg_config, no p2p peers to "
            "follow and no start order of the ranks that a pipeline has; the run is analyzed without a pipeline")
    return None, None, 1


def _said(chains: list) -> str:
    return " | ".join(" -> ".join(map(str, c)) for c in chains)


def _chains(ops: pd.DataFrame):
    """The forward chains of the pipeline: a chain starts at a rank whose first p2p op (in
    its first step) is a send: only the first stage sends before it receives. Each hop is
    a rank's first send (its first forward send where the direction is named), up to a
    rank already in the chain. -> (rank -> stage, pp, description) or None."""
    known = ops[ops["peer"] >= 0]
    if known.empty:
        return None
    first_step = known[known["step"] == known.groupby("rank")["step"].transform("min")]
    first_op = first_step.sort_values("start_ns").groupby("rank").first()
    heads = sorted(int(r) for r in first_op.index[first_op["is_send"].to_numpy(bool)])
    sends = first_step[first_step["is_send"]]
    if (sends["dir"] == "fwd").any():
        sends = sends[sends["dir"] == "fwd"]
    first_send = sends.sort_values("start_ns").groupby("rank")["peer"].first()
    nxt = dict(zip(first_send.index.astype(int).tolist(), first_send.astype(int).tolist()))
    ranks = set(int(r) for r in ops["rank"].unique()) | set(nxt.values())
    chains, seen = [], set()
    for head in heads:
        chain = [head]
        while chain[-1] in nxt and nxt[chain[-1]] not in chain and nxt[chain[-1]] not in seen:
            chain.append(nxt[chain[-1]])
        seen.update(chain)
        chains.append(chain)
    if not chains or len({len(c) for c in chains}) != 1 or seen != ranks or len(chains[0]) < 2:
        return None
    stage_of = {r: i for chain in chains for i, r in enumerate(chain)}
    return stage_of, len(chains[0]), chains


def _timing_chain(ops: pd.DataFrame, clock: dict | None):
    """The pipelines of a run whose p2p ops name no peer, from when each rank starts: in the
    first step every rank has p2p in, only a first stage sends before it receives (the
    heads, one per pipeline); the other ranks follow by when their first recv completed,
    as many per stage as there are pipelines, each level's in the order of time. Each rank's
    first recv must complete after the first send of the rank before it in its pipeline
    (a recv cannot end before its send was posted), else no pipeline is claimed. -> (rank
    -> stage, pp, the pipelines by position) or None."""
    if ops.empty or (ops["peer"] >= 0).any():
        return None
    shift = ops["rank"].map(clock or {}).fillna(0).to_numpy(np.int64)
    post = np.where(ops["post_start"].to_numpy(np.int64) >= 0, ops["post_start"].to_numpy(np.int64),
                    ops["start_ns"].to_numpy(np.int64)) - shift
    frame = pd.DataFrame({"rank": ops["rank"].to_numpy(np.int64), "step": ops["step"].to_numpy(np.int64),
                          "send": ops["is_send"].to_numpy(bool), "post": post,
                          "end": ops["end_ns"].to_numpy(np.int64) - shift})
    frame = frame[frame["step"] >= 0]
    ranks = np.unique(frame["rank"].to_numpy())
    if len(ranks) < 2:
        return None
    first = frame[frame["step"] == frame.groupby("rank")["step"].min().max()]
    if len(np.unique(first["rank"].to_numpy())) != len(ranks):
        return None
    opens = first.sort_values(["rank", "post"], kind="stable").groupby("rank")["send"].first()
    send_post = first[first["send"]].groupby("rank")["post"].min().reindex(ranks)
    recv_end = first[~first["send"]].groupby("rank")["end"].min().reindex(ranks)
    heads = opens.index[opens.to_numpy(bool)].to_numpy()
    n = len(heads)
    if n == 0 or len(ranks) % n or len(ranks) // n < 2:
        return None
    rest = ranks[~np.isin(ranks, heads)]
    if recv_end.reindex(rest).isna().any():
        return None
    order = np.r_[heads[np.argsort(send_post.reindex(heads).to_numpy(), kind="stable")],
                  rest[np.argsort(recv_end.reindex(rest).to_numpy(), kind="stable")]]
    pp = len(ranks) // n
    # level by level, each level's ranks in the order of time: grid[stage, pipeline]
    grid = order.reshape(pp, n)
    after = recv_end.reindex(grid[1:].ravel()).to_numpy(float)
    before = send_post.reindex(grid[:-1].ravel()).to_numpy(float)
    if not (after > before).all():  # NaN (a stage that never sends) fails too
        return None
    stage_of = {int(r): int(k) for k, row in enumerate(grid) for r in row}
    return stage_of, pp, [[int(r) for r in grid[:, j]] for j in range(n)]


def fit_layout(stage_of: dict, pp: int, world: int, metas: dict, out: Inference) -> Layout | None:
    """The Layout whose pp coordinate of every rank is its stage (and whose tp / cp groups
    are pg_config's where it names them); a stage order no Megatron-style layout has is
    reported, not forced."""
    groups = dim_groups(metas)
    sizes = {d: len(next(iter(groups[d].values()))) for d in ("tp", "cp") if groups.get(d)}
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    if world % (pp * tp * cp):
        out.warnings.append(f"pipeline of {pp} stages does not divide the world of {world} ranks; layout not inferred")
        return None
    dp = world // (pp * tp * cp)
    for order in LAYOUT_ORDERS:
        layout = Layout(tp=tp, cp=cp, pp=pp, dp=dp, order=order)
        if all(layout.coords(r).pp == s for r, s in stage_of.items() if r < world) and all(
                sorted(layout.group_ranks(d, r)) == sorted(g)
                for d in ("tp", "cp") for r, g in groups.get(d, {}).items()):
            return layout
    order = " ".join(f"{r}:{s}" for r, s in sorted(stage_of.items()))
    out.warnings.append(
        f"the pipeline's stage order (rank:stage {order}) fits no Megatron-style layout; pp coordinates "
        "follow the ranks' order instead, so per-stage results are per rank")
    return Layout(tp=tp, cp=cp, pp=pp, dp=dp)


def add_directions(ops: pd.DataFrame, stage_of: dict, pp: int | None) -> pd.DataFrame:
    """Direction where no name gave it and the peer is known (towards the next stage: fwd);
    ``guessed`` marks the ops whose direction only the stage order gave."""
    if ops.empty:
        return ops
    ops = ops.copy()
    named = ops["dir"].to_numpy(object) != ""
    src = np.where(ops["is_send"], ops["rank"], ops["peer"])
    dst = np.where(ops["is_send"], ops["peer"], ops["rank"])
    s_src = pd.Series(src).map(stage_of).fillna(-1).to_numpy()
    s_dst = pd.Series(dst).map(stage_of).fillna(-1).to_numpy()
    # towards the next stage: fwd, the previous: bwd; interleaved schedules wrap around from
    # the last stage to the first (with two stages, next and previous are one rank: by order)
    ahead = (s_dst - s_src) % pp == 1 if pp and pp > 2 else s_dst > s_src
    guess = np.where((ops["peer"] >= 0) & (s_src >= 0) & (s_dst >= 0), np.where(ahead, "fwd", "bwd"), "")
    ops["dir"] = np.where(named, ops["dir"], guess)
    ops["guessed"] = ~named & (guess != "")
    return ops


#: With two stages the next stage and the previous one are one rank: the stage order cannot
#: tell an interleaved schedule's forward wrap-around (last stage to the first one's second
#: chunk) from a backward message. When the passes beside the ops read this share of them the
#: other way, the passes' reading stands.
CONTRADICTED_SHARE = 0.10


def directions_of_two_stages(ops: pd.DataFrame, infer, pp) -> tuple | None:
    """(ops, passes) re-read with each op's direction from the passes beside it, for a
    two-stage pipeline whose guessed directions (stage order: add_directions) the passes
    contradict (CONTRADICTED_SHARE); None when they agree (the stage order stands) or there
    is nothing guessed. ``infer``: ops -> passes, run on the ops with the guesses taken back
    so that no direction from the stage order shapes the passes."""
    if pp != 2 or ops.empty or "guessed" not in ops or not ops["guessed"].any():
        return None
    guessed = ops["guessed"].to_numpy(bool)
    blind = ops.assign(dir=np.where(guessed, "", ops["dir"].to_numpy(object)))
    passes = infer(blind)
    found = pass_directions(blind, passes)
    compared = guessed & (found != "")
    if not compared.any() or (found[compared] != ops["dir"].to_numpy(object)[compared]).mean() < CONTRADICTED_SHARE:
        return None
    return blind.assign(dir=np.where(compared, found, ops["dir"].to_numpy(object)), guessed=False), passes


def number_messages(ops: pd.DataFrame) -> pd.DataFrame:
    """mb where no name gave it: by FIFO order per (rank, step, side, peer, direction), so
    that the k-th send of a rank to its neighbour pairs with the neighbour's k-th recv."""
    if ops.empty:
        return ops
    ops = ops.copy()
    counted = ops["mb"] < 0
    order = ops.groupby(["rank", "step", "is_send", "peer", "dir"], sort=False).cumcount().to_numpy()
    ops["mb"] = np.where(counted, order, ops["mb"])
    ops.attrs["mb_counted"] = bool(counted.any())
    return ops


def fill_peers(ops: pd.DataFrame, passes: pd.DataFrame, rows: pd.DataFrame, stage_of: dict, pp: int,
               groups: dict) -> pd.DataFrame:
    """The direction and peer of p2p ops the trace names no peer for (no record_shapes):
    the direction from the name around the post where there is one, else from the passes
    beside it (a send hands on the output of the pass that ended before its post; a recv's
    wait returns right before the pass that takes its input), the peer the neighbouring
    stage in the rank's pipeline (``groups``: rank -> its pipeline by position), round the
    ring (an interleaved schedule's last stage feeds the first). Unplaced ops keep -1."""
    unknown = (ops["peer"] < 0).to_numpy()
    if ops.empty or not unknown.any() or not groups or not pp:
        return ops
    ops = ops.copy()
    rank = ops["rank"].to_numpy(np.int64)
    send = ops["is_send"].to_numpy(bool)
    direction = ops["dir"].to_numpy(object).copy()
    need = unknown & (direction == "")
    found = pass_directions(ops, passes)
    direction[need & (found != "")] = found[need & (found != "")]
    ahead = (send & (direction == "fwd")) | (~send & (direction == "bwd"))
    position = pd.Series(rank).map(stage_of).to_numpy(float)
    # a stage the name gives: its neighbour's position is where that stage runs
    named = ops["stage"].to_numpy(np.int64)
    stages = rows.loc[staged(rows) & (rows["stage"] >= 0).to_numpy(), ["rank", "stage"]].drop_duplicates("stage")
    where = pd.Series(stages["rank"].map(stage_of).to_numpy(float), index=stages["stage"].to_numpy())
    # a send's stage is its own; a recv's too (PP:3RECV_F1 receives into stage 3)
    neighbour = np.where(ahead, named + 1, named - 1)
    by_name = pd.Series(neighbour).map(where).to_numpy(float, copy=True)
    by_name[named < 0] = np.nan
    target = np.where(np.isnan(by_name), position + np.where(ahead, 1, -1), by_name) % pp
    members = np.full((max(max(groups), int(rank.max())) + 1, pp), -1, np.int64)
    listed = np.array([r for r in groups if len(groups[r]) == pp], np.int64)
    if len(listed):
        members[listed] = np.array([groups[r] for r in listed], np.int64)
    placed = unknown & (direction != "") & ~np.isnan(target) & (rank < len(members))
    peer = ops["peer"].to_numpy(np.int64).copy()
    got = members[rank[placed], np.nan_to_num(target[placed]).astype(np.int64)]
    peer[placed] = np.where(got == rank[placed], -1, got)
    ops["peer"], ops["dir"] = peer, direction
    ops.attrs["peers_inferred"] = int((unknown & (peer >= 0)).sum())
    return ops


def pass_directions(ops: pd.DataFrame, passes: pd.DataFrame) -> np.ndarray:
    """Each p2p op's direction from the passes beside it: a send hands on the output of the
    pass that ended before its post, a recv's wait returns right before the pass that takes
    its input; "" where no pass says."""
    found = np.full(len(ops), "", dtype=object)
    if ops.empty or passes is None or passes.empty:
        return found
    rank = ops["rank"].to_numpy(np.int64)
    post = np.where(ops["post_start"].to_numpy(np.int64) >= 0, ops["post_start"].to_numpy(np.int64),
                    ops["start_ns"].to_numpy(np.int64))
    p_rank = passes["rank"].to_numpy(np.int64)
    p_op = passes["op"].astype(str).to_numpy(object)
    before = _pass_at(p_rank, passes["end_ns"].to_numpy(np.int64), p_op, rank, post, after=False)
    after = _pass_at(p_rank, passes["start_ns"].to_numpy(np.int64), p_op, rank, ops["end_ns"].to_numpy(np.int64),
                     after=True)
    found = np.where(ops["is_send"].to_numpy(bool), before, after)
    return np.where(np.isin(found, [FWD, BWD]), found, "").astype(object)


def _pass_at(p_rank, p_time, p_op, rank, t, after: bool) -> np.ndarray:
    """The op of each query's (rank, t) pass of its rank: the first whose time is at or after
    t (``after``), else the last at or before t; "" where none."""
    out = np.full(len(t), "", dtype=object)
    if not len(p_time) or not len(t):
        return out
    order = np.lexsort((p_time, p_rank))
    p_rank, p_time, p_op = p_rank[order], p_time[order], p_op[order]
    key, q_key = lane_keys([p_rank, rank], [p_time, t])
    i = np.searchsorted(key, q_key, side="left") if after else np.searchsorted(key, q_key, side="right") - 1
    k = np.clip(i, 0, len(p_time) - 1)
    hit = (i >= 0) & (i < len(p_time)) & (p_rank[k] == rank)
    out[hit] = p_op[k[hit]]
    return out
