"""Cache of normalized per-rank tables, so that a second load skips JSON parsing.

Each entry is an Arrow IPC file (zstd-compressed buffers): about half the size of the same
table in Parquet, written and read back several times faster, and read into memory that is
given back to the system as soon as the run's frame has taken its columns.

The cache lives next to the traces (``traces/.pptrace-cache/<file>.arrow``) or, when that
directory cannot be written, under ``$XDG_CACHE_HOME/pptrace/`` (default ``~/.cache``). User
trace files are only ever read. An entry is valid while the trace's size and mtime and the
schema version it was written with are unchanged; the key travels in the file's schema
metadata, with the rank's meta and the row count.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

import orjson
import pyarrow as pa

from .columnar import StoredTable
from .schema import SCHEMA_VERSION

CACHE_DIRNAME = ".pptrace-cache"
_SUFFIX = ".arrow"
_OLD_SUFFIXES = (".parquet",)  # entries of earlier pptrace versions, replaced when rewritten
_META_KEY = b"pptrace.ingest.store"


def source_key(trace_path) -> dict:
    st = os.stat(trace_path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "schema": SCHEMA_VERSION}


def _writable(directory: Path) -> bool:
    # Mode bits too: root passes os.access everywhere, but a directory without write bits
    # (a shared, read-only fixture or archive) is meant to stay as it is.
    try:
        return os.access(directory, os.W_OK | os.X_OK) and bool(os.stat(directory).st_mode & stat.S_IWUSR)
    except OSError:
        return False


def cache_path(trace_path) -> Path:
    """Where the cache entry of ``trace_path`` lives (the directory may not exist yet)."""
    trace_path = Path(trace_path).resolve()
    local = trace_path.parent / CACHE_DIRNAME
    if (local.is_dir() and _writable(local)) or (not local.exists() and _writable(trace_path.parent)):
        return local / f"{trace_path.name}{_SUFFIX}"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pptrace"
    digest = hashlib.sha1(str(trace_path.parent).encode()).hexdigest()[:16]
    return root / digest / f"{trace_path.name}{_SUFFIX}"


def lookup(trace_path):
    """(StoredTable, meta) for a valid cache entry, or None. Reads only the file's footer:
    the table itself is read when the run's frame is assembled (columnar.frame_from_tables)."""
    path = cache_path(trace_path)
    try:
        key = source_key(trace_path)
        with pa.OSFile(str(path)) as source:
            schema = pa.ipc.open_file(source).schema
        stored = orjson.loads((schema.metadata or {})[_META_KEY])
        if stored.get("key") != key or not isinstance(stored.get("rows"), int):
            return None
        return StoredTable(stored["rows"], path=path), stored["meta"]
    except (OSError, KeyError, ValueError, TypeError, pa.ArrowException, orjson.JSONDecodeError):
        return None


def read(trace_path):
    """(pyarrow Table, meta) from a valid cache entry, or None."""
    found = lookup(trace_path)
    if found is None:
        return None
    try:
        return found[0].read(), found[1]
    except (OSError, pa.ArrowException):
        return None


def write(trace_path, table: pa.Table, meta: dict) -> Path | None:
    """Store ``table``; returns the entry's path, or None when no cache dir can be written
    (caching is an optimisation: failing to cache never fails a load)."""
    path = cache_path(trace_path)
    try:
        key = source_key(trace_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = orjson.dumps({"key": key, "rows": table.num_rows, "meta": meta}, option=orjson.OPT_NON_STR_KEYS)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META_KEY: payload})
        # Write then rename, so that a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            StoredTable.write_ipc(table, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in _OLD_SUFFIXES:
            stale = path.with_name(path.name[: -len(_SUFFIX)] + old)
            if stale.exists():
                stale.unlink()
        return path
    except (OSError, pa.ArrowException):
        return None
