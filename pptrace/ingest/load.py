"""Per-rank trace files -> per-rank tables, in child processes (or on Dask), cached.

Each rank is parsed (document.py: its JSON in slices, cut as the file is read and inflated;
frame.py: the slices into the normalized columns of schema.py) in one of as many child
processes as there are CPUs and memory allows (see _worker_plan), and kept compressed (its cache entry, store.py, or Arrow IPC bytes) until
the run's frame is assembled once (:func:`assemble`).
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import orjson

from ..errors import TraceError
from ..progress import LOAD, phase
from . import memory, store as cache
from .cluster import LOCAL, describe, map_jobs
from .columnar import StoredTable, frame_from_tables, to_arrow
from .document import StreamedTrace, Unstreamable, parse_document, read_trace
from .header import base_time, normalize_header, rank_of
from .files import is_nsys_name, unchanged, trace_size
from .frame import build_frame
from . import nsys

def load_rank(path, rank: int | None = None, *, typed: bool = True, with_key: bool = False,
              compact: bool = True):
    """Parse one rank's trace -> (events DataFrame in the schema.py columns, meta dict).

    ``meta`` holds: path, rank, world_size, base_ns, pptrace (the block or None),
    distributed (distributedInfo or None), hostname, threads {tid: name}, profiler_steps,
    n_events, warnings (list of strings). Raises TraceError for files that are not traces.
    ``typed=False`` parses every event into a dict (the slow reference for the tests).
    ``with_key``: also return the cache key of the bytes parsed (see _load_rank).
    ``compact``: fold nested plain CPU ops (ingest/compact.py; ``meta["folded"]`` counts
    them); False keeps every event (``pptrace merge``).
    """
    frame, meta, key = _load_rank(path, rank, typed=typed, compact=compact)
    return (frame, meta, key) if with_key else (frame, meta)


def _load_rank(path, rank: int | None = None, *, typed: bool = True, compact: bool = True):
    """load_rank, plus the cache key of the bytes parsed: None when the file changed while
    it was read, so that no entry ever holds one version's table under another's key."""
    path = Path(path)
    if is_nsys_name(path.name):  # the Nsight Systems reader (ingest/nsys.py), same table and meta
        return nsys.load(path, rank, compact=compact)
    try:
        header, frame, info, warnings, (opened, probe, base, bad_base, rank) = _parse_streamed(
            path, rank, typed, compact)
    except (Unstreamable, orjson.JSONDecodeError):
        # what the stream leaves (damaged, odd layouts): the whole document, read again
        header, frame, info, warnings, (opened, probe, base, bad_base, rank) = _parse_whole(
            path, rank, typed, compact)
    if rank is None:
        rank = rank_of(header, path)
    if rank is None:
        warnings.append(f"{path}: no rank in the trace or its name; assuming rank 0")
        rank = 0
    dist = header.get("distributedInfo")
    block = header.get("pptrace")
    world = (block or {}).get("world_size") or (dist or {}).get("world_size")
    meta = {
        "path": str(path),
        "rank": rank,
        "world_size": world if isinstance(world, int) else None,
        "base_ns": base,
        "clock_unknown": bool(bad_base),  # run/build.py places and aligns such a rank from its events
        "pptrace": block,
        "distributed": dist,
        "hostname": (block or {}).get("hostname") or header.get("host_name"),
        "header": header,  # for read_header from the cache
        **info,
        "warnings": warnings,
    }
    if probe is not None and unchanged(path, opened):
        return frame, meta, cache.key_of(opened, probe)
    warnings.append(
        f"{path}: changed while pptrace read it; these results are of the version read (not "
        "cached): run again for the current one"
    )
    return frame, meta, None


def _bad_base_line(path, bad_base: str) -> str:
    return (f"{path}: {bad_base}; this rank's clock is placed from its events (aligned on its collectives and "
            "p2p with the other ranks)")


def _parse_streamed(path: Path, rank, typed: bool, compact: bool):
    """The rank's table from its trace read a piece at a time (document.StreamedTrace): its
    header, hence its rank and clock base, is known only once every slice is read."""
    found = {"rank": rank}
    with StreamedTrace(path, typed=typed) as stream:
        warnings = stream.warnings

        def place():
            header = normalize_header(stream.header, path)
            base, bad_base = base_time(header)
            # where the whole-buffer path says them: before the slices'
            warnings[:0] = stream.head_warnings + ([_bad_base_line(path, bad_base)] if bad_base else [])
            found.update(header=header, base=base, bad_base=bad_base)
            if rank is None:
                found["rank"] = rank_of(header, path)
            return (0 if found["rank"] is None else found["rank"]), base

        frame, info = build_frame(stream, 0 if rank is None else rank, 0, path, warnings, compact=compact,
                                  place=place)
    return (found["header"], frame, info, warnings,
            (stream.opened, stream.probe, found["base"], found["bad_base"], found["rank"]))


def _parse_whole(path: Path, rank, typed: bool, compact: bool):
    """The rank's table from its whole document in memory: the path that repairs damaged
    traces (truncated, odd layouts, a cut inside an event: the whole document parsed at once)."""
    data, opened, probe = read_trace(path)
    header, slices, warnings = parse_document(path, data, typed=typed)
    header = normalize_header(header, path)
    base, bad_base = base_time(header)
    if bad_base:
        warnings.append(_bad_base_line(path, bad_base))
    rank = rank if rank is not None else rank_of(header, path)
    del data  # the slices hold the bytes until the last one is parsed, not beyond
    try:
        frame, info = build_frame(slices, 0 if rank is None else rank, base, path, warnings, compact=compact)
    except orjson.JSONDecodeError:
        # A cut landed inside an event (an unusual layout): parse the whole document, read
        # again (a change meanwhile leaves the entry uncached: unchanged below).
        header, slices, warnings = parse_document(path, read_trace(path)[0], whole=True)
        header = normalize_header(header, path)
        frame, info = build_frame(slices, 0 if rank is None else rank, base, path, warnings, compact=compact)
    del slices
    return header, frame, info, warnings, (opened, probe, base, bad_base, rank)


# -------------------------------------------------------------------------------------------
# many ranks: parallel, cached
# -------------------------------------------------------------------------------------------
# Below this much trace data a process pool costs more (fork, pickling) than it saves.
_POOL_MIN_BYTES = 8 << 20
#: What one more worker adds to the command's memory while it parses (the trace read in pieces,
#: one slice's objects, the rank's table before folding, the heap it dirties of the parent's),
#: per byte of the largest (decompressed) trace: the slope of the tree's peak PSS over 1, 2 and
#: 3 workers on bench_analyze's 8-rank trainer run (+73 MB a worker for 65 MB traces).
_WORKER_BYTES_PER_TRACE_BYTE = 1.1
#: What the analysis adds to the parent once the run's table is assembled, per byte of
#: (decompressed) trace: the compact table and the analyses' working arrays (same run: its
#: cached analysis peaks ~150 MB above the parent as it parses, for 515 MB of traces).
_ANALYSIS_BYTES_PER_TRACE_BYTE = 0.3


def _parse_job(path: str, rank: int | None, use_cache: bool, compact: bool = True):
    """Parse one trace -> (StoredTable, meta, None), or (None, None, error line). With
    ``use_cache`` the table goes to its cache entry (read back when the run's frame is
    assembled), else into compressed Arrow IPC bytes: the caller never holds the full
    pandas frame of a rank beyond this call. The cache holds compact tables only."""
    try:
        frame, meta, key = load_rank(path, rank, with_key=True, compact=compact)
    except TraceError as exc:
        return None, None, str(exc)
    except (ValueError, TypeError, KeyError, OverflowError, MemoryError, RecursionError) as exc:
        # Data this loader did not foresee: lose this rank, keep the others.
        return None, None, f"{path}: could not be loaded ({type(exc).__name__}: {exc}); please report this trace"
    table = to_arrow(frame)
    del frame
    stored = None
    if use_cache and compact and key is not None:
        written = cache.write(path, table, meta, key)
        if written is not None:
            stored = StoredTable(table.num_rows, path=written)
    if stored is None:
        stored = StoredTable.pack(table)
    del table
    memory.release()  # the next rank's parse starts from the heap this one freed
    return stored, meta, None


def _worker_count(workers: int | None, sizes: list) -> int:
    """:func:`_worker_plan`'s number of child processes."""
    return _worker_plan(workers, sizes)[0]


def _worker_plan(workers: int | None, sizes: list) -> tuple[int, str]:
    """(child processes for parsing traces of ``sizes`` (decompressed bytes each), why: said
    after the progress count). 0: parse in this process, for less than _POOL_MIN_BYTES of
    traces. Otherwise at least one: the heap a parse fragments then goes with the child, and
    the parent enters the analysis with only the tables (its peak is that of a cached run);
    where processes are spawned, not forked, one child is not worth it (0). Explicit
    ``workers`` is obeyed; by default one worker per CPU this process may run on, while their
    parses together take no more memory than the analysis will (so the parse phase never sets
    the peak), and no more workers than traces."""
    total = sum(sizes)
    if not sizes or total < _POOL_MIN_BYTES:
        return 0, ""
    if workers is not None:
        n = max(1, min(int(workers), len(sizes)))
        return n, f"{_workers(n)}: as asked"
    cpus = _cpus()
    per_worker = _WORKER_BYTES_PER_TRACE_BYTE * max(sizes)
    fits = max(1, int(_ANALYSIS_BYTES_PER_TRACE_BYTE * total // per_worker))
    n = min(cpus, len(sizes), fits)
    if n == 1 and _start_method() != "fork":
        # a spawned child imports pandas again (~0.3 s) and re-runs a script's unguarded
        # top level: one child is worth it only where it is forked
        return 0, ""
    return n, f"{_workers(n)}: {cpus} CPU{'s' * (cpus > 1)}, memory allows {fits}"


def _workers(n: int) -> str:
    return f"{n} worker{'s' * (n > 1)}"


def _cpus() -> int:
    """CPUs this process may run on (its affinity, which a container or taskset narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on macOS and Windows
        return max(1, os.cpu_count() or 1)


def _start_method() -> str:
    """How ProcessPoolExecutor will start processes here, without fixing the choice."""
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def load_ranks(jobs, *, use_cache: bool = True, workers: int | None = None, progress=None,
               compact: bool = True, scheduler: str | None = None, entries=None):
    """Load many traces -> (list of (StoredTable, meta) in job order, errors).

    ``jobs`` is a list of (path, rank or None). Valid cache entries are only looked up
    (their footer; ``entries``: the store.Entries the caller looked the headers up with, so
    that each entry is looked up once); the rest are parsed in ``workers`` child processes
    (default: one per CPU as memory allows, see _worker_plan; none for a few MB of traces),
    one trace at a time per process. Each rank's table stays compact (its cache entry, or compressed Arrow bytes) until
    :func:`pptrace.ingest.columnar.frame_from_tables` assembles the run's frame once.
    ``errors`` lists one line per file that could not be loaded (its slot is None).

    ``scheduler``: parse on Dask instead (pptrace.ingest.cluster), every trace not in the
    cache being one task: ``"local"`` (cluster.LOCAL) starts a cluster of ``workers``
    processes on this machine for the load, an address (``tcp://HOST:8786``) uses that
    scheduler's workers. A rank Dask cannot load raises TraceError, never a missing slot.
    """
    results: list = [None] * len(jobs)
    errors: list[str] = []
    todo = []
    use_cache = use_cache and compact  # the cache holds compact tables only
    entries = (entries or cache.Entries()) if use_cache else None
    if use_cache:
        for directory in {entries.path(path).parent for path, _ in jobs}:
            cache.remove_stale_tmp(directory)
    forged: list = []
    for i, (path, rank) in enumerate(jobs):
        hit = entries.lookup(path, forged) if use_cache else None
        if hit is not None:
            results[i] = hit
        else:
            todo.append(i)
    if not todo:
        return results, errors
    _parse_todo(jobs, todo, results, errors, use_cache, compact, workers, progress, scheduler)
    if forged:
        _said_forged(forged, jobs, results)
    return results, errors


def _said_forged(forged: list, jobs, results) -> None:
    """One line for every cache entry that named this user's secret without its digests:
    written by someone else (who can write the cache directory), so never read; the line goes
    with the first of those ranks (after its new entry was written: not kept in the cache)."""
    entries = {str(path) for path in forged}
    for (path, _), result in zip(jobs, results):
        if result is not None and str(cache.cache_path(path)) in entries:
            which = f"{len(entries)} cache entries, e.g. {cache.cache_path(path)}" if len(entries) > 1 \
                else f"cache entry {cache.cache_path(path)}"
            result[1]["warnings"] = [*(result[1].get("warnings") or ()), (
                f"{which}: not written by your pptrace (its digest does not verify: someone who can write the "
                "cache directory changed it); not used, the trace parsed again")]
            return


def _parse_todo(jobs, todo, results, errors, use_cache, compact, workers, progress, scheduler) -> None:
    """Parse the traces ``todo`` (indices into ``jobs``) into ``results`` and ``errors``."""
    # the same arguments in this process, in a pool or on Dask
    calls = {i: (str(jobs[i][0]), jobs[i][1], use_cache, compact) for i in todo}
    cached = len(jobs) - len(todo)
    label = f"{LOAD} ({cached} from cache)" if cached else LOAD
    if scheduler is not None:
        if scheduler == LOCAL:  # no more processes to start than traces to parse
            workers = min(int(workers or os.cpu_count() or 1), len(todo))
        label = f"{label} on {describe(scheduler, workers)}"
        n_workers = 0
        note = ""
    else:
        n_workers, note = _worker_plan(workers, [trace_size(jobs[i][0]) for i in todo])
    shown = phase(label, total=len(todo), enabled=progress, note=f" ({note})" if note else "")

    def collect(i, outcome):
        stored, meta, error = outcome
        if error is not None:
            errors.append(error)
        else:
            results[i] = (stored, meta)
        bar.advance()

    bar = shown.__enter__()
    try:
        if scheduler is not None:
            map_jobs(scheduler, workers, _parse_job, calls, collect)
        elif n_workers:
            with ProcessPoolExecutor(max_workers=n_workers) as pool:
                futures = {pool.submit(_parse_job, *args): i for i, args in calls.items()}
                for future in as_completed(futures):
                    try:
                        outcome = future.result()
                    except Exception as exc:  # a worker died (out of memory, killed)
                        outcome = (None, None, f"{jobs[futures[future]][0]}: worker failed ({type(exc).__name__}: {exc})")
                    collect(futures[future], outcome)
        else:
            for i, args in calls.items():
                collect(i, _parse_job(*args))
    finally:
        shown.__exit__(None, None, None)


def parse_again(item: StoredTable):
    """The table of a cache entry found broken when the run's frame is assembled: the entry
    is dropped and its trace parsed again (into a new entry)."""
    cache.drop(item.path)
    trace, rank = item.source
    stored, _, error = _parse_job(trace, rank, use_cache=True)
    if error is not None:
        raise TraceError(f"{item.path}: broken cache entry, and its trace no longer loads: {error}")
    table = stored.read(cache.secret())
    if table.num_rows != item.num_rows:
        raise TraceError(f"{trace}: changed while pptrace loaded it ({table.num_rows} events, "
                         f"{item.num_rows} a moment before); run again")
    return table


def assemble(tables: list):
    """The run's frame from the per-rank tables of :func:`load_ranks` (columnar.frame_from_tables;
    ``tables`` is emptied), a broken cache entry among them parsed again."""
    memory.large_blocks_on_heap()  # the parse workers are done (memory.py)
    return frame_from_tables(tables, reparse=parse_again, key=cache.secret())
