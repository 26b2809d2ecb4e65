"""Megatron-Core's real MoE layer (``MoELayer``, alltoall token dispatcher) on CPU gloo ranks.

``run(out_dir, world=2, ...)`` spawns ``world`` gloo ranks (file:// rendezvous,
OMP_NUM_THREADS=1) that build Megatron's parallel state with
``initialize_model_parallel(expert_model_parallel_size=world)`` (tp = pp = 1, dp = ep = world)
and train a model of ``layers`` Megatron ``MoELayer`` s (each ``x + moe(x)``;
``moe_token_dispatcher_type="alltoall"``, i.e. ``MoEAlltoAllTokenDispatcher``; SequentialMLP
experts from ``get_moe_module_spec(use_te=False, moe_grouped_gemm=False)``; TopKRouter, softmax,
top-``topk`` of ``experts``, no load-balancing loss) for ``steps`` steps of ``microbatches``
microbatches through Megatron's own ``forward_backward_no_pipelining``, on random tokens of
``SEQ`` rows per rank. The router is skewed: feature 0 of every token is 1 and the router's
weight for it on expert ``hot_expert`` is raised by ``skew``, so that expert (on ep rank
``hot_expert // (experts / world)``) is in nearly every token's top-k and that rank's experts
get the most tokens. Profiled with ``pptrace.profile(out_dir, steps=profile_steps)`` ALONE.

What is replaced for CPU, and nothing else (all outside the dispatcher's token scheduling):

- ``token_dispatcher.torch``, ``router.torch`` and ``tensor_parallel.mappings.torch``: a ``torch``
  whose ``cuda`` is the CPU (``_CpuTorch`` of tests/megatron_run.py, plus a stand-in
  ``torch.cuda.Stream`` / ``current_stream`` / ``stream``): the dispatcher's class-level
  ``cuda_dtoh_stream = torch.cuda.Stream()`` (token_dispatcher.py:445) and the stream
  switches of ``_maybe_dtoh_and_synchronize`` (:871-895); ``TopKRouter.gating`` moving its
  weight to ``torch.cuda.current_device()`` (router.py:88-92); the all-to-all / all-gather
  output buffers on ``torch.cuda.current_device()`` (mappings.py:141, :148, :442).
- ``token_dispatcher.maybe_move_tensor_to_cpu``: Megatron's device-to-host copy of the split
  sizes (moe_utils.py:1093) copies only CUDA tensors, so on the CPU the splits would stay
  tensors, which ``all_to_all_single`` refuses (it takes lists; on a GPU they arrive as numpy
  arrays): the stand-in makes the same numpy array from a host tensor.
- ``moe_utils.te_general_gemm = None``: not CPU but a Megatron 0.16.1 bug on any install without
  Transformer Engine: ``RouterGatingLinearFunction`` (moe_utils.py:1192) tests
  ``te_general_gemm is not None``, a name only the TE import defines (NameError).
- schedules / p2p_communication: tests/megatron_run.py's ``_megatron_on_cpu`` (the
  ``torch.zeros(device="cuda")`` of forward_backward_no_pipelining).

Ground truth (``out_dir/truth/rank{r}.json``), logged outside pptrace: every
``all_to_all_single`` the dispatcher's all-to-alls make (through mappings' ``torch.distributed``:
its input / output split sizes, rows, bytes, whether it ran in backward
(``torch._C._current_autograd_node()``), its wall time), every all-gather of the count exchange
(mappings' ``dist_all_gather_func``, timed), and per layer call the dispatcher's
``input_splits`` / ``output_splits`` and the ``tokens_per_expert`` the experts were handed
(a forward pre-hook on the experts module); each step's start and end.

    python tests/megatron_moe_run.py OUT_DIR [--world 4] [--layers 2] [--skew 3]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

SEQ, HIDDEN, FFN = 64, 32, 64  # tokens per rank and microbatch, hidden size, expert ffn size


class _HostStream:
    """``torch.cuda.Stream`` on the CPU: nothing runs asynchronously, so there is nothing to wait for."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self):
        return types.SimpleNamespace(synchronize=lambda: None)


class _Logged(types.ModuleType):
    """``torch.distributed`` as mappings sees it: ``all_to_all_single`` timed and logged."""

    def __init__(self, dist, truth):
        super().__init__("torch.distributed")
        self._dist, self._truth = dist, truth

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        import torch

        backward = torch._C._current_autograd_node() is not None
        start = time.time_ns()
        work = self._dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                            input_split_sizes=input_split_sizes, **kwargs)
        self._truth.a2a.append({
            "step": self._truth.step, "start_ns": start, "end_ns": time.time_ns(), "backward": backward,
            "send": [int(n) for n in input_split_sizes], "recv": [int(n) for n in output_split_sizes],
            "rows": int(input.shape[0]), "dim": input.dim(), "bytes": input.numel() * input.element_size(),
        })
        return work


class Truth:
    def __init__(self, rank: int):
        self.rank, self.step = rank, -1
        self.a2a: list[dict] = []
        self.gathers: list[dict] = []  # the count exchange's all-gathers
        self.experts: list[dict] = []
        self.steps: list[dict] = []

    def expert_hook(self, layer):
        """Forward pre-hook of ``layer.experts``: the tokens each local expert is handed."""
        def hook(module, args):
            dispatcher = layer.token_dispatcher
            self.experts.append({
                "step": self.step, "layer": layer.layer_number,
                "tokens_per_expert": [int(n) for n in args[1].tolist()],
                "input_splits": [int(n) for n in dispatcher.input_splits.tolist()],
                "output_splits": [int(n) for n in dispatcher.output_splits.tolist()],
            })
        return hook

    def time_gathers(self, mappings) -> None:
        """Time mappings' all-gather (the dispatcher's count exchange): timing only."""
        gather = mappings.dist_all_gather_func

        def timed(output, input, group=None, **kwargs):
            start = time.time_ns()
            try:
                return gather(output, input, group=group, **kwargs)
            finally:
                self.gathers.append({"step": self.step, "start_ns": start, "end_ns": time.time_ns(),
                                     "bytes": input.numel() * input.element_size()})

        mappings.dist_all_gather_func = timed


def _moe_on_cpu(truth: Truth) -> None:
    """The replacements the module docstring lists."""
    import torch
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    from megatron_run import _CpuTorch, _megatron_on_cpu

    _megatron_on_cpu()
    current = _HostStream()
    cpu = _CpuTorch(torch)
    cpu.cuda = types.SimpleNamespace(current_device=lambda: "cpu", synchronize=lambda: None, Stream=_HostStream,
                                     current_stream=lambda: current, stream=lambda s: contextlib.nullcontext())
    token_dispatcher.torch = router.torch = cpu
    logged = _CpuTorch(torch)
    logged.cuda, logged.distributed = cpu.cuda, _Logged(torch.distributed, truth)
    mappings.torch = logged

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    moe_utils.te_general_gemm = None
    truth.time_gathers(mappings)


def _build_model(config, layers: int, truth: Truth, hot_expert: int, skew: float):
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)

    class MoeModel(torch.nn.Module):
        """What a model provider returns: ``config``, ``model_type``, ``set_input_tensor``."""

        def __init__(self):
            super().__init__()
            self.config, self.model_type = config, ModelType.encoder_or_decoder
            self.layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1)
                                              for i in range(layers))
            with torch.no_grad():
                for layer in self.layers:
                    layer.router.weight[hot_expert, 0] += skew
                    layer.experts.register_forward_pre_hook(truth.expert_hook(layer))

        def set_input_tensor(self, input_tensor):
            pass

        def forward(self, x):
            for layer in self.layers:
                out, _ = layer(x)
                x = x + out
            return x

    return MoeModel()


def _batches(rank: int, step: int, microbatches: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    for _ in range(microbatches):
        x = torch.randn(SEQ, 1, HIDDEN, generator=g)
        x[..., 0] = 1.0  # the feature the skewed router weight reads
        yield x.requires_grad_(True)  # as an embedding's output would


def _forward_step(data_iterator, model):
    output = model(next(data_iterator))

    def loss_func(output_tensor):
        loss = output_tensor.pow(2).mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _worker(rank, world, out_dir, layers, experts, topk, microbatches, steps, profile_steps, hot_expert, skew):
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same dense (router) weights on every rank, as Megatron's init gives
    out = Path(out_dir)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    import pptrace

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    truth = Truth(rank)
    _moe_on_cpu(truth)
    config = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=1, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=world, use_cpu_initialization=True, add_bias_linear=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )
    model = _build_model(config, layers, truth, hot_expert, skew)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    forward_backward = get_forward_backward_func()

    def train_step(step):
        optimizer.zero_grad()
        forward_backward(forward_step_func=_forward_step, data_iterator=_batches(rank, step, microbatches),
                         model=model, num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=1,
                         forward_only=False)
        # Megatron's clip_grad_norm closes every step with an all-reduce over all ranks
        norm = torch.stack([p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]).sum()
        dist.all_reduce(norm)
        optimizer.step()

    with pptrace.profile(out, steps=profile_steps) as prof:
        for step in range(steps):
            truth.step = step
            start_ns = time.time_ns()
            train_step(step)
            truth.steps.append({"step": step, "start_ns": start_ns, "end_ns": time.time_ns()})
            prof.step()
    dist.barrier()
    (out / "truth").mkdir(parents=True, exist_ok=True)
    (out / "truth" / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "ep": world, "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "layers": layers, "experts": experts, "topk": topk, "microbatches": microbatches,
        "profile_steps": profile_steps, "hot_expert": hot_expert, "skew": skew,
        "steps": truth.steps, "a2a": truth.a2a, "gathers": truth.gathers, "experts_calls": truth.experts,
    }))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run(out_dir, world: int = 2, layers: int = 2, experts: int = 4, topk: int = 2, microbatches: int = 2,
        steps: int = 3, profile_steps: str = "1-2", hot_expert: int = 0, skew: float = 3.0) -> Path:
    """Spawn ``world`` gloo ranks training Megatron's MoE layers; returns the run directory."""
    import torch.multiprocessing as mp

    import box
    from instrumented_model.train import start_method

    if world not in (2, 4):
        raise ValueError(f"world {world} must be 2 or 4 (ep = world)")
    if experts % world or not 1 <= topk <= experts:
        raise ValueError(f"experts {experts} must be a multiple of world {world} and topk {topk} in 1..experts")
    if not 0 <= hot_expert < experts:
        raise ValueError(f"hot_expert {hot_expert} must be in 0..{experts - 1}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    sys.path.insert(0, str(Path(__file__).parent))  # megatron_run, for the workers too
    with box.alone():
        mp.start_processes(_worker, args=(world, str(out), layers, experts, topk, microbatches, steps, profile_steps,
                                          hot_expert, skew), nprocs=world, join=True, start_method=start_method())
    return out




if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile-steps", default="1-2")
    parser.add_argument("--hot-expert", type=int, default=0)
    parser.add_argument("--skew", type=float, default=3.0)
    args = parser.parse_args()
    t0 = time.time()
    run(args.out_dir, args.world, args.layers, args.experts, args.topk, args.microbatches, args.steps,
        args.profile_steps, args.hot_expert, args.skew)
    print(f"wrote {args.out_dir} in {time.time() - t0:.1f}s", file=sys.stderr)
