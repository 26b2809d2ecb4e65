"""The inference written into the events table: p2p and pass rows appended (cat
``pptrace_inferred``), the foreign rows left as the trace has them."""
from __future__ import annotations

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from ...ingest.schema import nullable_int


def write_inference(events: pd.DataFrame, ops: pd.DataFrame, passes: pd.DataFrame, *more: dict | None) -> pd.DataFrame:
    """events with the inferred rows appended (the foreign rows stay as they are); ``more``:
    further rows in the same columns (collectives.collective_rows), a column one lacks null."""
    rows = [r for r in (_p2p_rows(ops), _pass_rows(passes), *more) if r is not None]
    if not rows:
        return events
    new = {}
    for k in dict.fromkeys(k for r in rows for k in r):
        parts = [r.get(k) if r.get(k) is not None else np.full(len(r["rank"]), None, dtype=object) for r in rows]
        if k in _INT_TAGS:
            new[k] = _int_column(np.concatenate([p.to_numpy(np.int64, na_value=-1) if isinstance(p, pd.arrays.IntegerArray)
                                                 else np.asarray(p, np.int64) for p in parts]))
        else:
            new[k] = np.concatenate(parts)
    return _append(events, new)


#: the nullable integer columns of the appended rows (-1: null)
_INT_TAGS = ("mb", "chunk", "peer", "bytes")


def _contract_names(kind: str, op: np.ndarray, tags: dict) -> np.ndarray:
    """``<kind>:<op> k=v ...`` per row, tags with a negative value left out."""
    name = pd.Series(kind + ":", index=range(len(op))) + pd.Series(op, dtype=object)
    for key, values in tags.items():
        values = pd.Series(np.asarray(values, dtype=np.int64))
        name = name.where(values < 0, name + f" {key}=" + values.astype(str))
    return name.to_numpy(object)


def _int_column(values) -> pd.arrays.IntegerArray:
    """int64 values, negative ones null."""
    values = np.asarray(values, dtype=np.int64)
    return pd.arrays.IntegerArray(np.where(values >= 0, values, 0), values < 0)


def _p2p_rows(ops: pd.DataFrame) -> dict | None:
    """``pp:send_fwd peer=1 mb=3 chunk=0 bytes=64`` rows spanning each op from its post to
    the end of its wait (a send moves data from its post on: the gloo range starts after
    it). ``op`` is ``send`` / ``recv`` where the direction is unknown."""
    if ops is None or ops.empty:
        return None
    n = len(ops)
    side = np.where(ops["is_send"].to_numpy(bool), "send", "recv").astype(object)
    direction = ops["dir"].to_numpy(object)
    op = np.where(direction != "", side + "_" + direction, side).astype(object)
    pp = max(int(ops.attrs.get("pp") or 1), 1)
    peer = ops["peer"].to_numpy(np.int64)
    mb = np.where(direction != "", ops["mb"].to_numpy(np.int64), -1)
    # chunk: the consuming stage's (a send's is its peer's), as the integrations tag them
    stage = ops["stage"].to_numpy(np.int64)
    send = ops["is_send"].to_numpy(bool)
    consumer = stage + np.where(send, np.where(direction == "fwd", 1, np.where(direction == "bwd", -1, 0)), 0)
    chunk = np.where((stage >= 0) & (consumer >= 0), consumer // pp, -1)
    size = ops["bytes"].fillna(-1).to_numpy(np.int64)
    wire = ops["start_ns"].to_numpy(np.int64)
    post = ops["post_start"].to_numpy(np.int64)
    start = np.where(post >= 0, np.minimum(post, wire), wire)
    end = ops["end_ns"].to_numpy(np.int64)
    return {
        "rank": ops["rank"].to_numpy(np.int32), "lane": np.full(n, "main", dtype=object),
        "lane_kind": np.full(n, "host", dtype=object), "pid": ops["pid"].to_numpy(np.int64),
        "tid": ops["tid"].to_numpy(np.int64),
        "name": _contract_names("pp", op, {"peer": peer, "mb": mb, "chunk": chunk, "bytes": size}),
        "cat": np.full(n, "pptrace_inferred", dtype=object), "start_ns": start, "end_ns": end, "dur_ns": end - start,
        "kind": np.full(n, "pp", dtype=object), "op": op, "mb": _int_column(mb), "chunk": _int_column(chunk),
        "peer": _int_column(peer), "bytes": _int_column(size), "category": np.full(n, "p2p", dtype=object),
        "step": ops["step"].to_numpy(np.int32), "inferred": np.ones(n, dtype=bool),
    }


def _pass_rows(passes: pd.DataFrame) -> dict | None:
    """``compute:fwd mb=3 chunk=0`` rows, cat ``pptrace_inferred``."""
    if passes is None or passes.empty:
        return None
    n = len(passes)
    mb = passes["mb"].to_numpy(np.int64)
    chunk = passes["chunk"].to_numpy(np.int64)
    op = passes["op"].astype(str).to_numpy(object)
    start, end = passes["start_ns"].to_numpy(np.int64), passes["end_ns"].to_numpy(np.int64)
    return {
        "rank": passes["rank"].to_numpy(np.int32), "lane": np.full(n, "main", dtype=object),
        "lane_kind": np.full(n, "host", dtype=object), "pid": passes["pid"].to_numpy(np.int64),
        "tid": passes["tid"].to_numpy(np.int64),
        "name": _contract_names("compute", op, {"mb": mb, "chunk": chunk}),
        "cat": np.full(n, "pptrace_inferred", dtype=object), "start_ns": start, "end_ns": end, "dur_ns": end - start,
        "kind": np.full(n, "compute", dtype=object), "op": op, "mb": _int_column(mb), "chunk": _int_column(chunk),
        "peer": _int_column(np.full(n, -1)), "bytes": _int_column(np.full(n, -1)),
        "category": np.full(n, "compute", dtype=object), "step": passes["step"].to_numpy(np.int32),
        "inferred": np.ones(n, dtype=bool),
    }


def _append(events: pd.DataFrame, new: dict) -> pd.DataFrame:
    """events with rows appended: ``new`` holds some columns, the others are null / False."""
    n = len(next(iter(new.values())))
    cols = {}
    for column in events.columns:
        col = events[column]
        value = new.get(column)
        if isinstance(col.dtype, pd.CategoricalDtype):
            values = np.asarray(value if value is not None else [None] * n, dtype=object)
            uniques = [v for v in pd.unique(values) if v is not None]
            extra = pd.Categorical(values, categories=pd.Index(uniques, dtype=col.cat.categories.dtype))
            cols[column] = union_categoricals([col.array, extra])
        elif isinstance(col.dtype, (pd.Int64Dtype, pd.Int32Dtype)):
            extra = pd.array(value if value is not None else [pd.NA] * n, dtype="Int64")
            data = np.concatenate([col.to_numpy(np.int64, na_value=0), extra.to_numpy(np.int64, na_value=0)])
            mask = np.concatenate([col.isna().to_numpy(), pd.isna(extra)])
            cols[column] = nullable_int(column, data, mask)
        elif col.dtype == bool:
            cols[column] = np.concatenate([col.to_numpy(), value if value is not None else np.zeros(n, bool)])
        else:
            fill = value if value is not None else np.zeros(n, dtype=col.dtype)
            cols[column] = np.concatenate([col.to_numpy(), np.asarray(fill, dtype=col.dtype)])
    return pd.DataFrame(cols, columns=events.columns)
