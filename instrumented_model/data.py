"""Deterministic synthetic token batches (no downloads), sliced the way Megatron slices them.

A step's global batch is ``(dp * num_microbatches * micro_batch_size, seq_len + 1)`` random
tokens drawn from ``(config.seed, step)``. Data-parallel rank d, microbatch m takes row block
``d * num_microbatches + m``, so one process with ``num_microbatches = dp * M`` sees the same
rows in the same order as the whole data-parallel group. Context parallelism then keeps two
of ``2 * cp`` sequence chunks per rank (Megatron's ``get_batch_on_this_cp_rank``).
"""
from __future__ import annotations

import torch


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, ...]:
    """Load balancing for causal attention: rank i keeps chunks i and 2cp-1-i, so every rank
    has as many early (cheap) as late (expensive) query positions."""
    if cp_size == 1:
        return (0,)
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Original token positions (s_local,) held by ``cp_rank``, in local order."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2*cp={2 * cp_size}")
    chunks = torch.arange(seq_len).chunk(2 * cp_size if cp_size > 1 else 1)
    return torch.cat([chunks[i] for i in cp_chunk_ids(cp_size, cp_rank)])


def get_microbatch(config, pstate, step: int, mb: int, micro_batch_size: int, num_microbatches: int):
    """(tokens, labels), both (micro_batch_size, seq_len / cp) int64 on ``pstate.device``."""
    if not 0 <= mb < num_microbatches:
        raise ValueError(f"microbatch {mb} outside 0..{num_microbatches - 1}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    rows = pstate.dp_size * num_microbatches * micro_batch_size
    batch = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=generator)
    first = (pstate.dp_rank * num_microbatches + mb) * micro_batch_size
    block = batch[first : first + micro_batch_size]  # (b, s + 1)
    tokens, labels = block[:, :-1], block[:, 1:]
    keep = cp_positions(config.seq_len, pstate.cp_size, pstate.cp_rank)
    return (
        tokens[:, keep].contiguous().to(pstate.device),
        labels[:, keep].contiguous().to(pstate.device),
    )
