"""The collectives of a plain gloo trace, by the process group they ran on.

gloo runs each collective on a worker thread of its process group (``pt_gloo_runloop``, two
per group, made when the group is), as a ``gloo:all_reduce`` range with no group, no
sequence number and no size (record_shapes=False); the main thread's ``c10d::allreduce_``
is only the enqueue. What does say the group is who takes part: no member's range of a
collective ends before every member's has begun (a member descheduled on a loaded host may
end tens of ms after the others, so ends say less; a rank's dp all-reduce and the world's
right after it end half a millisecond apart). The ranks run one program, so a rank's k-th
all-reduce of a step and another's k-th are one collective when they are on one group: the
place (rank, collective, k) runs on the largest of its rank's process groups
(distributedInfo.pg_config, else the layout's groups and the world) whose every other loaded
member's range in that place overlapped its own in RAN_WITH of the steps. Its dimension is
the group's ``pg_desc`` where that names one (``mesh_dp``, Megatron's DATA_PARALLEL_GROUP),
else the layout's dimension with exactly its ranks, else, for the world, dp (as on GPU:
timeline/activity.py), the last of a step's world collectives being the step-end one
(``what=grad_norm``: contract 3's grad norm, blocked while the pipeline runs, is bubble).

Each classified range gets an appended contract range ``<dim>:<op>`` with its thread and
times (cat ``pptrace_inferred``), which the partition counts as that dimension's, exposed or
hidden; an unplaced one stays the foreign range it is (``other``).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...sweeps import isin
from ...timeline.activity import dim_of_desc
from ...topology import Layout
from ...vocab import COMM_DIMS, STEP_END_TAGS, collective_key
from .p2p import process_groups

#: of the steps, the share in which another member of its group must have run a collective with
#: it (every one but for a window's edge; two groups' collectives running at once in one step
#: of two must not make them one)
RAN_WITH = 0.75
_GLOO = "gloo:"
_P2P = ("gloo:send", "gloo:recv")


def collective_rows(events: pd.DataFrame, metas: dict, layout: Layout, host_ranks, offsets=None) -> dict | None:
    """The appended ``<dim>:<op>`` rows (write.write_inference's columns) of the gloo worker
    ranges of ``host_ranks`` whose group is found, or None. ``offsets``: rank -> ns to
    subtract to compare ranks' times (None: one clock)."""
    names = events["name"].cat.categories
    is_coll = np.array([isinstance(n, str) and n.startswith(_GLOO) and n not in _P2P for n in names] + [False])
    codes = events["name"].cat.codes.to_numpy()
    sel = (is_coll[codes] & (events["lane"] != "main").to_numpy() & (events["lane_kind"] == "host").to_numpy()
           & (events["step"].to_numpy() >= 0) & isin(events["rank"], host_ranks))
    if not sel.any():
        return None
    work = events.loc[sel, ["rank", "lane", "pid", "tid", "step", "start_ns", "end_ns", "name"]].reset_index(drop=True)
    name_code, distinct = pd.factorize(work["name"].astype(str))
    work["family"] = pd.factorize(np.array([collective_key(n) for n in distinct], dtype=object))[0][name_code]
    shift = work["rank"].map(offsets or {}).fillna(0).to_numpy(np.int64)
    work["start"], work["end"] = work["start_ns"].to_numpy(np.int64) - shift, work["end_ns"].to_numpy(np.int64) - shift
    # its place in the program: the k-th of its collective in a step (the ranks run one program)
    work["order"] = work.sort_values("start_ns", kind="stable").groupby(["rank", "step", "family"]).cumcount() \
        .reindex(work.index).to_numpy()
    work["place"] = pd.factorize(pd.MultiIndex.from_arrays([work["rank"], work["family"], work["order"]]))[0]
    groups = _candidates(metas, layout, sorted(int(r) for r in work["rank"].unique()))
    place_group = _place_groups(work, _ran_with(work), groups)
    if place_group.empty:
        return None
    dims = _group_dims(groups.drop_duplicates(["group", "member"]), layout)
    placed = work.merge(place_group, on="place").merge(dims, on="group")
    placed = placed[placed["dim"].notna()]
    if placed.empty:
        return None
    return _rows(placed)


def _ran_with(work: pd.DataFrame) -> pd.DataFrame:
    """(place, other rank) -> the share of the place's ranges (one a step) that ran with that
    rank: its range in the same place overlapped (no member's range of a collective ends
    before every member's has begun; a descheduled member may end tens of ms after the
    others, so ends are no test)."""
    keys = ["step", "family", "order"]
    pairs = work[["place", "rank", "start", "end", *keys]].merge(
        work[["rank", "start", "end", *keys]].rename(columns={"rank": "other", "start": "o_start", "end": "o_end"}),
        on=keys)
    pairs = pairs[(pairs["other"] != pairs["rank"]).to_numpy()]
    hit = pairs.assign(hit=(pairs["start"] <= pairs["o_end"]).to_numpy() & (pairs["o_start"] <= pairs["end"]).to_numpy())
    share = hit.groupby(["place", "other"], as_index=False)["hit"].sum()
    share["hit"] = share["hit"] / share["place"].map(work.groupby("place").size()).to_numpy()
    return share


def _candidates(metas: dict, layout: Layout, ranks: list) -> pd.DataFrame:
    """(rank, group, desc, size, member) rows: each rank's process groups of two or more
    ranks (pg_config), else those of the layout and the world; ``group`` numbers a distinct
    member set and desc."""
    said = process_groups(metas)
    rows = []
    for rank in ranks:  # per rank: its few groups
        groups = said.get(rank) or [(f"layout_{d}", layout.group_ranks(d, rank)) for d in COMM_DIMS
                                    if rank < layout.world_size and layout.size(d) > 1]
        if not said.get(rank):
            groups = [*groups, ("world", list(range(layout.world_size)))]
        rows += [(rank, desc, tuple(sorted(g))) for desc, g in groups if len(g) > 1 and rank in g]
    frame = pd.DataFrame(rows, columns=["rank", "desc", "members"])
    frame["group"] = pd.factorize(pd.MultiIndex.from_arrays([frame["desc"], frame["members"]]))[0]
    frame["size"] = frame["members"].map(len)
    return frame.explode("members").rename(columns={"members": "member"}).astype({"member": np.int64})


def _place_groups(work: pd.DataFrame, ran_with: pd.DataFrame, groups: pd.DataFrame) -> pd.DataFrame:
    """place -> group: the largest of its rank's groups whose every other loaded member ran
    with it (RAN_WITH of its steps: a smaller group of the same ranks always does, a larger
    one only in a step where two groups' collectives happened to run at once); places with
    none are left out."""
    places = work.drop_duplicates("place")[["place", "rank"]]
    loaded = set(work["rank"].unique().tolist())
    cand = places.merge(groups, on="rank")
    cand = cand[(cand["member"] != cand["rank"]).to_numpy() & cand["member"].isin(loaded).to_numpy()]
    cand = cand.merge(ran_with.rename(columns={"other": "member"}), on=["place", "member"], how="left")
    cand["hit"] = cand["hit"].fillna(0.0)
    score = cand.groupby(["place", "group", "size"], as_index=False)["hit"].min()
    score = score[score["hit"] >= RAN_WITH]
    score = score.sort_values(["place", "size", "group"], ascending=[True, False, True], kind="stable")
    return score.drop_duplicates("place")[["place", "group"]]


def _group_dims(groups: pd.DataFrame, layout: Layout) -> pd.DataFrame:
    """group -> (dim, world) once per distinct group: its pg_desc's dim, else the layout dim
    with exactly its ranks, else dp for the world; dim None where none says."""
    members = groups.groupby("group")["member"].agg(lambda m: tuple(sorted(m)))
    desc = groups.drop_duplicates("group").set_index("group")["desc"]
    out = []
    for group, ranks in members.items():  # per distinct group
        world = len(ranks) == layout.world_size
        dim = dim_of_desc(desc[group]) if not str(desc[group]).startswith("layout_") else None
        if dim is None:
            fits = [d for d in COMM_DIMS if layout.size(d) > 1 and ranks[0] < layout.world_size
                    and tuple(sorted(layout.group_ranks(d, ranks[0]))) == ranks]
            dim = fits[0] if fits else ("dp" if world else None)
        out.append((group, dim, world))
    return pd.DataFrame(out, columns=["group", "dim", "world"])


def _rows(placed: pd.DataFrame) -> dict:
    """write.py's row columns for each placed worker range: ``<dim>:<op>``, the world's
    tagged ``group=world``, a step's last world one ``what=grad_norm`` instead."""
    placed = placed.sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)
    world = placed["world"].to_numpy(bool)
    last = np.zeros(len(placed), bool)
    if world.any():
        ends = placed[world].groupby(["rank", "step"])["start_ns"].idxmax().to_numpy()
        last[ends] = True
    op = placed["name"].astype(str).str.slice(len(_GLOO)).to_numpy(object)
    dim = placed["dim"].to_numpy(object)
    step_end = ",".join(f'"{k}":"{v}"' for k, v in STEP_END_TAGS.items())
    tags = np.where(last, "{" + step_end + "}", np.where(world, '{"group":"world"}', None)).astype(object)
    suffix = np.where(last, " " + " ".join(f"{k}={v}" for k, v in STEP_END_TAGS.items()),
                      np.where(world, " group=world", ""))
    n = len(placed)
    start, end = placed["start_ns"].to_numpy(np.int64), placed["end_ns"].to_numpy(np.int64)
    none = np.full(n, -1, np.int64)
    return {
        "rank": placed["rank"].to_numpy(np.int32), "lane": placed["lane"].astype(object).to_numpy(),
        "lane_kind": np.full(n, "host", dtype=object), "pid": placed["pid"].to_numpy(np.int64),
        "tid": placed["tid"].to_numpy(np.int64), "name": (dim + ":" + op + suffix).astype(object),
        "cat": np.full(n, "pptrace_inferred", dtype=object), "start_ns": start, "end_ns": end,
        "dur_ns": end - start, "kind": dim, "op": op, "mb": none, "chunk": none, "peer": none, "bytes": none,
        "category": ("comm:" + dim).astype(object), "step": placed["step"].to_numpy(np.int32),
        "inferred": np.ones(n, dtype=bool), "tags": tags,
    }
