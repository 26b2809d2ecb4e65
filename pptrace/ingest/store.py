"""Cache of normalized per-rank tables, so that a second load skips JSON parsing.

Each entry is an Arrow IPC file (LZ4-compressed buffers, columnar._codec says why), about the
size of the trace's .json.gz, written and read back several times faster than Parquet, and
read into memory that is given back to the system as soon as the run's frame has taken its
columns.

The cache lives next to the traces (``traces/.pptrace-cache/<file>.arrow``) or, when that
directory cannot be written, under ``$XDG_CACHE_HOME/pptrace/`` (default ``~/.cache``). User
trace files are only ever read. An entry is valid while the trace file it was parsed from is
the one at the path, unchanged: same inode, size, mtime and ctime (``touch -r`` sets mtime
back, not ctime), and the same digest of its first and last bytes (a same-second edit on a
filesystem with coarse timestamps) -- all taken from the file as it was opened and read, so a
trace replaced mid-read never gets the new version's key on the old version's table -- and
the same schema version. The key travels in the file's schema metadata, with the rank's meta
and the row count. Entries are written under a temporary name and renamed: a killed run
leaves at most a ``*.tmp`` file, removed by a later load once it is stale. Each entry also
holds digests of its metadata and data (columnar.CHECKSUM_KEY): a damaged entry is a miss,
or found out when read and replaced by parsing its trace again, never read as data.

Whoever can write the cache directory (a shared run directory) could write an entry of their
own under a trace's valid key, with its CRCs recomputed. So the digests are keyed with a
secret of the invoking user's (:func:`secret`: 32 random bytes, a 0600 file in a 0700
directory of the user cache, never in a run directory): only an entry this user's pptrace
wrote verifies, anything else is a miss and its trace is parsed again (an entry that names
this user's secret yet does not verify is said in one line). Colleagues sharing a run
directory each cache for themselves; without a secret (no writable user cache) nothing is
cached.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
import time
from pathlib import Path

import orjson
import pyarrow as pa

from ..errors import TraceError
from .columnar import StoredTable, metadata_intact
from .files import open_trace
from .schema import SCHEMA_VERSION

CACHE_DIRNAME = ".pptrace-cache"
_SUFFIX = ".arrow"
_OLD_SUFFIXES = (".parquet",)  # entries of earlier pptrace versions, replaced when rewritten
_META_KEY = b"pptrace.ingest.store"
#: Bytes hashed at each end of a trace file: a look-up reads these two only.
_PROBE_BYTES = 64 << 10
_TMP_SUFFIX = ".tmp"
#: The names _create_tmp gives: ``.<trace>.json[.gz].arrow.<pid>.<8 hex digits>.tmp`` (or of an
#: Nsight export, ``.sqlite`` / ``.nsys-rep``).
_TMP_NAME = re.compile(r"\..+(\.json(\.gz)?|\.sqlite|\.nsys-rep)\.arrow\.\d+\.[0-9a-f]{8}\.tmp")
#: Writing one entry takes seconds; a temporary file this old is a killed run's leftover.
_STALE_TMP_S = 600
#: The entries' format beside the table's schema (schema.SCHEMA_VERSION): 2 since their
#: digests are keyed (entries of format 1 carry CRCs anyone can recompute).
ENTRY_FORMAT = 2
_SECRET_DIR, _SECRET_FILE, _SECRET_BYTES = "secret", "cache-key", 32


def _probe(head: bytes, tail: bytes) -> str:
    digest = hashlib.blake2b(head, digest_size=16)
    digest.update(tail)
    return digest.hexdigest()


def probe_of(raw: bytes) -> str:
    """Digest of the first and last _PROBE_BYTES of a trace file's bytes (as stored, gzip or
    not); :func:`source_key` gets the same from the file without reading the rest."""
    return _probe(raw[:_PROBE_BYTES], raw[max(_PROBE_BYTES, len(raw) - _PROBE_BYTES):])


def key_of(st: os.stat_result, probe: str) -> dict:
    """The key of a trace file opened as ``st`` whose bytes gave ``probe``."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "probe": probe, "schema": SCHEMA_VERSION, "entry": ENTRY_FORMAT}


def source_key(trace_path) -> dict:
    """The key of the trace file now at ``trace_path`` (TraceError if it is no regular file)."""
    fh, st = open_trace(trace_path)
    with fh:
        head = fh.read(_PROBE_BYTES)
        start = max(_PROBE_BYTES, st.st_size - _PROBE_BYTES)
        fh.seek(start)
        tail = fh.read(max(0, st.st_size - start))
    return key_of(st, _probe(head, tail))


def _writable(directory: Path) -> bool:
    # Mode bits too: root passes os.access everywhere, but a directory without write bits
    # (a shared, read-only fixture or archive) is meant to stay as it is.
    try:
        return os.access(directory, os.W_OK | os.X_OK) and bool(os.stat(directory).st_mode & stat.S_IWUSR)
    except OSError:
        return False


def cache_path(trace_path) -> Path:
    """Where the cache entry of ``trace_path`` lives (the directory may not exist yet): in
    the traces directory the user named, beside a symlinked trace's link and never its
    target's (that would write outside the run); in the user cache when that directory's
    ``.pptrace-cache`` is not pptrace's to use (read-only, or a symlink: pptrace never
    follows a cache directory it did not create, nor writes or sweeps where one points)."""
    trace_path = Path(os.path.abspath(trace_path))
    return cache_dir(trace_path.parent) / f"{trace_path.name}{_SUFFIX}"


def cache_dir(traces_dir: Path) -> Path:
    """The directory of the cache entries of the traces in ``traces_dir`` (absolute)."""
    local = traces_dir / CACHE_DIRNAME
    if not local.is_symlink() and ((local.is_dir() and _writable(local))
                                   or (not local.exists() and _writable(traces_dir))):
        return local
    return user_cache() / hashlib.sha1(str(traces_dir).encode()).hexdigest()[:16]


class Entries:
    """The cache as one load sees it: this user's secret read once, each traces directory's
    cache directory decided once, and each entry looked up once, though the headers and then
    the tables ask for it (on a 1,024-rank run those repeats cost ~1.5 s of a cached load)."""

    def __init__(self):
        self.key = secret()
        self._dirs: dict = {}
        self._found: dict = {}  # trace path -> (lookup's answer, the entry if it was forged)

    def path(self, trace_path) -> Path:
        trace_path = Path(os.path.abspath(trace_path))
        parent = trace_path.parent
        if parent not in self._dirs:
            self._dirs[parent] = cache_dir(parent)
        return self._dirs[parent] / f"{trace_path.name}{_SUFFIX}"

    def lookup(self, trace_path, forged: list | None = None):
        """:func:`lookup`, with this view's key and directories, once per trace."""
        known = str(trace_path)
        if known not in self._found:
            bad: list = []
            self._found[known] = (_lookup(trace_path, self.path(trace_path), self.key, bad), bad)
        found, bad = self._found[known]
        if forged is not None:
            forged += bad
        return found


def user_cache() -> Path:
    """pptrace's directory in the user cache: ``$XDG_CACHE_HOME/pptrace`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:  # no HOME and no passwd entry (some containers)
            base = Path(os.sep, "nonexistent")
    return Path(base) / "pptrace"


def _private(st: os.stat_result) -> bool:
    """Owned by this user, and nobody else may read or write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def secret() -> bytes | None:
    """This user's key for the cache entries' digests (created on first use), or None when
    there is no private place for one: the user cache not writable, or its secret directory
    or file a link, someone else's, or readable by others (then nothing is cached)."""
    directory = user_cache() / _SECRET_DIR
    path = directory / _SECRET_FILE
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or not _private(st):
            return None
        try:
            return _read_secret(path)
        except FileNotFoundError:
            pass
        # written whole under a name of its own, then linked into place: of two processes
        # creating it at once, both use the one that got there first
        tmp = directory / f".{_SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(secrets.token_bytes(_SECRET_BYTES))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
        return _read_secret(path)
    except OSError:
        return None


def _read_secret(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(path) from None
        return None  # a link (ELOOP) or not ours to read
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        key = fh.read(_SECRET_BYTES + 1)
    ok = stat.S_ISREG(st.st_mode) and _private(st) and len(key) == _SECRET_BYTES
    return key if ok else None


def _key_id(key: bytes) -> str:
    """Which secret an entry's digests were keyed with, without saying anything of it."""
    return hashlib.blake2b(key, digest_size=8, person=b"pptrace-key-id").hexdigest()


def lookup(trace_path, forged: list | None = None):
    """(StoredTable, meta) for a valid cache entry, or None. Reads only the file's footer
    (and the ends of the trace, for its key): the table itself is read when the run's frame
    is assembled (columnar.frame_from_tables, with :func:`secret`), which parses the trace
    again should the entry turn out broken. A broken or stale entry is a miss, replaced by
    the next write; one that names this user's secret but whose digests that secret does not
    give (written by someone else) is also added to ``forged``."""
    return _lookup(trace_path, cache_path(trace_path), secret(), forged)


def _lookup(trace_path, path: Path, key: bytes | None, forged: list | None):
    try:
        if key is None or path.is_symlink():  # pptrace makes no links: someone else's, never followed
            return None
        with pa.OSFile(str(path)) as source:
            schema = pa.ipc.open_file(source).schema
        metadata = schema.metadata or {}
        if not metadata_intact(metadata, key):  # damaged, an earlier pptrace's, another user's, forged
            if forged is not None and _claims(metadata, key):
                forged.append(path)
            return None
        stored = orjson.loads(metadata[_META_KEY])
        meta = stored["meta"]
        if not isinstance(stored.get("rows"), int) or not isinstance(meta, dict) \
                or stored.get("key") != source_key(trace_path):
            return None
        return StoredTable(stored["rows"], path=path, source=(str(trace_path), meta.get("rank"))), meta
    except (TraceError, OSError, KeyError, ValueError, TypeError, pa.ArrowException, orjson.JSONDecodeError):
        return None


def _claims(metadata: dict, key: bytes) -> bool:
    """Whether an entry of this format says its digests are keyed with ``key`` (an entry of
    another pptrace's format is a plain miss, not a forgery)."""
    try:
        stored = orjson.loads(metadata[_META_KEY])
        return stored.get("secret") == _key_id(key) and stored["key"].get("entry") == ENTRY_FORMAT
    except (KeyError, ValueError, AttributeError, orjson.JSONDecodeError):
        return False


def drop(entry) -> None:
    """Remove a cache entry (found broken); a failure leaves it to be replaced by the next write."""
    try:
        os.unlink(entry)
    except OSError:
        pass


def read(trace_path):
    """(pyarrow Table, meta) from a valid cache entry, or None."""
    found = lookup(trace_path)
    if found is None:
        return None
    try:
        return found[0].read(secret()), found[1]
    except (OSError, ValueError, pa.ArrowException):
        return None


def remove_stale_tmp(directory: Path) -> None:
    """Remove the temporary files that killed runs left in a cache directory: only names
    :func:`_create_tmp` gives (a file pptrace did not name is never deleted), and only those
    older than _STALE_TMP_S (younger ones may be a concurrent run's write in progress)."""
    cutoff = time.time() - _STALE_TMP_S
    try:
        if Path(directory).is_symlink():
            return
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        try:
            if _TMP_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False) \
                    and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:  # gone meanwhile, or another user's in a directory we may not clean
            pass


def _create_tmp(path: Path, trace_path) -> Path:
    """A new, empty temporary file beside ``path`` (``.<entry>.<pid>.<random>.tmp``: never
    taken for an entry), readable like the trace: created 0666 less the umask (mkstemp's
    0600 would keep colleagues sharing the run directory from the entries), then no more
    readable than the trace itself."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        allowed = os.fstat(fd).st_mode & 0o666  # 0666 less the umask
        trace_mode = os.stat(trace_path).st_mode & 0o666
        os.fchmod(fd, allowed & (trace_mode | stat.S_IRUSR | stat.S_IWUSR))
    finally:
        os.close(fd)
    return tmp


def write(trace_path, table: pa.Table, meta: dict, key: dict | None) -> Path | None:
    """Store ``table`` under ``key`` (load.load_rank's, of the bytes it parsed; None: do not
    store); returns the entry's path, or None when nothing was stored (caching is an
    optimisation: failing to cache never fails a load)."""
    secret_key = secret()
    if key is None or secret_key is None:
        return None
    path = cache_path(trace_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent.is_symlink():  # one put there since cache_path looked
            return None
        payload = orjson.dumps({"key": key, "rows": table.num_rows, "meta": meta, "secret": _key_id(secret_key)},
                               option=orjson.OPT_NON_STR_KEYS)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META_KEY: payload})
        # Write then rename, so that a concurrent reader never sees half a file.
        tmp = _create_tmp(path, trace_path)
        try:
            StoredTable.write_checked(table, str(tmp), secret_key)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in _OLD_SUFFIXES:
            stale = path.with_name(path.name[: -len(_SUFFIX)] + old)
            if stale.is_file() and not stale.is_symlink():  # a link there is not pptrace's
                stale.unlink()
        return path
    except (OSError, pa.ArrowException):
        return None
