"""A small GPT split Megatron-style over tp (+SP), cp and pp, with MoE layers over ep.

Activations are sequence-first, (s, b, h), like Megatron: sequence parallelism and context
parallelism both cut the first dimension. The word embedding and the LM head are separate
parameters (untied), so there is no embedding-gradient all-reduce between the first and the
last pipeline stage.

Every parameter is generated UNSHARDED from a generator seeded by (config.seed, its global
name, e.g. ``layers.3.mlp.fc1.weight``) and then cut to this rank's shard, so any layout
starts from the same weights as one process and computes the same loss and gradients.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .context_parallel import core_attention
from .data import cp_positions
from .expert_parallel import MoELayer
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_shape,
    shard_full_tensor,
    vocab_parallel_cross_entropy,
)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    mlp_ratio: int = 4
    seed: int = 1234
    #: mixture of experts (expert_parallel.py): 0 = dense; else every ``moe_every``-th layer's
    #: MLP is ``experts`` experts, each token routed to ``topk`` of them
    experts: int = 0
    topk: int = 1
    moe_every: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers", "mlp_ratio", "topk", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.experts, int) or self.experts < 0:
            raise ValueError(f"GPTConfig.experts must be a non-negative integer, got {self.experts!r}")
        if self.experts and self.topk > self.experts:
            raise ValueError(f"GPTConfig.topk={self.topk} exceeds experts={self.experts}")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig.hidden={self.hidden} is not divisible by heads={self.heads}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"GPTConfig.seed must be a non-negative integer, got {self.seed!r}")


def is_moe_layer(config: GPTConfig, layer: int) -> bool:
    """Layers moe_every-1, 2*moe_every-1, ... are MoE (all of them for moe_every = 1)."""
    return config.experts > 0 and (layer + 1) % config.moe_every == 0


def check_model_parallel(config: GPTConfig, pstate) -> None:
    """Raise ValueError naming the first size that does not split over the layout."""
    tp, cp = pstate.tp_size, pstate.cp_size
    checks = [
        (pstate.ep_size == 1 or (config.experts and config.experts % pstate.ep_size == 0),
         f"experts={config.experts} not divisible by ep={pstate.ep_size}"),
        (config.vocab_size % tp == 0, f"vocab_size={config.vocab_size} not divisible by tp={tp}"),
        (config.heads % tp == 0, f"heads={config.heads} not divisible by tp={tp}"),
        (cp == 1 or config.seq_len % (2 * cp) == 0,
         f"seq_len={config.seq_len} not divisible by 2*cp={2 * cp} (load-balanced context parallelism)"),
        (not pstate.sequence_parallel or (config.seq_len // cp) % tp == 0,
         f"seq_len/cp={config.seq_len // cp} not divisible by tp={tp} (sequence parallelism)"),
        (cp == 1 or pstate.cp_algo != "ulysses" or (config.heads // tp) % cp == 0,
         f"heads/tp={config.heads // tp} not divisible by cp={cp} (Ulysses)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _layer_norm(config, pstate) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.hidden, device=pstate.device)
    for param in norm.parameters():
        param.tensor_model_parallel = False
        # Under SP each tp rank normalises only its sequence slice: partial gradients.
        param.sequence_parallel = pstate.sequence_parallel
    return norm


class Embedding(nn.Module):
    """Vocab-parallel word embedding + learned absolute positions of the ORIGINAL token
    positions (under CP a rank holds two non-adjacent chunks)."""

    def __init__(self, config, pstate):
        super().__init__()
        self.config, self.pstate = config, pstate
        self.word = VocabParallelEmbedding(config.vocab_size, config.hidden, pstate)
        self.position_weight = nn.Parameter(torch.empty(config.seq_len, config.hidden, device=pstate.device))
        self.position_weight.tensor_model_parallel = False
        self.position_weight.sequence_parallel = pstate.sequence_parallel

    def forward(self, ids):
        x = self.word(ids)  # (s_part, b, h)
        ps = self.pstate
        positions = cp_positions(self.config.seq_len, ps.cp_size, ps.cp_rank)
        if ps.sequence_parallel:
            positions = positions.chunk(ps.tp_size)[ps.tp_rank]
        return x + self.position_weight[positions.to(x.device)].unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, config, pstate, layer):
        super().__init__()
        self.pstate, self.layer = pstate, layer
        self.heads_local = config.heads // pstate.tp_size
        self.head_dim = config.hidden // config.heads
        # stride=3: the fused weight is [q; k; v] and each rank keeps its heads of all three.
        self.qkv = ColumnParallelLinear(config.hidden, 3 * config.hidden, pstate, layer, stride=3)
        self.proj = RowParallelLinear(config.hidden, config.hidden, pstate, layer)

    def forward(self, x):
        qkv = self.qkv(x)  # (s, b, 3 * n * d)
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, 3, self.heads_local, self.head_dim).permute(2, 1, 3, 0, 4)  # 3 x (b, n, s, d)
        out = core_attention(q, k, v, self.pstate, self.layer)  # (b, n, s, d)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)  # (s, b, n * d)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, config, pstate, layer):
        super().__init__()
        inner = config.mlp_ratio * config.hidden
        self.fc1 = ColumnParallelLinear(config.hidden, inner, pstate, layer)
        self.fc2 = RowParallelLinear(inner, config.hidden, pstate, layer)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, pstate, layer):
        super().__init__()
        self.ln1 = _layer_norm(config, pstate)
        self.attn = Attention(config, pstate, layer)
        self.ln2 = _layer_norm(config, pstate)
        if is_moe_layer(config, layer):
            self.moe = MoELayer(config, pstate, layer)
        else:
            self.mlp = MLP(config, pstate, layer)

    def forward(self, x):  # (s_part, b, h) -> (s_part, b, h)
        x = x + self.attn(self.ln1(x))
        return x + (self.moe if hasattr(self, "moe") else self.mlp)(self.ln2(x))


def _full_init(name: str, shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    noise = torch.randn(shape, generator=generator)
    # 1-D ".weight" is a LayerNorm gain; random (not 1) so its gradient check means something.
    if len(shape) == 1 and name.endswith(".weight"):
        return 1.0 + 0.1 * noise
    return 0.02 * noise


class GPTChunk(nn.Module):
    """One (virtual) pipeline chunk: a contiguous range of decoder layers, plus the embedding
    on the first chunk (``pre_process``) and the final norm, LM head and loss on the last
    (``post_process``)."""

    def __init__(self, config, pstate, layer_ids: list[int], pre_process: bool, post_process: bool):
        super().__init__()
        check_model_parallel(config, pstate)
        self.config, self.pstate = config, pstate
        self.layer_ids = list(layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embedding = Embedding(config, pstate)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, pstate, i) for i in layer_ids})
        if post_process:
            self.final_ln = _layer_norm(config, pstate)
            self.head = ColumnParallelLinear(config.hidden, config.vocab_size, pstate, -1, bias=False)
        self._init_parameters()

    @torch.no_grad()
    def _init_parameters(self):
        ps = self.pstate
        for name, param in self.named_parameters():
            full = _full_init(name, full_shape(param), self.config.seed)
            if getattr(param, "tensor_model_parallel", False):
                full = shard_full_tensor(full, param.partition_dim, param.partition_stride, ps.tp_rank, ps.tp_size)
            param.copy_(full)

    def forward(self, x, labels=None):
        """pre_process: x = token ids (b, s_local); else hidden states (s_part, b, h).
        Returns the SUM of this rank's token cross-entropies on the last chunk, else (s_part, b, h)."""
        if self.pre_process:
            x = self.embedding(x)
        for layer in self.layers.values():
            x = layer(x)
        if not self.post_process:
            return x
        if labels is None:
            raise ValueError("the last pipeline chunk needs labels to compute the loss")
        logits = self.head(self.final_ln(x))  # (s_local, b, vocab / tp)
        return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pstate).sum()


def layers_for_chunk(config, pp_size: int, pp_rank: int, vpp: int, chunk: int) -> list[int]:
    """Megatron's interleaved assignment: chunk k on rank r holds L/(p*v) layers starting at
    k*L/v + r*L/(p*v); vpp=1 gives contiguous blocks."""
    if config.layers % (pp_size * vpp):
        raise ValueError(f"layers={config.layers} is not divisible by pp*vpp={pp_size}*{vpp}")
    if not (0 <= pp_rank < pp_size and 0 <= chunk < vpp):
        raise ValueError(f"pp_rank={pp_rank} / chunk={chunk} outside pp={pp_size} / vpp={vpp}")
    per_chunk = config.layers // (pp_size * vpp)
    start = chunk * config.layers // vpp + pp_rank * per_chunk
    return list(range(start, start + per_chunk))


def build_model_chunks(config, pstate, vpp: int = 1) -> list[GPTChunk]:
    """This rank's model chunks, in virtual-stage order."""
    if vpp < 1:
        raise ValueError(f"vpp must be >= 1, got {vpp}")
    return [
        GPTChunk(
            config,
            pstate,
            layers_for_chunk(config, pstate.pp_size, pstate.pp_rank, vpp, chunk),
            pre_process=pstate.is_first_stage and chunk == 0,
            post_process=pstate.is_last_stage and chunk == vpp - 1,
        )
        for chunk in range(vpp)
    ]


def activation_shape(config, pstate, micro_batch_size: int) -> tuple[int, int, int]:
    """Shape of the hidden states pipeline stages exchange: (s_part, b, h)."""
    s_local = config.seq_len // pstate.cp_size
    s_part = s_local // pstate.tp_size if pstate.sequence_parallel else s_local
    return (s_part, micro_batch_size, config.hidden)


def num_local_tokens(config, pstate, micro_batch_size: int) -> int:
    """Tokens whose loss this rank sums for one microbatch."""
    return (config.seq_len // pstate.cp_size) * micro_batch_size
