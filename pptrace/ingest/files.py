"""Which files a run's traces are, opened safely: regular files only (never a FIFO's
blocking open or a device's endless read), and what a file's size and identity are without
parsing it, and its bytes inflated within limits (a decompression bomb is refused before it
fills memory). The lowest layer of import: no parsing, no cache."""
from __future__ import annotations

import io
import os
import re
import stat
import zlib
from pathlib import Path

from ..errors import TraceError

GZIP_MAGIC = b"\x1f\x8b"
GZIP_MIN_BYTES = 18  # the 10-byte header and the 8-byte trailer
_TRACE_SUFFIXES = (".json", ".json.gz")
#: Nsight Systems exports and reports (ingest/nsys.py).
NSYS_SUFFIXES = (".sqlite", ".nsys-rep")
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


def shown(path) -> str:
    """``path`` as text that every output can hold: the bytes of a name that is not UTF-8
    (which Python keeps as lone surrogates) written out, ``rank1\\xff.json``."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def open_trace(path):
    """(binary file object, its os.stat_result) of a trace, refusing anything but a regular
    file (or a symlink to one): a FIFO named rank2.json would block the read forever, a
    device never ends. The stat is the opened file's, so it describes the bytes read even
    if the path is replaced meanwhile. A name that is not UTF-8 is refused too: it could be
    read, but no report, cache entry or warning could name it."""
    if shown(path) != str(path):
        raise TraceError(f"{shown(path)}: the file name is not UTF-8 text; rename it to analyse this trace")
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


def gzip_trailer(last8: bytes) -> tuple[int, int]:
    """(CRC-32, length modulo 4 GiB) of a gzip file's last member, from its last 8 bytes."""
    return int.from_bytes(last8[:4], "little"), int.from_bytes(last8[4:], "little")


def is_nsys_name(name) -> bool:
    """An Nsight Systems export or report (read by ingest/nsys.py, not as JSON)."""
    return str(name).endswith(NSYS_SUFFIXES)


_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_in_name(path) -> int | None:
    """The ``rank{r}`` in a file's name (the last source of a rank, after its metadata)."""
    match = _RANK_IN_NAME.search(Path(path).name)
    return int(match.group(1)) if match else None


def is_trace_name(name: str) -> bool:
    return name.endswith((*_TRACE_SUFFIXES, *NSYS_SUFFIXES)) and not name.startswith(".")


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
    # a report and its export side by side are one rank: the export is read
    exports = {f.name[: -len(".sqlite")] for f in files if f.name.endswith(".sqlite")}
    files = [f for f in files if not (f.name.endswith(".nsys-rep") and f.name[: -len(".nsys-rep")] in exports)]
    nsys = [f for f in files if is_nsys_name(f.name)]
    if nsys and len(nsys) < len(files):
        other = next(f for f in files if not is_nsys_name(f.name))
        raise TraceError(f"{trace_dir}: Nsight Systems exports ({nsys[0].name}) and torch.profiler traces "
                         f"({other.name}) mixed: profile every rank the same way, one kind per directory")
    if not files:
        raise TraceError(
            f"{run_dir}: no trace files (*.json, *.json.gz, *.sqlite, *.nsys-rep) here or in {run_dir}/traces/; "
            "did the profiled steps run? (pptrace.profile writes traces/rank<r>.json.gz)"
        )
    return files


def unchanged(path: Path, opened: os.stat_result) -> bool:
    """Whether ``path`` still names the file opened as ``opened``, as it was: not replaced
    (another inode) nor written (size, mtime, and ctime, which ``touch -r`` cannot set back)."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    fields = ("st_ino", "st_dev", "st_size", "st_mtime_ns", "st_ctime_ns")
    return all(getattr(now, f) == getattr(opened, f) for f in fields)


def trace_size(path) -> int:
    """The decompressed size of a trace: a .gz's trailer gives it (modulo 4 GiB, so a
    length below the file's own is taken as the usual 10:1)."""
    try:
        fh, st = open_trace(path)  # never a FIFO's open, which would block
        with fh:
            size = st.st_size
            if fh.read(2) != GZIP_MAGIC or size < GZIP_MIN_BYTES:
                return size
            fh.seek(-8, os.SEEK_END)
            _, inflated = gzip_trailer(fh.read(8))
    except (OSError, TraceError):
        return 0
    return inflated if inflated >= size else 10 * size


#: Environment variables that raise the limits of :func:`inflate_limit`.
MAX_BYTES_ENV = "PPTRACE_MAX_TRACE_BYTES"
MAX_RATIO_ENV = "PPTRACE_MAX_INFLATE_RATIO"
#: Parsing a trace streamed takes ~1.1x its inflated bytes in one process
#: (load._WORKER_BYTES_PER_TRACE_BYTE), one the stream leaves to the whole buffer ~2x, beside the
#: run's other tables: past a quarter of the machine's memory a trace cannot be analysed, only
#: swapped or killed for.
_MEMORY_SHARE = 4
_UNKNOWN_MEMORY = 16 << 30
#: Real traces inflate 8-23x (tests/data/hta-gpu), the most repetitive synthetic ones ~60x;
#: gzip of one repeated byte 230-1000x. Up to the floor a trace fits anywhere, whatever its ratio.
_MAX_RATIO = 100
_RATIO_FLOOR = 64 << 20
#: Inflated this much at a time: bounded memory for a bomb, 2% over a one-shot inflate for a trace.
_IN_PIECE, _OUT_PIECE = 1 << 20, 4 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def machine_memory() -> int:
    """Bytes of memory this process can have: the machine's, or its cgroup's limit (a container) when lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        total = _UNKNOWN_MEMORY
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = ""
    return min(total, int(limit)) if limit.isdigit() else total


def _env_number(name: str, units: bool) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    digits, unit = (text[:-1], text[-1].upper()) if units and text[-1].upper() in _UNITS else (text, "")
    if not digits.isdigit() or int(digits) == 0:
        example = "8G or 8589934592 (bytes)" if units else "a whole number, e.g. 500"
        raise TraceError(f"{name}={text!r} is not a limit; give {example}, or unset it for the default")
    return int(digits) * _UNITS[unit]


def size_limit(path) -> tuple[int, str]:
    """(most bytes the trace at ``path`` may take inflated, the one-line reason given past it)."""
    limit = _env_number(MAX_BYTES_ENV, units=True)
    if limit is None:
        memory = machine_memory()
        limit, origin = memory // _MEMORY_SHARE, f"a quarter of this machine's {human_size(memory)} of memory"
    else:
        origin = MAX_BYTES_ENV
    return limit, (f"{path}: more than {human_size(limit)} of trace ({origin}), too big to load; set "
                   f"{MAX_BYTES_ENV} to a larger size (e.g. {max(1, 2 * limit >> 30)}G) to read it")


def inflate_limit(path, compressed: int) -> tuple[int, str]:
    """:func:`size_limit` for a .gz of ``compressed`` bytes, lowered to a ratio to its own size:
    what a decompression bomb exceeds long before memory runs out."""
    limit, reason = size_limit(path)
    ratio = _env_number(MAX_RATIO_ENV, units=False) or _MAX_RATIO
    if limit <= max(_RATIO_FLOOR, ratio * compressed):
        return limit, reason
    return max(_RATIO_FLOOR, ratio * compressed), (
        f"{path}: inflates to over {ratio} times its {human_size(compressed)} on disk, like a decompression "
        f"bomb; if it is a real trace, set {MAX_RATIO_ENV} to a larger ratio (e.g. {10 * ratio}) to read it")


def human_size(n: int) -> str:
    """``1536`` -> ``"1.5 KB"``: sizes in the lines a user reads."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def inflated_pieces(pieces, path, compressed: int):
    """The inflated bytes of the gzip members in ``pieces`` (a .gz's bytes in order, a
    ``compressed`` bytes' worth), at most _OUT_PIECE at a time, stopping with TraceError
    once past :func:`inflate_limit`. Several members (``cat a.gz b.gz``) and NUL padding
    after one read as gzip reads them; a truncated last member raises EOFError, bytes after
    one that are no member OSError, a damaged stream zlib.error."""
    limit, reason = inflate_limit(path, compressed)
    inflater, total, carried = None, 0, b""
    for piece in pieces:
        data = carried + piece if carried else piece
        carried = b""
        while True:
            if inflater is None:  # between members
                data = data.lstrip(b"\0")
                if len(data) < len(GZIP_MAGIC):
                    carried = data
                    break
                if data[:len(GZIP_MAGIC)] != GZIP_MAGIC:
                    raise OSError("bytes after the end of the gzip stream that are no gzip member")
                inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out = inflater.decompress(data, _OUT_PIECE)
            total += len(out)
            if total > limit:
                raise TraceError(reason)
            if out:
                yield out
            if inflater.eof:
                data, inflater = inflater.unused_data, None
                continue
            data = inflater.unconsumed_tail
            if not data and len(out) < _OUT_PIECE:  # a full piece out: zlib may hold more
                break
    if inflater is not None or carried:
        raise EOFError("Compressed file ended before the end-of-stream marker was reached")


class RawPieces:
    """The bytes of the opened file ``fh``, _IN_PIECE at a time (iterate once), no more than
    ``most`` of them, keeping its first and last _IN_PIECE for the cache probe: what
    :func:`~pptrace.ingest.store.probe_of` reads of a whole file, without holding the file."""

    def __init__(self, fh, most: int):
        self._fh, self._most = fh, most
        self.total, self.head, self._last = 0, b"", [b"", b""]

    def __iter__(self):
        while self.total < self._most:
            piece = self._fh.read(min(_IN_PIECE, self._most - self.total))
            if not piece:
                return
            if not self.total:
                self.head = piece
            self.total += len(piece)
            self._last = [self._last[1], piece]
            yield piece

    def ends(self) -> bytes:
        """The first _IN_PIECE bytes read and the last ones after them: a shorter stand-in of
        the same probe (store.probe_of reads no more than 64 KB of each end)."""
        window = b"".join(self._last) if self.total > _IN_PIECE else b""
        tail_from = max(_IN_PIECE, self.total - _IN_PIECE) - (self.total - len(window))
        return self.head[:_IN_PIECE] + window[tail_from:]


class TruncatedGzip(EOFError):
    """A .gz that ends inside its last member (a rank that died while writing): ``data`` is
    what inflated before the end, to be salvaged like a truncated .json."""

    def __init__(self, data: bytes):
        super().__init__("Compressed file ended before the end-of-stream marker was reached")
        self.data = data


def gunzip(raw: bytes, path) -> bytes:
    """The inflated bytes of the .gz ``raw`` read from ``path`` (TraceError past
    :func:`inflate_limit`; see :func:`inflated_pieces`; TruncatedGzip, holding what inflated,
    when it ends inside a member). Gathered in one BytesIO, whose getvalue() hands its buffer
    over: ~1x the trace at the peak (joined pieces take 2x). Kept only up to the trailer's
    length (a lying trailer's, a truncated file's garbage, or the last of several members'):
    past it, or when it is past the limit, they are only counted, and inflated again if
    within the limit, so a bomb never fills memory."""
    claimed = gzip_trailer(raw[-8:])[1] if len(raw) >= GZIP_MIN_BYTES else 0

    def pieces():
        return (raw[i:i + _IN_PIECE] for i in range(0, len(raw), _IN_PIECE))

    kept = io.BytesIO() if claimed <= inflate_limit(path, len(raw))[0] else None
    try:
        for out in inflated_pieces(pieces(), path, len(raw)):
            if kept is not None and kept.tell() + len(out) > claimed:
                kept = None
            elif kept is not None:
                kept.write(out)
    except EOFError:
        if kept is not None:
            raise TruncatedGzip(kept.getvalue()) from None
    if kept is None:
        kept = io.BytesIO()
        try:
            for out in inflated_pieces(pieces(), path, len(raw)):
                kept.write(out)
        except EOFError:
            raise TruncatedGzip(kept.getvalue()) from None
    return kept.getvalue()


#: More files than this with one reason are said in one line (10,000 empty files are one
#: problem, not 10,000 lines).
GROUPED_AFTER = 3


def group_by_reason(messages: list[str], prefix: str = "") -> list[str]:
    """Messages "<trace file>: <reason>" (``prefix`` before them, e.g. "skipped: "), with
    those of more than :data:`GROUPED_AFTER` files sharing a reason said once: "N files:
    <reason> (a, b, c and N-3 more)". Other messages stay as they are, in their order."""
    reasons: dict[str, list[str]] = {}
    parsed = []
    for text in messages:
        body = text[len(prefix):] if text.startswith(prefix) else None
        path, sep, reason = (body or "").partition(": ")
        if body is None or not sep or not path.endswith(_TRACE_SUFFIXES):
            parsed.append((text, None))
            continue
        reasons.setdefault(reason, []).append(path)
        parsed.append((text, reason))
    out, said = [], set()
    for text, reason in parsed:
        if reason is None or len(reasons[reason]) <= GROUPED_AFTER:
            out.append(text)
        elif reason not in said:
            said.add(reason)
            files = reasons[reason]
            names = ", ".join(Path(f).name for f in files[:GROUPED_AFTER])
            out.append(f"{prefix}{len(files)} files: {reason} ({names} and {len(files) - GROUPED_AFTER} more)")
    return out

