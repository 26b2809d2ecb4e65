"""The pipeline of a plain trace: the stage of each rank and pp (from pg_config, the stage
ids of ``PP:`` names or the forward chain of first sends), the Layout that fits them, and the
direction and microbatch of the p2p ops no name gave."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...topology import Layout
from ...vocab import LAYOUT_ORDERS
from .p2p import dim_groups
from .result import Inference


def find_pipeline(rows: pd.DataFrame, ops: pd.DataFrame, metas: dict, out: Inference):
    """(rank -> pipeline position, pp, stages per rank), from pg_config, else the stage ids
    of PP: names, else the forward chain of first sends; (None, None, 1) when none says."""
    named = rows[rows["kind"].isin(["pass", "pp_p2p"])]
    v = 1
    if len(named):
        per_rank = named.groupby("rank")["stage"].agg(["min", "nunique"])
        v = int(per_rank["nunique"].max())
    groups = dim_groups(metas).get("pp", {})
    if groups and len({len(g) for g in groups.values()}) == 1 and len(next(iter(groups.values()))) > 1:
        stage_of = {r: g.index(r) for r, g in groups.items()}
        pp = len(next(iter(groups.values())))
        out.inferred["layout"] = f"pp{pp} from the pipeline process group in distributedInfo.pg_config"
        return stage_of, pp, v
    if len(named):
        n_stages = int(named["stage"].nunique())
        pp = max(1, n_stages // max(v, 1))
        stage_of = {int(r): int(s) for r, s in per_rank["min"].items()}
        out.inferred["layout"] = f"pp{pp} from the stage ids of PyTorch's PP: ranges ({n_stages} stages, {v} per rank)"
        return stage_of, pp, v
    chain = _chains(ops)
    if chain is None:
        if len(ops):
            out.warnings.append(
                "pipeline stage order unknown: no stage names, no pipeline group in pg_config and no p2p "
                "peers to follow; the run is analyzed without a pipeline")
        return None, None, 1
    stage_of, pp, text = chain
    out.inferred["layout"] = f"pp{pp} from the forward chain of each rank's first send ({text})"
    return stage_of, pp, 1


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
    return stage_of, len(chains[0]), " | ".join(" -> ".join(map(str, c)) for c in chains)


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
    """Direction where no name gave it (towards the next stage: fwd), mb by FIFO order per
    (rank, step, side, peer, direction)."""
    if ops.empty:
        return ops
    ops = ops.copy()
    src = np.where(ops["is_send"], ops["rank"], ops["peer"])
    dst = np.where(ops["is_send"], ops["peer"], ops["rank"])
    s_src = pd.Series(src).map(stage_of).fillna(-1).to_numpy()
    s_dst = pd.Series(dst).map(stage_of).fillna(-1).to_numpy()
    # towards the next stage: fwd, the previous: bwd; interleaved schedules wrap around from
    # the last stage to the first (with two stages, next and previous are one rank: by order)
    ahead = (s_dst - s_src) % pp == 1 if pp and pp > 2 else s_dst > s_src
    guess = np.where((ops["peer"] >= 0) & (s_src >= 0) & (s_dst >= 0), np.where(ahead, "fwd", "bwd"), "")
    ops["dir"] = np.where(ops["dir"] != "", ops["dir"], guess)
    counted = ops["mb"] < 0
    order = ops.groupby(["rank", "step", "is_send", "peer", "dir"], sort=False).cumcount().to_numpy()
    ops["mb"] = np.where(counted, order, ops["mb"])
    ops.attrs["mb_counted"] = bool(counted.any())
    return ops
