"""The work a pipeline stage does per (microbatch, chunk): the real model or fixed sleeps.

Both implement ``pipeline_parallel.StageCompute``. Injected delays (``--delay R:PHASE:MS``)
are added inside the pass, so they show up as a slower compute range: a straggler of known
size. Sleep times and delays are per microbatch per stage, split evenly over the v chunks.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


# A plain sleep on this kind of VM overshoots by 0.1-2 ms (timer slack, waking an idle vCPU),
# and the overshoot varies from pass to pass: the pipeline then runs at the pace of its
# slowest passes instead of the flags'. Sleeping to just short of the deadline and yielding
# the CPU until it passes cuts the spread: on a quiet 2-core box, 4 sleeping stages measure
# a 10 ms pass (profiler ranges included) at median +0.2 ms, 90th percentile +0.45 ms.
_SPIN_S = 0.0015


def _sleep(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    if seconds > _SPIN_S:
        time.sleep(seconds - _SPIN_S)
    while time.perf_counter() < deadline:
        os.sched_yield()


@dataclass
class SleepCompute:
    """Fixed sleeps instead of compute; the tensors passed on are real zeros of the activation
    shape so that p2p moves real bytes. Sleeping ranks leave the CPU free, which is what lets
    a 2-core box run 4+ stages with step times that follow the schedule's theory."""

    shape: tuple  # (s_part, b, h)
    pp_rank: int
    pp_size: int
    vpp: int = 1
    fwd_s: float = 0.010
    bwd_s: float = 0.020  # input-grad part of the backward
    wgrad_s: float = 0.0  # weight-grad part
    fwd_delay_s: float = 0.0
    bwd_delay_s: float = 0.0
    device: torch.device = torch.device("cpu")
    moe: object = None  # expert_parallel.SleepMoE: the ep exchanges and expert sleeps of a pass

    def _is_first_virtual(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def _experts(self, mb, chunk, phase) -> None:
        if self.moe is not None:
            self.moe.run(mb, chunk, phase, _sleep)

    def _is_last_virtual(self, chunk: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and chunk == self.vpp - 1

    def forward(self, mb, chunk, input_tensor):
        _sleep((self.fwd_s + self.fwd_delay_s) / self.vpp)
        self._experts(mb, chunk, "fwd")
        return None if self._is_last_virtual(chunk) else torch.zeros(self.shape, device=self.device)

    def backward(self, mb, chunk, output_grad):
        # 1F1B-style: B and W back to back inside one compute:bwd range.
        self._experts(mb, chunk, "bwd")
        _sleep((self.bwd_s + self.bwd_delay_s + self.wgrad_s) / self.vpp)
        return None if self._is_first_virtual(chunk) else torch.zeros(self.shape, device=self.device)

    def backward_input(self, mb, chunk, output_grad):
        # the experts' backward feeds the input grad: B's, on the critical path
        self._experts(mb, chunk, "bwd")
        _sleep((self.bwd_s + self.bwd_delay_s) / self.vpp)
        return None if self._is_first_virtual(chunk) else torch.zeros(self.shape, device=self.device)

    def backward_weight(self, mb, chunk):
        _sleep(self.wgrad_s / self.vpp)


@dataclass
class ModelCompute:
    """Real forward/backward through this rank's model chunks for one training step.

    The last virtual stage's chunk returns the SUM of its local token cross-entropy; it is
    scaled by ``loss_scale`` = 1 / (seq_len * micro_batch_size * num_microbatches * dp) before
    backprop (grads are then SUM-reduced over dp x cp), and its unscaled value accumulates in
    ``loss_sum`` for reporting.
    """

    chunks: list
    get_batch: Callable  # mb -> (tokens, labels)
    is_first_stage: bool
    is_last_stage: bool
    loss_scale: float
    fwd_delay_s: float = 0.0
    bwd_delay_s: float = 0.0
    # The pass that produces the step's last weight grads (the last "B", or "W" in ZB-H1):
    # an overlapped DP reducer is armed just before it (earlier passes only accumulate).
    arm_reducer_at: Optional[tuple] = None  # (mb, chunk)
    reducer: object = None
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    _saved: dict = field(default_factory=dict)  # (chunk, mb) -> (input or None, output)
    _pending_w: dict = field(default_factory=dict)  # (chunk, mb) -> (output, grad)

    @property
    def vpp(self) -> int:
        return len(self.chunks)

    def _is_first_virtual(self, chunk: int) -> bool:
        return self.is_first_stage and chunk == 0

    def _is_last_virtual(self, chunk: int) -> bool:
        return self.is_last_stage and chunk == self.vpp - 1

    def _maybe_arm(self, mb: int, chunk: int) -> None:
        if self.reducer is not None and (mb, chunk) == self.arm_reducer_at:
            self.reducer.enable(True)

    def forward(self, mb, chunk, input_tensor):
        if self.fwd_delay_s:
            _sleep(self.fwd_delay_s / self.vpp)
        first, last = self._is_first_virtual(chunk), self._is_last_virtual(chunk)
        tokens, labels = self.get_batch(mb) if (first or last) else (None, None)
        if first:
            inp, x = None, tokens  # (b, s_local) token ids: nothing to differentiate
        else:
            # The received buffer becomes a leaf whose .grad is what we send back.
            inp = x = input_tensor.requires_grad_()  # (s_part, b, h)
        out = self.chunks[chunk](x, labels=labels if last else None)
        if last:
            self.loss_sum = self.loss_sum + out.detach()
            out = out * self.loss_scale
        self._saved[(chunk, mb)] = (inp, out)
        return None if last else out

    def backward(self, mb, chunk, output_grad):
        if self.bwd_delay_s:
            _sleep(self.bwd_delay_s / self.vpp)
        inp, out = self._saved.pop((chunk, mb))
        self._maybe_arm(mb, chunk)
        torch.autograd.backward(out, grad_tensors=output_grad)
        return None if inp is None else inp.grad

    def backward_input(self, mb, chunk, output_grad):
        """ZB-H1's B: only the grad of the stage input (the critical path); the graph is kept
        for W. The first virtual stage has no input grad to produce, so its B is empty."""
        if self.bwd_delay_s:
            _sleep(self.bwd_delay_s / self.vpp)
        inp, out = self._saved.pop((chunk, mb))
        self._pending_w[(chunk, mb)] = (out, output_grad)
        if inp is None:
            return None
        torch.autograd.backward(out, grad_tensors=output_grad, inputs=[inp], retain_graph=True)
        return inp.grad

    def backward_weight(self, mb, chunk):
        """ZB-H1's W: the parameter grads, from the graph B kept (correctness over speed: it
        re-walks the shared part of the graph)."""
        out, output_grad = self._pending_w.pop((chunk, mb))
        params = [p for p in self.chunks[chunk].parameters() if p.requires_grad]
        self._maybe_arm(mb, chunk)
        torch.autograd.backward(out, grad_tensors=output_grad, inputs=params)
