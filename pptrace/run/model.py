"""Run: one profiled run, the single object every analysis, what-if and export reads (built by
:func:`pptrace.run.build.load_run`, or by :meth:`Run.from_events` from an events table)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from . import align, match
from .claims import is_index
from ..sweeps import isin
from ..timeline import windows
from ..timeline.activity import activities
from ..timeline.windows import profiled_steps
from ..topology import Layout


@dataclass(frozen=True, eq=False)
class Run:
    """One profiled run, the single object every analysis, what-if and export reads.

    Frozen: analyses are pure functions of it. What several of them need (step and
    pipeline windows, per-rank activity) is derived once, on first use, and cached on the
    object (``functools.cached_property``); a run with other steps is a new Run
    (``dataclasses.replace``), with nothing stale carried over. Built by :func:`load_run`
    from trace files, or by :meth:`from_events` from an events table (tests, tools).
    """

    events: pd.DataFrame                 # aligned (raw_ns: each rank's own clock)
    layout: Layout
    ranks: tuple                         # ranks with a loaded trace
    steps: tuple                         # profiled steps the results cover
    path: Path | None = None
    meta: dict = field(default_factory=dict)   # rank -> per-rank meta (see load.load_rank)
    pairs: pd.DataFrame | None = None    # match.PAIR_COLUMNS, aligned times
    collectives: pd.DataFrame | None = None    # match.INSTANCE_COLUMNS, aligned times
    offsets: pd.DataFrame | None = None  # align.OFFSET_COLUMNS
    warnings: tuple = ()
    schedule: str | None = None
    microbatches: int | None = None
    vpp: int | None = None
    #: what pptrace inferred from a plain trace (no pptrace in the run) -> how, one line
    #: each: keys among layout, peers, p2p, passes, schedule, microbatches, vpp; {} when
    #: the traces said it all (pptrace.run.infer)
    inferred: dict = field(default_factory=dict)
    #: the ranks the caller asked for (load_run's ``ranks``); None: all of the run's
    requested: tuple | None = None
    #: GPU kernels counted as communication by name (comm_kernels.py): library -> {dim,
    #: kernels (events)}; {} when none but NCCL's ran
    comm_kernels: dict = field(default_factory=dict)

    def __post_init__(self):
        missing = {"rank", "lane_kind", "start_ns", "end_ns", "category"} - set(self.events.columns)
        if missing:
            raise ValueError(f"events table lacks columns {sorted(missing)}")
        if self.vpp is not None and self.vpp < 1:
            raise ValueError(f"vpp must be >= 1, got {self.vpp!r}")
        # lists and other sequences given by callers become tuples: a frozen run stays frozen
        for name in ("ranks", "steps", "warnings"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        if self.requested is not None:
            object.__setattr__(self, "requested", tuple(int(r) for r in self.requested))

    def raw_ns(self, events: pd.DataFrame | None = None) -> pd.DataFrame:
        """start_ns / end_ns of ``events`` (default: the run's) on each rank's own clock, as
        its trace recorded them: columns raw_start_ns, raw_end_ns on the events' index. The
        aligned time is the recorded one minus the rank's ``offsets`` (none: 0)."""
        events = self.events if events is None else events
        per_row = align.offsets_per_row(events["rank"].to_numpy(), self.offsets)
        return pd.DataFrame({"raw_start_ns": events["start_ns"].to_numpy(np.int64) + per_row,
                             "raw_end_ns": events["end_ns"].to_numpy(np.int64) + per_row}, index=events.index)

    @classmethod
    def from_events(cls, events: pd.DataFrame, layout: Layout, **kwargs) -> "Run":
        """A run of an events table built by hand (tests, or one loaded with load_rank):
        its ranks are those in the table, its steps those with a ProfilerStep range, its
        p2p pairs and collective instances matched as the loader matches them (the clocks
        are taken as they are: no alignment)."""
        ranks = tuple(sorted(int(r) for r in events["rank"].unique()))
        steps = kwargs.pop("steps", None)
        if steps is None:
            steps = profiled_steps(events)
        if kwargs.get("pairs") is None:
            kwargs["pairs"] = match.match_p2p(events)[0]
        if kwargs.get("collectives") is None:
            kwargs["collectives"] = match.match_collectives(events, layout, ranks)[0]
        return cls(events=events, layout=layout, ranks=ranks, steps=tuple(steps), **kwargs)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def v(self) -> int:
        return int(self.vpp or 1)

    @cached_property
    def missing_ranks(self) -> tuple:
        """Ranks of the layout (of those requested, when some were) without a loaded trace."""
        world = self.layout.world_size
        wanted = np.arange(world) if self.requested is None else np.asarray(self.requested, dtype=np.int64)
        wanted = wanted[(wanted >= 0) & (wanted < world)]
        return tuple(int(r) for r in np.setdiff1d(wanted, np.asarray(self.ranks, dtype=np.int64)))

    def describe(self, rank: int) -> str:
        return self.layout.label(rank)

    # -- what the traces' metadata says (contract 2) ----------------------------------------
    def _blocks(self) -> dict:
        return {int(r): m["pptrace"] for r, m in self.meta.items()
                if isinstance(m, dict) and isinstance(m.get("pptrace"), dict)}

    @cached_property
    def has_pptrace(self) -> bool:
        """Whether the traces carry the pptrace metadata block (a hand-built run: yes)."""
        return bool(self._blocks()) or not self.meta

    @cached_property
    def process_groups(self) -> dict:
        """rank -> {pg_name: {"desc", "ranks"}} from each rank's distributedInfo.pg_config."""
        out = {}
        for rank, m in self.meta.items():
            config = ((m or {}).get("distributed") or {}).get("pg_config") if isinstance(m, dict) else None
            if isinstance(config, list):
                out[int(rank)] = {
                    str(g.get("pg_name")): {"desc": g.get("pg_desc"), "ranks": g.get("ranks")}
                    for g in config if isinstance(g, dict) and g.get("pg_name") is not None
                }
        return out

    @cached_property
    def pipeline_actions(self) -> dict:
        """rank -> its recorded action order [(op, global stage, mb)] (integrations)."""
        return {r: b["pipeline_actions"] for r, b in self._blocks().items()
                if isinstance(b.get("pipeline_actions"), list) and all(map(_is_action, b["pipeline_actions"]))}

    @cached_property
    def stage_ranks(self) -> tuple | None:
        """global stage -> global rank, when an integration recorded it."""
        for _, block in sorted(self._blocks().items()):
            ranks = block.get("stage_ranks")
            if isinstance(ranks, list) and all(map(is_index, ranks)):
                return tuple(ranks)
        return None

    @cached_property
    def offsets_ns(self) -> dict:
        """rank -> the clock offset applied to its events."""
        if self.offsets is None or self.offsets.empty:
            return {}
        return dict(zip(self.offsets["rank"].astype(int).tolist(), self.offsets["offset_ns"].astype(int).tolist()))

    @cached_property
    def uncertainty_ns(self) -> dict:
        """rank -> the bound on its alignment error (0 where exact)."""
        if self.offsets is None or self.offsets.empty:
            return {}
        bound = self.offsets["uncertainty_ns"].fillna(0).astype("int64")
        return dict(zip(self.offsets["rank"].astype(int).tolist(), bound.tolist()))

    # -- derived once, used by every analysis ------------------------------------------------
    @cached_property
    def gpu_ranks(self) -> frozenset:
        """Ranks whose work ran in GPU kernels: their timeline is the GPU's."""
        ev = self.events
        kernels = isin(ev["category"], ["kernel_compute", "kernel_comm"])
        return frozenset(int(r) for r in pd.unique(ev["rank"].to_numpy()[kernels]))

    @cached_property
    def step_windows(self) -> dict:
        """(rank, step) -> (start, end) of that rank's step (windows.step_windows)."""
        return windows.step_windows(self.events, self.steps, self.gpu_ranks)

    @cached_property
    def pipeline_windows(self) -> dict:
        """step -> (start, end) of the pipeline window (windows.pipeline_windows)."""
        return windows.pipeline_windows(self.events, self.layout.pp)

    @cached_property
    def pipeline_spans(self) -> dict:
        """step -> (start, end) of the step's pipeline ops, p2p included: what a replay of
        its programs spans (windows.pipeline_windows, ``with_p2p``)."""
        return windows.pipeline_windows(self.events, self.layout.pp, with_p2p=True)

    @cached_property
    def activities(self) -> dict:
        """rank -> Activity: when it computed and when each dimension communicated."""
        return activities(self.events, None, self.layout, self.process_groups)


def _is_action(action) -> bool:
    """[op, global stage, mb] as the integrations record it."""
    return (isinstance(action, (list, tuple)) and len(action) == 3 and isinstance(action[0], str)
            and is_index(action[1]) and is_index(action[2]))
