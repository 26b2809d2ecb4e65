"""Plain traces (no pptrace in the run): find the pipeline and attribute its work.

The one place that reads other libraries' names and the trace's structure. It turns what
torch.distributed.pipelining (torchtitan) and gloo write into the contract-1 columns, so
matching (match.py) and every analyzer work on a plain run as on an instrumented one, and
marks each such row ``inferred``:

- p2p: each ``c10d::send`` / ``c10d::recv_`` post with its ``gloo:send`` / ``gloo:recv`` range
  (main thread, until ``wait()`` returns) becomes an appended ``pp:send_<dir>`` /
  ``pp:recv_<dir>`` row spanning both (a send's data leaves at its post), with the peer of
  the post ("Concrete Inputs", a *group* rank: mapped to a global
  rank through the pipeline group of ``distributedInfo.pg_config``, else the default group),
  direction and mb from the ``PP:<stage>SEND_F<mb>`` range around the post where the
  schedule names it, else from the stage order (towards the next stage: fwd) and FIFO order
  per (step, src, dst, direction). :func:`_p2p_rows` builds the rows from a table of ops
  (rank, step, is_send, peer, dir, mb, stage, bytes, post/wire times) whatever transport
  they came from.
- passes: ``PP:<stage><F|B|I|W><mb>``, ``PP:(<sub>;<sub>)OVERLAP_F_B`` (DualPipeV: split at
  its first autograd op) and ``Forward i`` / ``Backward i`` (GPipe) become appended
  ``compute:<op> mb= chunk=`` rows. Those ranges start with the wait on a recv posted
  earlier (and GPipe's end with the next send's post), so a pass is the part of the range
  after the last recv that *ends* inside it (that wait returned there) and before the first
  send posted inside it, cut to the ops in it. Schedules that name nothing (Schedule1F1B,
  Megatron-Core) get passes from the main thread's ops between p2p posts: runs of autograd
  ops (``autograd::engine::evaluate_function``) are backwards, a forward is the run of ops
  before a forward send (or settled by count: one forward per backward); microbatch and
  chunk come from the table of the schedule whose order they follow (1F1B, GPipe,
  Megatron's interleaved), else by counting. Compute is the ops: stretches inside a pass
  where no op runs become ``host:between_ops`` rows nested in it (not compute).
- layout: the pipeline group of pg_config (Megatron's PIPELINE_MODEL_PARALLEL_GROUP,
  DeviceMesh ``mesh_pp``), else the stage ids of ``PP:`` names, else the forward chain of
  sends starting at each rank that sends before it receives; schedule from the names (or
  the order of passes), microbatches from the passes.

The inferred rows (cat ``pptrace_inferred``) are appended rather than written over the
foreign ranges because their times differ (a pass without its wait, a p2p op with its post)
and Schedule1F1B has no range to write on; the foreign rows stay as the trace has them.
Everything inferred is listed in ``Inference.inferred`` (``Run.inferred``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from .intervals import union
from .lanes import inside, lane_keys
from .passes import SUB_ACTION, infer_passes
from .schema import tags_of
from ..topology import Layout
from ..vocab import BWD, DIRECTION_OF, FWD, GPIPE, INTERLEAVED, LAYOUT_ORDERS, ONE_F_ONE_B, PASS_OPS

_PASS = re.compile(r"^PP:(\d+)([FBIW])(\d+)$")
_PP_P2P = re.compile(r"^PP:(\d+)(SEND|RECV)_([FB])(\d+)$")
_OVERLAP = re.compile(r"^PP:\(((?:\d+[FBIW]\d+;?)+)\)OVERLAP_F_B$")
_GPIPE = re.compile(r"^(Forward|Backward) (\d+)$")
_POSTS = {"c10d::send": True, "c10d::recv_": False}
_WIRES = {"gloo:send": True, "gloo:recv": False}
_AUTOGRAD = "autograd::engine::evaluate_function"
#: torch.optim's profiler ranges around every optimizer's step and zero_grad
#: (``Optimizer.zero_grad#SGD.zero_grad``): their ops are no pass's, even where no p2p post
#: parts them from the first stage's first forward
_OPTIMIZER = "Optimizer."
_DIR = {"F": "fwd", "B": "bwd"}
#: pg_desc of a process group -> the dim it spans (Megatron's group names, DeviceMesh's)
_GROUP_DESC = {
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp", "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "CONTEXT_PARALLEL_GROUP": "cp", "mesh_pp": "pp", "mesh_tp": "tp", "mesh_cp": "cp",
}
#: Inside a pass, a stretch this long in which the main thread runs no op is not compute
#: (Python between ops): shorter ones are part of the pass.
MIN_GAP_NS = 20_000
NO_PEERS_HINT = ("profile with record_shapes=True (torch.profiler) so pptrace can pair p2p sends "
                 "with recvs")


@dataclass
class Inference:
    events: pd.DataFrame
    layout: Layout | None = None       # None: nothing found, keep the loader's
    schedule: str | None = None
    microbatches: int | None = None
    vpp: int | None = None
    #: what was inferred -> how, one line each (Run.inferred)
    inferred: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)


# -------------------------------------------------------------------------------------------
# names: parsed once per distinct name
# -------------------------------------------------------------------------------------------
def _name_table(names: pd.Index) -> pd.DataFrame:
    """One row per distinct event name: what it says (kind: pass, overlap, gpipe, pp_p2p,
    post, wire, autograd, optimizer or "" for nothing), stage, action letter, mb, is_send."""
    rows = []
    for name in names:
        kind, stage, act, mb, send = "", -1, "", -1, False
        if not isinstance(name, str):
            rows.append((kind, stage, act, mb, send))
            continue
        if name in _POSTS:
            kind, send = "post", _POSTS[name]
        elif name in _WIRES:
            kind, send = "wire", _WIRES[name]
        elif name.startswith(_AUTOGRAD):
            kind = "autograd"
        elif name.startswith(_OPTIMIZER):
            kind = "optimizer"
        elif name.startswith("PP:"):
            if m := _PASS.match(name):
                kind, stage, act, mb = "pass", int(m.group(1)), m.group(2), int(m.group(3))
            elif m := _PP_P2P.match(name):
                kind, stage, act, mb = "pp_p2p", int(m.group(1)), m.group(3), int(m.group(4))
                send = m.group(2) == "SEND"
            elif _OVERLAP.match(name):
                kind = "overlap"
            else:
                kind = "pp_other"  # UNSHARD, RESHARD, REDUCE_GRAD: no pass
        elif m := _GPIPE.match(name):
            kind, act, mb = "gpipe", m.group(1)[0], int(m.group(2))
        rows.append((kind, stage, act, mb, send))
    return pd.DataFrame(rows, columns=["kind", "stage", "act", "mb", "send"])


def _overlap_parts(name: str) -> list[tuple[int, str, int]]:
    """``PP:(7F5;0B1)OVERLAP_F_B`` -> [(7, "F", 5), (0, "B", 1)]."""
    return [(int(s), a, int(m)) for s, a, m in SUB_ACTION.findall(name.split(")")[0])]


# -------------------------------------------------------------------------------------------
# the entry point
# -------------------------------------------------------------------------------------------
def is_plain(events: pd.DataFrame) -> bool:
    """No contract pass or p2p range on the host: nothing told pptrace what the work is."""
    host = (events["lane_kind"] == "host").to_numpy() & ~events["gpu_annotation"].to_numpy()
    contract = events["category"].isin(["compute", "p2p"]).to_numpy() & ~events["inferred"].to_numpy()
    return not (host & contract).any()


def infer_run(events: pd.DataFrame, metas: dict, layout: Layout | None = None) -> Inference | None:
    """The inference of a plain run's events (all ranks, one frame with a RangeIndex), or
    None when the run has contract ranges or nothing this module knows. ``metas``: rank ->
    load_rank meta (its ``distributed`` block has pg_config). ``layout``: the run's layout
    when the user or a pptrace block gave it (then only its stages are used)."""
    if events.empty or not is_plain(events):
        return None
    table = _name_table(events["name"].cat.categories)
    codes = events["name"].cat.codes.to_numpy()
    kind = np.where(codes >= 0, table["kind"].to_numpy(object)[codes], "")
    main = (events["lane"] == "main").to_numpy() & (events["step"].to_numpy() >= 0)  # categorical: by code
    # host traces only: on GPU traces the work runs in kernels (the NCCL p2p: nccl.py)
    gpu = (events["lane_kind"] == "gpu").to_numpy()
    if gpu.any():
        main &= ~events["rank"].isin(events.loc[gpu, "rank"].unique()).to_numpy()
    known = main & (kind != "")
    if not (known & np.isin(kind, ["wire", "pass", "gpipe", "overlap"])).any():
        return None
    out = Inference(events=events)
    rows = events.loc[known, ["rank", "pid", "tid", "step", "start_ns", "end_ns", "tags", "bytes"]].copy()
    rows["kind"] = kind[known]
    c = codes[known]
    for col in ("stage", "act", "mb", "send"):
        rows[col] = table[col].to_numpy()[c]
    rows["name"] = events.loc[known, "name"].astype(object).to_numpy()

    ops = _p2p_ops(rows, metas, out)
    stage_of, pp, v = _pipeline(rows, ops, metas, out)
    if layout is not None:
        out.inferred.pop("layout", None)
        stage_of, pp = {r: layout.coords(r).pp for r in range(layout.world_size)}, layout.pp
    elif pp and pp > 1:
        out.layout = _layout(stage_of, pp, _world(events, metas), metas, out)
    if stage_of is not None:
        ops = _directions(ops, stage_of, pp)
    ops.attrs["pp"] = pp
    not_work = np.isin(kind, ["post", "wire", "pp_p2p", "pass", "gpipe", "overlap", "pp_other", "optimizer"])
    is_step = (events["category"] == "step").to_numpy()
    work = events.loc[main & ~not_work & ~is_step, ["rank", "pid", "tid", "start_ns", "end_ns"]]
    work = work.assign(auto=kind[main & ~not_work & ~is_step] == "autograd")
    optimizer = events.loc[main & (kind == "optimizer"), ["rank", "start_ns", "end_ns"]]
    work = work[~inside(*(work[c].to_numpy() for c in ("rank", "start_ns", "end_ns")),
                        *(optimizer[c].to_numpy() for c in ("rank", "start_ns", "end_ns")))]
    steps = events.loc[main & is_step, ["rank", "step", "start_ns", "end_ns"]]
    passes = infer_passes(rows, ops, work, steps, pp or 1)
    passes = _schedule(rows, passes, stage_of, pp, v, out)
    out.events = _write(events, ops, passes, _gaps(passes, work))
    return out


def _world(events: pd.DataFrame, metas: dict) -> int:
    sizes = [m.get("world_size") for m in metas.values() if isinstance(m.get("world_size"), int)]
    return max(sizes) if sizes else int(events["rank"].max()) + 1


# -------------------------------------------------------------------------------------------
# p2p ops
# -------------------------------------------------------------------------------------------
def _process_groups(metas: dict) -> dict:
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
    for rank, groups in _process_groups(metas).items():
        for desc, ranks in groups:
            dim = _GROUP_DESC.get(desc)
            if dim and rank in ranks:
                out.setdefault(dim, {})[rank] = ranks
    return out


def _p2p_ops(rows: pd.DataFrame, metas: dict, out: Inference) -> pd.DataFrame:
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
    wires = wires.assign(index=wires.index.to_numpy())
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
        "stage": ops["n_stage"].fillna(-1).to_numpy(np.int64), "dir": ops["n_dir"].fillna("").to_numpy(object),
        "mb": ops["n_mb"].fillna(-1).to_numpy(np.int64), "bytes": ops["bytes"].astype("Int64"),
    }).sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)
    unknown = ops[ops["peer"] < 0]
    if len(unknown):
        ranks = sorted(int(r) for r in unknown["rank"].unique())
        out.warnings.append(
            f"the peers of {len(unknown)} p2p sends/recvs (gloo:send / gloo:recv on ranks {ranks[:8]}) are "
            "unknown: their c10d::send / c10d::recv_ carry no 'Concrete Inputs'; " + NO_PEERS_HINT)
    if (ops["peer"] >= 0).any():
        out.inferred["peers"] = "'Concrete Inputs' of the c10d::send / c10d::recv_ posts (group rank -> global)"
    return ops


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


# -------------------------------------------------------------------------------------------
# the pipeline: stage of each rank, pp, stages per rank
# -------------------------------------------------------------------------------------------
def _pipeline(rows: pd.DataFrame, ops: pd.DataFrame, metas: dict, out: Inference):
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


def _layout(stage_of: dict, pp: int, world: int, metas: dict, out: Inference) -> Layout | None:
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


def _directions(ops: pd.DataFrame, stage_of: dict, pp: int | None) -> pd.DataFrame:
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


# -------------------------------------------------------------------------------------------
# schedule and microbatches
# -------------------------------------------------------------------------------------------
def _schedule(rows: pd.DataFrame, passes: pd.DataFrame, stage_of, pp, v: int, out: Inference) -> pd.DataFrame:
    """Fill the schedule, microbatches and vpp of ``out``; -> the passes, their (mb, chunk)
    taken from the schedule's table where their order is a known schedule's."""
    kinds = set(rows["kind"].unique())
    if passes.empty:
        return passes
    by_order = bool(passes.attrs.get("by_order")) and not (kinds & {"pass", "gpipe", "overlap"})
    out.inferred["passes"] = (
        "from the main thread's ops between p2p posts (no pass names; backward = autograd ops; "
        "mb and chunk by their order)" if by_order else
        "from PyTorch's pass ranges (PP:<stage><action><mb>, Forward i / Backward i), less the recv wait they include")
    out.inferred["p2p"] = "gloo:send / gloo:recv ranges, from the post until wait() returned"
    named = rows[rows["kind"] == "pass"]
    how = None
    if "gpipe" in kinds:
        out.schedule, how = "ScheduleGPipe", "'Forward i' / 'Backward i' ranges"
    elif len(named) or "overlap" in kinds:
        out.schedule, how = _pp_schedule(named, kinds, pp, v), "PyTorch's PP: action ranges"
    elif pp and stage_of is not None:
        found = _order_schedule(passes, pp, stage_of)
        if found is not None:
            out.schedule, v, passes = found
            how = "the order of its passes (no pass names in the trace)"
    out.vpp = v
    if out.schedule:
        out.inferred["schedule"] = f"{out.schedule} from {how}"
    if v > 1:
        source = "the PP: stage ids" if how and "PP:" in how else how
        out.inferred["vpp"] = f"{v} model chunks per rank, from {source}"
    m = microbatches_of(passes)
    if m is not None:
        out.microbatches = m
        out.inferred["microbatches"] = f"{out.microbatches}: distinct microbatches of a rank's forwards in a step"
    return passes


def microbatches_of(passes: pd.DataFrame) -> int | None:
    """The most distinct microbatches of one rank's forwards in one step (None: no forward
    carries one; an untagged one is null or -1)."""
    fwd = passes[(passes["op"] == FWD).to_numpy() & (passes["mb"].astype("Int64").fillna(-1) >= 0).to_numpy()]
    return int(fwd.groupby(["rank", "step"])["mb"].nunique().max()) if len(fwd) else None


def _order_schedule(passes: pd.DataFrame, pp: int, stage_of: dict, candidates=None):
    """Schedules that name nothing: the first of 1F1B, GPipe and Megatron's interleaved
    (v = 2..4) (or of ``candidates``, (name, v) pairs) whose table (pptrace.schedules.tables)
    has every rank's order of forwards and backwards in every step -> (name, v, passes with
    that table's mb and chunk), or None."""
    from ..schedules.tables import schedule_table

    order = passes.sort_values(["rank", "step", "start_ns"], kind="stable").reset_index(drop=True)
    # each (rank, step) runs the order of forwards (F) and backwards (B) of its stage's table
    act = np.where(order["op"].to_numpy(object) == "fwd", "F", "B")
    by_step = order.groupby(["rank", "step"], sort=False)
    at = by_step.cumcount().to_numpy()  # the place in its step
    length = by_step["op"].transform("size").to_numpy()
    n_f = int(pd.Series(act == "F").groupby([order["rank"], order["step"]]).sum().max())
    if candidates is None:
        candidates = [(ONE_F_ONE_B, 1), (GPIPE, 1)]
        candidates += [(INTERLEAVED, v) for v in (2, 3, 4) if n_f % v == 0 and (n_f // v) % pp == 0]
    ranks = order["rank"].unique()
    if not all(int(r) in stage_of for r in ranks):
        return None
    stage = order["rank"].map(stage_of).to_numpy(np.int64)
    stages = np.unique(stage)
    for name, v in candidates:
        if n_f % v:
            continue
        m = n_f // v
        try:  # one table per stage: (action, mb, chunk) in the order the stage runs them
            tables = [pd.DataFrame(schedule_table(name, pp, int(s), m, v), columns=["act", "mb", "chunk"],
                                   dtype=object) for s in stages]
        except ValueError:
            continue
        sizes = np.array([len(t) for t in tables])
        table = pd.concat(tables, ignore_index=True)
        k = np.searchsorted(stages, stage)
        row = np.r_[0, np.cumsum(sizes)][k] + at  # the table row of each pass (where in range)
        fits = (length == sizes[k]) & (at < sizes[k])
        if not fits.all() or (table["act"].to_numpy(object)[row] != act).any():
            continue
        return name, v, order.assign(mb=table["mb"].to_numpy(np.int64)[row],
                                     chunk=table["chunk"].to_numpy(np.int64)[row])
    return None


def _pp_schedule(named: pd.DataFrame, kinds: set, pp, v: int) -> str:
    # a V (ZBV, DualPipeV): every rank holds two stages, s and 2 pp - 1 - s
    stages = named[["rank", "stage"]].drop_duplicates().groupby("rank")["stage"].agg(["size", "sum"])
    if v == 2 and pp and ((stages["size"] == 2) & (stages["sum"] == 2 * pp - 1)).all():
        return "ScheduleDualPipeV" if "overlap" in kinds else "ScheduleZBVZeroBubble"
    if v == 1:
        return "Schedule1F1B"
    if set(named["act"]) & {"I", "W"}:
        return "ScheduleInterleavedZeroBubble"
    # LoopedBFS runs every forward of a stage before the next stage's, all before any backward
    s = named.sort_values("start_ns")
    by_step = [s["rank"].to_numpy(), s["step"].to_numpy()]
    acts = s["act"].to_numpy(object)
    at = s.groupby(by_step).cumcount()  # the place in its (rank, step)
    f_after_b = (at.where(acts == "F").groupby(by_step).max() > at.where(acts == "B").groupby(by_step).min()).any()
    is_f = acts == "F"
    stage_back = (s["stage"][is_f].groupby([k[is_f] for k in by_step]).diff() < 0).any()
    return "ScheduleInterleaved1F1B" if f_after_b or stage_back else "ScheduleLoopedBFS"


# -------------------------------------------------------------------------------------------
# writing the inference into the events table
# -------------------------------------------------------------------------------------------
def _gaps(passes: pd.DataFrame, work: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the stretches of at least MIN_GAP_NS inside its passes where no op runs."""
    columns = ["rank", "pid", "tid", "step", "start_ns", "end_ns"]
    if passes.empty:
        return pd.DataFrame(columns=columns)
    ranks = np.unique(passes["rank"].to_numpy())
    work = work[work["rank"].isin(ranks).to_numpy()]
    p_rank, w_rank = np.searchsorted(ranks, passes["rank"].to_numpy()), np.searchsorted(ranks, work["rank"].to_numpy())
    p_start, p_end = passes["start_ns"].to_numpy(np.int64), passes["end_ns"].to_numpy(np.int64)
    w_start, w_end = work["start_ns"].to_numpy(np.int64), work["end_ns"].to_numpy(np.int64)
    # each rank's times moved onto a stretch of the time line of its own (apart from the
    # next one's), so that one union and one difference do every rank
    times = np.concatenate([p_start, p_end, w_start, w_end])
    t0, span = times.min(), times.max() - times.min() + 1
    p_shift, w_shift = p_rank * span - t0, w_rank * span - t0
    gaps = union(p_start + p_shift, p_end + p_shift) - union(w_start + w_shift, w_end + w_shift)
    keep = (gaps.ends - gaps.starts) >= MIN_GAP_NS
    if not keep.any():
        return pd.DataFrame(columns=columns)
    k = gaps.starts[keep] // span  # the rank of each gap
    s, e = gaps.starts[keep] - k * span + t0, gaps.ends[keep] - k * span + t0
    # the step of the rank's last pass starting by the gap's start; the thread of its first pass
    order = np.lexsort((p_start, p_rank))
    o_rank = p_rank[order]
    key, q_key = lane_keys([o_rank, k], [p_start[order], s])
    first = np.searchsorted(o_rank, k, side="left")
    last = np.maximum(np.searchsorted(key, q_key, side="right") - 1, first)
    return pd.DataFrame({"rank": ranks[k].astype(np.int64), "pid": passes["pid"].to_numpy()[order[first]],
                         "tid": passes["tid"].to_numpy()[order[first]], "step": passes["step"].to_numpy()[order[last]],
                         "start_ns": s, "end_ns": e})


def _write(events: pd.DataFrame, ops: pd.DataFrame, passes: pd.DataFrame, gaps: pd.DataFrame) -> pd.DataFrame:
    """events with the inferred rows appended (the foreign rows stay as they are)."""
    rows = [r for r in (_p2p_rows(ops), _pass_rows(passes), _gap_rows(gaps)) if r is not None]
    if not rows:
        return events
    new = {}
    for k, first in rows[0].items():
        if isinstance(first, pd.arrays.IntegerArray):
            new[k] = _int_column(np.concatenate([r[k].to_numpy(np.int64, na_value=-1) for r in rows]))
        else:
            new[k] = np.concatenate([r[k] for r in rows])
    return _append(events, new)


def _contract_names(kind: str, op: np.ndarray, tags: dict) -> np.ndarray:
    """``<kind>:<op> k=v ...`` per row, tags with a negative value left out."""
    name = pd.Series(kind + ":", index=range(len(op))) + pd.Series(op, dtype=object)
    for key, values in tags.items():
        values = pd.Series(np.asarray(values, dtype=np.int64))
        name = name.where(values < 0, name + f" {key}=" + values.astype(str))
    return name.to_numpy(object)


def _int_column(values) -> pd.arrays.IntegerArray:
    """int64 values, negative ones null."""
    values = np.asarray(values, dtype=np.int64)
    return pd.arrays.IntegerArray(np.where(values >= 0, values, 0), values < 0)


def _p2p_rows(ops: pd.DataFrame) -> dict | None:
    """``pp:send_fwd peer=1 mb=3 chunk=0 bytes=64`` rows spanning each op from its post to
    the end of its wait (a send moves data from its post on: the gloo range starts after
    it). ``op`` is ``send`` / ``recv`` where the direction is unknown."""
    if ops is None or ops.empty:
        return None
    n = len(ops)
    side = np.where(ops["is_send"].to_numpy(bool), "send", "recv").astype(object)
    direction = ops["dir"].to_numpy(object)
    op = np.where(direction != "", side + "_" + direction, side).astype(object)
    pp = max(int(ops.attrs.get("pp") or 1), 1)
    peer = ops["peer"].to_numpy(np.int64)
    mb = np.where(direction != "", ops["mb"].to_numpy(np.int64), -1)
    # chunk: the consuming stage's (a send's is its peer's), as the integrations tag them
    stage = ops["stage"].to_numpy(np.int64)
    send = ops["is_send"].to_numpy(bool)
    consumer = stage + np.where(send, np.where(direction == "fwd", 1, np.where(direction == "bwd", -1, 0)), 0)
    chunk = np.where((stage >= 0) & (consumer >= 0), consumer // pp, -1)
    size = ops["bytes"].fillna(-1).to_numpy(np.int64)
    wire = ops["start_ns"].to_numpy(np.int64)
    post = ops["post_start"].to_numpy(np.int64)
    start = np.where(post >= 0, np.minimum(post, wire), wire)
    end = ops["end_ns"].to_numpy(np.int64)
    return {
        "rank": ops["rank"].to_numpy(np.int32), "lane": np.full(n, "main", dtype=object),
        "lane_kind": np.full(n, "host", dtype=object), "pid": ops["pid"].to_numpy(np.int64),
        "tid": ops["tid"].to_numpy(np.int64),
        "name": _contract_names("pp", op, {"peer": peer, "mb": mb, "chunk": chunk, "bytes": size}),
        "cat": np.full(n, "pptrace_inferred", dtype=object), "start_ns": start, "end_ns": end, "dur_ns": end - start,
        "kind": np.full(n, "pp", dtype=object), "op": op, "mb": _int_column(mb), "chunk": _int_column(chunk),
        "peer": _int_column(peer), "bytes": _int_column(size), "category": np.full(n, "p2p", dtype=object),
        "step": ops["step"].to_numpy(np.int32), "inferred": np.ones(n, dtype=bool),
    }


def _gap_rows(gaps: pd.DataFrame) -> dict | None:
    """``host:between_ops`` rows (category other) nested in the passes: where the thread ran
    no op, which the step partition then does not count as compute (a deeper range)."""
    if gaps is None or gaps.empty:
        return None
    n = len(gaps)
    start, end = gaps["start_ns"].to_numpy(np.int64), gaps["end_ns"].to_numpy(np.int64)
    return {
        "rank": gaps["rank"].to_numpy(np.int32), "lane": np.full(n, "main", dtype=object),
        "lane_kind": np.full(n, "host", dtype=object), "pid": gaps["pid"].to_numpy(np.int64),
        "tid": gaps["tid"].to_numpy(np.int64), "name": np.full(n, "host:between_ops", dtype=object),
        "cat": np.full(n, "pptrace_inferred", dtype=object), "start_ns": start, "end_ns": end, "dur_ns": end - start,
        "kind": np.full(n, "host", dtype=object), "op": np.full(n, "between_ops", dtype=object),
        "mb": _int_column(np.full(n, -1)), "chunk": _int_column(np.full(n, -1)),
        "peer": _int_column(np.full(n, -1)), "bytes": _int_column(np.full(n, -1)),
        "category": np.full(n, "other", dtype=object), "step": gaps["step"].to_numpy(np.int32),
        "inferred": np.ones(n, dtype=bool),
    }


def _pass_rows(passes: pd.DataFrame) -> dict | None:
    """``compute:fwd mb=3 chunk=0`` rows, cat ``pptrace_inferred``."""
    if passes is None or passes.empty:
        return None
    n = len(passes)
    mb = passes["mb"].to_numpy(np.int64)
    chunk = passes["chunk"].to_numpy(np.int64)
    op = passes["op"].astype(str).to_numpy(object)
    start, end = passes["start_ns"].to_numpy(np.int64), passes["end_ns"].to_numpy(np.int64)
    return {
        "rank": passes["rank"].to_numpy(np.int32), "lane": np.full(n, "main", dtype=object),
        "lane_kind": np.full(n, "host", dtype=object), "pid": passes["pid"].to_numpy(np.int64),
        "tid": passes["tid"].to_numpy(np.int64),
        "name": _contract_names("compute", op, {"mb": mb, "chunk": chunk}),
        "cat": np.full(n, "pptrace_inferred", dtype=object), "start_ns": start, "end_ns": end, "dur_ns": end - start,
        "kind": np.full(n, "compute", dtype=object), "op": op, "mb": _int_column(mb), "chunk": _int_column(chunk),
        "peer": _int_column(np.full(n, -1)), "bytes": _int_column(np.full(n, -1)),
        "category": np.full(n, "compute", dtype=object), "step": passes["step"].to_numpy(np.int32),
        "inferred": np.ones(n, dtype=bool),
    }


def _append(events: pd.DataFrame, new: dict) -> pd.DataFrame:
    """events with rows appended: ``new`` holds some columns, the others are null / False."""
    n = len(next(iter(new.values())))
    cols = {}
    for column in events.columns:
        col = events[column]
        value = new.get(column)
        if isinstance(col.dtype, pd.CategoricalDtype):
            values = np.asarray(value if value is not None else [None] * n, dtype=object)
            uniques = [v for v in pd.unique(values) if v is not None]
            extra = pd.Categorical(values, categories=pd.Index(uniques, dtype=col.cat.categories.dtype))
            cols[column] = union_categoricals([col.array, extra])
        elif isinstance(col.dtype, pd.Int64Dtype):
            extra = pd.array(value if value is not None else [pd.NA] * n, dtype="Int64")
            data = np.concatenate([col.to_numpy(np.int64, na_value=0), extra.to_numpy(np.int64, na_value=0)])
            mask = np.concatenate([col.isna().to_numpy(), pd.isna(extra)])
            cols[column] = pd.arrays.IntegerArray(data, mask)
        elif col.dtype == bool:
            cols[column] = np.concatenate([col.to_numpy(), value if value is not None else np.zeros(n, bool)])
        else:
            fill = value if value is not None else np.zeros(n, dtype=col.dtype)
            cols[column] = np.concatenate([col.to_numpy(), np.asarray(fill, dtype=col.dtype)])
    return pd.DataFrame(cols, columns=events.columns)


# -------------------------------------------------------------------------------------------
# evidence: what the traces show of the pipeline, to check a pptrace block's claims against
# (pptrace.ingest.run); the same inference as for plain traces, fed the contract ranges
# -------------------------------------------------------------------------------------------
#: torch.distributed.pipelining's schedule classes (ScheduleGPipe ... _PipelineScheduleRuntime,
#: and subclasses named like them): their order is replayed as recorded or measured, so
#: pptrace knows them without a table
TORCH_SCHEDULE_PREFIX = ("Schedule", "PipelineSchedule", "_PipelineSchedule")


def passes_of(events: pd.DataFrame) -> pd.DataFrame:
    """Every pass on the host in a profiled step (contract or inferred ``compute:<op>``
    rows): rank, step, start_ns, op, mb and chunk (-1 where untagged)."""
    sel = events[(events["category"] == "compute").to_numpy() & (events["lane_kind"] == "host").to_numpy()
                 & ~events["gpu_annotation"].to_numpy() & events["op"].isin(list(PASS_OPS)).to_numpy()
                 & (events["step"].to_numpy() >= 0)]
    return pd.DataFrame({
        "rank": sel["rank"].to_numpy(np.int64), "step": sel["step"].to_numpy(np.int64),
        "start_ns": sel["start_ns"].to_numpy(np.int64), "op": sel["op"].astype(str).to_numpy(object),
        "mb": sel["mb"].astype("Int64").fillna(-1).to_numpy(np.int64),
        "chunk": sel["chunk"].astype("Int64").fillna(-1).to_numpy(np.int64),
    })


def chunks_of(passes: pd.DataFrame) -> int | None:
    """Model chunks per rank: the most distinct chunk tags of one rank's forwards, else (no
    chunk tags) how many times a rank's step runs each microbatch forward; None: no forward."""
    fwd = passes[(passes["op"] == FWD).to_numpy() & (passes["mb"] >= 0).to_numpy()]
    if fwd.empty:
        return None
    if (fwd["chunk"] >= 0).any():
        return int(fwd[fwd["chunk"] >= 0].groupby("rank")["chunk"].nunique().max())
    per_step = fwd.groupby(["rank", "step"])["mb"].agg(["size", "nunique"])
    return int((per_step["size"] // per_step["nunique"]).max())


def schedule_fits(passes: pd.DataFrame, pp: int, stage_of: dict, candidates=None):
    """(name, v) of the first schedule (of ``candidates``, else 1F1B, GPipe, interleaved
    v=2..4) whose table has every rank's order of forwards and backwards, or None (also
    when the passes are not plain forwards and backwards: split backwards have no such
    order)."""
    if passes.empty or not passes["op"].isin([FWD, BWD]).all() or pp < 2:
        return None
    found = _order_schedule(passes[passes["rank"].isin(list(stage_of))], pp, stage_of, candidates)
    return None if found is None else found[:2]


def p2p_chain(events: pd.DataFrame, metas: dict, world: int):
    """The layout the run's own p2p ranges (peer tags) and pg_config show -> (Layout or
    None, how it was found; None when they show no pipeline). Peers of inferred rows are
    left out: their direction came from a layout already."""
    sel = events[(events["category"] == "p2p").to_numpy() & (events["lane_kind"] == "host").to_numpy()
                 & ~events["gpu_annotation"].to_numpy() & ~events["inferred"].to_numpy()
                 & events["op"].isin(list(DIRECTION_OF)).to_numpy() & events["peer"].notna().to_numpy()
                 & (events["step"].to_numpy() >= 0)]
    op = sel["op"].astype(str)
    ops = pd.DataFrame({
        "rank": sel["rank"].to_numpy(np.int64), "step": sel["step"].to_numpy(np.int64),
        "start_ns": sel["start_ns"].to_numpy(np.int64), "peer": sel["peer"].to_numpy(np.int64),
        "is_send": op.str.startswith("send").to_numpy(bool), "dir": op.map(DIRECTION_OF).to_numpy(object),
    })
    out = Inference(events=events)
    no_names = pd.DataFrame({"kind": pd.Series(dtype=object), "rank": pd.Series(dtype=np.int64),
                             "stage": pd.Series(dtype=np.int64)})
    stage_of, pp, _ = _pipeline(no_names, ops, metas, out)
    if not pp or pp < 2:
        return None, None
    return _layout(stage_of, pp, world, metas, out), out.inferred.get("layout")


__all__ = ["Inference", "infer_run", "is_plain", "NO_PEERS_HINT", "dim_groups", "microbatches_of", "passes_of",
           "chunks_of", "schedule_fits", "p2p_chain", "TORCH_SCHEDULE_PREFIX"]
