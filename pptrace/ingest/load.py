"""Per-rank trace file -> normalized events (see schema.py), fast and with bounded memory.

A torch.profiler trace is one JSON document whose ``traceEvents`` array holds every event.
Parsing it whole with orjson needs ~8x the file size in Python objects, so the array is cut
into slices of ~256 KB at event boundaries and each slice is parsed and turned into columns
before the next one. A raw newline cannot occur inside a JSON string, so a cut at
``}\\n  {`` / ``}, {`` that lands inside an event makes that slice unparseable (unbalanced
braces); the loader then falls back to parsing the whole document, never to a wrong answer.

Slices are decoded by msgspec into :class:`~pptrace.ingest.schema.RawEvent` structs that declare
only the fields the table needs (everything else is skipped, never built); a slice msgspec
rejects (invalid UTF-8, NaN, an odd value) is parsed by orjson/json into dicts instead, which
give the same table. Many ranks: parsed one after the other in this process unless workers
fit in memory (see _worker_count), each rank's table kept compressed until the run's frame
is assembled once (columnar.frame_from_tables).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import sys
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import msgspec
import orjson

from ..errors import TraceError
from .frame import build_frame
from .schema import RawEvent

#: Separators between events, most specific first: Kineto's indented output, then compact.
_SEPARATORS = (b"\n  },\n  {", b"}, {", b"},{")
#: Slices of ~256 KB stay in the CPU caches while they are decoded: 1.4x faster than 4 MB.
_CHUNK_BYTES = 256 << 10
_HEADER_PEEK = 1 << 20
_SLICE_JUNK = b", \n\t\r"  # around the events of a slice
_EVENTS_KEY = b'"traceEvents"'
_TRACE_SUFFIXES = (".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(
            f"cannot read {path}: {exc.strerror or exc}; check that the file exists and is readable"
        ) from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(
                f"{path}: corrupt or truncated gzip ({exc}); re-copy the file or re-run the profiler"
            ) from None
    if not data.strip():
        raise TraceError(f"{path}: empty file; the rank probably died before writing its trace")
    return data


def _loads(blob: bytes, path: Path, warnings: list):
    """orjson, with the slow fallbacks that real traces need: ints beyond 64 bits (json
    keeps them as Python ints) and invalid UTF-8 (replaced, with a warning)."""
    try:
        return orjson.loads(blob)
    except orjson.JSONDecodeError as exc:
        message = str(exc)
    if "UTF-8" in message or "utf-8" in message:
        warnings.append(f"{path}: invalid UTF-8 in the trace; bad bytes replaced by U+FFFD")
        return _loads(blob.decode("utf-8", "replace").encode("utf-8"), path, [])
    try:
        return json.loads(blob)
    except (ValueError, RecursionError):
        raise orjson.JSONDecodeError(message, "", 0) from None


def _last_byte(data: bytes, start: int, end: int) -> bytes:
    """The last non-whitespace byte of data[start:end] (b"" if none), without copying it."""
    while end > start and data[end - 1] in b" \t\r\n":
        end -= 1
    return data[end - 1:end] if end > start else b""


def _locate_events(data: bytes):
    """(header bytes with an empty events array, events start, events end or None)."""
    key = data.find(_EVENTS_KEY)
    if key < 0:
        return None
    start = data.find(b"[", key + len(_EVENTS_KEY))
    if start < 0 or data[key + len(_EVENTS_KEY):start].strip(b" \t\r\n:"):
        return None
    # The array's closing bracket is among the last few ']' (only short metadata such as
    # traceName follows it); the right one is the one that leaves a valid document.
    end, tries = len(data), 0
    while tries < 64:
        end = data.rfind(b"]", start, end)
        if end < 0:
            break
        # The array ends right after an event's '}' (or is empty); a ']' after anything else
        # closes a metadata list such as Kineto's trailing "INFO": [...].
        if _last_byte(data, start, end) not in (b"}", b"["):
            continue
        head = data[:start] + b"[]" + data[end + 1:]
        try:
            orjson.loads(head)
            return head, start + 1, end
        except orjson.JSONDecodeError:
            tries += 1
    return data[:start] + b"[]}", start + 1, None  # truncated: no closing bracket found


def _cut_points(data: bytes, start: int, end: int) -> list[int]:
    sep = next((s for s in _SEPARATORS if data.find(s, start, min(end, start + _CHUNK_BYTES)) >= 0), None)
    cuts = [start]
    if sep is not None:
        pos = start + _CHUNK_BYTES
        while pos < end:
            hit = data.find(sep, pos, end)
            if hit < 0:
                break
            cuts.append(hit + sep.index(b"}") + 1)  # just after the closing brace of an event
            pos = hit + _CHUNK_BYTES
    cuts.append(end)
    return cuts


def _decode_slice(decoder, blob: bytes, path: Path, warnings: list) -> list:
    """Typed decoding (msgspec builds only the fields the table uses, ~6x faster than
    orjson's dicts); anything it rejects (invalid UTF-8, an odd value such as a list for
    ``args``, NaN) goes through :func:`_loads` and its fallbacks as event dicts."""
    if decoder is not None:
        try:
            return decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    return _loads(blob, path, warnings)


def _parse_slices(data: bytes, start: int, end: int, path: Path, warnings: list, typed: bool = True):
    """Yield (events, slice bytes) for each slice of the events array: lists of
    :class:`~pptrace.ingest.schema.RawEvent` (``typed``) or of dicts."""
    decoder = msgspec.json.Decoder(list[RawEvent]) if typed else None
    cuts = _cut_points(data, start, end)
    view = memoryview(data)
    for a, b in zip(cuts[:-1], cuts[1:]):
        while a < b and data[a] in _SLICE_JUNK:
            a += 1
        while b > a and data[b - 1] in _SLICE_JUNK:
            b -= 1
        blob = b"".join((b"[", view[a:b], b"]"))  # one copy, not three
        yield _decode_slice(decoder, blob, path, warnings), blob


def _salvage_truncated(data: bytes, start: int, path: Path, warnings: list):
    """Events before the cut of a trace whose writer died mid-file."""
    body = data[start:]
    for sep in _SEPARATORS:
        cut = body.rfind(sep)
        while cut > 0:
            blob = b"[" + body[: cut + sep.index(b"}") + 1].strip(b", \n\t\r") + b"]"
            try:
                events = _loads(blob, path, warnings)
            except orjson.JSONDecodeError:
                cut = body.rfind(sep, 0, cut)
                continue
            warnings.append(
                f"{path}: truncated trace (the rank died while writing it?); using the "
                f"{len(events)} events before the cut"
            )
            return [(events, blob)]
    return None


def parse_document(path, data: bytes | None = None, whole: bool = False, typed: bool = True):
    """-> (header dict, iterable of (events list, raw slice bytes), warnings).

    The slices are parsed lazily, one at a time as the caller iterates; a slice that does
    not parse raises orjson.JSONDecodeError from the iteration, and the caller then asks
    again with ``whole=True`` (see load_rank). Events are :class:`~pptrace.ingest.schema.RawEvent`
    structs where typed decoding accepts a slice (``typed=False``: always dicts, the
    straightforward reference), dicts otherwise.
    """
    path = Path(path)
    warnings: list = []
    if data is None:
        data = _read_bytes(path)
    located = None if whole else _locate_events(data)
    if located is not None:
        head_bytes, start, end = located
        try:
            header = _loads(head_bytes, path, warnings)
        except orjson.JSONDecodeError:
            header = None
        if isinstance(header, dict):
            if end is not None:
                return header, _parse_slices(data, start, end, path, warnings, typed), warnings
            slices = _salvage_truncated(data, start, path, warnings)
            if slices is not None:
                return header, slices, warnings
    try:
        doc = _loads(data, path, warnings)
    except orjson.JSONDecodeError as exc:
        raise TraceError(
            f"{path}: not valid JSON ({str(exc).splitlines()[0]}); the file is truncated or is "
            "not a torch.profiler trace"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(
            f"{path}: JSON without a 'traceEvents' list, so not a torch.profiler / Chrome trace; "
            "point pptrace at the run's traces/ directory"
        )
    events = doc.pop("traceEvents")
    return doc, [(events, None)], warnings


# -------------------------------------------------------------------------------------------
# headers and files
# -------------------------------------------------------------------------------------------


def _normalize_header(header: dict, path: Path) -> dict:
    block = header.get("pptrace")
    if isinstance(block, str):  # add_metadata_json may leave the value as a string
        try:
            block = orjson.loads(block)
        except orjson.JSONDecodeError:
            block = None
    header = dict(header)
    header["pptrace"] = block if isinstance(block, dict) else None
    dist = header.get("distributedInfo")
    header["distributedInfo"] = dist if isinstance(dist, dict) else None
    return header


def _head_and_tail(path: Path) -> bytes | None:
    """The first and the last ``_HEADER_PEEK`` bytes of the (decompressed) trace joined at
    the events array's opening bracket, or the whole document when it is that small: what
    :func:`_locate_events` needs to see the metadata on both sides of ``traceEvents``
    (pptrace's own traces carry the pptrace block before the events; Kineto writes its
    top-level metadata after them). The events between are streamed past, never parsed."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        head = fh.read(_HEADER_PEEK)
        tail = fh.read(_HEADER_PEEK)
        if len(tail) < _HEADER_PEEK:
            return head + tail
        while True:  # keep only the last window: bounded memory on any trace size
            more = fh.read(_HEADER_PEEK)
            if not more:
                break
            tail = tail[len(more):] + more if len(more) < _HEADER_PEEK else more
    key = head.find(_EVENTS_KEY)
    bracket = head.find(b"[", key) if key >= 0 else -1
    if bracket < 0:
        return None
    return head[: bracket + 1] + tail


def read_header(path) -> dict:
    """The top-level metadata of a trace (distributedInfo, pptrace block, baseTimeNanoseconds,
    ...) wherever it sits, before or after ``traceEvents``, without building the events
    table. The one reader of headers: :func:`load_rank` gets its header from the same
    :func:`_locate_events` split of the whole document."""
    path = Path(path)
    try:
        ends = _head_and_tail(path)
    except (OSError, EOFError, zlib.error):
        ends = None
    located = _locate_events(ends) if ends else None
    if located is not None and located[2] is not None:
        try:
            header = orjson.loads(located[0])
            if isinstance(header, dict):
                return _normalize_header(header, path)
        except orjson.JSONDecodeError:
            pass
    header, _, _ = parse_document(path)  # odd layouts, truncated or corrupt files
    return _normalize_header(header, path)


def rank_of(header: dict, path) -> int | None:
    """pptrace block, then distributedInfo, then a ``rank{r}`` in the file name."""
    for source in (header.get("pptrace") or {}, header.get("distributedInfo") or {}):
        rank = source.get("rank")
        if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
            return rank
    match = _RANK_IN_NAME.search(Path(path).name)
    return int(match.group(1)) if match else None


def is_trace_name(name: str) -> bool:
    return name.endswith(_TRACE_SUFFIXES) and not name.startswith(".")


def find_trace_files(run_dir) -> list[Path]:
    """Trace files of a run: ``run_dir/traces/`` if it exists, else ``run_dir`` itself
    (``.json``, ``.json.gz``, ``*.pt.trace.json[.gz]``), sorted by name. A path to a single
    file is returned as is."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise TraceError(f"{run_dir}: no such file or directory; give a run directory or a trace file")
    if run_dir.is_file():
        return [run_dir]
    trace_dir = run_dir / "traces" if (run_dir / "traces").is_dir() else run_dir
    try:
        names = sorted(os.listdir(trace_dir))
    except OSError as exc:
        raise TraceError(f"cannot list {trace_dir}: {exc.strerror or exc}; check its permissions") from None
    files = [trace_dir / n for n in names if is_trace_name(n) and not (trace_dir / n).is_dir()]
    if not files:
        raise TraceError(
            f"{run_dir}: no trace files (*.json, *.json.gz) here or in {run_dir}/traces/; "
            "did the profiled steps run? (pptrace.profile writes traces/rank<r>.json.gz)"
        )
    return files


def _base_ns(header: dict) -> int:
    base = header.get("baseTimeNanoseconds")
    if not isinstance(base, int) or isinstance(base, bool) or abs(base) >= 2**62:
        return 0  # older traces write ts as epoch microseconds and no base
    return base


def load_rank(path, rank: int | None = None, *, typed: bool = True):
    """Parse one rank's trace -> (events DataFrame in the schema.py columns, meta dict).

    ``meta`` holds: path, rank, world_size, base_ns, pptrace (the block or None),
    distributed (distributedInfo or None), hostname, threads {tid: name}, profiler_steps,
    n_events, warnings (list of strings). Raises TraceError for files that are not traces.
    ``typed=False`` parses every event into a dict (the slow reference for the tests).
    """
    path = Path(path)
    data = _read_bytes(path)
    header, slices, warnings = parse_document(path, data, typed=typed)
    header = _normalize_header(header, path)
    base = _base_ns(header)
    rank = rank if rank is not None else rank_of(header, path)
    try:
        frame, info = build_frame(slices, 0 if rank is None else rank, base, path, warnings)
    except orjson.JSONDecodeError:
        # A cut landed inside an event (an unusual layout): parse the whole document.
        header, slices, warnings = parse_document(path, data, whole=True)
        header = _normalize_header(header, path)
        frame, info = build_frame(slices, 0 if rank is None else rank, base, path, warnings)
    del data, slices
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
        "pptrace": block,
        "distributed": dist,
        "hostname": (block or {}).get("hostname") or header.get("host_name"),
        **info,
        "warnings": warnings,
    }
    return frame, meta


# -------------------------------------------------------------------------------------------
# many ranks: parallel, cached
# -------------------------------------------------------------------------------------------
# Below this much trace data a process pool costs more (fork, pickling) than it saves.
_POOL_MIN_BYTES = 8 << 20
#: While it parses, a worker holds its trace's bytes, one slice's objects and the rank's
#: table: about this many times the trace's size (measured on bench_load's traces).
_WORKER_BYTES_PER_TRACE_BYTE = 2.5
#: The parent's assembled table, per byte of (uncompressed) trace.
_TABLE_BYTES_PER_TRACE_BYTE = 0.45
#: A process with pandas and pyarrow imported, plus what the first load adds to it.
_PROCESS_BYTES = 160 << 20


def _parse_job(path: str, rank: int | None, use_cache: bool):
    """Parse one trace -> (StoredTable, meta, None), or (None, None, error line). With
    ``use_cache`` the table goes to its cache entry (read back when the run's frame is
    assembled), else into compressed Arrow IPC bytes: the caller never holds the full
    pandas frame of a rank beyond this call."""
    from . import store as cache
    from .columnar import StoredTable, to_arrow

    try:
        frame, meta = load_rank(path, rank)
    except TraceError as exc:
        return None, None, str(exc)
    except (ValueError, TypeError, KeyError, OverflowError, MemoryError) as exc:
        # Data this loader did not foresee: lose this rank, keep the others.
        return None, None, f"{path}: could not be loaded ({type(exc).__name__}: {exc}); please report this trace"
    table = to_arrow(frame)
    del frame
    if use_cache:
        written = cache.write(path, table, meta)
        if written is not None:
            return StoredTable(table.num_rows, path=written), meta, None
    return StoredTable.pack(table), meta, None


def _worker_count(workers: int | None, sizes: list) -> int:
    """Processes for parsing ``sizes`` (bytes per trace). Explicit ``workers`` is obeyed
    (above _POOL_MIN_BYTES of traces). By default the traces are parsed in this process
    unless several workers fit in memory: the parent ends up holding the run's table
    (~_TABLE_BYTES_PER_TRACE_BYTE of the traces) above its own _PROCESS_BYTES, and each
    worker ~2.5x its largest trace; workers are added only while all of it stays below the
    traces' total size (bench_load's 8 x 47 MB on any machine: no worker)."""
    total = sum(sizes)
    if not sizes or total < _POOL_MIN_BYTES:
        return 1
    if workers is not None:
        return max(1, min(int(workers), len(sizes)))
    spare = total * (1 - _TABLE_BYTES_PER_TRACE_BYTE) - _PROCESS_BYTES
    per_worker = _WORKER_BYTES_PER_TRACE_BYTE * max(sizes)
    fits = int(spare // per_worker) if per_worker else 1
    return max(1, min(os.cpu_count() or 1, len(sizes), fits))


def _progress(enabled, total: int):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or total < 2:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=Console(stderr=True), transient=True,
    )


def load_ranks(jobs, *, use_cache: bool = True, workers: int | None = None, progress=None):
    """Load many traces -> (list of (StoredTable, meta) in job order, errors).

    ``jobs`` is a list of (path, rank or None). Valid cache entries are only looked up
    (their footer); the rest are parsed here or in up to ``workers`` processes (default:
    as many as memory allows, see _worker_count), one trace at a time per process. Each
    rank's table stays compact (its cache entry, or compressed Arrow bytes) until
    :func:`pptrace.ingest.columnar.frame_from_tables` assembles the run's frame once.
    ``errors`` lists one line per file that could not be loaded (its slot is None).
    """
    from . import store as cache

    results: list = [None] * len(jobs)
    errors: list[str] = []
    todo = []
    for i, (path, rank) in enumerate(jobs):
        hit = cache.lookup(path) if use_cache else None
        if hit is not None:
            results[i] = hit
        else:
            todo.append(i)
    if not todo:
        return results, errors
    sizes = [os.path.getsize(jobs[i][0]) if os.path.exists(jobs[i][0]) else 0 for i in todo]
    n_workers = _worker_count(workers, sizes)
    bar = _progress(progress, len(todo))

    def collect(i, outcome):
        stored, meta, error = outcome
        if error is not None:
            errors.append(error)
        else:
            results[i] = (stored, meta)

    try:
        task = bar.add_task("loading traces", total=len(todo)) if bar else None
        if bar:
            bar.start()
        if n_workers > 1:
            with ProcessPoolExecutor(max_workers=n_workers) as pool:
                futures = {pool.submit(_parse_job, str(jobs[i][0]), jobs[i][1], use_cache): i for i in todo}
                for future in as_completed(futures):
                    try:
                        outcome = future.result()
                    except Exception as exc:  # a worker died (out of memory, killed)
                        outcome = (None, None, f"{jobs[futures[future]][0]}: worker failed ({type(exc).__name__}: {exc})")
                    collect(futures[future], outcome)
                    if bar:
                        bar.advance(task)
        else:
            for i in todo:
                collect(i, _parse_job(str(jobs[i][0]), jobs[i][1], use_cache))
                if bar:
                    bar.advance(task)
    finally:
        if bar:
            bar.stop()
    return results, errors
