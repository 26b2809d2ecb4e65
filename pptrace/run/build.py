"""``load_run``: a run directory -> one Run (aligned events of every rank, layout, matches).

Flow: find files -> read headers (rank, layout; reject mixed runs) -> load ranks (parallel,
cached) -> match p2p and collectives (order-based, clock-free) -> estimate clock offsets
-> shift events -> match again for times on the aligned clocks. Bad files become warnings
as long as one rank loads; a run with nothing usable raises TraceError.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import align, claims, clocks, infer, match, whole_trace
from ..ingest import comm_kernels as comm_kernels_mod, memory
from .claims import is_count, shape
from ..errors import TraceError
from ..progress import ALIGN, ASSEMBLE, HEADERS, phase
from ..sweeps import isin
from ..ingest.document import TRUNCATED
from ..ingest.header import rank_of, read_header
from ..ingest.files import find_trace_files, group_by_reason
from ..ingest.load import assemble, load_ranks
from ..ingest.store import Entries
from ..topology import Layout
from .model import Run

#: No training run has had this many ranks: a rank or world size at or above it in a trace's
#: metadata or file name is corrupt, and believing it would build ranges of that size.
MAX_RANKS = 1 << 18


def _headers(files, warnings, cached: bool = True, enough: tuple = ("pptrace", "distributedInfo"), entries=None):
    found, skipped = [], []
    entries = (entries or Entries()) if cached else None
    for path in files:
        try:
            # what ranks and layout are told by (pptrace's traces have both before the events)
            header = read_header(path, cached=cached, enough=enough, entries=entries)
        except TraceError as exc:
            skipped.append(f"skipped: {exc}")
            continue
        rank = _believable_rank(header, path, warnings)
        if rank is not False:
            found.append((path, header, rank))
    if not found:
        raise TraceError(
            f"no readable trace among {len(files)} file(s) in {Path(files[0]).parent}: none could be read ("
            + "; ".join(w.removeprefix("skipped: ") for w in skipped[:2]) + ")"
        )
    warnings += group_by_reason(skipped, "skipped: ")
    return found


class Headers(NamedTuple):
    """What a run directory says before any event is read (:func:`run_headers`)."""

    by_rank: dict        # rank -> (trace path, header)
    layout: Layout
    said: str | None     # how the layout came about (layout_of)
    layout_warnings: slice  # the warnings layout_of added, for load_run to redo


def run_headers(path, warnings: list, *, cached: bool = True, layout: Layout | None = None,
                enough: tuple = ("pptrace", "distributedInfo"), entries=None) -> Headers:
    """The checks of a run directory every command makes before reading events, ``info``'s
    as ``analyze``'s (one set, so that info never describes a run analyze refuses): its trace
    files (symlink loops, FIFOs, pptrace's own outputs skipped with a line, grouped by reason),
    their headers, one believable rank per trace, one run (layouts, world sizes). ``enough``:
    header.read_header's (the load reads the whole trace later; ``info`` gives () to read
    every header whole, within the size limits the load would meet)."""
    files = find_trace_files(path)
    by_rank = assign_ranks(_headers(files, warnings, cached=cached, enough=enough, entries=entries), warnings)
    first = len(warnings)
    run_layout, said = layout_of(by_rank, layout, warnings)
    return Headers(by_rank, run_layout, said, slice(first, len(warnings)))


def _believable_rank(header, path, warnings):
    """rank_of, where a rank of MAX_RANKS or more is not believed: the next source (pptrace
    block, distributedInfo, file name) that names a smaller one, else False (skip the file)."""
    rank = rank_of(header, path)
    if rank is None or rank < MAX_RANKS:
        return rank
    for ignored in ({"pptrace": None}, {"pptrace": None, "distributedInfo": None}):
        other = rank_of({**header, **ignored}, path)
        if other is not None and other < MAX_RANKS:
            warnings.append(f"{path}: rank {rank} in its metadata is beyond any run ({MAX_RANKS} ranks at most); "
                            f"using rank {other} from its {'file name' if len(ignored) == 2 else 'distributedInfo'}")
            return other
    warnings.append(f"skipped: {path}: rank {rank} is beyond any run ({MAX_RANKS} ranks at most) and nothing "
                    "else in it names its rank; rename it rank<N>.json.gz")
    return False


def assign_ranks(found, warnings):
    """rank -> (path, header) of the traces found (path, header, rank or None); one rank per
    trace, or the run is refused (two runs mixed in one directory). `info` checks the same."""
    by_rank: dict = {}
    unknown = [f for f in found if f[2] is None]
    if unknown and len(found) > 1:
        raise TraceError(
            f"{unknown[0][0]}: cannot tell which rank this trace is (no pptrace block, no "
            "distributedInfo, no 'rank<N>' in the file name); rename it rank<N>.json.gz"
        )
    for path, header, rank in found:
        if rank is None:
            warnings.append(f"{path}: no rank in the trace or its name; assuming rank 0")
            rank = 0
        if rank in by_rank:
            raise TraceError(
                f"{by_rank[rank][0]} and {path} both claim rank {rank}: traces of two runs mixed "
                "in one directory? keep one run's traces per directory"
            )
        by_rank[rank] = (path, header)
    return by_rank


def layout_of(by_rank, layout, warnings):
    blocks = {r: h.get("pptrace") for r, (_, h) in by_rank.items() if h.get("pptrace")}
    layouts, claims = {}, {}
    for rank, block in blocks.items():
        try:
            claims[rank] = Layout.from_dict(block.get("layout") or {})
        except ValueError as exc:  # a corrupt claim, not another run's: judged without it
            warnings.append(f"{by_rank[rank][0]}: the pptrace block has a bad layout ({exc}); not believed")
            continue
        layouts.setdefault((claims[rank], repr(block.get("world_size"))), []).append(rank)
    if len(layouts) > 1:
        (k1, r1), (k2, r2) = list(layouts.items())[:2]
        raise TraceError(
            f"traces from different runs: ranks {r1[:4]} say layout {k1[0].to_dict()} world "
            f"{k1[1]}, ranks {r2[:4]} say {k2[0].to_dict()} world {k2[1]}; keep one run per directory"
        )
    worlds = {h["distributedInfo"].get("world_size") for _, h in by_rank.values() if h.get("distributedInfo")}
    worlds.discard(None)
    if len(worlds) > 1:
        raise TraceError(
            f"traces from different runs: distributedInfo world sizes {sorted(worlds)}; keep one "
            "run per directory"
        )
    if layout is not None:
        return layout, None
    rank = next(iter(claims), None)
    block, claimed = (blocks[rank], claims[rank]) if rank is not None else (next(iter(blocks.values()), None), None)
    # how the layout came about, as the warning of a contradiction (_check_layout) says it
    said = "the pptrace block says layout {}" if claimed is not None else "with no layout in the traces, {} was assumed"
    return _believed_layout(claimed, block, worlds, by_rank, warnings), said


def _believed_layout(claimed, block, worlds, by_rank, warnings):
    """The world the metadata claims, checked against the trace files: a claim below the
    highest rank present, or of MAX_RANKS or more, is not believed (one warning each) and
    the files' world is used. The claimed tp/cp/pp stand where they divide the world."""
    top = max(by_rank) + 1  # the smallest world that holds every trace here
    claims = []
    if claimed is not None:
        claims.append((f"the pptrace block's layout {shape(claimed)}", claimed.world_size))
    if block is not None and block.get("world_size") is not None:
        claims.append(("the pptrace block's world_size", block["world_size"]))
    if worlds:
        claims.append(("distributedInfo's world_size", next(iter(worlds))))
    believed = [(what, w) for what, w in claims if is_count(w) and top <= w < MAX_RANKS]
    world = believed[0][1] if believed else top
    for what, w in claims:
        if not is_count(w):
            warnings.append(f"{what} is {w!r}, not a rank count; using world size {world}")
        elif w >= MAX_RANKS:
            warnings.append(f"{what} says {w} ranks, beyond any run ({MAX_RANKS} at most; {len(by_rank)} trace "
                            f"files here); using world size {world}")
        elif w < top:
            warnings.append(f"{what} says {w} ranks, but the trace of rank {top - 1} is here ({len(by_rank)} "
                            f"trace files); using world size {world}")
        elif w != world:
            warnings.append(f"{what} says {w} ranks, but {believed[0][0]} says {world}; using {world}")
    if claimed is not None and claimed.world_size == world:
        return claimed
    if claimed is not None and world % (claimed.tp * claimed.cp * claimed.pp) == 0:
        return Layout(tp=claimed.tp, cp=claimed.cp, pp=claimed.pp,
                      dp=world // (claimed.tp * claimed.cp * claimed.pp), order=claimed.order)
    return Layout(dp=world)


def _common(meta_field, metas):
    """The value every block that has ``meta_field`` gives it (None if they differ); a value
    that is no number or name (a list, a dict) is passed on for claims.cross_check to refuse."""
    values = [m["pptrace"].get(meta_field) for m in metas.values() if isinstance(m.get("pptrace"), dict)]
    values = [v for v in values if v is not None]
    return values[0] if values and all(v == values[0] for v in values) else None


def _check_steps(metas, warnings, path):
    """The profiled steps cross-rank results cover (those every rank profiled) and whether
    ranks differ; no common step at all is refused: no cross-rank number would mean anything."""
    per_rank = {r: tuple(m.get("profiler_steps") or ()) for r, m in metas.items()}
    distinct = set(per_rank.values())
    if distinct == {()} and any(m.get("dropped_steps") for m in metas.values()):
        # not a trace without prof.step(): its ProfilerStep ranges had impossible values
        lost = next(m for m in metas.values() if m.get("dropped_steps"))
        raise TraceError(
            f"{path}: no profiled step left: every ProfilerStep range had an impossible timestamp or duration "
            f"({lost['path']}: {lost['dropped_steps']} dropped); the traces are corrupt, re-profile the run"
        )
    if len(distinct) <= 1:
        return list(next(iter(distinct), ())), False
    common = sorted(set.intersection(*(set(s) for s in per_rank.values())))
    odd = sorted(per_rank.items(), key=lambda item: (item[1] == max(distinct, key=len), item[0]))
    detail = ", ".join(f"rank {r}: {list(s) or 'none'}" for r, s in odd[:6])
    if not common:
        # a rank left without steps most likely lost its ProfilerStep ranges to bad values
        dropped = [w for r, s in odd if not s for w in metas[r].get("warnings") or () if "dropped" in w]
        raise TraceError(
            f"{path}: no profiled step is common to all ranks ({detail}); cross-rank results need one: "
            "choose ranks that profiled the same steps with --ranks"
            + (f" ({dropped[0].split('; the other')[0]})" if dropped else "")
        )
    warnings.append(
        f"ranks profiled different steps ({detail}); cross-rank results use the common steps {common}"
    )
    return common, True


def _not_profiled(absent, run_steps, metas) -> str:
    """The line for requested steps that are not among the run's common steps."""
    profiled = sorted(set().union(*(m.get("profiler_steps") or () for m in metas.values())))
    never = [s for s in absent if s not in profiled]
    partly = [s for s in absent if s in profiled]
    said = []
    if never:
        plural = len(never) > 1
        said.append(f"step{'s' * plural} {', '.join(map(str, never))} {'were' if plural else 'was'} not profiled "
                    f"(profiled: {', '.join(map(str, profiled)) or 'none'})")
    if partly:
        plural = len(partly) > 1
        said.append(f"step{'s' * plural} {', '.join(map(str, partly))} {'were' if plural else 'was'} not "
                    f"profiled on every rank (on every rank: {', '.join(map(str, run_steps)) or 'none'})")
    return "; ".join(said)


def load_run(path, *, ranks=None, steps=None, use_cache: bool = True, progress=None,
             layout: Layout | None = None, workers: int | None = None, compact: bool = True,
             scheduler: str | None = None, comm_kernels=(), assume_same_run: bool = False) -> Run:
    """Load, align and match a run directory (or one trace file).

    ``ranks``/``steps`` restrict what is loaded/kept; ``layout`` overrides the layout found
    in the traces (plain torch.profiler traces have none); ``progress`` forces the display
    of each phase on stderr on/off (default: ``pptrace.progress.wanted``); ``compact=False``
    keeps the CPU ops that the analyses fold away (ingest/compact.py), for ``pptrace merge``;
    ``workers``/``scheduler``: where the ranks are parsed (see load.load_ranks: Dask with a
    ``scheduler``); ``comm_kernels``: GPU kernels that communicate, beyond those pptrace
    knows ('REGEX=DIM' strings or comm_kernels.CommKernel; a bad one is a ValueError before
    anything is read); ``assume_same_run``: traces whose clocks lie hours apart are one run
    whose clocks disagree (not refused as different runs): those ranks are aligned on their
    collectives and p2p alone.
    """
    path = Path(path)
    kernel_rules = comm_kernels_mod.rules(comm_kernels)
    warnings: list[str] = []
    entries = Entries() if use_cache and compact else None  # the cache, looked up once per trace
    with phase(HEADERS, enabled=progress):
        # a layout not given by the caller is checked against what the traces show (claims.cross_check);
        # its warnings (guessed) are replaced if the layout is redone
        by_rank, run_layout, said, guessed = run_headers(path, warnings, cached=use_cache and compact, layout=layout,
                                                         entries=entries)
    wanted, headed = None, by_rank
    if ranks is not None:
        wanted = {int(r) for r in ranks}
        absent = sorted(wanted - set(by_rank))
        if absent:
            warnings.append(f"requested ranks {absent} have no trace in {path}")
        by_rank = {r: v for r, v in by_rank.items() if r in wanted}
        if not by_rank:
            raise TraceError(f"{path}: none of the requested ranks {sorted(wanted)} has a trace")
    order = sorted(by_rank)
    results, errors = load_ranks([(by_rank[r][0], r) for r in order], use_cache=use_cache,
                                 progress=progress, workers=workers, compact=compact, scheduler=scheduler,
                                 entries=entries)
    tables, metas = [], {}
    for rank, result in zip(order, results):
        if result is not None and not result[1].get("profiler_steps") and any(
                TRUNCATED in w for w in result[1].get("warnings") or ()):
            # its steps' marks (Kineto writes them last) or every step lost to the cut
            errors.append(f"{result[1]['path']}: {TRUNCATED}, and the cut leaves no whole profiled step; "
                          "re-copy the file or re-profile the run")
        elif result is not None:
            tables.append(result[0])
            metas[rank] = result[1]
            warnings += result[1].get("warnings") or []
    warnings += group_by_reason([f"skipped: {e}" for e in errors], "skipped: ")
    results = result = None
    if not metas:
        raise TraceError(f"{path}: no trace could be loaded; " + "; ".join(errors[:2]))
    if any(m.get("pptrace") and not by_rank[r][1].get("pptrace") for r, m in metas.items()):
        # a block after the events (a rewritten file; _headers read the head only): the
        # layout is the full headers', its warnings in place of the first guess's
        full = {r: (p, metas[r]["header"] if r in metas else h) for r, (p, h) in headed.items()}
        redone: list[str] = []
        run_layout, said = layout_of(full, layout, redone)
        warnings[guessed] = redone
    world = run_layout.world_size
    expected = set(range(world)) if wanted is None else {r for r in wanted if 0 <= r < world}
    missing = sorted(expected - set(metas))
    if missing:
        shown = missing if len(missing) <= 8 else [*missing[:8], "..."]
        warnings.append(
            f"{len(missing)} of {run_layout.world_size} ranks have no usable trace (ranks {shown}); "
            "results cover the others only"
        )
    with phase(ASSEMBLE, enabled=progress):
        events = assemble(tables)  # empties `tables`
        memory.release()
    placed = clocks.place(events, metas, assume_same_run, warnings)
    events, metas, whole = whole_trace.as_one_step(events, metas)  # no prof.step(): one step each
    if whole:
        warnings.append(whole)
    run_steps, differ = _check_steps(metas, warnings, path)
    if steps is not None:
        keep = {int(s) for s in steps}
        absent = sorted(keep - set(run_steps))
        run_steps = [s for s in run_steps if s in keep]
        if absent:
            said = _not_profiled(absent, run_steps, metas)
            if not run_steps:
                raise TraceError(f"{path}: {said}; choose --steps among those")
            warnings.append(f"requested {said}")
    if steps is not None or differ:
        # only the steps results cover: a step some rank lacks would leave its peers' sends
        # and collectives unmatched
        events = events[isin(events["step"], run_steps)]
    events = events.reset_index(drop=True)
    events, found_kernels = comm_kernels_mod.mark(events, kernel_rules)
    # a layout the user gave, or a pptrace block's with a pipeline, stands; otherwise a plain
    # trace's pipeline may be inferred (infer/)
    known = layout is not None or run_layout.pp > 1
    with phase(ALIGN, enabled=progress):
        return _finish(path, events, run_layout, metas, run_steps, warnings, layout_known=known,
                       layout_said=said, requested=None if wanted is None else sorted(wanted),
                       comm_kernels=found_kernels, placed=placed, whole_line=whole)


def _peers_not_loaded(events, pairs, requested, loaded, layout, said: list) -> list:
    """match_p2p's warnings, with the p2p ranges whose peer a --ranks subset (``requested``)
    left out said once, as what it means: "peer not loaded", their split unknown
    (analyzers/partition.py), not one line per side of every message."""
    ops = match.p2p_ops(events)
    paired = np.concatenate([pairs["send_index"].to_numpy(), pairs["recv_index"].to_numpy()]) if len(pairs) else []
    free = ops[~ops["index"].isin(paired).to_numpy()]
    peer = np.where(free["is_send"].to_numpy(bool), free["dst"].to_numpy(np.int64), free["src"].to_numpy(np.int64))
    absent = ~np.isin(peer, np.asarray(requested, np.int64))
    if not absent.any():
        return said
    peers, ranks = sorted(set(peer[absent].tolist())), sorted(set(free["rank"].to_numpy()[absent].tolist()))
    stages = sorted({layout.coords(r).pp for r in range(layout.world_size)} - {
        layout.coords(r).pp for r in loaded if r < layout.world_size})
    line = (f"peer not loaded: {int(absent.sum())} p2p ranges of ranks {ranks[:8]} have no matching peer range, "
            f"their peers (ranks {peers[:8]}) are not among --ranks: their wait and transfer cannot be told apart, so "
            "those ranks' pp_bubble and pp_transfer are unknown (pp_bubble_or_transfer holds the two) and so is "
            "their stages' bubble" + (f"; stages {stages[:8]} are not loaded: no theory and no critical path, and the "
                                       "pipeline window spans the loaded stages only" if stages and layout.pp > 1 else ""))
    # match_p2p's lines say the same of these ranges; kept only when other ranges lack a peer too
    return [line] if absent.all() else [*said, line]


def _finish(path, events, layout, metas, steps, warnings, layout_known: bool = True,
            layout_said: str | None = None, requested=None, comm_kernels=None, placed=None,
            whole_line: str | None = None) -> Run:
    loaded = sorted(metas)
    given = {f: _common(f, metas) for f in ("schedule", "microbatches", "vpp")}
    claimed = {f for f, value in given.items() if value is not None}  # what the pptrace block says
    hosts = {rank: meta.get("hostname") for rank, meta in metas.items()}

    def clock():
        """Ranks on several hosts: their clocks aligned on the collectives alone (no p2p is
        paired yet), for an inference that must compare their times."""
        if len(set(hosts.values())) <= 1:
            return None
        instances, _ = match.match_collectives(events, layout, loaded)
        offsets, _ = align.estimate_offsets(loaded, instances, None, events, hosts=hosts, free=placed or ())
        return dict(zip(offsets["rank"].tolist(), offsets["offset_ns"].tolist()))

    found = infer.infer_run(events, metas, layout if layout_known else None, clock=clock)
    inferred = {}
    if found is not None:  # a plain trace: the pipeline and its work inferred (infer/)
        events, warnings = found.events, [*warnings, *found.warnings]
        layout = found.layout or layout
        inferred = {k: v for k, v in found.inferred.items() if given.get(k) is None}
        for f in given:
            given[f] = given[f] if given[f] is not None else getattr(found, f)
    ep = [lib for lib, v in (comm_kernels or {}).items() if v["dim"] == "ep"]
    if ep and not any(m.get("pptrace") for m in metas.values()):
        # the dense layout has no ep dim: say so rather than show a plain dpN as if that were all
        inferred["ep"] = (f"expert-parallel all-to-all from its kernels ({', '.join(ep)}); the traces do not say "
                          "the expert groups, so the ranks are shown by their dense layout")
    if whole_line:  # no ProfilerStep#N range: the step is the whole trace (whole_trace.py)
        inferred["steps"] = "one step, step 0, spanning each rank's whole trace (no ProfilerStep#N range)"
    layout, given, w_claims = claims.cross_check(events, layout, given, claimed, metas,
                                           None if found is not None else layout_said)
    warnings = [*warnings, *w_claims]
    schedule, microbatches, vpp = given["schedule"], given["microbatches"], given["vpp"]
    instances, w_coll = match.match_collectives(events, layout, loaded)
    pairs, w_p2p = match.match_p2p(events, timed=False)  # wait/transfer once clocks are aligned
    if requested is not None:
        w_p2p = _peers_not_loaded(events, pairs, requested, loaded, layout, w_p2p)
    offsets, w_align = align.estimate_offsets(loaded, instances, pairs, events, hosts=hosts, free=placed or ())
    # Matching is clock-free, so the matches stand; only their times move.
    shift = dict(zip(offsets["rank"].tolist(), offsets["offset_ns"].tolist()))
    aligned = align.apply_offsets(events, offsets, inplace=True)
    pairs, instances = match.shift_pairs(pairs, shift, aligned), match.shift_instances(instances, shift)
    offsets = clocks.placed_offsets(offsets, placed or {})
    typical = float(pairs["transfer_ns"].median()) if len(pairs) else None
    warnings = [
        *warnings, *w_p2p, *w_coll, *w_align, *align.clock_drift_warnings(metas),
        *align.large_bound_warnings(offsets, typical),
    ]
    return Run(
        path=path, events=aligned, layout=layout, meta=metas, ranks=tuple(loaded), steps=tuple(steps),
        pairs=pairs, collectives=instances, offsets=offsets, warnings=tuple(warnings),
        schedule=schedule, microbatches=microbatches, vpp=vpp, inferred=inferred, requested=requested,
        comm_kernels=comm_kernels or {},
    )
