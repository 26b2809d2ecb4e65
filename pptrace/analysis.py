"""The analysis of a run, as a notebook (and the CLI, the dashboard, the what-if) sees it:
``pptrace.analyze(run_or_path) -> Analysis``, one object whose tables are pandas DataFrames,
each computed once, on first use, from the analyzers (``pptrace.analyzers``: one analysis a
module, Run -> table). ``to_json()`` is the contract-4 document (``pptrace analyze --json``),
``figures()`` the dashboard's Plotly figures, ``whatif(...)`` a replay under other settings.

    >>> a = pptrace.analyze("runs/demo")
    >>> a.steps.groupby("rank")[["compute", "pp_bubble"]].mean()
    >>> a.stages[["stage", "bubble_s", "theory_bubble_s"]]

Nothing here computes an attribution: it wires the analyzers together and selects ranks and
steps, so that each table exists once however many outputs use it.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from .analyzers.bubble import bubble_split, microbatch_times, missing_stages, pipeline_stages
from .analyzers.collectives import collectives_by_dim, profiled_waits, waits_by_rank
from .analyzers.compute_by_pass import PASS_KINDS, compute_by_pass
from .analyzers.critical_path import step_bounds
from .analyzers.ep_pairs import EpPairs, ep_pairs, pair_means
from .analyzers.experts import expert_load, expert_tokens
from .analyzers.gpu_timeline import gpu_timeline
from .analyzers.p2p import MatchedPairs, link_table, match_pairs
from .analyzers.partition import UNSPLIT, breakdown_table, partition_run
from .analyzers.stragglers import find_stragglers
from .caveats import ep_warnings, gpu_warnings, has_contract_ranges, input_warnings, peer_loaded
from .timeline.projection import drawn_ranges
from .run.model import Run
from .run.build import load_run
from .progress import ANALYSE, phased
from .vocab import COMM_DIMS, PARTS

SCHEMA = "pptrace.analysis/1"


def strict_json(value):
    """numpy scalars -> Python, NaN/inf -> None, recursively: strict JSON."""
    # the document's own types first, by exact type (a 1,024-rank document is 400k values)
    kind = type(value)
    if kind is dict:
        return {k if type(k) is str else str(k): strict_json(v) for k, v in value.items()}
    if kind is list:
        return [strict_json(v) for v in value]
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is int or kind is str or kind is bool or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [strict_json(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if value is pd.NA:
        return None
    return value


def records(frame: pd.DataFrame) -> list[dict]:
    """``frame.to_dict("records")``, the same Python values, from each column's ``tolist``:
    pandas boxes cell by cell, 3x the time on the 8k passes of a 256-rank run."""
    columns = list(frame.columns)
    return [dict(zip(columns, row)) for row in zip(*(frame[c].tolist() for c in columns))] if len(frame) else []


def _whole(x):
    """A count (a per-step mean) as an int when it is whole: JSON says 48, not 48.0."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _whole_counts(report: dict) -> dict:
    """Counts and byte counts of the document as ints where whole (p2p pairs, links,
    collectives, ep pairs); means that are not whole stay floats."""
    p2p = report["p2p"]
    p2p["pairs"] = _whole(p2p["pairs"])
    for row in [*p2p["links"], *report["collectives"], *report.get("ep", {}).get("pairs", [])]:
        for key in row:
            if key in ("count", "bytes", "tokens") or key.endswith("_count"):
                row[key] = _whole(row[key])
        if isinstance(row.get("ops"), dict):
            row["ops"] = {op: _whole(n) for op, n in row["ops"].items()}
    return report


def _select(run: Run, steps, ranks) -> tuple[Run, list[str]]:
    warnings = []
    if steps is None:
        return run, warnings
    wanted = [int(s) for s in steps]
    keep = [s for s in run.steps if s in wanted] if run.steps else wanted
    absent = sorted(set(wanted) - set(keep))
    if absent:
        warnings.append(f"requested steps {absent} were not profiled (profiled: {list(run.steps)})")
    return replace(run, steps=tuple(keep)), warnings


_GPU_FIELDS = ("time_s", "busy_s", "compute_s", "comm_s", "overlap_s", "overlap_pct", "comm_exposed_s",
               "memcpy_s", "memcpy_exposed_s", "idle_s", "launch_bound_s", "host_launching_s")


def _slice_means(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per slice [starts[i], ends[i]) of ``values``: its mean skipping NaN, the float
    ``Series.mean`` gives (each slice's own pairwise sum: ``np.add.reduceat`` sums in
    another order, which changes last bits); NaN for an empty or all-NaN slice. Slices of
    one length (every rank with every step) are one reshaped sum."""
    known = ~np.isnan(values)
    zeroed = np.where(known, values, 0.0)  # adding 0.0 leaves a pairwise sum's bits alone
    lengths = ends - starts
    if len(starts) and (lengths == lengths[0]).all() and (starts == np.arange(len(starts)) * lengths[0]).all() \
            and ends[-1] == len(values):
        k = int(lengths[0])
        sums = zeroed.reshape(-1, k).sum(axis=1) if k else np.zeros(len(starts))
        counts = known.reshape(-1, k).sum(axis=1) if k else np.zeros(len(starts), np.int64)
    else:  # some rank lacks a step: slice by slice
        sums = np.array([zeroed[a:b].sum() for a, b in zip(starts, ends)], np.float64)
        counts = np.array([known[a:b].sum() for a, b in zip(starts, ends)], np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _by_rank(table: pd.DataFrame, ranks=None) -> tuple:
    """``table`` sorted by rank (its order within a rank kept), ``ranks`` (default: the
    table's) and where each one's rows begin and end in it: a rank's rows are one slice."""
    table = table.iloc[np.argsort(table["rank"].to_numpy(), kind="stable")]
    column = table["rank"].to_numpy(np.int64)
    ranks = np.unique(column) if ranks is None else np.asarray(ranks, np.int64)
    return table, ranks, np.searchsorted(column, ranks), np.searchsorted(column, ranks, side="right")


def _rank_entries(run: Run, table: pd.DataFrame, ranks, gpu: pd.DataFrame, waits: pd.DataFrame) -> list[dict]:
    out = []
    # rank -> {dim: {wait_s, transfer_s}}: the table's records once (JSON output, not analysis)
    by_rank: dict = {}
    if len(waits):
        for (r, d), v in waits.set_index(["rank", "dim"])[["wait_s", "transfer_s"]].astype(float).to_dict("index").items():
            by_rank.setdefault(int(r), {})[str(d)] = v
    # pp_bubble_or_transfer only in a run where some peer is not loaded: the document of a whole run is unchanged
    parts_of = [*PARTS, UNSPLIT] if UNSPLIT in table and table[UNSPLIT].any() else list(PARTS)
    hidden_of = [f"hidden_{d}" for d in COMM_DIMS]
    # every rank's rows one slice of whole columns: one pass, not a filter of the table per rank
    chosen = None if ranks is None else set(ranks)
    wanted = [r for r in run.ranks if chosen is None or r in chosen]
    table, _, bounds, ends = _by_rank(table, wanted)
    cols = {name: table[name].to_numpy(np.float64) for name in ("time_s", *parts_of, *hidden_of)}
    steps_col, time_col = table["step"].to_numpy().tolist(), cols["time_s"]
    breakdowns = records(table[parts_of])
    hidden_records = records(table[hidden_of].set_axis(list(COMM_DIMS), axis=1))
    means = {name: _slice_means(col, bounds, ends) for name, col in cols.items()}
    on_gpu_rows = _gpu_rows(gpu)
    for i, rank in enumerate(wanted):
        a, b = int(bounds[i]), int(ends[i])
        coords = run.layout.coords(rank)._asdict() if rank < run.layout.world_size else None
        steps = [{"step": int(step), "time_s": time, "breakdown_s": parts, "hidden_s": dims}
                 for step, time, parts, dims in zip(steps_col[a:b], time_col[a:b], breakdowns[a:b], hidden_records[a:b])]
        # GPU timeline (analyzers/gpu_timeline.py): beside the partition, memcpy and idle apart, launch-bound
        on_gpu = on_gpu_rows.get(rank)
        if on_gpu is not None:
            for entry in steps:
                if entry["step"] in on_gpu[0]:
                    g = on_gpu[0][entry["step"]]
                    entry["gpu"] = {k: g[k] for k in _GPU_FIELDS} | {"launch_bound": bool(g["launch_bound"])}
        mean = None
        if b > a:
            mean = {"time_s": means["time_s"][i],
                    "breakdown_s": {part: means[part][i] for part in parts_of},
                    "hidden_s": {d: means[f"hidden_{d}"][i] for d in COMM_DIMS}}
            if on_gpu is not None:
                mean["gpu"] = on_gpu[1]
            if rank in by_rank:  # collective time waiting for the group's last rank vs after it
                mean["collectives"] = by_rank[rank]
        out.append({
            "rank": rank, "coords": coords,
            "describe": run.layout.describe(rank) if rank < run.layout.world_size else None,
            "clock_offset_us": run.offsets_ns.get(rank, 0) / 1e3,
            "clock_uncertainty_us": (run.uncertainty_ns.get(rank) or 0) / 1e3,
            "steps": steps, "mean": mean,
        })
    return out


def _gpu_rows(gpu: pd.DataFrame) -> dict:
    """rank -> ({step: its GPU timeline record}, the rank's mean of each field): the table
    sorted by rank once, each rank's rows one slice (means as _slice_means gives them)."""
    if not len(gpu):
        return {}
    table, ranks, starts, ends = _by_rank(gpu)
    means = {k: _slice_means(table[k].to_numpy(np.float64), starts, ends) for k in _GPU_FIELDS}
    rows = records(table[[*_GPU_FIELDS, "launch_bound"]])
    steps = table["step"].tolist()
    return {int(r): (dict(zip(steps[a:b], rows[a:b])), {k: means[k][i] for k in _GPU_FIELDS})
            for i, (r, a, b) in enumerate(zip(ranks, starts, ends))}


def _microbatch_rows(run: Run, times: pd.DataFrame) -> list[dict]:
    """Every forward/backward range (``times``: the selected passes): rank, stage, step, mb,
    chunk, op, start_s (from the step's pipeline window start, aligned clocks) and dur_s —
    per-microbatch detail."""
    if times.empty:
        return []
    windows = run.pipeline_windows
    origin = times["step"].map({s: w.start_ns for s, w in windows.items()}).fillna(times.groupby("step")["start_ns"].transform("min"))
    times = times.assign(start_s=(times["start_ns"] - origin) / 1e9)
    return records(times[["rank", "stage", "step", "mb", "chunk", "op", "start_s", "dur_s"]])


class Analysis:
    """Every table of one run's analysis, each computed on first use and kept.

    ``run``: the loaded :class:`~pptrace.run.Run`; ``steps`` / ``ranks`` select what
    is reported (the pipeline window still spans every loaded rank: a stage's bubble is
    defined against all stages). Tables (pandas DataFrames, times in seconds):

    - ``steps``: one row per (rank, step): ``time_s``, the partition of contract 3
      (``compute``, ``<dim>_exposed``, ``pp_transfer``, ``pp_bubble``, ``other``; they sum to
      ``time_s``) and ``hidden_<dim>`` (communication under compute).
    - ``stages``: one row per pipeline stage: ``bubble_s``, ``bubble_fraction``, the schedule
      and latency parts, theory, ``t_fwd_s`` / ``t_bwd_s``, per-chunk detail.
    - ``links``: per p2p link (``src``, ``dst``) and step: ``count``, ``bytes``, ``wait_s``,
      ``transfer_s``.
    - ``collectives``: per dimension: collective time, exposed and hidden, wait and transfer.
    - ``rank_collectives``: per (rank, dim): wait and transfer per step (the JSON's
      ``ranks[].mean.collectives``).
    - ``experts``: per rank with MoE experts: ``tokens`` per step, ``share_of_mean`` in its
      ep group, ``hottest`` and ``wait_cost_s`` (what the group waited for its hottest rank).
    - ``expert_tokens``: per (rank, step, expert): the tokens the expert processed.
    - ``ep_pairs``: per (step, src, dst) of an ep group: ``tokens`` and ``bytes`` src sent
      dst, ``wait_s`` src waited for dst (a rank's sum is its ep wait).
    - ``stragglers``: the ranks that hold the others back (``rank``, ``metric``, ``slowdown``,
      ``cost_s``, evidence).
    - ``critical_path``: per step, what bounded it (``length_s``, ``compute_s``, ``p2p_s``,
      ``comm_s``, ``other_s``, ``ranks``, ``summary``).
    - ``gpu``: per (rank, step) of GPU traces: busy, compute, communication, overlap, idle,
      launch-bound time.
    - ``passes``: every forward/backward range (rank, stage, step, mb, chunk, op, start_ns, dur_s).
    """

    def __init__(self, run: Run, *, steps=None, ranks=None):
        self.run = run
        # the tables read the selected steps only; the what-if and the page start from the whole run
        self._selected_run, self._selection_warnings = _select(run, steps, ranks)
        self._ranks = None if ranks is None else [int(r) for r in ranks]

    def __repr__(self) -> str:
        layout = self.run.layout
        sizes = " ".join(f"{d}{n}" for d, n in layout.to_dict().items() if d != "order" and n > 1) or "1 rank"
        steps = list(self._selected_run.steps)
        return f"<Analysis: {layout.world_size} ranks ({sizes}), schedule {self.run.schedule}, steps {steps}>"

    # -- what the tables are built from ------------------------------------------------
    @cached_property
    def _matched(self) -> MatchedPairs:
        return match_pairs(self._selected_run)

    @cached_property
    def partitions(self) -> list:
        """The :class:`~pptrace.analyzers.partition.StepPartition` of every (rank, step): the
        intervals each part of ``steps`` sums (the dashboard's timeline draws them)."""
        return partition_run(self._selected_run, self._selected_run.activities, self._matched)

    @cached_property
    def drawn_ranges(self) -> pd.DataFrame:
        """The ranges the dashboard's timeline draws (projection.drawn_ranges): the analysed
        steps' passes, p2p and communication, each where its work ran."""
        return drawn_ranges(self.run.events, (self._document.get("run") or {}).get("steps") or None)

    @cached_property
    def _stage_pipe(self) -> tuple[pd.DataFrame, dict]:
        run, partitions = self._selected_run, self.partitions
        return pipeline_stages(run, partitions, bubble_split(run, partitions, self._matched.pairs), self._times)

    @cached_property
    def _selected_pairs(self) -> pd.DataFrame:
        pairs, steps = self._matched.pairs, self._selected_run.steps
        return pairs[pairs["step"].isin(list(steps))] if steps else pairs

    @cached_property
    def _instances(self):
        inst, steps = self._selected_run.collectives, self._selected_run.steps
        if steps and inst is not None and len(inst):
            inst = inst[inst["step"].isin(list(steps))]
        return inst

    @cached_property
    def _waits(self) -> pd.DataFrame:
        """Every collective instance's wait and transfer per rank, once for the tables that read them."""
        return profiled_waits(self._selected_run, self._instances)

    @property
    def _n_steps(self) -> int:
        return max(len(self._selected_run.steps), 1)

    # -- the tables ----------------------------------------------------------------------
    @cached_property
    def _all_steps(self) -> pd.DataFrame:
        return breakdown_table(self.partitions)

    @cached_property
    def steps(self) -> pd.DataFrame:
        table = self._all_steps
        return table if self._ranks is None else table[table["rank"].isin(self._ranks)].reset_index(drop=True)

    @cached_property
    def stages(self) -> pd.DataFrame:
        stages, _ = self._stage_pipe
        return stages

    @cached_property
    def links(self) -> pd.DataFrame:
        links = link_table(self._selected_pairs)
        for column in ("count", "bytes", "wait_s", "transfer_s", "bandwidth_count"):
            links[column] = links[column] / self._n_steps
        return links

    @cached_property
    def collectives(self) -> pd.DataFrame:
        chosen = self.partitions if self._ranks is None else self.partitions.take(np.isin(self.partitions.rank, self._ranks))
        return collectives_by_dim(self._selected_run, chosen, self._instances, self._waits)

    @cached_property
    def rank_collectives(self) -> pd.DataFrame:
        """Per (rank, dim): collective wait and transfer per step (waits_by_rank)."""
        return waits_by_rank(self._selected_run, self._instances, self._waits)

    @cached_property
    def experts(self) -> pd.DataFrame:
        """Per rank with MoE experts: tokens per step, share of its ep group's mean, the
        group's hottest rank and what waiting for it cost the others (analyzers/experts.py)."""
        load = expert_load(self._selected_run, self.rank_collectives)
        return load if self._ranks is None else load[load["rank"].isin(self._ranks)].reset_index(drop=True)

    @cached_property
    def expert_tokens(self) -> pd.DataFrame:
        """Per (rank, step, expert): the tokens the expert processed (analyzers/experts.py)."""
        table = expert_tokens(self._selected_run)
        return table if self._ranks is None else table[table["rank"].isin(self._ranks)].reset_index(drop=True)

    @cached_property
    def _ep_pairs(self) -> EpPairs:
        return ep_pairs(self._selected_run, self._instances, self._waits)

    @cached_property
    def ep_pairs(self) -> pd.DataFrame:
        """Per (step, src, dst) of an ep group: the token rows and bytes src sent dst in its
        all-to-alls, and the time src waited for dst (analyzers/ep_pairs.py); sizes NaN for
        ranks whose split sizes do not add up."""
        table = self._ep_pairs.table
        return table if self._ranks is None else table[table["src"].isin(self._ranks)].reset_index(drop=True)

    @cached_property
    def compute_passes(self) -> pd.DataFrame:
        """Per (rank, step): the partition's compute inside each pass type (``fwd``, ``bwd``,
        ``bwd_input``, ``bwd_weight``) and ``other``, summing to ``steps.compute``
        (analyzers/compute_by_pass.py; the JSON's ``ranks[].steps[].compute_s``)."""
        return compute_by_pass(self._selected_run, self.partitions)

    @cached_property
    def stragglers(self) -> pd.DataFrame:
        return find_stragglers(self.partitions, self._selected_pairs, self._waits)

    @cached_property
    def _bounds(self) -> list[dict]:
        # a path through stages not loaded cannot be walked: none rather than one that skips them
        return [] if missing_stages(self._selected_run) else step_bounds(self._selected_run)

    @cached_property
    def critical_path(self) -> pd.DataFrame:
        return pd.DataFrame(self._bounds, columns=["step", "length_s", "step_time_s", "compute_s", "p2p_s",
                                                   "comm_s", "other_s", "ranks", "stages", "summary"])

    @cached_property
    def gpu(self) -> pd.DataFrame:
        run = self._selected_run
        return gpu_timeline(run.events, set(run.steps) if run.steps else None)

    @cached_property
    def _times(self) -> pd.DataFrame:
        """Every pass of the selected steps (bubble.microbatch_times), for the stages and ``passes``."""
        return microbatch_times(self._selected_run)

    @cached_property
    def passes(self) -> pd.DataFrame:
        times = self._times
        return times if self._ranks is None else times[times["rank"].isin(self._ranks)]

    # -- outputs -------------------------------------------------------------------------
    @cached_property
    def _document(self) -> dict:
        return _build_document(self)

    def to_json(self) -> dict:
        """The contract-4 document (schema ``pptrace.analysis/1``), as ``pptrace analyze
        --json`` prints it. Built once; each call returns a new top-level dict, so a caller
        may add keys (the CLI adds ``hta``) without changing what the others see."""
        return dict(self._document)

    @cached_property
    def replay(self) -> tuple[dict | None, str | None]:
        """(the what-if replay of the step as measured, or None; why there is none, or None):
        what the dashboard's replay figure draws. None, None for a run without a pipeline."""
        from .whatif.predict import whatif

        if self.run.layout.pp < 2:
            return None, None
        try:
            return whatif(self.run), None
        except ValueError as exc:  # a run the simulator cannot replay: say why
            return None, " ".join(str(exc).split())

    def whatif(self, **changes) -> dict:
        """The what-if replay (``pptrace whatif --json``) of the run under ``changes``
        (``schedule``, ``vpp``, ``microbatches``, ``no_straggler``, ``p2p_free``,
        ``balanced_experts``); with none, the replay of the step as measured (computed once)."""
        from .whatif.predict import whatif

        if not changes:
            result, why = self.replay
            if result is None:
                raise ValueError(why or "a run without a pipeline has no what-if replay")
            return result
        return whatif(self.run, **changes)

    def figures(self) -> dict:
        """The dashboard's Plotly figures by name (``timeline``, ``replay``, ``partition``, ...):
        drawn from this analysis, they display inline in Jupyter."""
        from dashboards.page import build_figures

        result, note = self.replay
        return build_figures(self.run, self._document, partitions=self.partitions, ranges=self.drawn_ranges,
                             whatif_result=result, whatif_note=note)


def analyze(run_or_path, *, steps=None, ranks=None, **load_options) -> Analysis:
    """The :class:`Analysis` of a run: a loaded :class:`~pptrace.run.Run`, or a run
    directory / trace file, loaded here (``load_options`` go to
    :func:`~pptrace.run.load_run`, e.g. ``use_cache=False``, ``progress=False``)."""
    run = run_or_path if isinstance(run_or_path, Run) else load_run(Path(run_or_path), **load_options)
    return Analysis(run, steps=steps, ranks=ranks)


def _ep_section(a: Analysis) -> dict:
    return {"pairs": records(pair_means(a.ep_pairs, a._n_steps)),
            "expert_tokens": records(a.expert_tokens),
            "unmeasured_ranks": list(a._ep_pairs.inconsistent)}


def _with_pass_compute(entries: list[dict], table: pd.DataFrame) -> list[dict]:
    """``compute_s`` beside each step's breakdown (and the rank's mean): its compute by pass
    type, summing to ``breakdown_s.compute``."""
    by_key = table.set_index(["rank", "step"])[[*PASS_KINDS, "other"]].to_dict("index") if len(table) else {}
    for entry in entries:
        split = [by_key[(entry["rank"], s["step"])] for s in entry["steps"] if (entry["rank"], s["step"]) in by_key]
        for s in entry["steps"]:
            if (entry["rank"], s["step"]) in by_key:
                s["compute_s"] = by_key[(entry["rank"], s["step"])]
        if entry["mean"] is not None and split and len(split) == len(entry["steps"]):
            entry["mean"]["compute_s"] = {k: float(np.mean([row[k] for row in split])) for k in split[0]}
    return entries


def _environment(run: Run) -> dict:
    """Where and with what the run ran, from the traces' metadata: ``hosts`` (host -> its
    ranks) and ``versions`` (library -> version; a list where ranks differ): the pptrace
    block's ``versions`` (torch, pptrace, python) and the trace's NCCL version and backend."""
    hosts, versions = {}, {}
    for rank, meta in sorted(run.meta.items()):
        hosts.setdefault(str(meta.get("hostname") or "unknown"), []).append(int(rank))
        found = dict((meta.get("pptrace") or {}).get("versions") or {})
        dist = meta.get("distributed") or {}
        found.update({k: dist[k] for k in ("backend", "nccl_version") if dist.get(k) is not None})
        for name, value in found.items():
            versions.setdefault(str(name), set()).add(str(value))
    return {"hosts": hosts, "versions": {k: v.pop() if len(v) == 1 else sorted(v) for k, v in versions.items()}}


@phased(ANALYSE)
def _build_document(a: Analysis) -> dict:
    run, ranks = a._selected_run, a._ranks
    stages, pipe = a._stage_pipe
    sel_pairs, n_steps = a._selected_pairs, a._n_steps
    report = {
        "schema": SCHEMA,
        "run": {
            "world_size": run.layout.world_size, "layout": run.layout.to_dict(),
            "schedule": run.schedule, "microbatches": run.microbatches or pipe.get("microbatches"),
            "vpp": run.vpp, "steps": list(run.steps), "ranks": list(run.ranks),
            "inferred": dict(run.inferred),
            "comm_kernels": {lib: dict(v) for lib, v in run.comm_kernels.items()},
            "environment": _environment(run),
        },
        "ranks": _with_pass_compute(_rank_entries(run, a._all_steps, ranks, a.gpu, a.rank_collectives),
                                    a.compute_passes),
        "pipeline": {
            **pipe,
            "stages": records(stages),
            "microbatch_times": _microbatch_rows(run, a.passes),
        },
        # per step, what bounded it: the cross-rank critical path ([] without a pipeline)
        "critical_path": a._bounds,
        "p2p": {
            "pairs": len(sel_pairs) / n_steps,
            "wait_s": float(sel_pairs["wait_ns"].sum()) / 1e9 / n_steps,
            "transfer_s": float(sel_pairs["transfer_ns"].clip(lower=0).sum()) / 1e9 / n_steps,
            "unmatched": len(a._matched.unmatched),
            "links": records(a.links),
        },
        "collectives": records(a.collectives),
        "stragglers": records(a.stragglers),
        # MoE runs only: tokens per ep rank per step and the imbalance's cost
        **({"experts": records(a.experts)} if len(a.experts) else {}),
        # ep runs only: the rank-pair matrix (per step means) and tokens per expert per step
        **({"ep": _ep_section(a)} if len(a.ep_pairs) or len(a.expert_tokens) else {}),
        "warnings": [*run.warnings, *a._selection_warnings, *input_warnings(run, a.partitions, peer_loaded(a._matched.unmatched, run.requested)),
                     *ep_warnings(a._ep_pairs),
                     *gpu_warnings(run, run.activities, a.gpu, has_contract_ranges(run.events))],
    }
    return _whole_counts(strict_json(report))
