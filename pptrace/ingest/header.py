"""A trace's header (its top-level metadata: distributedInfo, the pptrace block, Kineto's
baseTimeNanoseconds) without its events, and what the loader reads from it: the rank, the
clock base, whether the file is pptrace's own output rather than one rank's trace.

The metadata sits on both sides of ``traceEvents`` (pptrace's block before, Kineto's after), so
a header is read from the document's two ends (document.py locates the events array between
them), or from a valid cache entry without inflating the trace at all.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import orjson

from ..errors import TraceError
from .document import _EVENTS_KEY, _locate_events, _orjson, _strip_bom, parse_document
from .files import GZIP_MAGIC, inflated_pieces, is_nsys_name, open_trace, rank_in_name
from .store import lookup
from . import nsys

_HEADER_PEEK = 1 << 20


@dataclass(frozen=True)
class RankHeader:
    """What the layers above ingest need of one rank's file, whichever reader read it (the
    Kineto JSON reader, ingest/nsys.py): the typed view of a load's meta, so that no caller
    reaches into a Kineto-shaped dict. ``pptrace`` / ``distributed``: the pptrace block and
    distributedInfo where the file has them (an nsys export: distributed holds the rank and
    world size its recorded environment names)."""

    path: str
    rank: int
    world_size: int | None
    base_ns: int
    clock_unknown: bool
    hostname: str | None
    pptrace: dict | None
    distributed: dict | None
    reader: str  # "kineto" or "nsys"

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"{self.path}: rank must be a non-negative int, not {self.rank!r}")
        if self.reader not in ("kineto", "nsys"):
            raise ValueError(f"{self.path}: unknown reader {self.reader!r}")

    @classmethod
    def of(cls, meta: dict) -> "RankHeader":
        """The header of a load's (or a cache entry's) meta."""
        return cls(path=meta["path"], rank=meta["rank"], world_size=meta.get("world_size"),
                   base_ns=int(meta.get("base_ns") or 0), clock_unknown=bool(meta.get("clock_unknown")),
                   hostname=meta.get("hostname"), pptrace=meta.get("pptrace"), distributed=meta.get("distributed"),
                   reader="nsys" if is_nsys_name(meta["path"]) else "kineto")

    @property
    def pg_config(self):
        """distributedInfo's pg_config (torch.profiler traces of NCCL runs), else None."""
        return (self.distributed or {}).get("pg_config")

    @property
    def clock(self) -> dict:
        """The pptrace block's wall-clock/perf-clock pair ({} without one)."""
        return (self.pptrace or {}).get("clock") or {}


def normalize_header(header: dict, path: Path) -> dict:
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
    raw, st = open_trace(path)
    with raw:
        gz = raw.peek(2)[:2] == GZIP_MAGIC
        if gz:  # inflated within the limits, a window at a time
            pieces = iter(lambda: raw.read(_HEADER_PEEK), b"")
            windows = _windows(inflated_pieces(pieces, path, st.st_size), _HEADER_PEEK)
        read = (lambda: next(windows, b"")) if gz else (lambda: raw.read(_HEADER_PEEK))
        head = _strip_bom(read())
        if enough and (alone := _head_alone(head, enough)) is not None:
            return alone
        if not gz:  # straight to the end: the events between are never read
            raw.seek(max(raw.tell(), st.st_size - _HEADER_PEEK))
        tail = read()
        if len(tail) < _HEADER_PEEK:  # the whole document (a plain file's seek stayed put)
            return head + tail
        while gz:  # keep only the last window: bounded memory on any trace size
            more = read()
            if not more:
                break
            tail = tail[len(more):] + more if len(more) < _HEADER_PEEK else more
    bracket = _events_bracket(head)
    return head[: bracket + 1] + tail if bracket >= 0 else None


def _windows(pieces, size: int):
    """The bytes of ``pieces`` again, ``size`` at a time (the last one shorter)."""
    buffer = b""
    for piece in pieces:
        buffer += piece
        while len(buffer) >= size:
            yield buffer[:size]
            buffer = buffer[size:]
    if buffer:
        yield buffer


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


def read_header(path, *, cached: bool = False, enough: tuple = (), entries=None) -> dict:
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
    gets it from the load's full header (run.load_run). ``entries``: the cache as the caller's
    load sees it (store.Entries), for many headers in a row."""
    path = Path(path)
    if is_nsys_name(path.name):  # an export's header is a few small queries: never cached
        return _checked(normalize_header(nsys.read_header(path), path), path)
    header = _cached_header(path, entries) if cached else None
    if header is not None:
        return _checked(header, path)
    try:
        ends = _head_and_tail(path, enough)
    except (OSError, EOFError, zlib.error):
        ends = None
    header = None
    located = _locate_events(ends) if ends else None
    if located is not None and located.end is not None:
        try:
            header = _orjson(located.head)
        except orjson.JSONDecodeError:
            pass
    if not isinstance(header, dict):
        header, _, _ = parse_document(path)  # odd layouts, truncated or corrupt files
    return _checked(normalize_header(header, path), path)


def _cached_header(path: Path, entries=None) -> dict | None:
    found = entries.lookup(path) if entries is not None else lookup(path)
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
    return rank_in_name(path)


#: No clock reads this many nanoseconds (year 2116); a base beyond it is corrupt.
_MAX_BASE_NS = 2**62


def base_time(header: dict) -> tuple[int, str | None]:
    """(Kineto's baseTimeNanoseconds as an int, None), or (0, what is wrong with it) for a
    value that is no clock ("x", true, 1e30): then the rank's times have no known origin.
    Absent, it is (0, None): older traces write ts as epoch microseconds and no base."""
    given = base = header.get("baseTimeNanoseconds")
    if base is None:
        return 0, None
    if isinstance(base, float) and math.isfinite(base) and base == int(base):
        base = int(base)  # an exporter that writes every number as a double
    if isinstance(base, int) and not isinstance(base, bool) and 0 <= base < _MAX_BASE_NS:
        return base, None
    shown = json.dumps(given) if isinstance(given, (bool, int, float, str)) else type(given).__name__
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    why = "beyond any clock" if isinstance(base, (int, float)) and not isinstance(base, bool) else "not a number"
    return 0, f"baseTimeNanoseconds is {shown}, {why}"
