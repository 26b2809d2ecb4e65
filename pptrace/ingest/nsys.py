"""Nsight Systems input: one ``nsys export --type sqlite`` file (or a ``.nsys-rep``, exported
where ``nsys`` is installed) -> one rank's events table, through the same finish_frame as a
Kineto trace, so that every analysis reads it unchanged.

What maps to what (Kineto's categories, so the recognizers of schema.classify apply as they are):
kernels -> ``kernel`` (names through StringIds; NCCL kernels are communication by name),
memcpy / memset -> ``gpu_memcpy`` / ``gpu_memset``, CUDA runtime calls -> ``cuda_runtime``
(their correlation ids link them to the GPU work they launched), NVTX ranges (push/pop and
start/end, ``text`` or ``textId``) -> ``user_annotation`` (pptrace's range grammar, Megatron's
and NCCL's NVTX names, MPI's ranges), OS runtime calls -> ``osrt`` (host activity).
GPU rows: pid = device, tid = stream, as Kineto writes them; host rows: the pid and tid of
nsys's serialized globalTid. Times: the export's nanoseconds plus the capture's UTC start.

The schema differs between nsys versions, so every table and column is read by name and a
missing one is tolerated (selected as NULL); SQL selects and joins, the rows go to numpy
columns at once (no Python loop per row).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import TraceError
from .files import open_trace, rank_in_name, unchanged
from .frame import _Codes, _join, _nullable_parts, finish_frame
from .store import source_key, user_cache

_SQLITE_MAGIC = b"SQLite format 3\x00"
#: Process environment variables that name the rank and the world size, in order of trust
#: (torchrun, then MPI launchers and Slurm).
_RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_WORLD_ENV = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
#: CUDA_MEMCPY_KIND -> Kineto's memcpy names.
_COPY_KINDS = {1: "Memcpy HtoD", 2: "Memcpy DtoH", 8: "Memcpy DtoD", 10: "Memcpy PtoP"}
_TID_MASK = (1 << 24) - 1
#: Rows fetched from SQLite at a time: their tuples, a few tens of MB, are all that is held
#: beyond the typed columns.
FETCH_ROWS = 1 << 16


def _ints(pieces: list) -> tuple[np.ndarray, np.ndarray]:
    """One (int64 data, null mask) column from its pieces' pairs."""
    return _join([d for d, _ in pieces], np.int64), _join([m for _, m in pieces], bool)


def rep_command(path) -> str:
    return f"nsys export --type sqlite --output {Path(path).with_suffix('.sqlite')} {path}"


def _exported(path: Path) -> Path:
    """The SQLite export of a .nsys-rep, made once into pptrace's user cache (never beside the
    user's file) with the nsys on PATH, again when the report changes."""
    nsys = shutil.which("nsys")
    if nsys is None:
        raise TraceError(f"{path}: a .nsys-rep needs nsys to read it and nsys is not on PATH; export it with "
                         f"`{rep_command(path)}` and analyse the .sqlite")
    st = os.stat(path)
    tag = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = user_cache() / "nsys" / f"{path.stem}-{tag}.sqlite"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
                               "--output", str(out), str(path)], capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise TraceError(f"{path}: `nsys export --type sqlite` failed ({last[0]})")
    return out


class Export:
    """One open export: its tables and their columns, read by name."""

    def __init__(self, path):
        self.path = Path(path)
        source = _exported(self.path) if self.path.suffix == ".nsys-rep" else self.path
        fh, self.opened = open_trace(source)
        with fh:
            if fh.read(16) != _SQLITE_MAGIC:
                raise TraceError(f"{path}: not a SQLite file (an .sqlite trace must be `nsys export --type sqlite`'s)")
        self.source = source
        try:
            self.db = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
            self.db.text_factory = lambda b: b.decode("utf-8", "replace")
            self.columns = {t: {c[1] for c in self.db.execute(f'PRAGMA table_info("{t}")')}
                            for (t,) in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{path}: SQLite cannot read it ({exc}): truncated, locked or damaged? export it again") \
                from None
        if "StringIds" not in self.columns or not any(t.startswith(("CUPTI_", "NVTX_", "TARGET_INFO"))
                                                      for t in self.columns):
            self.db.close()
            raise TraceError(f"{path}: a SQLite file but not an Nsight Systems export (no StringIds, CUPTI, NVTX or "
                             "TARGET_INFO tables)")

    def close(self):
        self.db.close()

    def has(self, table: str) -> bool:
        return table in self.columns

    def col(self, table: str, column: str, alias: str = "t") -> str:
        return f"{alias}.{column}" if column in self.columns.get(table, ()) else "NULL"

    def rows(self, sql: str, kinds: str, text: _Codes | None = None) -> list:
        """The result's columns, read FETCH_ROWS at a time (so that no list of every row's
        tuple is ever held: ~300 bytes a row for a kernel table's): per ``kinds`` letter an
        ``i`` column as (int64 values, null mask), a ``t`` column as int32 codes into
        ``text`` (the Kineto reader's codes, frame._Codes: NULL is ""), one the caller shares
        between its tables or this call's own."""
        text = text if text is not None else _Codes(bad="")
        out: list = [[] for _ in kinds]
        try:
            cursor = self.db.execute(sql)
            while chunk := cursor.fetchmany(FETCH_ROWS):
                for got, kind, values in zip(out, kinds, zip(*chunk)):
                    got.append(_nullable_parts(values) if kind == "i" else text.add(values))
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.path}: SQLite cannot read it ({exc}): truncated or damaged? export it again") \
                from None
        return [_ints(got) if kind == "i" else _join(got, np.int32) for got, kind in zip(out, kinds)]

    def scalar(self, sql: str):
        try:
            row = self.db.execute(sql).fetchone()
        except sqlite3.DatabaseError:
            return None
        return row[0] if row else None


# -------------------------------------------------------------------------------------------
# the header: rank, world size, clock base, host
# -------------------------------------------------------------------------------------------
def _environment(ex: Export) -> dict:
    if not ex.has("TARGET_INFO_SYSTEM_ENV"):
        return {}
    text = ex.scalar("SELECT value FROM TARGET_INFO_SYSTEM_ENV WHERE name = 'DeviceEnvironment'") or ""
    return dict(item.split("=", 1) for item in text.split("\x00") if "=" in item)


def _int_env(env: dict, names) -> int | None:
    for name in names:
        value = env.get(name, "")
        if re.fullmatch(r"\d+", value.strip()):
            return int(value)
    return None


def _header(ex: Export) -> dict:
    """A Kineto-shaped header (normalized as header.normalize_header leaves one), so that the
    run's checks read an export's rank, world size and clock as a trace's."""
    env = _environment(ex)
    rank, world = _int_env(env, _RANK_ENV), _int_env(env, _WORLD_ENV)
    base = ex.scalar("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME") \
        if "utcEpochNs" in ex.columns.get("TARGET_INFO_SESSION_START_TIME", ()) else None
    host = ex.scalar("SELECT value FROM TARGET_INFO_SYSTEM_ENV WHERE name = 'Hostname'") \
        if ex.has("TARGET_INFO_SYSTEM_ENV") else None
    version = ex.scalar("SELECT value FROM EXPORT_META_DATA WHERE name = 'EXPORT_PRODUCT_VERSION'") \
        if ex.has("EXPORT_META_DATA") else None
    dist = {k: v for k, v in (("rank", rank), ("world_size", world)) if v is not None}
    return {"pptrace": None, "distributedInfo": dist or None,
            "baseTimeNanoseconds": base if isinstance(base, int) else None,
            "host_name": host, "nsys": {"version": version}}


def read_header(path) -> dict:
    ex = Export(path)
    try:
        return _header(ex)
    finally:
        ex.close()


# -------------------------------------------------------------------------------------------
# the events
# -------------------------------------------------------------------------------------------
def _string(ex: Export, table: str, column: str) -> tuple[str, str]:
    """(the SELECT term of a StringIds reference, its JOIN) or NULL where the column is absent."""
    if column not in ex.columns.get(table, ()):
        return "NULL", ""
    alias = f"s_{column}"
    return f"{alias}.value", f" LEFT JOIN StringIds {alias} ON {alias}.id = t.{column}"


#: each table's SELECT, in this order: "iiiitii" for Export.rows
_FIELDS = ("start", "end", "pid", "tid", "name", "stream", "correlation")


def _piece(ex: Export, sql: str, cat: str, names: _Codes) -> dict:
    return dict(zip(_FIELDS, ex.rows(sql, "iiiitii", names)), cat=cat)


def _host(ex: Export, names: _Codes, table: str, cat: str, name_sql: str, join: str, where: str = "1") -> dict | None:
    if not ex.has(table):
        return None
    gtid = ex.col(table, "globalTid")
    corr = ex.col(table, "correlationId")
    sql = (f"SELECT t.start, t.end, ({gtid} >> 24) & {_TID_MASK}, {gtid} & {_TID_MASK}, {name_sql}, NULL, {corr} "
           f"FROM {table} t{join} WHERE t.end IS NOT NULL AND {where}")
    return _piece(ex, sql, cat, names)


def _gpu(ex: Export, names: _Codes, table: str, cat: str, name_sql: str, join: str = "") -> dict | None:
    if not ex.has(table):
        return None
    sql = (f"SELECT t.start, t.end, {ex.col(table, 'deviceId')}, {ex.col(table, 'streamId')}, {name_sql}, "
           f"{ex.col(table, 'streamId')}, {ex.col(table, 'correlationId')} FROM {table} t{join}")
    return _piece(ex, sql, cat, names)


def _pieces(ex: Export, names: _Codes) -> list:
    """Every table's piece, their names coded into ``names``."""
    kname, kjoin = _string(ex, "CUPTI_ACTIVITY_KIND_KERNEL", "demangledName")
    if kname == "NULL":
        kname, kjoin = _string(ex, "CUPTI_ACTIVITY_KIND_KERNEL", "shortName")
    kinds = " ".join(f"WHEN {k} THEN '{v}'" for k, v in _COPY_KINDS.items())
    copy = ex.col("CUPTI_ACTIVITY_KIND_MEMCPY", "copyKind")
    rname, rjoin = _string(ex, "CUPTI_ACTIVITY_KIND_RUNTIME", "nameId")
    oname, ojoin = _string(ex, "OSRT_API", "nameId")
    tname, tjoin = _string(ex, "NVTX_EVENTS", "textId")
    text = ex.col("NVTX_EVENTS", "text")
    # ranges only (marks have no end); a range's text is its own or its registered string's
    nvtx = _host(ex, names, "NVTX_EVENTS", "user_annotation", f"COALESCE({text}, {tname})", tjoin,
                 f"COALESCE({text}, {tname}) IS NOT NULL")
    return [p for p in (
        _gpu(ex, names, "CUPTI_ACTIVITY_KIND_KERNEL", "kernel", kname, kjoin),
        _gpu(ex, names, "CUPTI_ACTIVITY_KIND_MEMCPY", "gpu_memcpy", f"CASE {copy} {kinds} ELSE 'Memcpy' END"),
        _gpu(ex, names, "CUPTI_ACTIVITY_KIND_MEMSET", "gpu_memset", "'Memset'"),
        _host(ex, names, "CUPTI_ACTIVITY_KIND_RUNTIME", "cuda_runtime", f"COALESCE({rname}, 'cudaRuntime')", rjoin),
        nvtx,
        _host(ex, names, "OSRT_API", "osrt", f"COALESCE({oname}, 'osrt')", ojoin),
    ) if p is not None]


def _columns(ex: Export) -> tuple[dict, np.ndarray]:
    """finish_frame's raw columns of every table, and each row's drop code."""
    codes = _Codes(bad="")
    pieces = _pieces(ex, codes)

    def joined(key):
        return _ints([p[key] for p in pieces])

    start, no_start = joined("start")
    end, no_end = joined("end")
    dur = end - start
    why = np.select([no_start, no_end, dur < 0], [1, 2, 3], 0).astype(np.int8)
    names, _ = codes.categorical([p["name"] for p in pieces])
    # the categories present, sorted (as the reader coded them before it read in chunks)
    names = names.remove_unused_categories()
    names = names.reorder_categories(sorted(names.categories))
    present = [p for p in pieces if len(p["start"][0])]
    cats = sorted({p["cat"] for p in present})
    cat = pd.Categorical.from_codes(np.repeat(np.array([cats.index(p["cat"]) for p in present], np.int64),
                                              [len(p["start"][0]) for p in present]), cats)
    stream, correlation = (pd.arrays.IntegerArray(*joined(k)) for k in ("stream", "correlation"))
    columns = {
        "pid": joined("pid")[0], "tid": joined("tid")[0],
        "name": names, "cat": cat,
        "start_ns": start, "dur_ns": np.where(why == 0, dur, 0),
        "stream": stream, "correlation": correlation,
        "external_id": pd.arrays.IntegerArray(np.zeros(len(start), np.int64), np.ones(len(start), bool)),
    }
    return columns, why


def _threads(ex: Export) -> dict:
    if not ex.has("ThreadNames"):
        return {}
    names = _Codes(bad="")
    (tids, _), codes = ex.rows(f"SELECT t.globalTid & {_TID_MASK}, s.value FROM ThreadNames t "
                               "JOIN StringIds s ON s.id = t.nameId", "it", names)
    return dict(zip(tids.tolist(), np.array(list(names.lookup), dtype=object)[codes].tolist()))


def load(path, rank: int | None = None, *, compact: bool = True):
    """(events table, meta, cache key or None) of one export, as load._load_rank gives a
    trace's: meta has the same keys."""
    ex = Export(path)
    path = Path(path)
    warnings: list = []
    try:
        key = source_key(ex.source)
        header = _header(ex)  # already in normalize_header's shape
        if rank is None:
            rank = (header["distributedInfo"] or {}).get("rank")
        if rank is None:  # header.rank_of's last source (header.py reads exports through this module)
            rank = rank_in_name(path)
        if rank is None:
            warnings.append(f"{path}: no rank in the export's environment or its name; assuming rank 0")
            rank = 0
        base = header["baseTimeNanoseconds"]
        if base is None:
            warnings.append(f"{path}: lacks TARGET_INFO_SESSION_START_TIME.utcEpochNs; this rank's clock is placed "
                            "from its events")
        kernels = ex.scalar("SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL") \
            if ex.has("CUPTI_ACTIVITY_KIND_KERNEL") else 0
        if not kernels:
            warnings.append(f"{path}: no CUDA kernels (CUPTI_ACTIVITY_KIND_KERNEL absent or empty: profiled without "
                            "`--trace=cuda`?); host-only analysis")
        if not ex.has("NVTX_EVENTS"):
            warnings.append(f"{path}: no NVTX_EVENTS table (profiled without `--trace=nvtx`?): no ranges, steps "
                            "or pipeline operations")
        columns, why = _columns(ex)
        columns["start_ns"] = columns["start_ns"] + (base or 0)
        threads = _threads(ex)
    finally:
        ex.close()
    frame, info = finish_frame(columns, why, rank, path, warnings, compact=compact, threads=threads)
    dist = header["distributedInfo"]
    meta = {
        "path": str(path), "rank": rank,
        "world_size": (dist or {}).get("world_size"),
        "base_ns": base or 0, "clock_unknown": base is None,
        "pptrace": None, "distributed": dist, "hostname": header.get("host_name"),
        "header": header, **info, "warnings": warnings,
    }
    return frame, meta, (key if unchanged(ex.source, ex.opened) else None)
