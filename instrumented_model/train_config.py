"""The reference trainer's configuration: one validated dataclass and its command line.

Every bad combination is caught here, before any process starts, with a message that names
the bad value and says what would work.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

from pptrace.instrument import parse_steps
from pptrace.topology import Layout
from pptrace.vocab import DEFAULT_ORDER, LAYOUT_DIMS, SCHEDULES

COMPUTE_MODES = ("model", "sleep")
CP_ALGOS = ("ring", "ulysses")
DELAY_PHASES = ("fwd", "bwd")


@dataclass(frozen=True)
class Delay:
    """``--delay RANK:PHASE:MS``: MS more milliseconds in every fwd or bwd pass of RANK."""

    rank: int
    phase: str
    ms: float

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"--delay rank {self.rank} must be >= 0")
        if self.phase not in DELAY_PHASES:
            raise ValueError(f"--delay phase {self.phase!r} must be one of {DELAY_PHASES}")
        if self.ms < 0:
            raise ValueError(f"--delay ms {self.ms} must be >= 0")

    @classmethod
    def parse(cls, text: str) -> "Delay":
        parts = text.split(":")
        try:
            rank, phase, ms = parts
            return cls(int(rank), phase, float(ms))
        except ValueError as exc:
            if len(parts) == 3 and str(exc).startswith("--delay"):
                raise
            raise ValueError(f"--delay {text!r} must look like RANK:PHASE:MS, e.g. 3:fwd:20") from exc


@dataclass(frozen=True)
class TrainConfig:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = DEFAULT_ORDER
    sp: bool = False
    cp_algo: str = "ring"
    cp_overlap: bool = True
    schedule: str = "1f1b"
    vpp: int = 1
    # Megatron's overlap_p2p_comm. None: what Megatron's training scripts do, on for the
    # interleaved schedule (--no-overlap-p2p-communication turns it off), off for the others.
    overlap_p2p_comm: bool | None = None
    microbatches: int = 4
    micro_batch_size: int = 1
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    seq_len: int = 64
    vocab_size: int = 128
    steps: int = 4
    seed: int = 0
    lr: float = 0.01
    clip_grad: float = 1.0
    compute: str = "model"
    fwd_ms: float = 10.0
    bwd_ms: float = 20.0
    wgrad_ms: float = 0.0
    delays: tuple = field(default_factory=tuple)  # of Delay
    dp_overlap: bool = False
    # mixture of experts (expert_parallel.py): ep is carved out of dp x cp (Layout.ep)
    ep: int = 1
    experts: int = 0
    topk: int = 1
    moe_every: int = 1
    moe_imbalance: object = None  # expert_parallel.Imbalance
    expert_us_per_token: float = 0.0
    # each MoE layer as two halves, one's all-to-alls under the other's experts (DualPipe-style)
    ep_overlap: bool = False
    out: str | None = None
    profile_steps: str = "1-2"

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp", "vpp", "microbatches", "micro_batch_size", "layers",
                     "hidden", "heads", "seq_len", "vocab_size", "steps", "ep", "topk", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        layout = self.layout  # validates the order string
        for name, allowed in (("schedule", SCHEDULES), ("compute", COMPUTE_MODES), ("cp_algo", CP_ALGOS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is not one of {allowed}")
        for name in ("fwd_ms", "bwd_ms", "wgrad_ms", "lr", "clip_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.overlap_p2p_comm is None:  # frozen: the default is resolved once, here
            object.__setattr__(self, "overlap_p2p_comm", self.schedule == "interleaved")
        self._check_model()
        self._check_schedule()
        self._check_experts()
        for delay in self.delays:
            if not isinstance(delay, Delay):
                raise ValueError(f"delays must be Delay objects, got {delay!r}")
            if delay.rank >= layout.world_size:
                raise ValueError(
                    f"--delay rank {delay.rank} is outside the {layout.world_size} ranks of this layout"
                )
        if self.out is not None:
            first, last = parse_steps(self.profile_steps)
            if last >= self.steps:
                raise ValueError(
                    f"--profile-steps {self.profile_steps} needs steps up to {last}, but --steps is "
                    f"{self.steps} (steps count from 0): raise --steps to {last + 1}"
                )

    def _check_model(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if self.vocab_size % self.tp:
            raise ValueError(f"--vocab-size {self.vocab_size} must be divisible by --tp {self.tp}")
        if self.heads % self.tp:
            raise ValueError(f"--heads {self.heads} must be divisible by --tp {self.tp}")
        if self.sp and self.tp < 2:
            raise ValueError("--sp (sequence parallel) needs --tp > 1")
        if self.cp > 1 and self.cp_algo == "ring" and self.seq_len % (2 * self.cp):
            raise ValueError(
                f"--seq-len {self.seq_len} must be divisible by 2*cp = {2 * self.cp} for ring "
                "context parallelism (load-balanced halves)"
            )
        if self.cp > 1 and self.cp_algo == "ulysses":
            if self.seq_len % self.cp:
                raise ValueError(f"--seq-len {self.seq_len} must be divisible by --cp {self.cp}")
            if self.heads % (self.tp * self.cp):
                raise ValueError(
                    f"--heads {self.heads} must be divisible by tp*cp = {self.tp * self.cp} for ulysses"
                )
        if self.sp and (self.seq_len // self.cp) % self.tp:
            raise ValueError(
                f"--seq-len/cp = {self.seq_len // self.cp} must be divisible by --tp {self.tp} "
                "with sequence parallelism"
            )
        if self.layers % (self.pp * self.vpp):
            raise ValueError(
                f"--layers {self.layers} must be divisible by pp*vpp = {self.pp * self.vpp}"
            )

    def _check_experts(self) -> None:
        from .expert_parallel import Imbalance

        if self.experts < 0:
            raise ValueError(f"--experts must be >= 0, got {self.experts}")
        if self.ep > 1 and not self.experts:
            raise ValueError(f"--ep {self.ep} needs MoE layers: give --experts (a multiple of {self.ep})")
        if self.experts and self.experts % self.ep:
            raise ValueError(f"--experts {self.experts} must be divisible by --ep {self.ep}")
        if self.experts and self.topk > self.experts:
            raise ValueError(f"--topk {self.topk} exceeds --experts {self.experts}")
        if self.ep_overlap and self.ep < 2:
            raise ValueError(f"--ep-overlap hides the ep all-to-alls under expert compute: it needs --ep > 1, "
                             f"got --ep {self.ep}")
        if self.expert_us_per_token < 0:
            raise ValueError(f"--expert-us-per-token must be >= 0, got {self.expert_us_per_token}")
        if self.moe_imbalance is not None:
            if not isinstance(self.moe_imbalance, Imbalance):
                raise ValueError(f"moe_imbalance must be an Imbalance, got {self.moe_imbalance!r}")
            if self.compute != "sleep":
                raise ValueError("--moe-imbalance skews sleep mode's synthetic routing: it needs --compute sleep "
                                 "(the model's own router decides the real one)")
            if self.moe_imbalance.rank >= self.ep:
                raise ValueError(f"--moe-imbalance rank {self.moe_imbalance.rank} is outside the {self.ep} ep ranks")
            if self.moe_imbalance.factor > self.ep:
                raise ValueError(f"--moe-imbalance factor {self.moe_imbalance.factor:g} exceeds --ep {self.ep}: one "
                                 "rank cannot get more than every token")

    def _check_schedule(self) -> None:
        if self.schedule == "interleaved":
            if self.pp < 2 or self.vpp < 2:
                raise ValueError(
                    f"--schedule interleaved needs --pp >= 2 and --vpp >= 2, got pp={self.pp} vpp={self.vpp}"
                )
            if self.microbatches % self.pp:
                raise ValueError(
                    f"--schedule interleaved needs --microbatches ({self.microbatches}) divisible by "
                    f"--pp ({self.pp})"
                )
        elif self.vpp > 1:
            raise ValueError(f"--vpp {self.vpp} needs --schedule interleaved, got {self.schedule!r}")
        if self.overlap_p2p_comm and self.schedule != "interleaved":
            raise ValueError(f"--overlap-p2p-comm needs --schedule interleaved, got {self.schedule!r}")
        if self.schedule == "zb-h1" and self.pp < 2:
            raise ValueError("--schedule zb-h1 needs --pp >= 2 (it splits the pipeline's backward)")

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, order=self.order, ep=self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def delay_s(self, rank: int, phase: str) -> float:
        return sum(d.ms for d in self.delays if d.rank == rank and d.phase == phase) / 1000.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["delays"] = [f"{d.rank}:{d.phase}:{d.ms:g}" for d in self.delays]
        imb = self.moe_imbalance
        data["moe_imbalance"] = None if imb is None else f"{imb.rank}:{imb.factor:g}"
        return data


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    ap = argparse.ArgumentParser(
        prog="python -m instrumented_model.train",
        description="Reference Megatron-style trainer (TP/SP, CP, PP, DP, EP) instrumented with pptrace.",
    )
    for dim in LAYOUT_DIMS:
        ap.add_argument(f"--{dim}", type=int, default=getattr(d, dim), help=f"{dim} size")
    ap.add_argument("--order", default=d.order, help="rank order, fastest first (Megatron's)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    ap.add_argument("--cp-algo", default=d.cp_algo, choices=CP_ALGOS)
    ap.add_argument("--no-cp-overlap", dest="cp_overlap", action="store_false")
    ap.add_argument("--schedule", default=d.schedule, choices=SCHEDULES)
    ap.add_argument("--vpp", type=int, default=d.vpp, help="virtual chunks per stage (interleaved)")
    ap.add_argument("--overlap-p2p-comm", action=argparse.BooleanOptionalAction, default=None,
                    help="interleaved: post each exchange after its pass and wait right before use (Megatron's "
                         "overlap_p2p_comm, on by default there as in Megatron's training scripts); "
                         "--no-overlap-p2p-comm runs Megatron's blocking four-way exchanges")
    ap.add_argument("--microbatches", type=int, default=d.microbatches)
    ap.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    for name in ("layers", "hidden", "heads", "seq_len", "vocab_size", "steps", "seed"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--clip-grad", type=float, default=d.clip_grad)
    ap.add_argument("--compute", default=d.compute, choices=COMPUTE_MODES,
                    help="model: the real GPT; sleep: fixed sleeps per pass (known timings)")
    ap.add_argument("--fwd-ms", type=float, default=d.fwd_ms, help="sleep mode: forward per microbatch")
    ap.add_argument("--bwd-ms", type=float, default=d.bwd_ms, help="sleep mode: input-grad backward")
    ap.add_argument("--wgrad-ms", type=float, default=d.wgrad_ms, help="sleep mode: weight-grad backward")
    ap.add_argument("--delay", action="append", default=[], metavar="R:PHASE:MS",
                    help="add MS to rank R's fwd|bwd of every microbatch (repeatable)")
    ap.add_argument("--dp-overlap", action="store_true", help="bucketed async DP grad all-reduce")
    ap.add_argument("--ep", type=int, default=d.ep, help="expert parallelism, carved out of dp x cp")
    ap.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer in total (0: dense)")
    ap.add_argument("--topk", type=int, default=d.topk, help="experts per token")
    ap.add_argument("--moe-every", type=int, default=d.moe_every, help="every N-th layer is MoE")
    ap.add_argument("--moe-imbalance", default=None, metavar="RANK:FACTOR",
                    help="sleep mode: ep rank RANK's experts get FACTOR times the mean tokens")
    ap.add_argument("--ep-overlap", action="store_true",
                    help="cut each MoE layer's tokens in two and run one half's all-to-alls (async, on a group "
                         "of their own) under the other half's experts, DualPipe-style (needs --ep > 1)")
    ap.add_argument("--expert-us-per-token", type=float, default=d.expert_us_per_token,
                    help="sleep mode: an expert's forward per token it got (backward twice that)")
    ap.add_argument("--out", default=None, help="run directory: traces/, metrics.jsonl, run.json")
    ap.add_argument("--profile-steps", default=d.profile_steps, help="steps to trace, A-B (from 0)")
    return ap


def config_from_args(argv=None) -> TrainConfig:
    """Parse and validate; raises ValueError (one line) on a bad value or combination."""
    args = build_parser().parse_args(argv)
    values = vars(args)
    values["delays"] = tuple(Delay.parse(text) for text in values.pop("delay"))
    if values["moe_imbalance"] is not None:
        from .expert_parallel import Imbalance

        values["moe_imbalance"] = Imbalance.parse(values["moe_imbalance"])
    return TrainConfig(**values)
