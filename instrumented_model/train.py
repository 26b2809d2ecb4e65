"""The reference trainer: ``python -m instrumented_model.train --tp 2 --pp 2 --out run/``.

Under torchrun (RANK/WORLD_SIZE set) each process trains as its rank (nccl if CUDA, else
gloo). Started plainly, it spawns tp*cp*pp*dp local gloo processes itself (file:// store in a
temp dir). Every step is: pipeline schedule -> DP grad sync -> global grad-norm all-reduce
over all ranks (gradient clipping; DESIGN.md contract 3 relies on this collective) -> SGD.

``--out DIR`` writes DIR/traces/rank{r}.json.gz (pptrace.profile), DIR/metrics.jsonl (rank 0,
one object per step), DIR/run.json (the full config), DIR/sched/rank{r}.json (how long each
step's main thread waited for a CPU: on a busy box, the slowdown the OS gave a rank) and, in
sleep mode, DIR/truth/rank{r}.json (the known timeline: each pass's sleeps and span,
``_sleep_truth``).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

import pptrace
from pptrace import region
from pptrace.vocab import STEP_END_TAGS

from .pipeline_parallel import PipelineRun, get_forward_backward_func
from .pp_communications import P2PContext
from pptrace.schedules.tables import schedule_table
from .stage_compute import ModelCompute, SleepCompute
from .train_config import TrainConfig, config_from_args

# Sleep mode has no parameters; its DP all-reduce moves this many zeros so DP traffic is real.
_SLEEP_GRAD_NUMEL = 4096


class TrainingFailed(RuntimeError):
    """A rank failed; the message is that rank's error, one line."""


def _gpt_config(config: TrainConfig):
    from .model import GPTConfig

    return GPTConfig(
        vocab_size=config.vocab_size, seq_len=config.seq_len, hidden=config.hidden,
        heads=config.heads, layers=config.layers, mlp_ratio=4, seed=config.seed,
        experts=config.experts, topk=config.topk, moe_every=config.moe_every,
    )


def _sleep_moe(config: TrainConfig, gpt, pstate, overlap_group=None):
    """Sleep mode's ep work (expert_parallel.SleepMoE), None for a dense model."""
    from .expert_parallel import SleepMoE
    from .model import is_moe_layer, layers_for_chunk, num_local_tokens

    if not config.experts:
        return None
    layers = [[i for i in layers_for_chunk(gpt, config.pp, pstate.pp_rank, config.vpp, c) if is_moe_layer(gpt, i)]
              for c in range(config.vpp)]
    tokens = num_local_tokens(gpt, pstate, config.micro_batch_size) // (config.tp if config.sp else 1)
    return SleepMoE(layers, tokens, config.topk, config.hidden, config.expert_us_per_token, pstate.ep_group,
                    config.ep, pstate.ep_rank, config.moe_imbalance, pstate.device, overlap_group,
                    local_experts=config.experts // config.ep)


class _NoProfile:
    def step(self) -> None:
        pass


def _profile(config: TrainConfig):
    if config.out is None:
        return _nullcontext()
    extra = {
        "trainer": "instrumented_model",
        "compute": config.compute,
        "fwd_ms": config.fwd_ms, "bwd_ms": config.bwd_ms, "wgrad_ms": config.wgrad_ms,
        "delays": config.to_dict()["delays"],
        "config": config.to_dict(),
    }
    return pptrace.profile(
        config.out, steps=config.profile_steps, layout=config.layout, schedule=config.schedule,
        microbatches=config.microbatches, vpp=config.vpp, extra=extra,
    )


def _global_norm_and_loss(chunks, pstate, loss_sum: torch.Tensor, device) -> tuple[float, float]:
    """The grad-norm all-reduce over ALL ranks, with the loss packed alongside (one collective).

    Each parameter counts once: after the DP sync every dp x cp replica holds the same grads,
    so only the replica at dp=cp=0 contributes, and replicated (not tensor_model_parallel)
    params only from tp rank 0. Loss: every last-stage rank of tp rank 0 adds its local CE sum.
    """
    coords = pstate.coords
    sq = torch.zeros((), dtype=torch.float64, device=device)
    # an expert's replicas are its edp group: the one at edp rank 0 counts it
    counts = {False: coords.dp == 0 and coords.cp == 0, True: pstate.layout.expert_coords(pstate.rank)[1] == 0}
    for chunk in chunks:
        for p in chunk.parameters():
            if (p.grad is not None and counts[getattr(p, "expert_parallel", False)]
                    and (coords.tp == 0 or getattr(p, "tensor_model_parallel", False))):
                sq += p.grad.detach().double().pow(2).sum()
    contributes_loss = pstate.is_last_stage and coords.tp == 0
    loss = loss_sum.detach().double().to(device) if contributes_loss else torch.zeros((), dtype=torch.float64, device=device)
    buf = torch.stack([sq, loss]).float()
    with region("dp:all_reduce", **STEP_END_TAGS, bytes=buf.numel() * buf.element_size()):
        dist.all_reduce(buf)
    return math.sqrt(max(buf[0].item(), 0.0)), buf[1].item()


def _sgd_step(chunks, lr: float, clip: float, grad_norm: float) -> None:
    with region("compute:optimizer"), torch.no_grad():
        scale = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        for chunk in chunks:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr * scale)
                    p.grad = None


def train(config: TrainConfig, pstate) -> list[dict]:
    """Train on this rank (process groups already set up); returns rank 0's metrics rows."""
    from .model import activation_shape

    rank, coords, device = pstate.rank, pstate.coords, pstate.device
    gpt = _gpt_config(config)
    m, mbs = config.microbatches, config.micro_batch_size
    wrap = config.vpp > 1  # the interleaved ring: last stage feeds stage 0's next chunk
    ctx = P2PContext(
        prev_rank=config.layout.pipeline_prev_rank(rank, wrap=wrap),
        next_rank=config.layout.pipeline_next_rank(rank, wrap=wrap),
        shape=tuple(activation_shape(gpt, pstate, mbs)),
        device=device, tag_chunks=config.vpp > 1,
    )
    forward_backward = get_forward_backward_func(config.schedule, config.pp, config.vpp)
    fwd_delay, bwd_delay = config.delay_s(rank, "fwd"), config.delay_s(rank, "bwd")
    dp_cp_size = config.dp * config.cp

    chunks, reducer = [], None
    overlap_group = None
    if config.ep_overlap:
        from .expert_parallel import overlap_group as make_overlap_group

        overlap_group = make_overlap_group(pstate)  # collective: every rank, before any traffic
    if config.compute == "model":
        from .data import get_microbatch
        from .expert_parallel import enable_overlap
        from .model import build_model_chunks

        chunks = build_model_chunks(gpt, pstate, vpp=config.vpp)
        enable_overlap(chunks, overlap_group)
        if config.dp_overlap and dp_cp_size > 1:
            from .data_parallel import OverlappedGradReducer

            reducer = OverlappedGradReducer(chunks, pstate)
    loss_scale = 1.0 / (config.seq_len * mbs * m * config.dp)
    table = schedule_table(config.schedule if config.pp > 1 else "1f1b", config.pp, coords.pp, m, config.vpp)
    last_grad_op = "W" if config.schedule == "zb-h1" else "B"
    arm_at = [(mb, c) for op, mb, c in table if op == last_grad_op][-1]

    rows = []
    metrics_path = Path(config.out) / "metrics.jsonl" if config.out and rank == 0 else None
    if metrics_path is not None:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        metrics_path.write_bytes(b"")
    moe = _sleep_moe(config, gpt, pstate, overlap_group) if config.compute == "sleep" else None
    truth = _sleep_truth(config, rank, coords.pp, fwd_delay, bwd_delay, moe)
    waited = {}  # step -> ns this rank's main thread waited for a CPU (the box's own slowdown)
    with _profile(config) as prof:
        for step in range(config.steps):
            start, queued = time.perf_counter(), _runqueue_wait_ns()
            if config.compute == "model":
                compute = ModelCompute(
                    chunks=chunks,
                    get_batch=lambda mb, step=step: get_microbatch(gpt, pstate, step, mb, mbs, m),
                    is_first_stage=pstate.is_first_stage, is_last_stage=pstate.is_last_stage,
                    loss_scale=loss_scale, fwd_delay_s=fwd_delay, bwd_delay_s=bwd_delay,
                    arm_reducer_at=arm_at, reducer=reducer,
                )
            else:
                compute = SleepCompute(
                    shape=ctx.shape, pp_rank=coords.pp, pp_size=config.pp, vpp=config.vpp,
                    fwd_s=config.fwd_ms / 1000, bwd_s=config.bwd_ms / 1000,
                    wgrad_s=config.wgrad_ms / 1000, fwd_delay_s=fwd_delay, bwd_delay_s=bwd_delay,
                    device=device, moe=moe,
                )
            passes = truth["steps"].setdefault(str(step), []) if truth is not None else None
            if moe is not None and truth is not None:
                moe.calls = truth["experts"]["calls"].setdefault(str(step), [])
                moe.computes = truth["experts"]["compute"].setdefault(str(step), [])
                moe.blocked = truth["experts"]["blocked"].setdefault(str(step), [])
            forward_backward(PipelineRun(compute, ctx, m, coords.pp, config.pp, config.vpp,
                                         overlap_p2p_comm=config.overlap_p2p_comm, passes=passes))
            _sync_data_parallel(config, pstate, chunks, reducer, dp_cp_size)
            loss_sum = getattr(compute, "loss_sum", torch.zeros(()))
            grad_norm, loss_total = _global_norm_and_loss(chunks, pstate, loss_sum, device)
            _sgd_step(chunks, config.lr, config.clip_grad, grad_norm)
            elapsed = time.perf_counter() - start
            now = _runqueue_wait_ns()
            if queued is not None and now is not None:
                waited[str(step)] = now - queued
            if rank == 0:
                row = {
                    "step": step,
                    "loss": loss_total * loss_scale if config.compute == "model" else None,
                    "step_time_s": elapsed,
                    "grad_norm": grad_norm,
                }
                rows.append(row)
                if metrics_path is not None:
                    with metrics_path.open("ab") as f:
                        f.write(orjson.dumps(row) + b"\n")
            prof.step()
    if config.out and waited:
        (Path(config.out) / "sched").mkdir(parents=True, exist_ok=True)
        (Path(config.out) / "sched" / f"rank{rank}.json").write_bytes(
            orjson.dumps({"rank": rank, "runqueue_wait_ns": waited}))
    if truth is not None:
        if "experts" in truth:
            from .expert_parallel import overlap_ns

            e = truth["experts"]
            # the hidden EP time: calls in flight while the main thread ran its pass outside
            # its ep posts and waits (a serial call blocks it throughout); the part of it
            # under the experts' sleeps bounds it from below
            spans = {step: [(start, end) for *_, start, end in passes] for step, passes in truth["steps"].items()}
            blocked = e["blocked"] if config.ep_overlap else e["calls"]
            e["overlap_ns"] = {step: overlap_ns(calls, spans.get(step, ()), blocked.get(step, ()))
                               for step, calls in e["calls"].items()}
            e["overlap_expert_ns"] = {step: overlap_ns(calls, e["compute"].get(step, ()))
                                      for step, calls in e["calls"].items()}
        (Path(config.out) / "truth").mkdir(parents=True, exist_ok=True)
        (Path(config.out) / "truth" / f"rank{rank}.json").write_bytes(orjson.dumps(truth))
    return rows


def _runqueue_wait_ns() -> int | None:
    """Time this thread has waited for a CPU so far (Linux schedstat), None where unknown."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _sleep_truth(config: TrainConfig, rank: int, pp_rank: int, fwd_delay: float, bwd_delay: float,
                 moe=None) -> dict | None:
    """Sleep mode's known timeline, the ground truth tests hold the analysis to: the sleeps
    each pass of this rank takes (per microbatch, all chunks) and, per step, every pass's span
    as ``[op, mb, chunk, start_ns, end_ns]`` on the clock trace times are given in (time_ns).
    With MoE layers, ``experts``: the tokens this rank's experts get per MoE layer and
    microbatch, the MoE layers of each chunk, their sleep per layer (s) by phase, and per
    step the all-to-all calls' ``[start_ns, end_ns]`` (with --ep-overlap from post to
    completion), the expert sleeps' (``compute``), the main thread's posts and waits of the
    overlapped calls (``blocked``), and ``overlap_ns``: the hidden EP time, calls in flight
    while the main thread ran its pass outside its ep calls (``overlap_expert_ns``: the part
    under the expert sleeps, its lower bound)."""
    if config.compute != "sleep" or not config.out:
        return None
    truth = {"rank": rank, "pp_rank": pp_rank, "vpp": config.vpp,
             "sleeps_s": {"fwd": config.fwd_ms / 1000 + fwd_delay,
                          "bwd_input": config.bwd_ms / 1000 + bwd_delay,
                          "bwd_weight": config.wgrad_ms / 1000},
             "steps": {}}
    if moe is not None:
        truth["experts"] = {"tokens": moe.received, "sent": moe.in_splits, "layers": moe.layers_of_chunk,
                            "ep_rank": moe.ep_rank, "fwd_s": moe.expert_s("fwd"), "bwd_s": moe.expert_s("bwd"),
                            "overlap": config.ep_overlap, "calls": {}, "compute": {}, "blocked": {}}
    return truth


def _sync_data_parallel(config, pstate, chunks, reducer, dp_cp_size: int) -> None:
    if config.compute == "sleep":
        if dp_cp_size == 1:
            return
        zeros = torch.zeros(_SLEEP_GRAD_NUMEL, device=pstate.device)
        with region("dp:all_reduce", bucket=0, bytes=zeros.numel() * zeros.element_size()):
            dist.all_reduce(zeros, group=pstate.dp_cp_group)
    elif reducer is not None:
        reducer.finish()
    else:
        from .data_parallel import finish_grad_sync

        finish_grad_sync(chunks, pstate)


class _nullcontext:
    def __enter__(self):
        return _NoProfile()

    def __exit__(self, *exc):
        return False


# -- processes ---------------------------------------------------------------------------


def _init_and_train(config: TrainConfig, rank: int, world_size: int, init_method: str, backend: str):
    from .parallel_state import initialize_model_parallel

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        pstate = initialize_model_parallel(
            config.layout, sequence_parallel=config.sp, cp_algo=config.cp_algo,
            cp_overlap=config.cp_overlap,
        )
        if rank == 0 and config.out:
            out = Path(config.out)
            out.mkdir(parents=True, exist_ok=True)
            run_info = {"config": config.to_dict(), "world_size": world_size,
                        "layout": config.layout.to_dict(), "backend": backend}
            (out / "run.json").write_bytes(orjson.dumps(run_info, option=orjson.OPT_INDENT_2))
        return train(config, pstate)
    finally:
        dist.destroy_process_group()


def _spawned_worker(rank: int, config: TrainConfig, store_dir: str) -> None:
    # Spawned children: one thread each (2 cores host 8 ranks), loopback for gloo.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        _init_and_train(config, rank, config.world_size, f"file://{store_dir}/store", "gloo")
    except BaseException as exc:  # noqa: BLE001 - reported as one line by the parent
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        (Path(store_dir) / f"error.rank{rank}").write_text(f"{time.time_ns()} rank {rank}: {message}")
        sys.exit(1)


def _first_error(store_dir: str) -> str | None:
    # The earliest error is the cause; the others are usually peers losing their connection.
    found = []
    for path in Path(store_dir).glob("error.rank*"):
        stamp, _, message = path.read_text().partition(" ")
        found.append((int(stamp), message))
    return min(found)[1] if found else None


def start_method() -> str:
    """How the local ranks start: forked on Linux, so that each shares the torch this process
    imported instead of importing its own (~3 s of CPU a rank on a 2-core box, half of a small
    run's time); spawned where fork is unsafe (macOS, Windows) or would inherit an initialised
    CUDA context."""
    return "fork" if sys.platform.startswith("linux") and not torch.cuda.is_initialized() else "spawn"


def run(config: TrainConfig) -> None:
    """Train with ``config``: as one rank under torchrun, else by spawning local processes.
    Raises TrainingFailed (one-line message) if any rank fails."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != config.world_size:
            raise TrainingFailed(
                f"torchrun started {world} processes but tp*cp*pp*dp = {config.world_size}"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        _init_and_train(config, int(os.environ["RANK"]), world, "env://", backend)
        return
    if config.world_size == 1:
        # One rank needs no child process: train here on a private one-rank gloo group.
        with tempfile.TemporaryDirectory(prefix="pptrace-train-") as store_dir:
            try:
                _init_and_train(config, 0, 1, f"file://{store_dir}/store", "gloo")
            except Exception as exc:  # noqa: BLE001 - one line for the caller
                raise TrainingFailed(" ".join(f"rank 0: {type(exc).__name__}: {exc}".split())) from exc
        return
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the children
    # torch logs a warning per surviving child it terminates after a failure; the failing
    # rank's one-line error is what the user needs.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="pptrace-train-") as store_dir:
        try:
            mp.start_processes(
                _spawned_worker, args=(config, store_dir), nprocs=config.world_size,
                join=True, start_method=start_method(),
            )
        except ProcessException as exc:
            raise TrainingFailed(_first_error(store_dir) or " ".join(str(exc).split())) from None
        finally:
            spawn_log.setLevel(level)


def main(argv=None) -> int:
    try:
        config = config_from_args(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run(config)
    except TrainingFailed as exc:
        print(f"error: training failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
