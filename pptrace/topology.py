"""Rank <-> parallel coordinates, Megatron-style.

``order`` lists the dimensions from fastest-varying to slowest, as Megatron-Core's
``RankGenerator`` does: with the default ``tp-cp-dp-pp``,
``rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))``.
"""
from __future__ import annotations

from collections.abc import Mapping

from dataclasses import dataclass
from typing import NamedTuple

from .vocab import DEFAULT_ORDER, LAYOUT_DIMS


class Coords(NamedTuple):
    tp: int
    cp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = DEFAULT_ORDER
    #: expert parallelism, carved out of the dp x cp ranks as Megatron-Core does (it adds no
    #: ranks): the ep group is ``ep`` consecutive ranks of the combined cp-then-dp index
    #: (same tp and pp), the expert-data-parallel group (``edp``) the ranks one ep group apart
    ep: int = 1

    def __post_init__(self):
        for dim in (*LAYOUT_DIMS, "ep"):
            size = getattr(self, dim)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Layout.{dim} must be a positive integer, got {size!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"Layout.ep {self.ep} must divide dp*cp = {self.dp * self.cp}: expert parallelism is "
                "carved out of the data-parallel (and context-parallel) ranks"
            )
        # Megatron's order strings also name ep; pptrace's dense layout has ep=1, so drop it.
        dims = [d for d in str(self.order).split("-") if d != "ep"]
        if sorted(dims) != sorted(LAYOUT_DIMS):
            raise ValueError(
                f"Layout.order {self.order!r} must be a '-'-joined permutation of tp, cp, dp, pp "
                "(e.g. 'tp-cp-dp-pp')"
            )
        object.__setattr__(self, "order", "-".join(dims))

    # -- sizes ----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def size(self, dim: str) -> int:
        if dim == "ep":
            return self.ep
        if dim == "edp":
            return self.dp * self.cp // self.ep
        if dim not in LAYOUT_DIMS:
            raise ValueError(f"unknown parallel dimension {dim!r}; expected one of {(*LAYOUT_DIMS, 'ep', 'edp')}")
        return getattr(self, dim)

    def _strides(self) -> dict:
        strides, stride = {}, 1
        for dim in self.order.split("-"):
            strides[dim] = stride
            stride *= getattr(self, dim)
        return strides

    # -- rank <-> coordinates -------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size} of {self}")

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        strides = self._strides()
        return Coords(**{d: (rank // strides[d]) % getattr(self, d) for d in LAYOUT_DIMS})

    def rank(self, tp: int = 0, cp: int = 0, pp: int = 0, dp: int = 0) -> int:
        coords = dict(tp=tp, cp=cp, pp=pp, dp=dp)
        for dim, value in coords.items():
            if not 0 <= value < getattr(self, dim):
                raise ValueError(f"{dim} coordinate {value} outside 0..{getattr(self, dim) - 1}")
        strides = self._strides()
        return sum(coords[d] * strides[d] for d in LAYOUT_DIMS)

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(ep rank, expert-data-parallel rank) of ``rank``: its combined dp x cp index
        ``cp + cp_size * dp`` split as ``ep_rank + ep * edp_rank`` (Megatron's expert rank
        generator, order tp-ep-dp-pp over the same ranks)."""
        c = self.coords(rank)
        j = c.cp + self.cp * c.dp
        return j % self.ep, j // self.ep

    def _expert_rank(self, here: dict, ep_rank: int, edp_rank: int) -> int:
        j = ep_rank + self.ep * edp_rank
        return self.rank(**{**here, "cp": j % self.cp, "dp": j // self.cp})

    # -- groups ---------------------------------------------------------------------------
    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``dim`` (a layout dim, ``ep`` or ``edp``),
        ordered by their ``dim`` coordinate."""
        here = self.coords(rank)._asdict()
        if dim in ("ep", "edp"):
            ep_rank, edp_rank = self.expert_coords(rank)
            if dim == "ep":
                return [self._expert_rank(here, i, edp_rank) for i in range(self.ep)]
            return [self._expert_rank(here, ep_rank, i) for i in range(self.size("edp"))]
        return [self.rank(**{**here, dim: i}) for i in range(self.size(dim))]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``, ordered by their lowest rank."""
        seen, out = set(), []
        for rank in range(self.world_size):
            if rank not in seen:
                group = self.group_ranks(dim, rank)
                seen.update(group)
                out.append(group)
        return out

    def pipeline_next_rank(self, rank: int, wrap: bool = False) -> int | None:
        """The next stage's rank; None on the last stage unless ``wrap`` (interleaved ring)."""
        group, stage = self.group_ranks("pp", rank), self.coords(rank).pp
        if stage + 1 < self.pp:
            return group[stage + 1]
        return group[0] if wrap else None

    def pipeline_prev_rank(self, rank: int, wrap: bool = False) -> int | None:
        group, stage = self.group_ranks("pp", rank), self.coords(rank).pp
        if stage > 0:
            return group[stage - 1]
        return group[-1] if wrap else None

    # -- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict:
        # ep only where there is some: a dense run's metadata stays as it always was
        extra = {"ep": self.ep} if self.ep > 1 else {}
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "order": self.order, **extra}

    @classmethod
    def from_dict(cls, data: dict) -> "Layout":
        if not isinstance(data, Mapping):
            raise ValueError(f"not a layout: {data!r}")
        return cls(**{k: data[k] for k in (*LAYOUT_DIMS, "order", "ep") if k in data})

    def describe(self, rank: int) -> str:
        c = self.coords(rank)
        parts = [f"{d}{getattr(c, d)}" for d in ("pp", "tp", "cp", "dp") if getattr(self, d) > 1]
        if self.ep > 1:
            parts.append(f"ep{self.expert_coords(rank)[0]}")
        return " ".join(parts) or "single"

    def label(self, rank: int) -> str:
        """How a rank is named on screen: "rank 3 · pp1 tp1" (a rank past the layout: "rank 9")."""
        return f"rank {rank} · {self.describe(rank)}" if rank < self.world_size else f"rank {rank}"
