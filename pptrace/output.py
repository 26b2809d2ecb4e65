"""Every file pptrace writes for a user goes through here: the dashboard and its PNGs, merged
and simulated traces, JSON documents, the profiler's own traces.

A file is written whole or not at all: the bytes go to a hidden file beside the target and
replace it only once complete, so a full disk, a killed process or a failing writer leaves the
previous file as it was and no half-written one behind. A failure is one line saying which
path could not be written and why (:class:`pptrace.errors.TraceError`).
"""
from __future__ import annotations

import errno
import gzip
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from .errors import TraceError

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


def cannot_write(path, exc: OSError) -> TraceError:
    """The one-line error for ``path`` that failed with ``exc``."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno in _FULL:
        hint = "free some space or choose another output path"
    elif exc.errno in _DENIED:
        hint = "choose a writable output path"
    elif exc.errno == errno.EISDIR:
        hint = "give a file name, not a directory"
    else:
        hint = "choose another output path"
    return TraceError(f"cannot write {path}: {reason}; {hint}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path) -> Iterator[Path]:
    """A path to write ``path``'s new content to, by any means (a library that wants a file
    name, say); it replaces ``path`` when the block ends without error and is removed
    otherwise. The new file keeps the old one's permissions (new ones get the umask's).

    Targets that are not regular files (``/dev/null``, ``/dev/stdout``, a FIFO) are written in
    place: replacing a device node by a file would be the real damage."""
    shown = Path(path)
    try:
        try:
            mode = os.stat(shown).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        # /dev/stdout and /dev/fd/N name whatever the shell opened, a file included: only
        # writing through them reaches it
        if (mode is not None and not stat.S_ISREG(mode)) or str(shown.absolute()).startswith(("/dev/", "/proc/")):
            yield shown
            return
        target = Path(os.path.realpath(shown))  # through a symlink: replace what it points to
        target.parent.mkdir(parents=True, exist_ok=True)
        # Hidden (a run directory's file lister skips dot files) and with the target's
        # suffixes, for writers that pick the format by the name (.gz, .png).
        tmp = target.with_name(f".{secrets.token_hex(4)}.{target.name}")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise cannot_write(shown, exc) from None
    try:
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        yield tmp
        # on disk before the rename: after a crash the target is the old file or the new
        # one, never an empty one
        _fsync(tmp)
        os.replace(tmp, target)
    except OSError as exc:
        raise cannot_write(shown, exc) from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:  # the directory turned unwritable meanwhile: nothing more to do
            pass


def write_file(path, data: bytes | Iterable[bytes], *, compresslevel: int | None = None) -> Path:
    """Write ``data`` (bytes, or chunks of bytes streamed as they come) to ``path`` whole or
    not at all; gzip-compressed when the name ends in ``.gz``. Returns ``path``."""
    path = Path(path)
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    with replacing(path) as tmp:
        try:
            with open(tmp, "wb") as raw:
                if path.name.endswith(".gz"):
                    # the member's name is the target's, not the temporary file's
                    with gzip.GzipFile(filename=path.name[:-3], mode="wb", fileobj=raw,
                                       compresslevel=9 if compresslevel is None else compresslevel) as out:
                        for chunk in chunks:
                            out.write(chunk)
                else:
                    for chunk in chunks:
                        raw.write(chunk)
        except OSError as exc:
            raise cannot_write(path, exc) from None
    return path
