"""Real ``torch.distributed.pipelining`` runs on gloo, with stages that sleep known times.

``run(out, "Schedule1F1B", mode="pptrace")`` spawns ``world`` gloo processes that train a
``pp``-stage pipeline with one of torch's schedules and writes, per rank:

- ``out/traces/rank{r}.json.gz``: the trace. ``mode="pptrace"`` wraps the loop in
  ``pptrace.profile(out, steps=profile_steps)`` and nothing else (layout, schedule and
  microbatches are left for the integration to find); ``"plain"`` uses torch.profiler
  directly with ``record_shapes=True`` and the same step window; ``"plain-noshapes"`` the
  same with ``record_shapes=False``; ``"none"`` writes no trace.
- ``out/truth/rank{r}.json``: ground truth from the same run. Per step its start/end, the
  call of ``schedule.step()`` (``pipeline_start`` / ``pipeline_end``: the pipeline runs in
  it, so across ranks they bound the pipeline window of DESIGN contract 3), with ``dp > 1``
  the gradients' all-reduce over the dp group (``dp_reduce_start`` / ``dp_reduce_end``), the
  closing all-reduce (``reduce_start`` / ``reduce_end``) and every compute action this rank ran (``op`` F|B|I|W, global ``stage``, local ``chunk``,
  ``mb``, start/end) with the sleeps measured inside it (``kind`` fwd|bwd_input|bwd_weight),
  in ``losses`` every loss call of the last stage (torch's ``_maybe_compute_loss``, after
  each of its forwards, in their order) with its sleep (``kind`` loss), and in ``p2p`` every call of
  torch's ``_batch_p2p`` (a post) and ``_wait_batch_p2p``.
  Every time is given twice: ``*_ns`` from ``perf_counter_ns`` and ``*_epoch_ns`` from
  ``time_ns`` (comparable with trace times: ``baseTimeNanoseconds + ts * 1000``). Also the
  schedule's own ``pipeline_order`` for this rank (``[op, stage, mb]``, OVERLAP_F_B expanded
  into its sub-actions; torch 2.13 computes it wrongly for Schedule1F1B's last stage, where
  it lists F1..F8: the executed order is each step's ``actions``), for the runtime schedules
  (``_PipelineScheduleRuntime`` and its subclasses) ``pipeline_order_with_comms``, the order
  they run, with their send posts as ``["SF" | "SB", sending stage, mb]`` where they stand
  (None for GPipe / 1F1B, which post each send right after its pass), ``stage_ranks`` (global
  stage -> global rank) and this rank's stages.

Schedules: ScheduleGPipe, Schedule1F1B (one stage per rank); ScheduleInterleaved1F1B,
ScheduleLoopedBFS, ScheduleInterleavedZeroBubble (``v`` stages per rank, looped: stage s on
pp rank s % pp); ScheduleZBVZeroBubble, ScheduleDualPipeV (2 stages per rank in a V: stage
s on pp rank s if s < pp else 2 pp - 1 - s); ``_PipelineScheduleRuntime`` (the CSV path: the
runtime loads Interleaved1F1B's compute-only order from a CSV file it wrote).

Sleep model (what the truth's numbers mean): every stage pass sleeps the given times,
whatever the number of stages per rank (so a v=2 schedule does twice the work per
microbatch of a v=1 one): forward ``fwd_ms``; the whole backward ``bwd_ms``, of which
``wgrad_ms`` (default half) is the weight gradient. A full backward (B) sleeps both parts;
zero-bubble schedules split it into I (input grad, ``bwd_ms - wgrad_ms``) and W (weight
grad, ``wgrad_ms``), except on stage 0, where torch skips I (the stage input needs no
gradient) and its W runs the whole backward. The last stage's loss sleeps ``loss_ms``
(default 0) in each call.

With ``dp > 1`` the world is a DeviceMesh ``(pp, dp)`` named ("pp", "dp"); each dp replica
runs its own pipeline and sums its gradients over its dp group after ``schedule.step()``.
Every step ends with an all-reduce over all ranks (the grad norm of
clipping), as real trainers do, so each rank's step covers the whole pipeline window.

    python -m tests.pipelining_run OUT --schedule Schedule1F1B --mode pptrace
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

SINGLE = ("ScheduleGPipe", "Schedule1F1B")
LOOPED = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "_PipelineScheduleRuntime")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SCHEDULES = SINGLE + LOOPED + V_SHAPED
MODES = ("pptrace", "plain", "plain-noshapes", "none")

HIDDEN = 256  # activation [2 rows x 256] float32 = 2 KiB per message
ROWS_PER_MB = 2


def stage_ranks(schedule: str, pp: int, v: int) -> list[int]:
    """Global stage index -> pipeline position (the rank in the pp group)."""
    n = pp * v
    if schedule in V_SHAPED:
        return [s if s < pp else 2 * pp - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


# --------------------------------------------------------------------------------------
# Ground truth recorder (one per process; the harness is the only user)
# --------------------------------------------------------------------------------------


def now() -> tuple[int, int]:
    return time.perf_counter_ns(), time.time_ns()


class Recorder:
    """Collects the steps, actions and sleeps of this process."""

    def __init__(self):
        self.steps: list[dict] = []
        self._action = None

    def begin_step(self, step: int) -> None:
        ns, epoch = now()
        self.steps.append({"step": step, "start_ns": ns, "start_epoch_ns": epoch, "actions": [], "p2p": [],
                           "losses": []})

    def mark(self, name: str) -> None:
        """A named instant of the current step (``<name>_ns`` and ``<name>_epoch_ns``)."""
        ns, epoch = now()
        self.steps[-1].update({f"{name}_ns": ns, f"{name}_epoch_ns": epoch})

    def end_step(self) -> None:
        ns, epoch = now()
        self.steps[-1].update(end_ns=ns, end_epoch_ns=epoch)

    @contextlib.contextmanager
    def _timed(self, into: str, **fields):
        """A span of the current step logged in its ``into`` list, the sleeps inside it with it."""
        ns, epoch = now()
        record = {**fields, "start_ns": ns, "start_epoch_ns": epoch, "sleeps": []}
        outer, self._action = self._action, record
        try:
            yield
        finally:
            self._action = outer
            ns, epoch = now()
            record.update(end_ns=ns, end_epoch_ns=epoch)
            if self.open_step() is not None:
                self.open_step()[into].append(record)

    def action(self, op: str, stage: int, chunk: int, mb: int):
        """A compute action of the schedule (a pass), logged in the step's ``actions``."""
        return self._timed("actions", op=op, stage=stage, chunk=chunk, mb=mb)

    def loss(self):
        """A loss call of the last stage (after each of its forwards), logged in the step's
        ``losses``: compute, but no action of the schedule."""
        return self._timed("losses")

    def open_step(self) -> dict | None:
        """The step a record made now belongs to (here: the last one begun)."""
        return self.steps[-1] if self.steps else None

    def timed_p2p(self, fn):
        """``fn`` (torch's ``_batch_p2p`` or ``_wait_batch_p2p``) with each call's span logged
        in the step's ``p2p``: what lies between two of them and is no pass is the framework's.
        Wrapped with its signature, which pptrace's integration checks before it wraps it too."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            ns, epoch = now()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.open_step() is not None:
                    end_ns, end_epoch = now()
                    self.open_step()["p2p"].append({"start_ns": ns, "end_ns": end_ns, "start_epoch_ns": epoch,
                                                  "end_epoch_ns": end_epoch})
        return call

    def sleep(self, kind: str, seconds: float) -> None:
        if seconds <= 0:
            return
        ns, epoch = now()
        time.sleep(seconds)
        end_ns, end_epoch = now()
        entry = {"kind": kind, "start_ns": ns, "end_ns": end_ns, "start_epoch_ns": epoch, "end_epoch_ns": end_epoch}
        if self._action is not None:
            self._action["sleeps"].append(entry)
        elif self.open_step() is not None:  # a pass outside any action (should not happen): keep it visible
            self.open_step().setdefault("loose_sleeps", []).append(entry)


RECORDER = Recorder()


# --------------------------------------------------------------------------------------
# The model: a stage whose forward and backward halves sleep
# --------------------------------------------------------------------------------------


def _build_model_classes():
    """Defined lazily so that importing this module does not import torch."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    class InputSleep(torch.autograd.Function):
        """Forward sleeps fwd; backward (the input-gradient half) sleeps bwd_input.
        ``anchor`` is a non-parameter leaf that needs a gradient, so that the backward runs on
        stage 0 too, where the stage input itself needs none."""

        @staticmethod
        def forward(ctx, x, anchor, fwd_s, bwd_s):
            ctx.bwd_s = bwd_s
            RECORDER.sleep("fwd", fwd_s)
            return x * 1.0 + anchor

        @staticmethod
        def backward(ctx, grad):
            RECORDER.sleep("bwd_input", ctx.bwd_s)
            return grad, grad.sum().reshape(1), None, None

    class WeightSleep(torch.autograd.Function):
        """The weight's branch: its backward (the weight-gradient half) sleeps bwd_weight.
        It joins the input branch at one add, the node torch's stage_backward_input stops at,
        so I runs only InputSleep's backward and W only this one."""

        @staticmethod
        def forward(ctx, w, bwd_s):
            ctx.bwd_s = bwd_s
            return w * 1.0

        @staticmethod
        def backward(ctx, grad):
            RECORDER.sleep("bwd_weight", ctx.bwd_s)
            return grad, None

    class SleepStage(torch.nn.Module):
        def __init__(self, fwd_s: float, bwd_input_s: float, bwd_weight_s: float):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(HIDDEN))
            self.anchor = torch.zeros(1, requires_grad=True)  # not a Parameter on purpose
            self.times = (fwd_s, bwd_input_s, bwd_weight_s)

        def forward(self, x):
            fwd_s, bwd_input_s, bwd_weight_s = self.times
            return InputSleep.apply(x, self.anchor, fwd_s, bwd_input_s) + WeightSleep.apply(self.weight, bwd_weight_s)

    class TimedStage(PipelineStage):
        """Records each compute action (the truth) around torch's own implementation."""

        def __init__(self, *args, chunk: int, **kwargs):
            super().__init__(*args, **kwargs)
            self.chunk = chunk

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with RECORDER.action("F", self.stage_index, self.chunk, fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            with RECORDER.action("B" if full_backward else "I", self.stage_index, self.chunk, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                  last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with RECORDER.action("W", self.stage_index, self.chunk, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    return SleepStage, TimedStage


def _make_loss(seconds: float):
    """The last stage's loss: mean squared error, after sleeping ``seconds`` (the known cost
    of a loss like torchtitan's, which runs the output head and cross entropy)."""

    def loss(output, target):
        RECORDER.sleep("loss", seconds)  # inside the loss call _time_losses logs
        return ((output - target) ** 2).mean()

    return loss


def _time_losses(schedules) -> None:
    """Log every loss call of the last stage (torch's ``_maybe_compute_loss``) around torch's
    own, and around pptrace's range of it: installed once pptrace.profile has patched it, so
    the logged span holds the range (the most the loss can have taken)."""
    owner = schedules._PipelineSchedule
    original = owner.__dict__["_maybe_compute_loss"]

    @functools.wraps(original)
    def timed(self, stage, *args, **kwargs):
        if not (stage.is_last and self._loss_fn is not None):
            return original(self, stage, *args, **kwargs)
        with RECORDER.loss():
            return original(self, stage, *args, **kwargs)

    owner._maybe_compute_loss = timed


def order_rows(actions, sends: bool = False) -> list:
    """torch's action list -> [op, stage, mb] rows of compute actions (sub-actions expanded);
    with ``sends``, SEND_F / SEND_B too, as ["SF" | "SB", sending stage, mb] where they stand."""
    names = {"F": "F", "B": "B", "I": "I", "W": "W", **({"SEND_F": "SF", "SEND_B": "SB"} if sends else {})}
    rows = []
    for action in actions or ():
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        for a in subs if subs else (action,):
            op = names.get(a.computation_type.value)
            if op is not None:
                rows.append([op, int(a.stage_index), int(a.microbatch_index)])
    return rows


# --------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------


def _make_schedule(cfg: dict, stages: list, pp_rank: int, scratch: str):
    import torch.distributed.pipelining.schedules as S

    name, m = cfg["schedule"], cfg["microbatches"]
    _loss = _make_loss(cfg["loss_ms"] / 1e3)
    if name in SINGLE:
        return getattr(S, name)(stages[0], m, loss_fn=_loss)
    if name != "_PipelineScheduleRuntime":
        return getattr(S, name)(stages, m, loss_fn=_loss)
    # The CSV path: write a compute-only order (Interleaved1F1B's), load it into the runtime.
    source = S.ScheduleInterleaved1F1B(stages, m, loss_fn=_loss)
    path = os.path.join(scratch, f"schedule-rank{pp_rank}.csv")
    source._dump_csv(path, format="compute_only")
    runtime = S._PipelineScheduleRuntime(stages, m, loss_fn=_loss)
    runtime._load_csv(path, format="compute_only")
    return runtime


def _profiler(cfg: dict, out: Path, rank: int):
    """The context manager that records the trace, and its step() (or None)."""
    first, _, last = cfg["profile_steps"].partition("-")
    first, last = int(first), int(last or first)
    if cfg["mode"] == "pptrace":
        import pptrace

        prof = pptrace.profile(out, steps=f"{first}-{last}")
        return prof, prof.step
    if cfg["mode"] == "none":
        return contextlib.nullcontext(), (lambda: None)
    import torch

    path = out / "traces" / f"rank{rank}.json.gz"

    def ready(p):
        path.parent.mkdir(parents=True, exist_ok=True)
        p.export_chrome_trace(str(path))

    warmup = 1 if first >= 1 else 0
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=first - warmup, warmup=warmup, active=last - first + 1, repeat=1),
        on_trace_ready=ready,
        record_shapes=cfg["mode"] == "plain",
    )
    return prof, prof.step


def _worker(rank: int, cfg: dict, store: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    world, pp, v, dp = cfg["world"], cfg["pp"], cfg["v"], cfg["dp"]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = Path(cfg["out"])
    try:
        if dp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
            group = mesh.get_group("pp")
        else:
            group = None
        pp_rank = dist.get_rank(group)
        pp_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        placement = stage_ranks(cfg["schedule"], pp, v)
        mine = [s for s in range(pp * v) if placement[s] == pp_rank]

        SleepStage, TimedStage = _build_model_classes()
        fwd_s, bwd_s, wgrad_s = cfg["fwd_ms"] / 1e3, cfg["bwd_ms"] / 1e3, cfg["wgrad_ms"] / 1e3
        stages = [
            TimedStage(SleepStage(fwd_s, bwd_s - wgrad_s, wgrad_s), s, pp * v, torch.device("cpu"),
                       group=group, chunk=chunk)
            for chunk, s in enumerate(mine)
        ]
        schedule = _make_schedule(cfg, stages, pp_rank, os.path.dirname(store))
        m = cfg["microbatches"]
        batch = torch.randn(m * ROWS_PER_MB, HIDDEN)
        target = torch.zeros(m * ROWS_PER_MB, HIDDEN)
        has_first, has_last = 0 in mine, pp * v - 1 in mine
        params = [p for st in stages for p in st.submod.parameters()]
        optimizer = torch.optim.SGD(params, lr=1e-3)

        # Posts and waits are timed around torch's own helpers (looked up as module globals
        # at each call), so the schedules' code runs unchanged.
        from torch.distributed.pipelining import schedules as torch_schedules

        for name in ("_batch_p2p", "_wait_batch_p2p"):
            setattr(torch_schedules, name, RECORDER.timed_p2p(getattr(torch_schedules, name)))
        prof, prof_step = _profiler(cfg, out, rank)
        with prof:
            _time_losses(torch_schedules)
            for step in range(cfg["steps"]):
                RECORDER.begin_step(step)
                optimizer.zero_grad()
                args = (batch,) if has_first else ()
                kwargs = {"target": target} if has_last else {}
                RECORDER.mark("pipeline_start")
                schedule.step(*args, **kwargs)
                RECORDER.mark("pipeline_end")
                if dp > 1:  # data parallel: each stage's gradients summed over its dp group (DDP's all-reduce)
                    RECORDER.mark("dp_reduce_start")
                    dist.all_reduce(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]),
                                    group=mesh.get_group("dp"))
                    RECORDER.mark("dp_reduce_end")
                # Gradient clipping's global norm: one all-reduce over all ranks ends the step.
                norm = torch.stack([p.grad.norm() if p.grad is not None else torch.zeros(()) for p in params]).sum()
                RECORDER.mark("reduce_start")
                dist.all_reduce(norm.reshape(1))
                RECORDER.mark("reduce_end")
                optimizer.step()
                RECORDER.end_step()
                prof_step()

        first, _, last = cfg["profile_steps"].partition("-")
        profiled = set(range(int(first), int(last or first) + 1))
        for entry in RECORDER.steps:
            entry["profiled"] = entry["step"] in profiled
        order = getattr(schedule, "pipeline_order", None) or {}
        with_comms = getattr(schedule, "pipeline_order_with_comms", None)
        truth = {
            "rank": rank, "world": world, "pp": pp, "dp": dp, "vpp": v, "pp_rank": pp_rank, "pp_ranks": pp_ranks,
            "schedule": cfg["schedule"], "microbatches": m, "mode": cfg["mode"],
            "fwd_ms": cfg["fwd_ms"], "bwd_ms": cfg["bwd_ms"], "wgrad_ms": cfg["wgrad_ms"], "loss_ms": cfg["loss_ms"],
            "stages": mine, "stage_ranks": [pp_ranks[p] for p in placement],
            "pipeline_order": order_rows(order.get(pp_rank)),
            "pipeline_order_with_comms": order_rows(with_comms.get(pp_rank), sends=True) if with_comms else None,
            "torch": torch.__version__, "steps": RECORDER.steps,
        }
        (out / "truth").mkdir(parents=True, exist_ok=True)
        (out / "truth" / f"rank{rank}.json").write_text(json.dumps(truth))
        dist.barrier()  # nobody tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def run(
    out_dir,
    schedule: str,
    *,
    world: int = 4,
    microbatches: int = 8,
    steps: int = 4,
    profile_steps: str = "2-3",
    mode: str = "pptrace",
    fwd_ms: float = 10,
    bwd_ms: float = 20,
    wgrad_ms: float | None = None,
    loss_ms: float = 0,
    v: int | None = None,
    dp: int = 1,
    timeout: float = 300,
) -> Path:
    """Spawn ``world`` gloo ranks running ``schedule`` and return the run directory.

    ``v``: stages per rank (default 1 for GPipe/1F1B, 2 otherwise; the V schedules need 2).
    ``dp``: data-parallel replicas (world = pp * dp, a DeviceMesh ("pp", "dp"))."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if world % dp:
        raise ValueError(f"world {world} is not a multiple of dp {dp}")
    if v is None:
        v = 1 if schedule in SINGLE else 2
    if (schedule in SINGLE and v != 1) or (schedule in V_SHAPED and v != 2):
        raise ValueError(f"{schedule} cannot run {v} stages per rank")
    wgrad_ms = bwd_ms / 2 if wgrad_ms is None else wgrad_ms
    if not 0 <= wgrad_ms <= bwd_ms:
        raise ValueError(f"wgrad_ms {wgrad_ms} must lie in 0..bwd_ms ({bwd_ms})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(out=str(out), schedule=schedule, world=world, pp=world // dp, dp=dp, v=v, microbatches=microbatches,
               steps=steps, profile_steps=profile_steps, mode=mode, fwd_ms=fwd_ms, bwd_ms=bwd_ms, wgrad_ms=wgrad_ms,
               loss_ms=loss_ms)
    spawn_ranks(_worker, cfg, world, timeout, schedule)
    return out


def spawn_ranks(worker, cfg: dict, world: int, timeout: float, what: str) -> None:
    """``worker(rank, cfg, store)`` in ``world`` processes (gloo on the loopback, one thread
    each, a file:// store in a scratch directory), every one killed unless all finish within
    ``timeout`` seconds."""
    import torch.multiprocessing as mp

    from instrumented_model.train import start_method

    import box

    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with box.alone(), tempfile.TemporaryDirectory(prefix="ranks-") as scratch:
        ctx = mp.start_processes(worker, args=(cfg, os.path.join(scratch, "store")), nprocs=world,
                                 join=False, start_method=start_method())
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: {world} ranks did not finish within {timeout} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join()


def load_truth(out_dir) -> dict:
    """rank -> the truth that rank logged."""
    files = sorted(Path(out_dir, "truth").glob("rank*.json"))
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in files}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--schedule", default="Schedule1F1B", choices=SCHEDULES)
    parser.add_argument("--mode", default="pptrace", choices=MODES)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile-steps", default="2-3")
    parser.add_argument("--fwd-ms", type=float, default=10)
    parser.add_argument("--bwd-ms", type=float, default=20)
    parser.add_argument("--wgrad-ms", type=float, default=None)
    parser.add_argument("--loss-ms", type=float, default=0, help="the last stage's loss sleeps this long")
    parser.add_argument("--v", type=int, default=None, help="stages per rank")
    a = parser.parse_args()
    t0 = time.time()
    run(a.out_dir, a.schedule, world=a.world, microbatches=a.microbatches, steps=a.steps,
        profile_steps=a.profile_steps, mode=a.mode, fwd_ms=a.fwd_ms, bwd_ms=a.bwd_ms, wgrad_ms=a.wgrad_ms,
        loss_ms=a.loss_ms, v=a.v, dp=a.dp)
    print(f"wrote {a.out_dir} ({a.schedule}, {a.mode}) in {time.time() - t0:.1f}s", file=sys.stderr)
