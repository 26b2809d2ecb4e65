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
  per (step, src, dst, direction). Without "Concrete Inputs" (``record_shapes=False``, what
  most users run) the peer is inferred: the direction from the name, else from the pass
  before a send's post / after a recv's wait, the peer the neighbouring stage, so the k-th
  send of a rank pairs with the k-th recv of its neighbour; an op still unplaced is left
  out (its wait never booked as transfer). :func:`.write._p2p_rows` builds the rows from a
  table of ops (rank, step, is_send, peer, dir, mb, stage, bytes, post/wire times) whatever
  transport they came from. torch's ``PP::fwd_send (stage i)`` labels (``dist.record_comm``,
  ingest/p2p_args.pp_comm_label) stand where gloo writes ``gloo:send`` and give the op's
  direction and stage; a label of a batch of both kinds (``PP::fwd_send_bwd_recv``) its side
  from its post. With two stages the stage order cannot tell an interleaved schedule's forward
  wrap-around from a backward message: where the passes beside the ops read the guessed
  directions otherwise, the passes' reading stands (pipeline.directions_of_two_stages).
- passes: ``PP:<stage><F|B|I|W><mb>``, ``PP:(<sub>;<sub>)OVERLAP_F_B`` (DualPipeV: split at
  its first autograd op) and ``Forward i`` / ``Backward i`` (GPipe) become appended
  ``compute:<op> mb= chunk=`` rows. Those ranges start with the wait on a recv posted
  earlier (and GPipe's end with the next send's post), so a pass is the part of the range
  after the last recv that *ends* inside it (that wait returned there) and before the first
  send posted inside it: from where that wait returned (else its first op) to its last op,
  Python between its ops included (GPipe's last stage computes its loss after ``Forward
  i``: up to its last op before the next range). Schedules that name nothing (Schedule1F1B, Megatron-Core) get
  passes from the main thread's ops between p2p posts: the last run of autograd ops
  (``autograd::engine::evaluate_function``) before a post is a backward, earlier ones (a
  loss calling backward() per chunk) belong to that microbatch's forward; a forward is the
  run of ops before a forward send (or settled by count: one forward per backward), the
  first stage's first one without the step's set-up before it; a pass spans its first op to
  its last before a p2p wait returns; microbatch and chunk come from the table of the
  schedule whose order they follow (1F1B, GPipe, Megatron's interleaved), else by counting.
- layout: the pipeline group of pg_config (Megatron's PIPELINE_MODEL_PARALLEL_GROUP,
  DeviceMesh ``mesh_pp``), else the stage ids of ``PP:`` names, else the forward chain of
  sends starting at each rank that sends before it receives, else (no peer in the trace)
  the order the ranks start in (first send before any recv, then each first recv's
  completion: one host's clock, else clocks aligned on collectives); schedule from the
  names (or the order of passes), microbatches from the passes, or from the p2p messages
  where they disagree (consistency.py says so in one line, as it says any other
  implausible structure).

- collectives: each gloo worker-thread collective by its process group, from the ranks it ran
  with (collectives.py): ``<dim>:<op>`` rows on its thread, the world's step-end one tagged as
  contract 3's.

The inferred rows (cat ``pptrace_inferred``) are appended rather than written over the
foreign ranges because their times differ (a pass without its wait, a p2p op with its post)
and Schedule1F1B has no range to write on; the foreign rows stay as the trace has them.
Everything inferred is listed in ``Inference.inferred`` (``Run.inferred``).

Each step is a module (names, p2p, passes, pipeline, schedule, consistency, collectives, write; evidence
for the claims check); this one runs them in order and holds the names the rest of pptrace
uses.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...sweeps import inside, isin
from ...topology import Layout
from .collectives import collective_rows
from .consistency import check_structure
from .evidence import TORCH_SCHEDULE_PREFIX, chunks_of, p2p_chain, passes_of, schedule_fits
from .names import name_table
from .p2p import NO_PEERS_HINT, dim_groups, label_sides, p2p_ops, peers_said
from .passes import infer_passes
from .pipeline import (add_directions, directions_of_two_stages, fill_peers, find_pipeline, fit_layout,
                       number_messages)
from .result import Inference
from .schedule import fill_schedule, microbatches_of
from .write import write_inference


def is_plain(events: pd.DataFrame) -> bool:
    """No contract pass or p2p range on the host: nothing told pptrace what the work is."""
    host = (events["lane_kind"] == "host").to_numpy() & ~events["gpu_annotation"].to_numpy()
    contract = isin(events["category"], ["compute", "p2p"]) & ~events["inferred"].to_numpy()
    return not (host & contract).any()


def infer_run(events: pd.DataFrame, metas: dict, layout: Layout | None = None, clock=None) -> Inference | None:
    """The inference of a plain run's events (all ranks, one frame with a RangeIndex), or
    None when the run has contract ranges or nothing this module knows. ``metas``: rank ->
    load_rank meta (its ``distributed`` block has pg_config). ``layout``: the run's layout
    when the user or a pptrace block gave it (then only its stages are used). ``clock``: a
    callable -> rank -> ns to subtract from its times, for comparing ranks' times across
    hosts (called only when a pipeline must be found from timing); None: one clock."""
    if events.empty or not is_plain(events):
        return None
    table = name_table(events["name"].cat.categories)
    codes = events["name"].cat.codes.to_numpy()
    kind = np.where(codes >= 0, table["kind"].to_numpy(object)[codes], "")
    main = (events["lane"] == "main").to_numpy() & (events["step"].to_numpy() >= 0)  # categorical: by code
    # host traces only: on GPU traces the work runs in kernels (the NCCL p2p: nccl.py)
    gpu = (events["lane_kind"] == "gpu").to_numpy()
    if gpu.any():
        main &= ~isin(events["rank"], events.loc[gpu, "rank"].unique())
    known = main & (kind != "")
    if not (known & np.isin(kind, ["wire", "pass", "gpipe", "overlap"])).any():
        return None
    out = Inference(events=events)
    rows = events.loc[known, ["rank", "pid", "tid", "step", "start_ns", "end_ns", "tags", "bytes"]].copy()
    rows["kind"] = kind[known]
    c = codes[known]
    for col in ("stage", "act", "mb", "send", "send_dir", "recv_dir"):
        rows[col] = table[col].to_numpy()[c]
    rows["name"] = events.loc[known, "name"].astype(object).to_numpy()
    rows = label_sides(rows)

    ops = p2p_ops(rows, metas, out)
    unknown = (ops["peer"] < 0).to_numpy()
    offsets = clock() if clock is not None and unknown.all() and len(ops) else None
    stage_of, pp, v = find_pipeline(rows, ops, metas, out, offsets)
    if layout is not None:
        out.inferred.pop("layout", None)
        stage_of, pp = {r: layout.coords(r).pp for r in range(layout.world_size)}, layout.pp
        out.groups = {r: layout.group_ranks("pp", r) for r in range(layout.world_size)}
    elif pp and pp > 1:
        out.layout = fit_layout(stage_of, pp, _world(events, metas), metas, out)
        fits = out.layout is not None and all(out.layout.coords(r).pp == s for r, s in stage_of.items())
        if not out.groups and fits:  # the stage names' pipelines: those of the layout they fit
            out.groups = {r: out.layout.group_ranks("pp", r) for r in stage_of}
    if stage_of is not None:
        ops = add_directions(ops, stage_of, pp)
    not_work = np.isin(kind, ["post", "wire", "pp_p2p", "pass", "gpipe", "overlap", "pp_other", "optimizer"])
    is_step = (events["category"] == "step").to_numpy()
    work = events.loc[main & ~not_work & ~is_step, ["rank", "pid", "tid", "start_ns", "end_ns"]]
    work = work.assign(auto=kind[main & ~not_work & ~is_step] == "autograd", code=codes[main & ~not_work & ~is_step])
    optimizer = events.loc[main & (kind == "optimizer"), ["rank", "start_ns", "end_ns"]]
    work = work[~inside(*(work[c].to_numpy() for c in ("rank", "start_ns", "end_ns")),
                        *(optimizer[c].to_numpy() for c in ("rank", "start_ns", "end_ns")))]
    steps = events.loc[main & is_step, ["rank", "step", "start_ns", "end_ns"]]
    passes = infer_passes(rows, ops, work, steps, pp or 1)
    reread = directions_of_two_stages(ops, lambda blind: infer_passes(rows, blind, work, steps, pp), pp)
    if reread is not None:
        ops, passes = reread
        out.inferred["directions"] = (
            "from the passes beside each p2p op (a send after a forward carries an activation, after a backward a "
            "gradient): with two stages the stage order cannot tell an interleaved schedule's forward wrap-around "
            "from a backward message")
    if stage_of is not None:
        ops = fill_peers(ops, passes, rows, stage_of, pp, out.groups)
    peers_said(ops, unknown, out)
    # an op with no peer cannot pair: its wait would be booked as transfer; it stays the
    # foreign range it is
    ops = number_messages(ops[~unknown | (ops["peer"] >= 0).to_numpy()].reset_index(drop=True))
    ops.attrs["pp"] = pp
    passes = fill_schedule(rows, passes, stage_of, pp, v, out)
    named = bool(set(rows["kind"].unique()) & {"pass", "gpipe", "overlap"})
    check_structure(passes, ops, steps, stage_of, pp, named, out)
    run_layout = layout if layout is not None else out.layout
    host = np.unique(events.loc[main, "rank"].to_numpy())
    comm = collective_rows(events, metas, run_layout, host, offsets) if run_layout is not None else None
    if comm is not None:
        out.inferred["collectives"] = (
            "gloo's worker-thread collectives by their process group: the ranks each one ran with (its range ends "
            "nearest theirs, mutually), the group's pg_desc or the layout's dim, the world's as dp")
    out.events = write_inference(events, ops, passes, comm)
    return out


def _world(events: pd.DataFrame, metas: dict) -> int:
    sizes = [m.get("world_size") for m in metas.values() if isinstance(m.get("world_size"), int)]
    return max(sizes) if sizes else int(events["rank"].max()) + 1


__all__ = ["Inference", "infer_run", "is_plain", "NO_PEERS_HINT", "dim_groups", "microbatches_of", "passes_of",
           "chunks_of", "schedule_fits", "p2p_chain", "TORCH_SCHEDULE_PREFIX"]
