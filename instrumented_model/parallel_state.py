"""Process groups of the reference trainer, held in an explicit ``ParallelState``.

Megatron keeps ~60 module-level ``_..._GROUP`` globals; here every function that
communicates receives the state it needs, so two layouts can coexist in one process (tests
build several in a row) and nothing is hidden.

Groups whose ``group`` is ``None`` are treated as size 1 by every communication helper.
That lets a single process without ``torch.distributed`` build the same model (the
reference the tests compare against) through :func:`single_process_state`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pptrace.topology import Coords, Layout
from pptrace.vocab import LAYOUT_DIMS

CP_ALGOS = ("ring", "ulysses")


@dataclass
class ParallelState:
    layout: Layout
    rank: int
    device: torch.device
    sequence_parallel: bool = False
    cp_algo: str = "ring"
    # ring: post the KV exchange for step i+1 before step i's attention, wait after it.
    cp_overlap: bool = True
    tp_group: Any = None
    cp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    dp_cp_group: Any = None
    # expert parallelism (Layout.ep, carved out of dp x cp): the all-to-all group, and the
    # expert-data-parallel group that sums the expert weights' gradients
    ep_group: Any = None
    edp_group: Any = None
    world_group: Any = None

    def __post_init__(self):
        if self.cp_algo not in CP_ALGOS:
            raise ValueError(f"cp_algo {self.cp_algo!r} is not one of {CP_ALGOS}")
        if self.sequence_parallel and self.layout.tp < 2:
            raise ValueError(
                f"sequence_parallel=True needs tensor parallelism (tp > 1), got tp={self.layout.tp}"
            )
        if not 0 <= self.rank < self.layout.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.layout.world_size}")

    # -- coordinates --------------------------------------------------------------------
    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[0]

    # -- global ranks of this rank's groups ---------------------------------------------
    @property
    def tp_ranks(self) -> list[int]:
        return self.layout.group_ranks("tp", self.rank)

    @property
    def cp_ranks(self) -> list[int]:
        return self.layout.group_ranks("cp", self.rank)

    @property
    def pp_ranks(self) -> list[int]:
        return self.layout.group_ranks("pp", self.rank)

    @property
    def dp_ranks(self) -> list[int]:
        return self.layout.group_ranks("dp", self.rank)

    @property
    def dp_cp_ranks(self) -> list[int]:
        return dp_cp_group_ranks(self.layout, self.rank)

    # -- pipeline -----------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int | None:
        return self.layout.pipeline_next_rank(self.rank)

    @property
    def prev_rank(self) -> int | None:
        return self.layout.pipeline_prev_rank(self.rank)

    @property
    def tp_enabled(self) -> bool:
        return self.layout.tp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.layout.cp_enabled

    @property
    def pp_enabled(self) -> bool:
        return self.layout.pp_enabled

    @property
    def dp_enabled(self) -> bool:
        return self.layout.dp_enabled


def dp_cp_group_ranks(layout: Layout, rank: int) -> list[int]:
    """Ranks that hold the same parameter shard: same tp and pp coordinate, any dp and cp."""
    here = layout.coords(rank)
    return sorted(
        layout.rank(tp=here.tp, pp=here.pp, cp=c, dp=d)
        for d in range(layout.dp)
        for c in range(layout.cp)
    )


def _local_device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _create_groups(partition: list[list[int]], rank: int, desc: str):
    # new_group is collective over the world: every rank creates every group, in the same
    # order, and keeps the one it belongs to.
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks, group_desc=desc)
        if rank in ranks:
            mine = group
    return mine


def initialize_model_parallel(
    layout: Layout,
    *,
    sequence_parallel: bool = False,
    cp_algo: str = "ring",
    cp_overlap: bool = True,
) -> ParallelState:
    """Create the tp/cp/pp/dp/dp_cp groups of ``layout``; call on every rank after
    ``dist.init_process_group``."""
    if not dist.is_initialized():
        raise ValueError("initialize_model_parallel needs torch.distributed initialised first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(
            f"layout {layout} needs {layout.world_size} ranks but the process group has {world}"
        )
    # Validate before the collective group creation so a bad option fails on every rank alike.
    state = ParallelState(
        layout=layout,
        rank=rank,
        device=_local_device(),
        sequence_parallel=sequence_parallel,
        cp_algo=cp_algo,
        cp_overlap=cp_overlap,
    )
    for dim in LAYOUT_DIMS:
        setattr(state, f"{dim}_group", _create_groups(layout.groups(dim), rank, dim))
    dp_cp = sorted({tuple(dp_cp_group_ranks(layout, r)) for r in range(world)})
    state.dp_cp_group = _create_groups([list(g) for g in dp_cp], rank, "dp_cp")
    if layout.ep > 1:
        state.ep_group = _create_groups(layout.groups("ep"), rank, "ep")
        state.edp_group = _create_groups(layout.groups("edp"), rank, "edp")
    else:  # every rank holds every expert: their replicas are the dense weights'
        state.edp_group = state.dp_cp_group
    state.world_group = dist.group.WORLD
    return state


def single_process_state(layout: Layout | None = None, **options) -> ParallelState:
    """A one-rank state with no process groups, for a reference model without
    ``torch.distributed`` (every group is size 1, so no communication happens)."""
    layout = layout or Layout()
    if layout.world_size != 1:
        raise ValueError(f"single_process_state needs a one-rank layout, got {layout}")
    return ParallelState(layout=layout, rank=0, device=torch.device("cpu"), **options)
