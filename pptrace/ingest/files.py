"""Which files a run's traces are, opened safely: regular files only (never a FIFO's
blocking open or a device's endless read), and what a file's size and identity are without
parsing it. The lowest layer of import: no parsing, no cache."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import TraceError

GZIP_MAGIC = b"\x1f\x8b"
GZIP_MIN_BYTES = 18  # the 10-byte header and the 8-byte trailer
_TRACE_SUFFIXES = (".json", ".json.gz")
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


def gzip_trailer(last8: bytes) -> tuple[int, int]:
    """(CRC-32, length modulo 4 GiB) of a gzip file's last member, from its last 8 bytes."""
    return int.from_bytes(last8[:4], "little"), int.from_bytes(last8[4:], "little")


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

