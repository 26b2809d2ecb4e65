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
give the same table. Ranks are parsed in child processes (one, or as many as fit in memory:
see _worker_count), each rank's table kept compressed until the run's frame is assembled
once (columnar.frame_from_tables).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import stat
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import msgspec
import numpy as np
import orjson

from ..errors import TraceError
from ..progress import LOAD, phase
from .frame import build_frame
from .schema import RawEvent

#: Separators between events, most specific first: Kineto's indented output, then compact.
_SEPARATORS = (b"\n  },\n  {", b"}, {", b"},{")
#: Slices of ~256 KB stay in the CPU caches while they are decoded: 1.4x faster than 4 MB.
_CHUNK_BYTES = 256 << 10
_HEADER_PEEK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_GZIP_MIN_BYTES = 18  # the 10-byte header and the 8-byte trailer
_SLICE_JUNK = b", \n\t\r"  # around the events of a slice
_EVENTS_KEY = b'"traceEvents"'
_TRACE_SUFFIXES = (".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


_BOM = b"\xef\xbb\xbf"
#: Deeper values than this are replaced by null before decoding: real traces nest a few
#: levels (Input Dims is a list of lists), and the decoders recurse per level (msgspec
#: stops at the interpreter's limit; orjson 3.8 does not stop and overflows the C stack).
_MAX_DEPTH = 64
_SKIP_DECODER = msgspec.json.Decoder(msgspec.Raw)
_FILE_KINDS = (
    (stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a named pipe (FIFO)"),
    (stat.S_ISSOCK, "is a socket"), (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
)


def _not_regular(path, mode: int) -> TraceError:
    kind = next((what for test, what in _FILE_KINDS if test(mode)), "is not a regular file")
    return TraceError(
        f"{path}: {kind}, not a trace file; pptrace reads regular files only (a symlink to one is "
        "fine): move it out of the traces directory"
    )


def open_trace(path):
    """(binary file object, its os.stat_result) of a trace, refusing anything but a regular
    file (or a symlink to one): a FIFO named rank2.json would block the read forever, a
    device never ends. The stat is the opened file's, so it describes the bytes read even
    if the path is replaced meanwhile."""
    try:
        # stat first: merely opening some devices has effects; O_NONBLOCK: a FIFO swapped in
        # between the two calls opens at once (and is refused below) instead of blocking.
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise TraceError(
            f"cannot read {path}: {exc.strerror or exc}; check that the file exists and is readable"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(path, st.st_mode)
    return os.fdopen(fd, "rb"), st


def _strip_bom(data: bytes) -> bytes:
    # Windows editors and PowerShell put one in front of the JSON they save; JSON parsers reject it.
    return data[len(_BOM):] if data.startswith(_BOM) else data


def _read_trace(path: Path):
    """(decompressed bytes, stat of the file read, its raw bytes' cache probe)."""
    fh, st = open_trace(path)
    try:
        with fh:
            data = fh.read()
    except OSError as exc:
        raise TraceError(
            f"cannot read {path}: {exc.strerror or exc}; check that the file exists and is readable"
        ) from None
    from .store import probe_of

    probe = probe_of(data) if len(data) == st.st_size else None  # shorter/longer: written meanwhile
    if data[:2] == _GZIP_MAGIC:
        try:
            data = _gunzip(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(
                f"{path}: corrupt or truncated gzip ({exc}); re-copy the file or re-run the profiler"
            ) from None
    data = _strip_bom(data)
    if not data or data.isspace():  # not strip(): that copies the whole trace
        raise TraceError(f"{path}: empty file; the rank probably died before writing its trace")
    return data, st, probe


def _gunzip(raw: bytes) -> bytes:
    """gzip.decompress at half its peak memory: its output grows in blocks joined at the
    end (2x the trace at once); sized by the trailer's length, zlib fills one buffer. The
    trailer describes the last member, so a file of several members (``cat a.gz b.gz``),
    whose first member then disagrees in length or CRC, takes gzip's way."""
    if len(raw) >= _GZIP_MIN_BYTES:
        crc, size = _gzip_trailer(raw[-8:])
        data = zlib.decompress(raw, 16 + zlib.MAX_WBITS, max(size, 1))
        if len(data) == size and zlib.crc32(data) == crc:
            return data
        del data
    return gzip.decompress(raw)


def _gzip_trailer(last8: bytes) -> tuple[int, int]:
    """(CRC-32, length modulo 4 GiB) of a gzip file's last member, from its last 8 bytes."""
    return int.from_bytes(last8[:4], "little"), int.from_bytes(last8[4:], "little")


def _read_bytes(path: Path) -> bytes:
    return _read_trace(path)[0]


def _too_deep(blob) -> bool:
    """Whether ``blob`` nests deeper than the decoders can follow. msgspec skipping a value
    builds nothing (7x faster than parsing it) and stops at the interpreter's recursion
    limit; malformed input is left for the real parse to report."""
    try:
        _SKIP_DECODER.decode(blob)
    except RecursionError:
        return True
    except msgspec.DecodeError:
        pass
    return False


def _flatten_deep(blob: bytes, path, warnings: list) -> bytes | None:
    """``blob`` with every value nested deeper than _MAX_DEPTH replaced by null (None when
    none is): unused deep ``args`` cost their event nothing. Depth is counted over the
    whole byte array, brackets inside strings (after an unescaped quote) excluded."""
    a = np.frombuffer(blob, dtype=np.uint8)
    index = np.arange(len(a), dtype=np.int64)
    backslash = a == ord("\\")
    last_plain = np.maximum.accumulate(np.where(backslash, -1, index))
    # a quote after an odd run of backslashes is escaped
    run = index - 1 - np.concatenate(([-1], last_plain[:-1]))
    quote = (a == ord('"')) & (run % 2 == 0)
    del index, last_plain, run, backslash
    outside = np.cumsum(quote, dtype=np.int64) % 2 == 0
    opens = ((a == ord("{")) | (a == ord("["))) & outside
    closes = ((a == ord("}")) | (a == ord("]"))) & outside
    after = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32), dtype=np.int32)
    before = after - opens + closes
    # from the bracket that opens level _MAX_DEPTH + 1 to the one that closes it
    deep = (after > _MAX_DEPTH) | (before > _MAX_DEPTH)
    del after, before, opens, closes, outside
    edges = np.diff(np.concatenate(([0], deep.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return None
    warnings.append(
        f"{path}: {len(starts)} value(s) nested more than {_MAX_DEPTH} levels deep replaced by null "
        "(pptrace reads a few levels of event args)"
    )
    keep_from, keep_to = np.concatenate(([0], ends)), np.concatenate((starts, [len(a)]))
    return b"null".join(blob[i:j] for i, j in zip(keep_from.tolist(), keep_to.tolist()))


def _orjson(blob):
    """orjson.loads, refusing (JSONDecodeError) what nests too deep for it."""
    if _too_deep(blob):
        raise orjson.JSONDecodeError(f"nested more than {_MAX_DEPTH} levels deep", "", 0)
    return orjson.loads(blob)


def _loads(blob: bytes, path: Path, warnings: list, fixes=("deep", "utf8")):
    """orjson, with the slow fallbacks that real traces need: ints beyond 64 bits (json
    keeps them as Python ints), invalid UTF-8 (replaced, with a warning) and values nested
    too deep (replaced by null, with a warning)."""
    if "deep" in fixes and _too_deep(blob):
        flat = _flatten_deep(blob, path, warnings)
        rest = tuple(f for f in fixes if f != "deep")
        return _loads(flat if flat is not None else blob, path, warnings, rest)
    try:
        return orjson.loads(blob)
    except orjson.JSONDecodeError as exc:
        message = str(exc)
    if "utf8" in fixes and ("UTF-8" in message or "utf-8" in message):
        warnings.append(f"{path}: invalid UTF-8 in the trace; bad bytes replaced by U+FFFD")
        fixed = blob.decode("utf-8", "replace").encode("utf-8")
        return _loads(fixed, path, warnings, tuple(f for f in fixes if f != "utf8"))
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
            _orjson(head)
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
        except RecursionError:
            flat = _flatten_deep(blob, path, warnings)
            if flat is not None:
                return _decode_slice(decoder, flat, path, warnings)
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
    data = _read_bytes(path) if data is None else _strip_bom(data)
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
            block = _orjson(block)
        except orjson.JSONDecodeError:
            block = None
    header = dict(header)
    header["pptrace"] = block if isinstance(block, dict) else None
    dist = header.get("distributedInfo")
    header["distributedInfo"] = dist if isinstance(dist, dict) else None
    return header


def _head_and_tail(path: Path, enough: tuple = ()) -> bytes | None:
    """The first and the last ``_HEADER_PEEK`` bytes of the (decompressed) trace joined at
    the events array's opening bracket, or the whole document when it is that small: what
    :func:`_locate_events` needs to see the metadata on both sides of ``traceEvents``
    (pptrace's own traces carry the pptrace block before the events; Kineto writes its
    top-level metadata after them). The events between are streamed past, never parsed.
    ``enough``: keys any of which, found before the events, makes the head alone the answer
    (a document with its events array emptied): no inflating a .gz to its end for them."""
    raw, _ = open_trace(path)
    with raw:
        fh = gzip.GzipFile(fileobj=raw, mode="rb") if raw.peek(2)[:2] == _GZIP_MAGIC else raw
        head = _strip_bom(fh.read(_HEADER_PEEK))
        if enough and (alone := _head_alone(head, enough)) is not None:
            return alone
        tail = fh.read(_HEADER_PEEK)
        if len(tail) < _HEADER_PEEK:
            return head + tail
        while True:  # keep only the last window: bounded memory on any trace size
            more = fh.read(_HEADER_PEEK)
            if not more:
                break
            tail = tail[len(more):] + more if len(more) < _HEADER_PEEK else more
    bracket = _events_bracket(head)
    return head[: bracket + 1] + tail if bracket >= 0 else None


def _events_bracket(head: bytes) -> int:
    """Where the events array opens in the first bytes of a trace (-1: not there)."""
    key = head.find(_EVENTS_KEY)
    return head.find(b"[", key) if key >= 0 else -1


def _head_alone(head: bytes, enough: tuple) -> bytes | None:
    """The metadata before the events as a document of its own, if it holds any of ``enough``."""
    bracket = _events_bracket(head)
    if bracket < 0:
        return None
    alone = head[: bracket + 1] + b"]}"
    try:
        found = orjson.loads(alone)
    except orjson.JSONDecodeError:
        return None
    return alone if isinstance(found, dict) and any(found.get(k) is not None for k in enough) else None


def read_header(path, *, cached: bool = False, enough: tuple = ()) -> dict:
    """The top-level metadata of a trace (distributedInfo, pptrace block, baseTimeNanoseconds,
    ...) wherever it sits, before or after ``traceEvents``, without building the events
    table. The one reader of headers: :func:`load_rank` gets its header from the same
    :func:`_locate_events` split of the whole document and keeps it in its meta, so that
    with ``cached`` a valid cache entry gives it without decompressing the trace (reaching
    the metadata after the events of a .gz means inflating all of it). ``enough``: keys
    written together (torch.profiler's add_metadata_json keys, which Kineto writes before
    the events); when the metadata before the events has one of them, the rest of the
    header (Kineto's baseTimeNanoseconds, traceName, after the events) is not read, and a
    key of ``enough`` that a rewritten file moved after the events is missed: the caller
    gets it from the load's full header (run.load_run)."""
    path = Path(path)
    header = _cached_header(path) if cached else None
    if header is not None:
        return _checked(header, path)
    try:
        ends = _head_and_tail(path, enough)
    except (OSError, EOFError, zlib.error):
        ends = None
    header = None
    located = _locate_events(ends) if ends else None
    if located is not None and located[2] is not None:
        try:
            header = _orjson(located[0])
        except orjson.JSONDecodeError:
            pass
    if not isinstance(header, dict):
        header, _, _ = parse_document(path)  # odd layouts, truncated or corrupt files
    return _checked(_normalize_header(header, path), path)


def _cached_header(path: Path) -> dict | None:
    from .store import lookup

    found = lookup(path)
    header = found[1].get("header") if found is not None else None
    return header if isinstance(header, dict) else None


def _checked(header: dict, path: Path) -> dict:
    writer = _pptrace_output(header)
    if writer is not None:
        raise TraceError(
            f"{path}: written by `{writer}`, not one rank's trace; keep pptrace's outputs outside "
            "the traces directory"
        )
    return header


def _pptrace_output(header: dict) -> str | None:
    """The pptrace command that wrote this trace when it is pptrace's own output (the
    metadata export/perfetto.py and whatif/predict.py write), else None: a merged trace or
    a simulated one in a traces directory is not one more rank."""
    other = header.get("otherData")
    if isinstance(other, dict) and isinstance(other.get("pptrace"), dict) \
            and not header.get("pptrace"):  # (normalized: None where absent)
        return "pptrace merge"
    if isinstance(header.get("pptrace_whatif"), dict):
        return "pptrace whatif --trace"
    return None


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
    if not run_dir.is_dir():  # one file; read_header refuses it if it is no regular file
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


def _unchanged(path: Path, opened: os.stat_result) -> bool:
    """Whether ``path`` still names the file opened as ``opened``, as it was: not replaced
    (another inode) nor written (size, mtime, and ctime, which ``touch -r`` cannot set back)."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    fields = ("st_ino", "st_dev", "st_size", "st_mtime_ns", "st_ctime_ns")
    return all(getattr(now, f) == getattr(opened, f) for f in fields)


def _load_rank(path, rank: int | None = None, *, typed: bool = True, compact: bool = True):
    """load_rank, plus the cache key of the bytes parsed: None when the file changed while
    it was read, so that no entry ever holds one version's table under another's key."""
    from .store import key_of

    path = Path(path)
    data, opened, probe = _read_trace(path)
    header, slices, warnings = parse_document(path, data, typed=typed)
    header = _normalize_header(header, path)
    base = _base_ns(header)
    rank = rank if rank is not None else rank_of(header, path)
    del data  # the slices hold the bytes until the last one is parsed, not beyond
    try:
        frame, info = build_frame(slices, 0 if rank is None else rank, base, path, warnings, compact=compact)
    except orjson.JSONDecodeError:
        # A cut landed inside an event (an unusual layout): parse the whole document, read
        # again (a change meanwhile leaves the entry uncached: _unchanged below).
        header, slices, warnings = parse_document(path, _read_trace(path)[0], whole=True)
        header = _normalize_header(header, path)
        frame, info = build_frame(slices, 0 if rank is None else rank, base, path, warnings, compact=compact)
    del slices
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
        "header": header,  # for read_header from the cache
        **info,
        "warnings": warnings,
    }
    if probe is not None and _unchanged(path, opened):
        return frame, meta, key_of(opened, probe)
    warnings.append(
        f"{path}: changed while pptrace read it; these results are of the version read (not "
        "cached): run again for the current one"
    )
    return frame, meta, None


# -------------------------------------------------------------------------------------------
# many ranks: parallel, cached
# -------------------------------------------------------------------------------------------
# Below this much trace data a process pool costs more (fork, pickling) than it saves.
_POOL_MIN_BYTES = 8 << 20
#: While it parses, a worker holds the trace's decompressed bytes, one slice's objects and
#: the rank's table before folding: at most this many times the (decompressed) trace, on
#: top of what it shares with the parent (measured on bench_analyze's 8-rank trainer run).
_WORKER_BYTES_PER_TRACE_BYTE = 1.7
#: What the analysis adds to the parent once the run's table is assembled, per byte of
#: (decompressed) trace: the compact table and the analyses' working arrays (same run).
_ANALYSIS_BYTES_PER_TRACE_BYTE = 0.25


def trace_size(path) -> int:
    """The decompressed size of a trace: a .gz's trailer gives it (modulo 4 GiB, so a
    length below the file's own is taken as the usual 10:1)."""
    try:
        fh, st = open_trace(path)  # never a FIFO's open, which would block
        with fh:
            size = st.st_size
            if fh.read(2) != _GZIP_MAGIC or size < _GZIP_MIN_BYTES:
                return size
            fh.seek(-8, os.SEEK_END)
            _, inflated = _gzip_trailer(fh.read(8))
    except (OSError, TraceError):
        return 0
    return inflated if inflated >= size else 10 * size


def _parse_job(path: str, rank: int | None, use_cache: bool, compact: bool = True):
    """Parse one trace -> (StoredTable, meta, None), or (None, None, error line). With
    ``use_cache`` the table goes to its cache entry (read back when the run's frame is
    assembled), else into compressed Arrow IPC bytes: the caller never holds the full
    pandas frame of a rank beyond this call. The cache holds compact tables only."""
    from . import memory, store as cache
    from .columnar import StoredTable, to_arrow

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
    """Child processes for parsing traces of ``sizes`` (decompressed bytes each); 0: parse
    in this process, for less than _POOL_MIN_BYTES of traces. Otherwise at least one: the
    heap a parse fragments then goes with the child, and the parent enters the analysis
    with only the tables (its peak is that of a cached run); where processes are spawned,
    not forked, one child is not worth it (0). Explicit ``workers`` is obeyed; by default
    workers are added while their parses together take no more memory than the analysis
    will (so the parse phase never sets the peak) and CPUs are free."""
    total = sum(sizes)
    if not sizes or total < _POOL_MIN_BYTES:
        return 0
    if workers is not None:
        return max(1, min(int(workers), len(sizes)))
    per_worker = _WORKER_BYTES_PER_TRACE_BYTE * max(sizes)
    fits = int(_ANALYSIS_BYTES_PER_TRACE_BYTE * total // per_worker) if per_worker else 1
    n = max(1, min(os.cpu_count() or 1, len(sizes), fits))
    if n == 1 and _start_method() != "fork":
        # a spawned child imports pandas again (~0.3 s) and re-runs a script's unguarded
        # top level: one child is worth it only where it is forked
        return 0
    return n


def _start_method() -> str:
    """How ProcessPoolExecutor will start processes here, without fixing the choice."""
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def load_ranks(jobs, *, use_cache: bool = True, workers: int | None = None, progress=None,
               compact: bool = True, scheduler: str | None = None):
    """Load many traces -> (list of (StoredTable, meta) in job order, errors).

    ``jobs`` is a list of (path, rank or None). Valid cache entries are only looked up
    (their footer); the rest are parsed in ``workers`` child processes (default: as many as
    memory allows, see _worker_count; none for a few MB of traces), one trace at a time per
    process. Each rank's table stays compact (its cache entry, or compressed Arrow bytes) until
    :func:`pptrace.ingest.columnar.frame_from_tables` assembles the run's frame once.
    ``errors`` lists one line per file that could not be loaded (its slot is None).

    ``scheduler``: parse on Dask instead (pptrace.ingest.cluster), every trace not in the
    cache being one task: ``"local"`` (cluster.LOCAL) starts a cluster of ``workers``
    processes on this machine for the load, an address (``tcp://HOST:8786``) uses that
    scheduler's workers. A rank Dask cannot load raises TraceError, never a missing slot.
    """
    from . import store as cache

    results: list = [None] * len(jobs)
    errors: list[str] = []
    todo = []
    use_cache = use_cache and compact  # the cache holds compact tables only
    if use_cache:
        for directory in {cache.cache_path(path).parent for path, _ in jobs}:
            cache.remove_stale_tmp(directory)
    for i, (path, rank) in enumerate(jobs):
        hit = cache.lookup(path) if use_cache else None
        if hit is not None:
            results[i] = hit
        else:
            todo.append(i)
    if not todo:
        return results, errors
    # the same arguments in this process, in a pool or on Dask
    calls = {i: (str(jobs[i][0]), jobs[i][1], use_cache, compact) for i in todo}
    cached = len(jobs) - len(todo)
    label = f"{LOAD} ({cached} from cache)" if cached else LOAD
    if scheduler is not None:
        from .cluster import LOCAL, describe

        if scheduler == LOCAL:  # no more processes to start than traces to parse
            workers = min(int(workers or os.cpu_count() or 1), len(todo))
        label = f"{label} on {describe(scheduler, workers)}"
        n_workers = 0
    else:
        n_workers = _worker_count(workers, [trace_size(jobs[i][0]) for i in todo])
    shown = phase(label, total=len(todo), enabled=progress)

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
            from .cluster import map_jobs

            map_jobs(scheduler, workers, calls, collect)
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
    return results, errors
