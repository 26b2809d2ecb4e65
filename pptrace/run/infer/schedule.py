"""The schedule and microbatches of a plain trace: from the names of its ranges, else from
the order of its passes matched against the schedules' tables (which then give each pass
its microbatch and chunk)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...vocab import FWD, GPIPE, INTERLEAVED, ONE_F_ONE_B
from .result import Inference


def fill_schedule(rows: pd.DataFrame, passes: pd.DataFrame, stage_of, pp, v: int, out: Inference) -> pd.DataFrame:
    """Fill the schedule, microbatches and vpp of ``out``; -> the passes, their (mb, chunk)
    taken from the schedule's table where their order is a known schedule's."""
    kinds = set(rows["kind"].unique())
    if passes.empty:
        return passes
    by_order = bool(passes.attrs.get("by_order")) and not (kinds & {"pass", "gpipe", "overlap"})
    out.inferred["passes"] = (
        "from the main thread's ops between p2p posts (no pass names; a backward is the last run of autograd "
        "ops before a post, a loss's own backward() calls part of its forward; mb and chunk by their order)"
        if by_order else
        "from PyTorch's pass ranges (PP:<stage><action><mb>, Forward i / Backward i), less the recv wait they include")
    labelled = rows.loc[(rows["kind"] == "wire").to_numpy(), "name"].astype(str).str.startswith("PP::").any()
    out.inferred["p2p"] = ("torch's PP:: p2p labels (direction and stage from the label)" if labelled else
                           "gloo:send / gloo:recv ranges") + ", from the post until wait() returned"
    named = rows[rows["kind"] == "pass"]
    how = None
    if "gpipe" in kinds:
        out.schedule, how = "ScheduleGPipe", "'Forward i' / 'Backward i' ranges"
    elif len(named) or "overlap" in kinds:
        out.schedule, how = _pp_schedule(named, kinds, pp, v), "PyTorch's PP: action ranges"
    elif pp and stage_of is not None:
        found = order_schedule(passes, pp, stage_of)
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


def order_schedule(passes: pd.DataFrame, pp: int, stage_of: dict, candidates=None):
    """Schedules that name nothing: the first of 1F1B, GPipe and Megatron's interleaved
    (v = 2..4) (or of ``candidates``, (name, v) pairs) whose table (pptrace.schedules.tables)
    has every rank's order of forwards and backwards in every step -> (name, v, passes with
    that table's mb and chunk), or None."""
    from ...schedules.tables import schedule_table

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
