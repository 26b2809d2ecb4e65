"""Parquet cache of normalized per-rank tables, so that a second load skips JSON parsing.

The cache lives next to the traces (``traces/.pptrace-cache/<file>.parquet``) or, when that
directory cannot be written, under ``$XDG_CACHE_HOME/pptrace/`` (default ``~/.cache``). User
trace files are only ever read. An entry is valid while the trace's size and mtime and the
schema version it was written with are unchanged; the key travels in the Parquet metadata.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from .events import SCHEMA_VERSION

CACHE_DIRNAME = ".pptrace-cache"
_META_KEY = b"pptrace.cache"


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
        return local / f"{trace_path.name}.parquet"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pptrace"
    digest = hashlib.sha1(str(trace_path.parent).encode()).hexdigest()[:16]
    return root / digest / f"{trace_path.name}.parquet"


def read(trace_path):
    """(pyarrow Table, meta) from a valid cache entry, or None."""
    path = cache_path(trace_path)
    try:
        key = source_key(trace_path)
        schema_meta = pq.read_schema(path).metadata or {}
        stored = orjson.loads(schema_meta[_META_KEY])
        if stored.get("key") != key:
            return None
        return pq.read_table(path), stored["meta"]
    except (OSError, KeyError, ValueError, pa.ArrowException, orjson.JSONDecodeError):
        return None


def write(trace_path, table: pa.Table, meta: dict) -> Path | None:
    """Store ``table``; returns the entry's path, or None when no cache dir can be written
    (caching is an optimisation: failing to cache never fails a load)."""
    path = cache_path(trace_path)
    try:
        key = source_key(trace_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = orjson.dumps({"key": key, "meta": meta}, option=orjson.OPT_NON_STR_KEYS)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), _META_KEY: payload})
        # Write then rename, so that a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        return path
    except (OSError, pa.ArrowException):
        return None
