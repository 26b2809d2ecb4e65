"""The p2p ops of a plain trace: each gloo send / recv with its post, its peer (a group rank
mapped to a global one through pg_config's process groups), and the stage, direction and
microbatch a ``PP:..SEND_F..`` range around the post names."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...ingest.schema import tags_of
from ...sweeps import lane_keys
from .result import Inference

_DIR = {"F": "fwd", "B": "bwd"}
#: pg_desc of a process group -> the dim it spans (Megatron's group names, DeviceMesh's)
_GROUP_DESC = {
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp", "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "CONTEXT_PARALLEL_GROUP": "cp", "mesh_pp": "pp", "mesh_tp": "tp", "mesh_cp": "cp",
}
NO_PEERS_HINT = ("profile with record_shapes=True (torch.profiler) so pptrace can pair p2p sends "
                 "with recvs exactly")


def process_groups(metas: dict) -> dict:
    """rank -> [(desc, ranks)] from distributedInfo.pg_config."""
    out = {}
    for rank, meta in metas.items():
        config = ((meta or {}).get("distributed") or {}).get("pg_config")
        if isinstance(config, list):
            out[int(rank)] = [(str(g.get("pg_desc")), [int(r) for r in g.get("ranks") or []])
                              for g in config if isinstance(g, dict) and isinstance(g.get("ranks"), list)]
    return out


def dim_groups(metas: dict) -> dict:
    """dim -> {rank: ranks of its group along dim} for groups pg_config names (pp, tp, cp)."""
    out: dict = {}
    for rank, groups in process_groups(metas).items():
        for desc, ranks in groups:
            dim = _GROUP_DESC.get(desc)
            if dim and rank in ranks:
                out.setdefault(dim, {})[rank] = ranks
    return out


def label_sides(rows: pd.DataFrame) -> pd.DataFrame:
    """rows with the side (``send``) of each torch ``PP::`` label that names sends and recvs
    (a batch posted together, ``PP::fwd_send_bwd_recv``): that of the c10d post its range
    starts in or after (each op of the batch is posted, then its Work's range opens)."""
    both = ((rows["kind"] == "wire") & (rows["send_dir"] != "") & (rows["recv_dir"] != "")).to_numpy()
    if not both.any():
        return rows
    posts = rows[(rows["kind"] == "post").to_numpy()]
    found, side = _post_side(posts, rows["rank"].to_numpy(np.int64)[both], rows["start_ns"].to_numpy(np.int64)[both])
    rows = rows.copy()
    send = rows["send"].to_numpy(bool).copy()
    send[np.flatnonzero(both)[found]] = side[found]
    rows["send"] = send
    return rows


def _post_side(posts: pd.DataFrame, rank: np.ndarray, t: np.ndarray) -> tuple:
    """Per query (rank, t): whether a post of that rank starts at or before t, and whether
    the last such is a send."""
    p_rank, p_start = posts["rank"].to_numpy(np.int64), posts["start_ns"].to_numpy(np.int64)
    if not len(p_start):
        return np.zeros(len(t), bool), np.zeros(len(t), bool)
    order = np.lexsort((p_start, p_rank))
    p_rank, p_start, p_send = p_rank[order], p_start[order], posts["send"].to_numpy(bool)[order]
    key, q_key = lane_keys([p_rank, rank], [p_start, t])
    i = np.searchsorted(key, q_key, side="right") - 1
    k = np.clip(i, 0, len(p_start) - 1)
    return (i >= 0) & (p_rank[k] == rank), p_send[k]


def p2p_ops(rows: pd.DataFrame, metas: dict, out: Inference) -> pd.DataFrame:
    """One row per gloo p2p range: index (its event row), rank, step, is_send, start/end,
    peer (global rank or -1), tag, stage/dir/mb from a ``PP:..SEND_F..`` range around its
    post (-1 / "" where none), bytes."""
    wires = rows[rows["kind"] == "wire"]
    if wires.empty:
        return pd.DataFrame(columns=["index", "post_index", "post_start", "rank", "pid", "tid", "step", "is_send",
                                     "start_ns", "end_ns", "peer", "tag",
                                     "stage", "dir", "mb", "bytes"])
    posts = rows[rows["kind"] == "post"]
    found = {}
    for tags in posts["tags"].dropna().unique():  # per distinct tag value
        t = tags_of(tags)
        if "group_peer" in t:
            found[tags] = (int(t["group_peer"]), int(t.get("tag", 0)))
    tag_col = posts["tags"].astype(object)
    posts = posts.assign(
        post_index=posts.index.to_numpy(),
        group_peer=tag_col.map(lambda x: found.get(x, (-1, 0))[0]).to_numpy(np.int64),
        tag=tag_col.map(lambda x: found.get(x, (-1, 0))[1]).to_numpy(np.int64),
        post_start=posts["start_ns"].to_numpy(), post_end=posts["end_ns"].to_numpy(),
    )
    # the name of the action that posted it (PP:1SEND_F3 encloses its c10d::send)
    named = rows[rows["kind"] == "pp_p2p"]
    if len(named):
        named = named.assign(n_start=named["start_ns"], n_end=named["end_ns"], n_stage=named["stage"],
                             n_dir=named["act"].map(_DIR), n_mb=named["mb"], n_send=named["send"])
        posts = pd.merge_asof(
            posts.sort_values("post_start"), named[["rank", "n_start", "n_end", "n_stage", "n_dir", "n_mb", "n_send"]]
            .sort_values("n_start"), left_on="post_start", right_on="n_start", by="rank", direction="backward")
        inside = (posts["n_end"] >= posts["post_end"]) & (posts["n_send"] == posts["send"])
        for col, empty in (("n_stage", -1), ("n_mb", -1), ("n_dir", "")):
            posts[col] = posts[col].where(inside, empty)
    else:
        posts = posts.assign(n_stage=-1, n_mb=-1, n_dir="")
    # a PP:: label names the direction and stage of its op itself
    send = wires["send"].to_numpy(bool)
    wires = wires.assign(index=wires.index.to_numpy(), w_stage=wires["stage"].to_numpy(np.int64),
                         w_dir=np.where(send, wires["send_dir"].to_numpy(object), wires["recv_dir"].to_numpy(object)))
    ops = pd.merge_asof(
        wires.sort_values("start_ns"),
        posts[["rank", "send", "post_index", "post_start", "group_peer", "tag", "n_stage", "n_dir", "n_mb"]]
        .sort_values("post_start"),
        left_on="start_ns", right_on="post_start", by=["rank", "send"], direction="backward")
    ops["group_peer"] = ops["group_peer"].fillna(-1).astype(np.int64)
    peer = _global_peers(ops["rank"].to_numpy(np.int64), ops["group_peer"].to_numpy(), metas)
    ops = pd.DataFrame({
        "index": ops["index"].to_numpy(np.int64), "post_index": ops["post_index"].fillna(-1).to_numpy(np.int64),
        "post_start": ops["post_start"].fillna(-1).to_numpy(np.int64),
        "rank": ops["rank"].to_numpy(np.int64), "pid": ops["pid"].to_numpy(np.int64),
        "tid": ops["tid"].to_numpy(np.int64),
        "step": ops["step"].to_numpy(np.int64), "is_send": ops["send"].to_numpy(bool),
        "start_ns": ops["start_ns"].to_numpy(np.int64), "end_ns": ops["end_ns"].to_numpy(np.int64),
        "peer": peer, "tag": ops["tag"].fillna(0).to_numpy(np.int64),
        "stage": np.where(ops["w_stage"] >= 0, ops["w_stage"], ops["n_stage"].fillna(-1)).astype(np.int64),
        "dir": np.where(ops["w_dir"] != "", ops["w_dir"], ops["n_dir"].fillna("")).astype(object),
        "mb": ops["n_mb"].fillna(-1).to_numpy(np.int64), "bytes": ops["bytes"].astype("Int64"),
    }).sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)
    if (ops["peer"] >= 0).any():
        out.inferred["peers"] = "'Concrete Inputs' of the c10d::send / c10d::recv_ posts (group rank -> global)"
    return ops


def peers_said(ops: pd.DataFrame, unknown: np.ndarray, out: Inference) -> None:
    """One warning for the p2p ops whose post names no peer (``unknown``: a mask of ``ops``
    before fill_peers; ``ops`` after it), and how the placed ones were inferred."""
    if not unknown.any():
        return
    ranks = sorted(int(r) for r in np.unique(ops["rank"].to_numpy()[unknown]))
    placed = unknown & (ops["peer"].to_numpy(np.int64) >= 0)
    said = (f"the peers of {int(unknown.sum())} p2p sends/recvs (gloo:send / gloo:recv on ranks {ranks[:8]}) are not "
            "in the trace: their c10d::send / c10d::recv_ carry no 'Concrete Inputs'; ")
    if placed.any():
        out.inferred["peers"] = (
            "inferred (no 'Concrete Inputs' on the gloo posts): each op's direction from its PP: name or the pass "
            "before a send's post / after a recv's wait, its peer the neighbouring stage, the k-th send of a rank "
            "paired with the k-th recv of its neighbour in that direction; record_shapes=True makes it exact")
        left = int((unknown & ~placed).sum())
        said += ("pptrace inferred them from the stage order and the order of the sends and recvs" if not left else
                 f"pptrace inferred {int(placed.sum())} from the stage order and their order; {left} it could not "
                 "place are left out of the pipeline's p2p (never booked as transfer)")
    else:
        said += "they are left out of the pipeline's p2p (never booked as transfer)"
    out.warnings.append(f"{said}; {NO_PEERS_HINT}")


def _global_peers(rank: np.ndarray, group_peer: np.ndarray, metas: dict) -> np.ndarray:
    """Group ranks -> global ranks through each rank's pipeline group (pg_config), else the
    default group (the identity); -1 where unknown."""
    pp_groups = dim_groups(metas).get("pp", {})
    out = group_peer.copy()
    for r in np.unique(rank):
        ranks = pp_groups.get(int(r))
        if ranks:
            mine = (rank == r) & (group_peer >= 0) & (group_peer < len(ranks))
            out[mine] = np.asarray(ranks, dtype=np.int64)[group_peer[mine]]
    out[out == rank] = -1  # a send to oneself is no pipeline p2p
    return out
