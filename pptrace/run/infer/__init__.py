"""Plain traces (no pptrace in the run): find the pipeline and attribute its work.

The one place that reads other libraries' names and the trace's structure. It turns what
torch.distributed.pipelining (torchtitan) and gloo write into the contract-1 columns, so
matching (pptrace.run.match) and every analyzer work on a plain run as on an instrumented one, and
marks each such row ``inferred``:

- p2p: each ``c10d::send`` / ``c10d::recv_`` post with its ``gloo:send`` / ``gloo:recv`` range
  (main thread, until ``wait()`` returns) becomes an appended ``pp:send_<dir>`` /
  ``pp:recv_<dir>`` row spanning both (a send's data leaves at its post), with the peer of
  the post ("Concrete Inputs", a *group* rank: mapped to a global
  rank through the pipeline group of ``distributedInfo.pg_config``, else the default group),
  direction and mb from the ``PP:<stage>SEND_F<mb>`` range around the post where the
  schedule names it, else from the stage order (towards the next stage: fwd) and FIFO order
  per (step, src, dst, direction). :func:`.write._p2p_rows` builds the rows from a table of ops
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

Each step is a module (names, p2p, passes, pipeline, schedule, write; evidence for the
claims check); this one runs them in order and holds the names the rest of pptrace uses.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...sweeps import inside
from ...topology import Layout
from .evidence import TORCH_SCHEDULE_PREFIX, chunks_of, p2p_chain, passes_of, schedule_fits
from .names import name_table
from .p2p import NO_PEERS_HINT, dim_groups, p2p_ops
from .passes import infer_passes
from .pipeline import add_directions, find_pipeline, fit_layout
from .result import Inference
from .schedule import fill_schedule, microbatches_of
from .write import find_gaps, write_inference


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
    table = name_table(events["name"].cat.categories)
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

    ops = p2p_ops(rows, metas, out)
    stage_of, pp, v = find_pipeline(rows, ops, metas, out)
    if layout is not None:
        out.inferred.pop("layout", None)
        stage_of, pp = {r: layout.coords(r).pp for r in range(layout.world_size)}, layout.pp
    elif pp and pp > 1:
        out.layout = fit_layout(stage_of, pp, _world(events, metas), metas, out)
    if stage_of is not None:
        ops = add_directions(ops, stage_of, pp)
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
    passes = fill_schedule(rows, passes, stage_of, pp, v, out)
    out.events = write_inference(events, ops, passes, find_gaps(passes, work))
    return out


def _world(events: pd.DataFrame, metas: dict) -> int:
    sizes = [m.get("world_size") for m in metas.values() if isinstance(m.get("world_size"), int)]
    return max(sizes) if sizes else int(events["rank"].max()) + 1


__all__ = ["Inference", "infer_run", "is_plain", "NO_PEERS_HINT", "dim_groups", "microbatches_of", "passes_of",
           "chunks_of", "schedule_fits", "p2p_chain", "TORCH_SCHEDULE_PREFIX"]
