"""A torch.profiler trace's JSON document -> its header and its events, fast and with bounded memory.

A torch.profiler trace is one JSON document whose ``traceEvents`` array holds every event.
Parsing it whole with orjson needs ~8x the file size in Python objects, so the array is cut
into slices of ~256 KB at event boundaries and each slice is parsed and turned into columns
before the next one (frame.build_frame). A raw newline cannot occur inside a JSON string, so a
cut at ``}\\n  {`` / ``}, {`` that lands inside an event makes that slice unparseable (unbalanced
braces); the loader then falls back to parsing the whole document, never to a wrong answer.

Slices are decoded by msgspec into :class:`~pptrace.ingest.schema.RawEvent` structs that declare
only the fields the table needs (everything else is skipped, never built); a slice msgspec
rejects (invalid UTF-8, NaN, an odd value) is parsed by orjson/json into dicts instead, which
give the same table. The header (top-level metadata) alone is header.py's to read.

The loader slices a trace while it reads and inflates it (:class:`StreamedTrace`: a few MB of
the document in memory, never all of it), by the same cut rule as the whole buffer
(:func:`_cuts`), hence the same slices and table; what that cannot read (a damaged gzip, a
BOM, an array that does not end, a cut inside an event) is read whole as before.

Reading the bytes, locating the events, slicing (whole or streamed), decoding, and salvaging
a damaged document (too deep, not UTF-8, cut short) stay one module: one job on one buffer,
whose offsets every part shares.
"""
from __future__ import annotations

import itertools
import json
import zlib
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np
import orjson

from ..errors import TraceError
from .files import GZIP_MAGIC, RawPieces, TruncatedGzip, gunzip, inflated_pieces, open_trace, size_limit
from .schema import RawEvent
from .store import probe_of

#: Separators between events, most specific first: Kineto's indented output, then compact.
_SEPARATORS = (b"\n  },\n  {", b"}, {", b"},{")
#: Slices of ~256 KB stay in the CPU caches while they are decoded: 1.4x faster than 4 MB.
_CHUNK_BYTES = 256 << 10
_SLICE_JUNK = b", \n\t\r"  # around the events of a slice
_EVENTS_KEY = b'"traceEvents"'
_BOM = b"\xef\xbb\xbf"
#: Deeper values than this are replaced by null before decoding: real traces nest a few
#: levels (Input Dims is a list of lists), and the decoders recurse per level (msgspec
#: stops at the interpreter's limit; orjson 3.8 does not stop and overflows the C stack).
_MAX_DEPTH = 64
_SKIP_DECODER = msgspec.json.Decoder(msgspec.Raw)


def _strip_bom(data: bytes) -> bytes:
    # Windows editors and PowerShell put one in front of the JSON they save; JSON parsers reject it.
    return data[len(_BOM):] if data.startswith(_BOM) else data


def read_trace(path: Path):
    """(decompressed bytes, stat of the file read, its raw bytes' cache probe); TraceError for
    a trace past files.size_limit / files.inflate_limit, read no further than them."""
    fh, st = open_trace(path)
    try:
        with fh:
            limit, too_big = size_limit(path)
            if st.st_size > limit:  # a .gz inflates to no less than its own size
                raise TraceError(too_big)
            # read(n) allocates n bytes up front: no more than the file holds (+1: one that
            # grew meanwhile reads short of whole, its probe then skipped)
            data = fh.read(min(limit, st.st_size) + 1)
    except OSError as exc:
        raise TraceError(
            f"cannot read {path}: {exc.strerror or exc}; check that the file exists and is readable"
        ) from None
    if len(data) > limit:
        raise TraceError(too_big)
    probe = probe_of(data) if len(data) == st.st_size else None  # shorter/longer: written meanwhile
    if data[:2] == GZIP_MAGIC:
        try:
            data = _gunzip(data, path)
        except TruncatedGzip as exc:  # what inflated is salvaged as a truncated .json is
            if not exc.data.strip():
                raise TraceError(f"{path}: truncated gzip with nothing inflated before the cut; re-copy the file "
                                 "or re-run the profiler") from None
            data = exc.data
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(
                f"{path}: corrupt or truncated gzip ({exc}); re-copy the file or re-run the profiler"
            ) from None
    data = _strip_bom(data)
    if not data or data.isspace():  # not strip(): that copies the whole trace
        raise TraceError(f"{path}: empty file; the rank probably died before writing its trace")
    return data, st, probe


def _gunzip(raw: bytes, path="the trace") -> bytes:
    """files.gunzip: inflated within the limits, in one buffer, several members as gzip reads them."""
    return gunzip(raw, path)


def _read_bytes(path: Path) -> bytes:
    data, _, _ = read_trace(path)
    return data


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
        error = exc
    message = str(error)
    if "utf8" in fixes and ("UTF-8" in message or "utf-8" in message):
        warnings.append(f"{path}: invalid UTF-8 in the trace; bad bytes replaced by U+FFFD")
        fixed = blob.decode("utf-8", "replace").encode("utf-8")
        return _loads(fixed, path, warnings, tuple(f for f in fixes if f != "utf8"))
    try:
        return json.loads(blob)
    except (ValueError, RecursionError):
        raise error from None  # orjson's, which says where (a new one would add "char 0")


def _last_byte(data: bytes, start: int, end: int) -> bytes:
    """The last non-whitespace byte of data[start:end] (b"" if none), without copying it."""
    while end > start and data[end - 1] in b" \t\r\n":
        end -= 1
    return data[end - 1:end] if end > start else b""


class _Located(NamedTuple):
    """Where :func:`_locate_events` found the events array."""

    head: bytes       # the document with its events array emptied: the header
    start: int        # the first byte inside the array
    end: int | None   # its closing bracket; None: truncated, none found


def _locate_events(data: bytes) -> _Located | None:
    """The header and where the events array lies, or None when there is no array."""
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
            return _Located(head, start + 1, end)
        except orjson.JSONDecodeError:
            tries += 1
    return _Located(data[:start] + b"[]}", start + 1, None)  # truncated: no closing bracket found


def _separator(data: bytes, start: int, stop: int) -> bytes | None:
    """The separator between the events of the array that opens at ``start``: the first of
    _SEPARATORS found before ``stop`` (a slice further on, or the array's end)."""
    return next((s for s in _SEPARATORS if data.find(s, start, stop) >= 0), None)


def _cuts(buf: bytes, base: int, sep: bytes, pos: int, end: int | None = None):
    """(cut, where the next cut is searched from) for each cut from ``pos`` on, positions in
    the document of which ``buf`` holds the bytes from ``base`` up to ``end`` (None: to its
    own end): the first ``sep`` at or after ``pos``, cut just after its event's closing
    brace, the next one searched a slice further on. One rule for a whole buffer
    (:func:`_cut_points`) and for a streamed one (:class:`StreamedTrace`), so both slice a
    trace the same way."""
    close = sep.index(b"}") + 1
    stop = len(buf) if end is None else end - base
    while pos - base < stop:
        hit = buf.find(sep, pos - base, stop)
        if hit < 0:
            return
        pos = base + hit + _CHUNK_BYTES
        yield base + hit + close, pos


def _cut_points(data: bytes, start: int, end: int) -> list[int]:
    sep = _separator(data, start, min(end, start + _CHUNK_BYTES))
    cuts = [start]
    if sep is not None:
        cuts += [cut for cut, _ in _cuts(data, 0, sep, start + _CHUNK_BYTES, end)]
    cuts.append(end)
    return cuts


def _slice(decoder, data: bytes, a: int, b: int, path: Path, warnings: list):
    """(events, slice bytes) of the events in data[a:b], around them separators and blanks."""
    while a < b and data[a] in _SLICE_JUNK:
        a += 1
    while b > a and data[b - 1] in _SLICE_JUNK:
        b -= 1
    with memoryview(data) as buffer:
        blob = b"".join((b"[", buffer[a:b], b"]"))  # one copy, not three
    return _decode_slice(decoder, blob, path, warnings), blob


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
    for a, b in zip(cuts[:-1], cuts[1:]):
        yield _slice(decoder, data, a, b, path, warnings)


#: What the warning of a salvaged trace says (load.py skips a rank the cut left without a
#: whole step: its steps' marks, Kineto writes them last, or every step interrupted)
TRUNCATED = "truncated trace (the rank died while writing it?)"


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
            warnings.append(f"{path}: {TRUNCATED}; using the {len(events)} events before the cut")
            _drop_interrupted_steps(events, path, warnings)
            return [(events, blob)]
    return None


def _drop_interrupted_steps(events: list, path: Path, warnings: list) -> None:
    """A step the cut lands in lost what came after the cut: analysed, it would read as a
    step of little compute and much idle. Its ProfilerStep mark (and any later one) ends past
    the last event kept, so it is made an instant event: the step is no step of this rank,
    its events outside every step, and the text of each event stays where it was (the slice's
    bytes are read again for exact times, one ts per event)."""
    def number(value):
        return value if type(value) in (int, float) else None

    last = max((t for t in (number(e.get("ts")) for e in events if type(e) is dict) if t is not None), default=None)
    marks = [e for e in events if type(e) is dict and e.get("ph") == "X"
             and str(e.get("name", "")).startswith("ProfilerStep#")
             and number(e.get("ts")) is not None and number(e.get("dur")) is not None]
    cut = [e for e in marks if last is not None and e["ts"] + e["dur"] > last]
    for e in cut:
        e["ph"] = "i"
    if cut:
        names = ", ".join(sorted({str(e["name"]).removeprefix("ProfilerStep#") for e in cut}, key=lambda s: (len(s), s)))
        warnings.append(f"{path}: the cut lands in step {names}: left out for this rank (what it ran after the cut is lost)")


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


class Unstreamable(Exception):
    """A trace :class:`StreamedTrace` leaves to the whole-buffer path (:func:`read_trace`,
    :func:`parse_document`), which knows every repair: no events array near the top, a BOM, a
    damaged or truncated gzip, an array without its end, a header that does not parse."""


#: The events array must open within this many bytes for the trace to be streamed.
_STREAM_HEAD_BYTES = 4 << 20


class StreamedTrace:
    """The slices of :func:`parse_document` (the same cuts, hence the same table) read while the
    file is read and inflated a piece at a time: a parse holds a few MB of the document, never
    all of it. Iterate once, in full; then ``header`` (as parse_document gives it; Kineto writes
    baseTimeNanoseconds and traceName after the events, so it is known only at the end),
    ``head_warnings`` (the header's, which come before the slices' ``warnings``), ``opened``
    (the file's stat) and ``probe`` (its cache probe, None if it changed while read).
    Raises :class:`Unstreamable` for what only the whole buffer repairs, TraceError past the
    size limits, orjson.JSONDecodeError for a slice that does not parse (see load_rank)."""

    def __init__(self, path, typed: bool = True):
        self.path, self.typed = Path(path), typed
        # opened now: what is read is this file, whatever replaces it meanwhile (load.unchanged says so)
        self._fh, self.opened = open_trace(self.path)
        self.header, self.probe = None, None
        self.warnings: list = []
        self.head_warnings: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()

    def __iter__(self):
        yield from self._slices(self._pieces(self._fh, self.opened))

    def _pieces(self, fh, st):
        """The document's bytes a piece at a time, within the limits read_trace applies."""
        limit, too_big = size_limit(self.path)
        if st.st_size > limit:
            raise TraceError(too_big)
        raw = RawPieces(fh, st.st_size + 1)  # + 1: one that grew meanwhile is not probed
        pieces = iter(raw)
        try:
            first = next(pieces, b"")
            if first[:2] == GZIP_MAGIC:
                yield from inflated_pieces(itertools.chain((first,), pieces), self.path, st.st_size)
            else:
                for piece in itertools.chain((first,), pieces):
                    if raw.total > limit:  # grown past the limit since its size was read
                        raise TraceError(too_big)
                    yield piece
        except (OSError, EOFError, zlib.error) as exc:
            raise Unstreamable(str(exc)) from None
        self.probe = probe_of(raw.ends()) if raw.total == st.st_size else None

    def _slices(self, pieces):
        path, warnings = self.path, self.warnings
        decoder = msgspec.json.Decoder(list[RawEvent]) if self.typed else None
        buf, bracket = b"", -1
        for piece in pieces:  # to the events array's opening bracket
            buf += piece
            bracket = _array_opening(buf)
            if bracket >= 0 or len(buf) > _STREAM_HEAD_BYTES:
                break
        if bracket < 0:
            raise Unstreamable("no events array near the top")
        prefix, start = buf[:bracket + 1], bracket + 1
        base, prev = 0, start  # buf holds the document from base on; prev: the last cut
        sep = pos = None
        for piece in itertools.chain((b"",), pieces):
            if piece:
                buf, base = buf[prev - base:] + piece, prev
            if sep is None and base + len(buf) >= start + _CHUNK_BYTES:
                sep, pos = _separator(buf, start - base, start + _CHUNK_BYTES - base), start + _CHUNK_BYTES
                if sep is None:  # one slice: nothing to gain from streaming
                    raise Unstreamable("no separator between the events")
            if sep is not None:
                for cut, pos in _cuts(buf, base, sep, pos):
                    yield _slice(decoder, buf, prev - base, cut - base, path, warnings)
                    prev = cut
        # the end: the last slices, up to the array's closing bracket, found as parse_document finds it
        buf = buf[prev - base:]
        base = prev
        located = _locate_events(prefix + buf)
        if located is None or located.start != start or located.end is None:
            raise Unstreamable("the events array does not end (truncated?)")
        end = base + located.end - len(prefix)
        try:
            header = _loads(located.head, path, self.head_warnings)
        except orjson.JSONDecodeError:
            header = None
        if not isinstance(header, dict):
            raise Unstreamable("the metadata around the events does not parse")
        self.header = header
        if sep is None:
            sep, pos = _separator(buf, start - base, min(end, start + _CHUNK_BYTES) - base), start + _CHUNK_BYTES
        for cut, pos in _cuts(buf, base, sep, pos, end) if sep is not None else ():
            yield _slice(decoder, buf, prev - base, cut - base, path, warnings)
            prev = cut
        yield _slice(decoder, buf, prev - base, end - base, path, warnings)


def _array_opening(head: bytes) -> int:
    """Where _locate_events will find the events array's '[' in a document that begins with
    ``head``: -1 while ``head`` does not tell; raises Unstreamable where it finds no array."""
    if head[:len(_BOM)] == _BOM[:len(head)]:
        if len(head) >= len(_BOM):
            raise Unstreamable("a byte order mark")
        return -1
    key = head.find(_EVENTS_KEY)
    if key < 0:
        return -1
    bracket = head.find(b"[", key + len(_EVENTS_KEY))
    between = head[key + len(_EVENTS_KEY):bracket if bracket >= 0 else len(head)]
    if between.strip(b" \t\r\n:"):
        raise Unstreamable("no events array after traceEvents")
    return bracket
