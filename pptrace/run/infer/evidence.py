"""What the traces show of the pipeline, to check a pptrace block's claims against
(pptrace.run.claims): the same inference as for plain traces, fed the contract ranges."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...sweeps import isin
from ...vocab import BWD, DIRECTION_OF, FWD, PASS_OPS
from .pipeline import find_pipeline, fit_layout
from .result import Inference
from .schedule import order_schedule


#: torch.distributed.pipelining's schedule classes (ScheduleGPipe ... _PipelineScheduleRuntime,
#: and subclasses named like them): their order is replayed as recorded or measured, so
#: pptrace knows them without a table
TORCH_SCHEDULE_PREFIX = ("Schedule", "PipelineSchedule", "_PipelineSchedule")


def passes_of(events: pd.DataFrame) -> pd.DataFrame:
    """Every pass on the host in a profiled step (contract or inferred ``compute:<op>``
    rows): rank, step, start_ns, op, mb and chunk (-1 where untagged)."""
    columns = ["rank", "step", "start_ns", "op", "mb", "chunk"]  # what is read, not every column
    sel = events[columns][(events["category"] == "compute").to_numpy() & (events["lane_kind"] == "host").to_numpy()
                 & ~events["gpu_annotation"].to_numpy() & isin(events["op"], PASS_OPS)
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
    found = order_schedule(passes[passes["rank"].isin(list(stage_of))], pp, stage_of, candidates)
    return None if found is None else found[:2]


def p2p_chain(events: pd.DataFrame, metas: dict, world: int):
    """The layout the run's own p2p ranges (peer tags) and pg_config show -> (Layout or
    None, how it was found; None when they show no pipeline). Peers of inferred rows are
    left out: their direction came from a layout already."""
    sel = events[(events["category"] == "p2p").to_numpy() & (events["lane_kind"] == "host").to_numpy()
                 & ~events["gpu_annotation"].to_numpy() & ~events["inferred"].to_numpy()
                 & isin(events["op"], DIRECTION_OF) & events["peer"].notna().to_numpy()
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
    stage_of, pp, _ = find_pipeline(no_names, ops, metas, out)
    if not pp or pp < 2:
        return None, None
    return fit_layout(stage_of, pp, world, metas, out), out.inferred.get("layout")
