"""Megatron-Core's own pipeline schedules on real gloo ranks, with stages that sleep known times.

``run(out_dir, schedule="1f1b"|"interleaved", world=2, ...)`` spawns ``world`` gloo ranks
(pp = world, file:// rendezvous, OMP_NUM_THREADS=1) that each build Megatron's parallel state
with ``initialize_model_parallel`` and run ``get_forward_backward_func()`` (1F1B without
interleaving, or the interleaved schedule with ``vpp`` model chunks per rank) for ``steps``
steps of ``microbatches`` microbatches. The model is a chain of chunks whose forward sleeps
``fwd_ms`` and backward ``bwd_ms`` per pass (a custom autograd Function), so the truth is known.

The step is what Megatron's ``pretrain`` does around the schedule: the config of its training
scripts (``deallocate_pipeline_outputs``, ``batch_p2p_comm = not overlap_p2p_comm``, overlap on
for interleaved only), then the grad-norm all-reduce over the model-parallel group (every rank
here) before the optimizer step.

Profiling (``mode``):

- ``pptrace``: ``pptrace.profile(out_dir, steps=profile_steps)`` ALONE: no layout, schedule or
  microbatch arguments; the Megatron integration finds them.
- ``plain`` / ``plain-noshapes``: plain ``torch.profiler`` (``record_shapes`` True / False)
  writing ``out_dir/traces/rank{r}.json.gz`` for the same steps; no pptrace in the run at all.

Ground truth goes to ``out_dir/truth/rank{r}.json``: every pass's measured sleep (epoch ns from
``time.time_ns`` and perf-counter ns), its step, stage, microbatch and chunk; every call of
Megatron's ``forward_step`` / ``backward_step`` (``frames``: the pass as the framework ran it,
its bookkeeping and autograd around the sleep included) and, as ``op: "p2p"`` frames, every
call of ``P2PCommunicator._communicate`` and every wait on a handle it returned; and every
step's start/end with the
schedule call (``pipeline_start_ns`` / ``pipeline_end_ns``) and the closing all-reduce
(``reduce_start_ns`` / ``reduce_end_ns``) inside it.

Megatron-Core needs CUDA in three places of its pipeline code (a ``torch.zeros(device="cuda")``
in schedules.py, ``device=torch.cuda.current_device()`` for p2p recv buffers, and
``torch.cuda.synchronize()`` after batched p2p). THIS HARNESS replaces them for CPU by giving
those two modules a ``torch`` whose CUDA bits point at the CPU (:func:`_megatron_on_cpu`); the
pptrace integration itself needs no such thing.

    python tests/megatron_run.py OUT_DIR [--schedule interleaved] [--world 2] [--mode plain]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

SCHEDULES = ("1f1b", "interleaved")
MODES = ("pptrace", "plain", "plain-noshapes")
SEQ, MICRO_BATCH, HIDDEN = 16, 1, 64  # one activation message: 16*1*64 float32 = 4096 bytes


class _CpuTorch(types.ModuleType):
    """``torch`` as Megatron's pipeline modules see it, with the CUDA-only calls on the CPU."""

    def __init__(self, torch):
        super().__init__("torch")
        self._torch = torch
        self.cuda = types.SimpleNamespace(current_device=lambda: "cpu", synchronize=lambda: None)

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *args, device=None, **kwargs):
        return self._torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _megatron_on_cpu() -> None:
    import torch
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    schedules.torch = p2p_communication.torch = _CpuTorch(torch)


def _megatron_nvtx_on() -> None:
    """What Megatron-LM's ``--nvtx-ranges`` does (``configure_nvtx_profiling(True)``), plus two
    test-only substitutions: torch's CPU build has no NVTX, so ``torch.cuda.nvtx`` pushes through
    the ``nvtx`` package (the same C API); and p2p_communication is imported again so that its
    ``@nvtx_decorator`` sees the switch: the decorator is applied at import, and ``import
    megatron.core`` imports that module before any script can turn the switch on."""
    import importlib

    import nvtx
    import torch
    from megatron.core import utils
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    utils.configure_nvtx_profiling(True)
    torch.cuda.nvtx.range_push = lambda msg: nvtx.push_range(msg)
    torch.cuda.nvtx.range_pop = lambda: nvtx.pop_range()
    importlib.reload(p2p_communication)
    schedules.P2PCommunicator = p2p_communication.P2PCommunicator


class Truth:
    """The passes this rank really ran, timed around the sleep itself, and Megatron's own
    pass functions (``forward_step`` / ``backward_step``) timed around their calls."""

    def __init__(self, rank: int, pp: int, pp_rank: int):
        self.rank, self.pp, self.pp_rank = rank, pp, pp_rank
        self.step = -1
        self.passes: list[dict] = []
        self.frames: list[dict] = []
        self.steps: list[dict] = []
        self.marks: dict = {}

    def mark(self, name: str) -> None:
        """A named instant of the current step (``<name>_ns``, epoch)."""
        self.marks[f"{name}_ns"] = time.time_ns()

    def time_calls(self, module, name: str, op: str) -> None:
        """Wrap ``module.name`` so that each call's span is logged as a frame. Timing only:
        the function Megatron's schedule calls is its own, with its signature (``wraps``), so
        the pptrace integration wraps it in turn as it would the original."""
        original = getattr(module, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start_ns = time.time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.frames.append({"step": self.step, "op": op, "start_ns": start_ns, "end_ns": time.time_ns()})

        setattr(module, name, timed)

    def time_p2p(self, p2p_module) -> None:
        """Log each post (Megatron's ``_batched_p2p_ops`` / ``_p2p_ops``, which ``_communicate``
        looks up at each call) and each wait on a request one returned (in ``_communicate``,
        or later with overlap_p2p_comm) as a ``p2p`` frame: the spans a pass inferred from
        posts cannot reach into. Not ``_communicate`` itself: its own work before its first
        post (buffers for the recvs) lies in such a pass. The requests stay Megatron's
        (``_Timed`` passes every other attribute through)."""
        truth = self

        class _Timed:
            def __init__(self, work):
                self._work = work

            def wait(self, *args, **kwargs):
                start_ns = time.time_ns()
                try:
                    return self._work.wait(*args, **kwargs)
                finally:
                    truth.frames.append({"step": truth.step, "op": "p2p", "start_ns": start_ns, "end_ns": time.time_ns()})

            def __getattr__(self, name):
                return getattr(self._work, name)

        for name in ("_batched_p2p_ops", "_p2p_ops"):
            self.time_calls(p2p_module, name, "p2p")
            posted = getattr(p2p_module, name)

            def with_timed_requests(*args, _posted=posted, **kwargs):
                reqs = _posted(*args, **kwargs)
                if isinstance(reqs, dict):
                    return {key: _Timed(work) for key, work in reqs.items()}
                return [_Timed(work) for work in reqs]

            setattr(p2p_module, name, functools.wraps(posted)(with_timed_requests))

    def sleep(self, op: str, mb: int, chunk: int, seconds: float) -> None:
        start_ns, start_perf = time.time_ns(), time.perf_counter_ns()
        time.sleep(seconds)
        end_perf, end_ns = time.perf_counter_ns(), time.time_ns()
        self.passes.append({
            "step": self.step, "op": op, "mb": mb, "chunk": chunk,
            "stage": chunk * self.pp + self.pp_rank,  # Megatron's virtual stage order
            "start_ns": start_ns, "end_ns": end_ns, "start_perf_ns": start_perf, "end_perf_ns": end_perf,
        })


def _sleep_function():
    import torch

    class Sleep(torch.autograd.Function):
        """y = x + w; forward and backward sleep their pass time and log it."""

        @staticmethod
        def forward(ctx, x, w, truth, mb, chunk, fwd_s, bwd_s):
            ctx.truth, ctx.mb, ctx.chunk, ctx.bwd_s = truth, mb, chunk, bwd_s
            truth.sleep("fwd", mb, chunk, fwd_s)
            return x + w

        @staticmethod
        def backward(ctx, grad):
            ctx.truth.sleep("bwd", ctx.mb, ctx.chunk, ctx.bwd_s)
            return grad, grad.sum(dim=(0, 1)), None, None, None, None, None

    return Sleep


def _build_chunks(config, truth: Truth, vpp: int, fwd_s: float, bwd_s: float):
    """What Megatron's model provider returns: one module per virtual chunk, each with the
    ``config``, ``model_type`` and ``set_input_tensor`` the schedules use."""
    import torch
    from megatron.core.enums import ModelType

    Sleep = _sleep_function()

    class SleepChunk(torch.nn.Module):
        def __init__(self, chunk: int):
            super().__init__()
            self.config, self.model_type, self.vp_stage = config, ModelType.encoder_or_decoder, chunk
            self.chunk = chunk
            self.first = chunk == 0 and truth.pp_rank == 0
            self.last = chunk == vpp - 1 and truth.pp_rank == truth.pp - 1
            self.weight = torch.nn.Parameter(torch.zeros(HIDDEN))
            self.input_tensor = None

        def set_input_tensor(self, input_tensor):
            self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

        def forward(self, data, mb: int):
            x = data if self.first else self.input_tensor
            return Sleep.apply(x, self.weight, truth, mb, self.chunk, fwd_s, bwd_s)

    return [SleepChunk(c) for c in range(vpp)]


def _forward_step(data_iterator, model):
    """Megatron's forward_step_func: the batch from the iterator, the model, a loss function."""
    import torch

    mb = next(data_iterator)
    data = torch.full((SEQ, MICRO_BATCH, HIDDEN), float(mb))
    output = model(data, mb)

    def loss_func(output_tensor):
        loss = output_tensor.sum()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _worker(rank, world, out_dir, schedule, microbatches, steps, profile_steps, mode, fwd_ms, bwd_ms, vpp, nvtx):
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    interleaved = schedule == "interleaved"
    vpp = vpp if interleaved else 1
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=vpp if interleaved else None,
    )
    if nvtx:
        _megatron_nvtx_on()
    _megatron_on_cpu()
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.pipeline_parallel import schedules as megatron_schedules
    # What megatron/training/arguments.py builds for these flags: overlap_p2p_comm on for the
    # interleaved schedule only, batch_p2p_comm = not overlap_p2p_comm, deallocated outputs.
    config = TransformerConfig(
        num_layers=world * vpp, hidden_size=HIDDEN, num_attention_heads=1,
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=vpp if interleaved else None,
        pipeline_dtype=torch.float32, deallocate_pipeline_outputs=True,
        overlap_p2p_comm=interleaved, batch_p2p_comm=not interleaved,
    )
    truth = Truth(rank, world, parallel_state.get_pipeline_model_parallel_rank())
    chunks = _build_chunks(config, truth, vpp, fwd_ms / 1000, bwd_ms / 1000)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    # Resolved once before the loop, as Megatron-LM's train() does: the integration must not
    # depend on wrapping the schedule function itself.
    forward_backward = get_forward_backward_func()

    def train_step():
        optimizer.zero_grad()
        truth.mark("pipeline_start")
        forward_backward(
            forward_step_func=_forward_step,
            data_iterator=[iter(range(microbatches)) for _ in chunks] if interleaved else iter(range(microbatches)),
            model=chunks if interleaved else chunks[0],
            num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        truth.mark("pipeline_end")
        # Megatron's clip_grad_norm: the grad norm all-reduced over the model-parallel group.
        norm = torch.stack([(p.grad if p.grad is not None else torch.zeros_like(p)).pow(2).sum()
                            for p in params]).sum()
        truth.mark("reduce_start")
        dist.all_reduce(norm, group=parallel_state.get_model_parallel_group())
        truth.mark("reduce_end")
        optimizer.step()

    profiler = _profiler(mode, out, rank, profile_steps)
    with profiler as prof:
        # Timed outside whatever the profiler wrapped them in: the truth's frame is the pass
        # as the rank ran it, the pptrace integration's own cost included.
        truth.time_calls(megatron_schedules, "forward_step", "fwd")
        truth.time_calls(megatron_schedules, "backward_step", "bwd")
        # A pass inferred from a plain trace runs from one post or wait to the next: it lies
        # within a frame stretched to the p2p spans on either side.
        truth.time_p2p(p2p_communication)
        for step in range(steps):
            truth.step = step
            start_ns, start_perf = time.time_ns(), time.perf_counter_ns()
            train_step()
            end_perf, end_ns = time.perf_counter_ns(), time.time_ns()
            truth.steps.append({"step": step, "start_ns": start_ns, "end_ns": end_ns,
                                "start_perf_ns": start_perf, "end_perf_ns": end_perf, **truth.marks})
            prof.step()
    dist.barrier()
    (out / "truth").mkdir(parents=True, exist_ok=True)
    (out / "truth" / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "pp": world, "pp_rank": truth.pp_rank, "schedule": schedule,
        "microbatches": microbatches, "vpp": vpp, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
        "profile_steps": profile_steps, "mode": mode, "steps": truth.steps, "passes": truth.passes,
        "frames": truth.frames,
    }))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _profiler(mode: str, out: Path, rank: int, profile_steps: str):
    import torch

    if mode == "pptrace":
        import pptrace

        return pptrace.profile(out, steps=profile_steps)
    first, _, last = profile_steps.partition("-")
    first, last = int(first), int(last or first)
    path = out / "traces" / f"rank{rank}.json.gz"

    def export(prof):
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))

    warmup = 1 if first >= 1 else 0
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=first - warmup, warmup=warmup, active=last - first + 1, repeat=1),
        on_trace_ready=export,
        record_shapes=mode == "plain",
    )


def run(out_dir, schedule: str = "1f1b", world: int = 2, microbatches: int = 8, steps: int = 4,
        profile_steps: str = "2-3", mode: str = "pptrace", fwd_ms: float = 10, bwd_ms: float = 20,
        vpp: int = 2, nvtx: bool = False) -> Path:
    """Spawn ``world`` gloo ranks running Megatron's schedule; returns the run directory.
    ``nvtx``: Megatron's own NVTX ranges on (see :func:`_megatron_nvtx_on`)."""
    import torch.multiprocessing as mp

    import box
    from instrumented_model.train import start_method

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if not 2 <= world <= 4:
        raise ValueError(f"world {world} must be 2..4 (pp = world)")
    if schedule == "interleaved" and (vpp < 2 or microbatches % world):
        raise ValueError(f"interleaved needs vpp >= 2 and microbatches % pp == 0, got vpp={vpp} "
                         f"microbatches={microbatches} pp={world}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    with box.alone():
        mp.start_processes(_worker, args=(world, str(out), schedule, microbatches, steps, profile_steps, mode,
                                          fwd_ms, bwd_ms, vpp, nvtx), nprocs=world, join=True,
                           start_method=start_method())
    return out


def load_truth(run_dir) -> dict:
    """rank -> that rank's truth document."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(Path(run_dir, "truth").glob("rank*.json"))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile-steps", default="2-3")
    parser.add_argument("--mode", choices=MODES, default="pptrace")
    parser.add_argument("--fwd-ms", type=float, default=10)
    parser.add_argument("--bwd-ms", type=float, default=20)
    parser.add_argument("--vpp", type=int, default=2)
    args = parser.parse_args()
    t0 = time.time()
    run(args.out_dir, args.schedule, args.world, args.microbatches, args.steps, args.profile_steps,
        args.mode, args.fwd_ms, args.bwd_ms, args.vpp)
    print(f"wrote {args.out_dir} in {time.time() - t0:.1f}s", file=sys.stderr)
