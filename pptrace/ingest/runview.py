"""What the analyzers read from a run, as one small immutable object.

``pptrace.ingest.run.Run`` (the loader's result) carries much more; the analyzers only need the
aligned events, the layout and the schedule facts. Taking them through this view keeps
every analysis a pure function that tests can feed with a hand-built events table
(:meth:`RunView.from_events`) instead of files on disk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ..topology import Layout


@dataclass(frozen=True)
class RunView:
    events: pd.DataFrame          # normalized events (events.py), clocks already aligned
    layout: Layout
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    schedule: str | None = None
    microbatches: int | None = None
    vpp: int | None = None
    offsets_ns: dict = field(default_factory=dict)       # rank -> applied clock offset
    uncertainty_ns: dict = field(default_factory=dict)   # rank -> alignment bound
    warnings: tuple[str, ...] = ()
    has_pptrace: bool = True      # whether the traces carry the pptrace metadata block
    pairs: pd.DataFrame | None = None         # match.match_p2p output, when the loader made it
    collectives: pd.DataFrame | None = None   # match.match_collectives output, likewise
    #: rank -> {pg_name: {"desc": pg_desc, "ranks": [...]}} from distributedInfo.pg_config
    process_groups: dict = field(default_factory=dict)
    #: rank -> its recorded action order [(op, global stage, mb)] (integrations, pptrace block)
    pipeline_actions: dict = field(default_factory=dict)
    stage_ranks: tuple | None = None  # global stage -> global rank, when recorded
    #: what was inferred from a plain trace (Run.inferred): field -> how, one line each
    inferred: dict = field(default_factory=dict)

    def __post_init__(self):
        missing = {"rank", "lane_kind", "start_ns", "end_ns", "category"} - set(self.events.columns)
        if missing:
            raise ValueError(f"events table lacks columns {sorted(missing)}")
        if self.vpp is not None and self.vpp < 1:
            raise ValueError(f"vpp must be >= 1, got {self.vpp!r}")

    @classmethod
    def from_events(cls, events: pd.DataFrame, layout: Layout, **kwargs) -> "RunView":
        """A view of an events table built by hand (tests, or one loaded with load_rank)."""
        ranks = tuple(sorted(int(r) for r in events["rank"].unique()))
        steps = kwargs.pop("steps", None)
        if steps is None:
            marks = events.loc[events["category"] == "step", "step"]
            steps = tuple(sorted(int(s) for s in marks.unique() if s >= 0))
        return cls(events=events, layout=layout, ranks=ranks, steps=tuple(steps), **kwargs)

    @property
    def v(self) -> int:
        return int(self.vpp or 1)


def _offsets(run) -> tuple[dict, dict]:
    table = getattr(run, "offsets", None)
    offsets, bounds = {}, {}
    if table is None:
        return offsets, bounds
    if isinstance(table, pd.DataFrame):
        frame = table.reset_index() if "rank" not in table.columns else table
        for row in frame.to_dict("records"):
            rank = int(row["rank"])
            offsets[rank] = int(row.get("offset_ns") or 0)
            bound = row.get("uncertainty_ns")
            bounds[rank] = int(bound) if bound is not None and bound == bound else 0
    elif isinstance(table, dict):
        for rank, value in table.items():
            if isinstance(value, dict):
                offsets[int(rank)] = int(value.get("offset_ns") or 0)
                bounds[int(rank)] = int(value.get("uncertainty_ns") or 0)
            else:
                offsets[int(rank)] = int(value)
    return offsets, bounds


def process_groups(meta) -> dict:
    """rank -> {pg_name: {"desc", "ranks"}} from each rank's distributedInfo.pg_config."""
    out = {}
    for rank, m in (meta.items() if isinstance(meta, dict) else ()):
        dist = (m or {}).get("distributed") if isinstance(m, dict) else None
        config = (dist or {}).get("pg_config") if isinstance(dist, dict) else None
        if not isinstance(config, list):
            continue
        out[int(rank)] = {
            str(g.get("pg_name")): {"desc": g.get("pg_desc"), "ranks": g.get("ranks")}
            for g in config if isinstance(g, dict) and g.get("pg_name") is not None
        }
    return out


def _recorded(meta) -> tuple[dict, tuple | None]:
    """(rank -> pipeline_actions, stage_ranks) from the pptrace blocks (contract 2)."""
    actions, stage_ranks = {}, None
    for rank, m in (meta.items() if isinstance(meta, dict) else ()):
        block = (m or {}).get("pptrace") if isinstance(m, dict) else None
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("pipeline_actions"), list):
            actions[int(rank)] = block["pipeline_actions"]
        if isinstance(block.get("stage_ranks"), list) and stage_ranks is None:
            stage_ranks = tuple(int(r) for r in block["stage_ranks"])
    return actions, stage_ranks


def view_of(run) -> RunView:
    """The view of a loaded ``pptrace.ingest.run.Run`` (duck-typed: any object with its attributes)."""
    if isinstance(run, RunView):
        return run
    offsets, bounds = _offsets(run)
    meta = getattr(run, "meta", None) or {}
    has_block = any(
        isinstance(m, dict) and m.get("pptrace") for m in (meta.values() if isinstance(meta, dict) else meta)
    ) if meta else True
    layout = run.layout if run.layout is not None else Layout(dp=max(1, len(run.ranks)))
    actions, stage_ranks = _recorded(meta)
    return RunView(
        events=run.events,
        layout=layout,
        ranks=tuple(int(r) for r in run.ranks),
        steps=tuple(int(s) for s in (run.steps or ())),
        schedule=getattr(run, "schedule", None),
        microbatches=getattr(run, "microbatches", None),
        vpp=getattr(run, "vpp", None),
        offsets_ns=offsets,
        uncertainty_ns=bounds,
        warnings=tuple(getattr(run, "warnings", ()) or ()),
        has_pptrace=bool(has_block),
        pairs=getattr(run, "pairs", None),
        collectives=getattr(run, "collectives", None),
        process_groups=process_groups(meta),
        pipeline_actions=actions,
        stage_ranks=stage_ranks,
        inferred=dict(getattr(run, "inferred", None) or {}),
    )
