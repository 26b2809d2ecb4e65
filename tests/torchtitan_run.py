"""torchtitan 0.3.0's own ``Trainer`` on CPU/gloo with PP=2, with stages that sleep known times.

``run(out, [("1F1B", "pptrace"), ("Interleaved1F1B", "titan"), ...])`` spawns 2 gloo ranks
(file:// rendezvous, OMP_NUM_THREADS=1) that each build and train one Trainer per
(schedule, mode), one after another in the same processes (torchtitan's import costs ~10 s
a process on a 2-core box; paid once), with torchtitan's llama3 ``debugmodel`` (6 layers,
dim 256, its ChunkedLossWrapper loss), ``pipeline_parallel_degree=2``, 8 microbatches of one
sample (``local_batch_size=8``, ``pipeline_parallel_microbatch_size=1``). Each writes
``out/<schedule>-<mode>/``:

- ``mode="pptrace"``: ``pptrace.profile(dir, steps=profile_steps)`` stands where torchtitan's
  profiler stands: the loop of ``Trainer.train()`` runs inside what ``config.profiler.build()``
  returns, and steps it every iteration, so the builder is swapped for one returning
  pptrace's context (nothing else: no layout, schedule or microbatches given) ->
  ``dir/traces/rank{r}.json.gz``.
- ``mode="titan"``: torchtitan's own profiler (``profiler.enable_profiling``, its
  ``profile_freq`` / ``profiler_warmup`` / ``profiler_active`` set to record the same steps)
  -> ``dir/profiling/traces/iteration_<N>/rank{r}_trace.json.gz``, a plain torch.profiler trace
  (``record_shapes=True``, as torchtitan sets it).
- ``mode="none"``: no trace.

and ``dir/truth/rank{r}.json``, the ground truth, in the format of tests/pipelining_run.py
(so tests/truth_checks.py reads it): per step its start/end around ``Trainer.train_step``,
``pipeline_start`` / ``pipeline_end`` around the ``pp_schedule.step`` call, ``reduce_start`` /
``reduce_end`` around the grad-norm all-reduce over the pp group (``clip_grad_norm_``), every
pass as torch's own ``_PipelineStageBase.forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` ran it (``op`` F|B|I|W, global ``stage``, local ``chunk``,
``mb``) with the sleeps inside it, every loss call of the last stage (torch's
``_PipelineSchedule._maybe_compute_loss``: torchtitan's ChunkedLossWrapper runs the output head,
cross entropy and one ``backward()`` per sequence chunk there) in ``losses``, and every
``_batch_p2p`` / ``_wait_batch_p2p`` call in ``p2p``. These wrappers are installed after
pptrace's patches, so each logged span holds pptrace's range of the same call. Times are
``*_ns`` (perf_counter) and ``*_epoch_ns`` (time_ns, comparable with trace times). Each pass
and loss call is timed twice: its span from outside pptrace's patch, and ``inner_start`` /
``inner_end`` from a wrapper installed before pptrace's (so inside its range), which lets a
check tell pptrace's hook, and whatever the box did while it ran (a 10 ms stall there was
seen on the shared 2-core box), from the pass.

Steps are numbered from 0 (torchtitan's ``step`` minus 1), as pptrace and torch.profiler
number them (``ProfilerStep#N``).

Sleep model: a forward hook on each stage's module sleeps ``fwd_ms`` at the end of its forward
and routes the output through an identity autograd Function whose backward sleeps ``bwd_ms``
(so every forward_one_chunk and backward_one_chunk of every stage holds one known sleep); a
forward pre-hook on the last stage's ``lm_head`` sleeps ``loss_ms / num_chunks`` per call (the
loss wrapper calls it once per chunk), so each loss call holds ``loss_ms``. Each sleep runs in
a ``record_function("harness_sleep_<kind>")`` range, so traces show it as an op. torchtitan's
model code and torch's schedule code run unchanged; the sleeps come on top of the model's real
compute, which is in the truth's spans.

Stand-ins (this machine: torch 2.13.0 CPU, no triton, no network), none in schedule code:

- **triton**: torchtitan imports it at module level (``distributed/minimal_async_ep/kernels.py``,
  its MoE all-to-all kernels, never run here). A stub module is put in ``sys.modules`` only
  after torch has looked for triton and cached its absence (``has_triton_package``) and the
  torch modules that probe for it are imported, and removed once torchtitan is imported, so
  torch keeps its no-triton paths.
- **CPU device**: on a CPU-only torch, torchtitan's ``tools.utils`` picks ``device_type =
  "cuda"`` and ``torch.cuda`` as its device module (memory monitor, ``set_device``,
  ``synchronize``); both are set to the CPU before the rest of torchtitan imports them.
- **set_timeout**: ``Trainer.train`` calls ``torch.distributed.set_timeout`` after the first
  step, which torch 2.13 does not have; aliased to ``distributed_c10d._set_pg_timeout``.
- **schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=)**: torchtitan passes pre-split
  microbatches, which torch 2.13's ``step(*args, target=, **kwargs)`` does not take (it would
  treat them as model kwargs). The shim on ``PipelineScheduleSingle.step`` /
  ``PipelineScheduleMulti.step`` (installed before pptrace's patches, so pptrace sees the
  call) hands torch's step the microbatches through the schedule object's ``_split_inputs``
  (this call only) and the targets concatenated (torch splits them back into the same 8).
- **tokenizer**: a local word-level ``tokenizer.json`` + ``tokenizer_config.json`` (BOS/EOS)
  written with the ``tokenizers`` package, vocabulary under the model's 2048.
- **dataset**: a local text dataset (synthetic sentences, a ``datasets.Dataset`` in memory)
  registered in torchtitan's ``DATASETS`` table; no download.
- **attention on CPU**: the debug model's attention is FlexAttention, whose backward torch
  refuses on CPU (``_validate_device``: "does not support backward on CPU"), and whose eager
  path, with that check lifted, costs ~85 ms a call here (it traces its graphs each call).
  ``FlexAttention._compiled_flex_attn`` (the class's ``torch.compile(flex_attention)``) is
  replaced by the dense equivalent: the BlockMask's own ``mask_mod`` made a dense mask
  (torch's ``create_mask``), masked softmax attention in plain autograd ops (equal to
  flex_attention's output to 4e-7). ``torch.compile`` is off (``TORCHDYNAMO_DISABLE=1``):
  torchtitan also compiles ``create_block_mask`` (inductor's C++ builds on CPU); eager builds
  the same BlockMask.

    python tests/torchtitan_run.py OUT [--schedule 1F1B] [--mode pptrace]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import pipelining_run
from pipelining_run import now

SCHEDULES = ("1F1B", "Interleaved1F1B")
MODES = ("pptrace", "titan", "none")
#: torch's class of each torchtitan schedule name
SCHEDULE_CLASSES = {"1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B"}
WORLD = 2
MICROBATCHES = 8
LOSS_CHUNKS = 8  # ChunkedLossWrapper.Config.num_chunks (its default)


def available() -> str | None:
    """None when torchtitan 0.3.0 can run here, else why not."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        return "torchtitan is not installed (pip install torchtitan==0.3.0)"
    try:
        from importlib.metadata import version

        found = version("torchtitan")
    except Exception:  # noqa: BLE001
        found = "unknown"
    if found != "0.3.0":
        return f"torchtitan {found} installed; the harness is written against 0.3.0"
    return None


def case_dir(out, schedule: str, mode: str) -> Path:
    return Path(out) / f"{schedule}-{mode}"


# --------------------------------------------------------------------------------------
# Ground truth (the same record as tests/pipelining_run.py's)
# --------------------------------------------------------------------------------------


class Recorder(pipelining_run.Recorder):
    """pipelining_run's record, kept only between a step's begin and end (torchtitan runs
    passes outside ``train_step``: its set-up and validation), each sleep inside a range so a
    trace shows it as the op it stands for: real compute runs ops, and a bare sleep is a
    stretch without any, which pptrace's plain path books as host time between ops (not
    compute) -- the harness's doing, not torchtitan's."""

    in_step = False

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.in_step = True

    def end_step(self) -> None:
        super().end_step()
        self.in_step = False

    def open_step(self) -> dict | None:
        return self.steps[-1] if self.in_step else None

    def sleep(self, kind: str, seconds: float) -> None:
        import torch

        with torch.profiler.record_function(f"harness_sleep_{kind}"):
            super().sleep(kind, seconds)


RECORDER = Recorder()


class _Patches:
    """setattr with undo, last in first out."""

    def __init__(self):
        self._undo: list = []

    def set(self, owner, name: str, value) -> None:
        had = name in vars(owner)
        self._undo.append((owner, name, vars(owner)[name] if had else None, had))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, old, had = self._undo.pop()
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)


def _truth_wrappers(patches: _Patches) -> None:
    """The passes, the loss calls and the p2p calls timed around whatever is installed now
    (pptrace's patches when it is on): each logged span holds its range."""
    from torch.distributed.pipelining import schedules, stage

    base = stage._PipelineStageBase

    def chunk_of(st) -> int:
        mapping = st.stage_index_to_group_rank
        mine = sorted(s for s, r in mapping.items() if r == mapping[st.stage_index])
        return mine.index(st.stage_index)

    fwd = vars(base)["forward_one_chunk"]

    @functools.wraps(fwd)
    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with RECORDER.action("F", self.stage_index, chunk_of(self), fwd_chunk_id):
            return fwd(self, fwd_chunk_id, *args, **kwargs)

    bwd = vars(base)["backward_one_chunk"]

    @functools.wraps(bwd)
    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        with RECORDER.action("B" if full else "I", self.stage_index, chunk_of(self), bwd_chunk_id):
            return bwd(self, bwd_chunk_id, *args, **kwargs)

    wgt = vars(base)["backward_weight_one_chunk"]

    @functools.wraps(wgt)
    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with RECORDER.action("W", self.stage_index, chunk_of(self), bwd_chunk_id):
            return wgt(self, bwd_chunk_id, *args, **kwargs)

    loss = vars(schedules._PipelineSchedule)["_maybe_compute_loss"]

    @functools.wraps(loss)
    def maybe_compute_loss(self, st, *args, **kwargs):
        if not (st.is_last and self._loss_fn is not None):
            return loss(self, st, *args, **kwargs)
        with RECORDER.loss():
            return loss(self, st, *args, **kwargs)

    patches.set(base, "forward_one_chunk", forward_one_chunk)
    patches.set(base, "backward_one_chunk", backward_one_chunk)
    patches.set(base, "backward_weight_one_chunk", backward_weight_one_chunk)
    patches.set(schedules._PipelineSchedule, "_maybe_compute_loss", maybe_compute_loss)
    for name in ("_batch_p2p", "_wait_batch_p2p"):
        patches.set(schedules, name, RECORDER.timed_p2p(getattr(schedules, name)))


def _inner_wrappers(patches: _Patches) -> None:
    """The passes and loss calls timed again from inside whatever wraps them later (pptrace's
    patches): ``inner_start`` / ``inner_end`` of the record the outer wrapper opened."""
    from torch.distributed.pipelining import schedules, stage

    def inner(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            record = RECORDER._action
            if record is not None and "inner_start_ns" not in record:
                ns, epoch = now()
                record.update(inner_start_ns=ns, inner_start_epoch_ns=epoch)
            try:
                return fn(*args, **kwargs)
            finally:
                if record is not None and "inner_end_ns" not in record:
                    ns, epoch = now()
                    record.update(inner_end_ns=ns, inner_end_epoch_ns=epoch)
        return call

    base = stage._PipelineStageBase
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        patches.set(base, name, inner(vars(base)[name]))
    owner = schedules._PipelineSchedule
    patches.set(owner, "_maybe_compute_loss", inner(vars(owner)["_maybe_compute_loss"]))



# --------------------------------------------------------------------------------------
# Stand-ins
# --------------------------------------------------------------------------------------


class _Anything:
    """What torchtitan's triton kernel modules touch at import: decorators, dtypes, types."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key):
        return _Anything()


def _module_getattr(name):
    if name.startswith("__"):  # inspect and importlib ask for dunders: say no
        raise AttributeError(name)
    return _Anything()


def _jit(fn=None, **options):
    return (lambda f: f) if fn is None else fn


@contextlib.contextmanager
def _triton_stub():
    """A ``triton`` for torchtitan's imports only (see the module docstring)."""
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    import torch._dynamo  # noqa: F401 - these import the torch modules that probe for triton
    import torch._functorch.partitioners  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.runtime.hints  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.nn.attention.flex_attention  # noqa: F401
    import torch.utils._triton

    assert not torch.utils._triton.has_triton_package()  # cached: torch's answer stays "no"
    triton, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    triton.jit, triton.language = _jit, language
    triton.__getattr__ = language.__getattr__ = _module_getattr
    before = set(sys.modules)
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        yield
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
        # a torch module imported meanwhile that took the stub for triton would run
        # triton paths: refuse to go on rather than measure that
        for name in set(sys.modules) - before:
            if name.startswith("torch.") and any(v is triton or v is language
                                                 for v in vars(sys.modules[name]).values()):
                raise RuntimeError(f"{name} imported the triton stub")


def _cpu_device_module():
    """What torchtitan asks of its device module (torch.cuda's names), for the CPU."""
    import torch

    return types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, synchronize=lambda *a: None,
        device_count=lambda: 1, is_available=lambda: True, get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=64 << 30),
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None, memory_stats=lambda *a: {},
        memory=torch.cpu,
    )


def _import_torchtitan():
    """torchtitan's Trainer and llama3 debug config, with the CPU stand-ins in place first."""
    import torch.distributed as dist

    with _triton_stub():
        from torchtitan.tools import utils

        # The rest of torchtitan imports these names from utils: set before it does.
        utils.device_type, utils.device_module = "cpu", _cpu_device_module()
        from torchtitan.models.common.attention import FlexAttention
        from torchtitan.models.llama3.config_registry import llama3_debugmodel
        from torchtitan.trainer import Trainer
    FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    return Trainer, llama3_debugmodel


def _dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                          return_aux=None, kernel_options=None):
    """flex_attention's result for a mask-only BlockMask, in ops with a CPU backward."""
    import torch
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("the dense stand-in takes mask_mods only (llama3 uses none else)")
    batch, heads, q_len, dim = q.shape
    kv_len = k.shape[-2]
    mask = getattr(block_mask, "_dense_mask", None)  # the stage's layers share one BlockMask
    if mask is None:
        mask = create_mask(block_mask.mask_mod, batch, None, q_len, kv_len, device=q.device)
        block_mask._dense_mask = mask
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (dim ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


def _step_shim(patches: _Patches) -> None:
    """torchtitan's ``step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)`` on torch 2.13's step."""
    import inspect

    import torch
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = vars(cls)["step"]
        if "arg_mbs" in inspect.signature(original).parameters:
            continue  # a torch that takes them itself

        def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None,
                 arg_mbs=None, kwarg_mbs=None, target_mbs=None, _original=original, **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _original(self, *args, target=target, losses=losses, return_outputs=return_outputs,
                                 loss_kwargs=loss_kwargs, **kwargs)
            n = self._n_microbatches
            split = (list(arg_mbs) if arg_mbs is not None else [()] * n,
                     list(kwarg_mbs) if kwarg_mbs is not None else [{}] * n)
            if target_mbs is not None:  # torch splits it back along dim 0 into the same n
                assert len({t.shape[0] for t in target_mbs}) == 1 and len(target_mbs) == n
                target = torch.cat(target_mbs)
            self._split_inputs = lambda a, k: split
            try:
                return _original(self, target=target, losses=losses, return_outputs=return_outputs,
                                 loss_kwargs=loss_kwargs)
            finally:
                del self._split_inputs

        patches.set(cls, "step", functools.wraps(original)(step))


_WORDS = ("the pipeline sends each microbatch forward through its stages and the gradients come back "
          "in the reverse order while the other stages wait for their inputs in the bubble of the "
          "schedule one forward one backward interleaved looped virtual stage rank loss head token "
          "model layer attention feed norm embedding output data batch step time trace profile").split()


def _local_assets(where: Path) -> Path:
    """A word-level tokenizer (tokenizer.json, tokenizer_config.json) under ``where``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    where.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
         "add_eos_token": True}))
    return where


def _register_dataset(name: str) -> None:
    """A local text dataset in torchtitan's table (deterministic sentences of the words)."""
    import random

    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    rng = random.Random(0)
    texts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 80))) for _ in range(400)]
    text_datasets.DATASETS[name] = DatasetConfig(
        path=name, loader=lambda path: Dataset.from_dict({"text": texts}), sample_processor=lambda s: s["text"])


# --------------------------------------------------------------------------------------
# Sleeping stages
# --------------------------------------------------------------------------------------


def _sleep_hooks(trainer, fwd_s: float, bwd_s: float, loss_s: float) -> list:
    import torch

    class SleepBackward(torch.autograd.Function):
        """Identity whose backward sleeps: the stage's backward holds ``bwd_s``."""

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            RECORDER.sleep("bwd", bwd_s)
            return grad

    def after_forward(module, args, output):
        RECORDER.sleep("fwd", fwd_s)
        return SleepBackward.apply(output)

    handles = []
    schedule = trainer.pp_schedule
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for st in stages:
        handles.append(st.submod.register_forward_hook(after_forward))
        if st.is_last and loss_s > 0:
            head = trainer.loss_fn.lm_head
            handles.append(head.register_forward_pre_hook(
                lambda module, args: RECORDER.sleep("loss", loss_s / LOSS_CHUNKS)))
    return handles


# --------------------------------------------------------------------------------------
# One case: a Trainer built, trained and torn down
# --------------------------------------------------------------------------------------


def _steps(spec: str) -> tuple[int, int]:
    first, _, last = spec.partition("-")
    return int(first), int(last or first)


def _config(llama3_debugmodel, cfg: dict, schedule: str, mode: str, dump: Path, assets: Path):
    c = llama3_debugmodel()
    c.hf_assets_path = str(assets)
    c.dump_folder = str(dump)
    c.dataloader.dataset = cfg["dataset"]
    c.training.steps = cfg["steps"]
    c.training.seq_len = cfg["seq_len"]
    c.training.local_batch_size = MICROBATCHES
    c.training.disable_cuda_graphs = True  # torchtitan refuses CUDA graphs with PP
    c.parallelism.pipeline_parallel_degree = WORLD
    c.parallelism.pipeline_parallel_schedule = schedule
    c.parallelism.pipeline_parallel_microbatch_size = 1
    c.checkpoint.enable = False
    c.validator.enable = False
    c.metrics.log_freq = 1
    # FSDP is always applied (a no-op shard of 1) with bf16 compute by default: bf16 on this
    # CPU made each pass 2-4x slower. fp32, the model's own dtype.
    c.training.mixed_precision_param = "float32"
    # Selective AC recomputes each block in backward: real compute the sleeps do not set,
    # ~25% of each backward here. Off, as a memory setting has no part in the schedule.
    c.activation_checkpoint = None
    if mode == "titan":
        first, last = _steps(cfg["profile_steps"])
        p = c.profiler
        p.enable_profiling = True
        # torch.profiler's schedule over its step() calls, one a trainer step: wait, warmup
        # 1, then active for the profiled steps (0-based, as the trace numbers them)
        p.profiler_warmup = 1 if first >= 1 else 0
        p.profiler_active = last - first + 1
        p.profile_freq = first + p.profiler_active
        p.profiler_repeat = 1
    return c


def _case(Trainer, llama3_debugmodel, cfg: dict, schedule: str, mode: str, assets: Path) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    dump = case_dir(cfg["out"], schedule, mode)
    config = _config(llama3_debugmodel, cfg, schedule, mode, dump, assets)
    RECORDER.steps.clear()
    torch.manual_seed(0)
    trainer = config.build()
    assert isinstance(trainer, Trainer)
    hooks = _sleep_hooks(trainer, cfg["fwd_ms"] / 1e3, cfg["bwd_ms"] / 1e3, cfg["loss_ms"] / 1e3)

    # the step, the schedule call and the closing all-reduce, timed around torchtitan's own
    train_step, sched = trainer.train_step, trainer.pp_schedule

    def timed_train_step(data_iterator):
        RECORDER.begin_step(trainer.step - 1)
        try:
            return train_step(data_iterator)
        finally:
            RECORDER.end_step()

    def timed_schedule_step(*args, **kwargs):
        RECORDER.mark("pipeline_start")
        try:
            return type(sched).step(sched, *args, **kwargs)  # looked up now: pptrace's patch when on
        finally:
            RECORDER.mark("pipeline_end")

    all_reduce = dist.all_reduce

    @functools.wraps(all_reduce)
    def timed_all_reduce(*args, **kwargs):
        if not (RECORDER.in_step and "pipeline_end_ns" in RECORDER.steps[-1]):
            return all_reduce(*args, **kwargs)
        RECORDER.mark("reduce_start")
        try:
            return all_reduce(*args, **kwargs)
        finally:
            RECORDER.mark("reduce_end")

    trainer.train_step, sched.step = timed_train_step, timed_schedule_step
    patches = _Patches()
    patches.set(dist, "all_reduce", timed_all_reduce)

    # The profiler torchtitan's loop runs in, and the truth wrappers inside it (after
    # pptrace's patches, so a logged span holds pptrace's range).
    build = type(config.profiler).build
    profiler_patch = _Patches()

    @contextlib.contextmanager
    def profiled(self, **kwargs):
        truth = _Patches()
        if mode == "pptrace":
            import pptrace

            first, last = _steps(cfg["profile_steps"])
            outer = pptrace.profile(dump, steps=f"{first}-{last}")
        else:
            outer = build(self, **kwargs)
        with outer as prof:
            _truth_wrappers(truth)
            try:
                yield prof
            finally:
                truth.undo()

    profiler_patch.set(type(config.profiler), "build", profiled)
    try:
        trainer.train()
    finally:
        profiler_patch.undo()
        patches.undo()
        for h in hooks:
            h.remove()
        trainer.close()

    first, last = _steps(cfg["profile_steps"])
    for entry in RECORDER.steps:
        entry["profiled"] = first <= entry["step"] <= last
    schedule_obj = trainer.pp_schedule
    stages = list(getattr(schedule_obj, "_stages", None) or [schedule_obj._stage])
    pp_group = stages[0].group
    pp_ranks = dist.get_process_group_ranks(pp_group)
    mapping = stages[0].stage_index_to_group_rank
    order = getattr(schedule_obj, "pipeline_order", None) or {}
    with_comms = getattr(schedule_obj, "pipeline_order_with_comms", None)
    pp_rank = dist.get_rank(pp_group)
    truth = {
        "rank": rank, "world": WORLD, "pp": WORLD, "dp": 1, "vpp": len(stages), "pp_rank": pp_rank,
        "pp_ranks": pp_ranks, "schedule": SCHEDULE_CLASSES[schedule], "titan_schedule": schedule,
        "microbatches": MICROBATCHES, "mode": mode, "fwd_ms": cfg["fwd_ms"], "bwd_ms": cfg["bwd_ms"],
        "loss_ms": cfg["loss_ms"], "stages": [st.stage_index for st in stages],
        "stage_ranks": [pp_ranks[mapping[s]] for s in range(stages[0].num_stages)],
        "pipeline_order": pipelining_run.order_rows(order.get(pp_rank)),
        "pipeline_order_with_comms": pipelining_run.order_rows(with_comms.get(pp_rank), sends=True) if with_comms else None,
        "torch": torch.__version__, "steps": RECORDER.steps,
    }
    (dump / "truth").mkdir(parents=True, exist_ok=True)
    (dump / "truth" / f"rank{rank}.json").write_text(json.dumps(truth))
    dist.barrier()


def _worker(rank: int, cfg: dict, store: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCHDYNAMO_DISABLE="1", RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # torchtitan's init_distributed keeps a process group it finds (file://, not env://)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        Trainer, llama3_debugmodel = _import_torchtitan()
        _register_dataset(cfg["dataset"])
        assets = _local_assets(Path(os.path.dirname(store)) / f"assets-rank{rank}")
        shim = _Patches()
        _step_shim(shim)
        _inner_wrappers(shim)
        try:
            for schedule, mode in cfg["cases"]:
                _case(Trainer, llama3_debugmodel, cfg, schedule, mode, assets)
        finally:
            shim.undo()
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def run(out_dir, cases, *, steps: int = 3, profile_steps: str = "1-2", fwd_ms: float = 10, bwd_ms: float = 20,
        loss_ms: float = 8, seq_len: int = 16, timeout: float = 300) -> dict:
    """Spawn the 2 ranks, run every (schedule, mode) of ``cases`` in turn; -> (schedule, mode) ->
    its directory."""
    for schedule, mode in cases:
        if schedule not in SCHEDULES or mode not in MODES:
            raise ValueError(f"({schedule!r}, {mode!r}): schedules {SCHEDULES}, modes {MODES}")
    if seq_len % LOSS_CHUNKS:
        raise ValueError(f"seq_len {seq_len} must be a multiple of the loss's {LOSS_CHUNKS} chunks")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(out=str(out), cases=[list(c) for c in cases], steps=steps, profile_steps=profile_steps,
               fwd_ms=fwd_ms, bwd_ms=bwd_ms, loss_ms=loss_ms, seq_len=seq_len, dataset="pptrace_local_text")
    pipelining_run.spawn_ranks(_worker, cfg, WORLD, timeout, "torchtitan")
    return {(s, m): case_dir(out, s, m) for s, m in cases}


def titan_trace_dir(case: Path) -> Path:
    """The one ``iteration_N/`` folder torchtitan's profiler wrote for a case."""
    found = sorted((Path(case) / "profiling" / "traces").glob("iteration_*"))
    if len(found) != 1:
        raise FileNotFoundError(f"{case}: expected one iteration_N trace folder, found {found}")
    return found[0]


def load_truth(case) -> dict:
    files = sorted(Path(case, "truth").glob("rank*.json"))
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in files}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--schedule", action="append", choices=SCHEDULES)
    parser.add_argument("--mode", action="append", choices=MODES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile-steps", default="1-2")
    parser.add_argument("--fwd-ms", type=float, default=10)
    parser.add_argument("--bwd-ms", type=float, default=20)
    parser.add_argument("--loss-ms", type=float, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    a = parser.parse_args()
    t0 = time.time()
    cases = [(s, m) for s in (a.schedule or ["1F1B"]) for m in (a.mode or ["pptrace"])]
    run(a.out_dir, cases, steps=a.steps, profile_steps=a.profile_steps, fwd_ms=a.fwd_ms, bwd_ms=a.bwd_ms,
        loss_ms=a.loss_ms, seq_len=a.seq_len)
    print(f"wrote {a.out_dir} ({cases}) in {time.time() - t0:.1f}s", file=sys.stderr)
