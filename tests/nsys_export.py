"""Write a rank's events as an Nsight Systems SQLite export, in the schema of the real export
(tests' fixture: its own ``CREATE TABLE`` statements, read from its sqlite_master), so that
the same run can be analysed both ways: kernels, memcpy/memset and CUDA runtime calls as
CUPTI rows, torch.profiler's user annotations (ProfilerStep#N, pptrace's ranges) as NVTX
push/pop ranges, the rank in the recorded environment. Host CPU ops have no nsys equivalent
and are left out, as nsys would."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np

FIXTURE = Path("/work/shared/fixtures/nsys/saxpy-mpi-cuda-rank0.sqlite")
_TABLES = ("StringIds", "ThreadNames", "TARGET_INFO_SYSTEM_ENV", "TARGET_INFO_SESSION_START_TIME",
           "EXPORT_META_DATA", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
           "CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS")
_COPY = {"HtoD": 1, "DtoH": 2, "DtoD": 8, "PtoP": 10}


def _schema() -> dict:
    with sqlite3.connect(f"file:{FIXTURE}?mode=ro", uri=True) as db:
        return dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type='table'").fetchall())


def _insert(db, table: str, rows: dict) -> None:
    """Insert the columns ``rows`` (name -> array); every other NOT NULL column gets 0."""
    n = len(next(iter(rows.values())))
    if not n:
        return
    info = db.execute(f'PRAGMA table_info("{table}")').fetchall()
    full = dict(rows)
    for _, name, _, notnull, _, _ in info:
        if notnull and name not in full:
            full[name] = np.zeros(n, np.int64)
    names = list(full)
    data = zip(*[[None if v is None else (int(v) if isinstance(v, (np.integer, int)) else v) for v in full[k]]
                 for k in names])
    db.executemany(f'INSERT INTO {table} ({", ".join(names)}) VALUES ({", ".join("?" * len(names))})', data)


def write_export(path, frame, *, base_ns: int, env: dict) -> Path:
    """``frame`` (a rank's pptrace events table on its own clock) as an nsys export at ``path``."""
    path = Path(path)
    schema = _schema()
    with sqlite3.connect(path) as db:
        for table in _TABLES:
            db.execute(schema[table])
        names = {n: i for i, n in enumerate(frame["name"].astype(str).unique())}
        db.executemany("INSERT INTO StringIds (id, value) VALUES (?, ?)", [(i, n) for n, i in names.items()])
        db.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME (utcEpochNs) VALUES (?)", (base_ns,))
        db.execute("INSERT INTO TARGET_INFO_SYSTEM_ENV (globalVid, devStateName, name, nameEnum, value) "
                   "VALUES (0, '', 'DeviceEnvironment', 0, ?)", ("\x00".join(f"{k}={v}" for k, v in env.items()),))
        db.execute("INSERT INTO EXPORT_META_DATA (name, value) VALUES ('EXPORT_PRODUCT_VERSION', 'pptrace-test')")
        cat = frame["cat"].astype(str).to_numpy()
        start = frame["start_ns"].to_numpy() - base_ns
        end = frame["end_ns"].to_numpy() - base_ns
        name = frame["name"].astype(str).to_numpy()
        ids = np.array([names[x] for x in name], np.int64)
        pid, tid = frame["pid"].to_numpy(), frame["tid"].to_numpy()
        corr = frame["correlation"].astype(object).where(frame["correlation"].notna(), None).to_numpy()
        stream = frame["stream"].fillna(0).to_numpy(np.int64)
        gtid = (pid.astype(np.int64) << 24) | (tid.astype(np.int64) & ((1 << 24) - 1))
        for table, keep, extra in (
            ("CUPTI_ACTIVITY_KIND_KERNEL", cat == "kernel", lambda k: {"demangledName": ids[k], "shortName": ids[k]}),
            ("CUPTI_ACTIVITY_KIND_MEMCPY", cat == "gpu_memcpy",
             lambda k: {"copyKind": np.array([next((c for w, c in _COPY.items() if w in x), 0) for x in name[k]])}),
            ("CUPTI_ACTIVITY_KIND_MEMSET", cat == "gpu_memset", lambda k: {}),
        ):
            _insert(db, table, {"start": start[keep], "end": end[keep], "deviceId": pid[keep],
                                "streamId": stream[keep], "correlationId": corr[keep], **extra(keep)})
        keep = cat == "cuda_runtime"
        _insert(db, "CUPTI_ACTIVITY_KIND_RUNTIME", {"start": start[keep], "end": end[keep], "globalTid": gtid[keep],
                                                    "correlationId": corr[keep], "nameId": ids[keep]})
        keep = cat == "user_annotation"
        _insert(db, "NVTX_EVENTS", {"start": start[keep], "end": end[keep], "eventType": np.full(keep.sum(), 59),
                                    "text": name[keep], "globalTid": gtid[keep]})
    return path
