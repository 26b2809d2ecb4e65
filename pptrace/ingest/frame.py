"""Parsed trace events -> one rank's events table (the columns of :mod:`.schema`).

Columns are gathered slice by slice as plain lists (extract.py: typed structs from msgspec,
or dicts from the fallbacks), then turned into numpy/pandas columns once; classification,
lanes, steps, NCCL links and the p2p facts of plain traces are whole-column passes over the
finished table.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from .compact import foldable_names, nested_cpu_ops
from .memory import release
from .extract import complete_events, dur_to_ns, duration_events, extract_dicts, extract_structs, ts_to_ns
from .nccl import infer_nccl_p2p, link_nccl_kernels
from .p2p_args import add_p2p_args
from .schema import (COLUMNS, GPU_CATS, NULLABLE_INT_COLUMNS, TAG_COLUMNS, RawEvent, classify, profiler_step_number,
                     with_schema_ints)

# -------------------------------------------------------------------------------------------
# building the table from parsed events
# -------------------------------------------------------------------------------------------
#: Why an event is dropped (the codes of build_frame's ``why``; 0: kept), as the warning says it.
_DROP_REASONS = {1: "without a usable timestamp", 2: "without a usable duration", 3: "with a negative duration",
                 4: "far outside the rank's other events (ts or ts+dur)"}
#: An event further than this from the median start of its rank's events (and further than
#: ABSURD_SPREAD x their median distance to it) lies outside the profiled window: a corrupt
#: timestamp, which would otherwise stretch steps or make the run look like two runs.
ABSURD_FLOOR_NS = 3600 * 10**9
ABSURD_SPREAD = 100
_RPC_FIELDS = {
    "collective": "Collective name", "group_ranks": "Process Group Ranks",
    "pg_name": "Process Group Name", "in_nelems": "In msg nelems",
    "out_nelems": "Out msg nelems", "dtype": "dtype", "comm_seq": "Seq",
    "src_rank": "Src Rank", "dst_rank": "Dst Rank",
    "in_splits": "In split size", "out_splits": "Out split size",
}


#: the integer fields of ``args`` that become nullable Int64 columns directly
_ARG_INTS = ("stream", "correlation", "external_id")


def _all_null(n: int) -> pd.arrays.IntegerArray:
    return pd.arrays.IntegerArray(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))


def _join(pieces: list, dtype) -> np.ndarray:
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def _nullable_parts(values: list) -> tuple:
    """(int64 data, null mask) of a list: ints within int64 (bool excluded) and floats with
    an integral value are kept, anything else (None, huge ints, strings, 1.5) is null."""
    n = len(values)
    if values.count(None) == n:  # the common case for GPU-only fields on CPU traces
        return np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)
    kinds = set(map(type, values))
    try:
        if kinds == {int}:
            return np.array(values, dtype=np.int64), np.zeros(n, dtype=bool)
        if kinds == {int, type(None)}:
            arr = np.array(values, dtype=object)
            mask = np.equal(arr, None)
            arr[mask] = 0
            return arr.astype(np.int64), mask
    except OverflowError:
        pass
    keep = [_as_int64(v) for v in values]
    mask = np.fromiter((v is None for v in keep), dtype=bool, count=n)
    return np.array([0 if v is None else v for v in keep], dtype=np.int64), mask


def _as_int64(v):
    if type(v) is float and v.is_integer():
        v = int(v)
    return v if type(v) is int and -(2**63) <= v < 2**63 else None


def _nullable(values: list) -> pd.arrays.IntegerArray:
    return pd.arrays.IntegerArray(*_nullable_parts(values))


class _Lookup(dict):
    """value -> code, a new value getting the next code (dict lookups in C via map)."""

    def __missing__(self, key):
        code = self[key] = len(self)
        return code


class _Codes:
    """Category codes of a column built slice by slice: values that are not strings become
    ``bad`` ("" for names, null for torch categories); categories in order of first use."""

    def __init__(self, bad):
        self.bad = bad
        self.lookup: dict = _Lookup()

    def add(self, values: list) -> np.ndarray:
        lookup, bad = self.lookup, self.bad
        if values.count(None) == 0 and set(map(type, values)) == {str}:  # the usual case
            return np.fromiter(map(lookup.__getitem__, values), dtype=np.int32, count=len(values))
        codes, uniques = pd.factorize(np.array(values, dtype=object))
        if (codes < 0).any() and bad is not None:
            # nulls that become a real category: map value by value to keep first-use order
            codes, uniques = pd.factorize(np.array([v if type(v) is str else bad for v in values], dtype=object))
        remap = np.empty(len(uniques) + 1, dtype=np.int32)
        remap[-1] = -1  # pandas' null code
        for i, u in enumerate(uniques):
            if type(u) is not str:
                u = bad
            remap[i] = -1 if u is None else lookup.setdefault(u, len(lookup))
        return remap[codes]

    def categorical(self, pieces: list) -> tuple[pd.Categorical, int]:
        """The column, and how many of its distinct values held a lone surrogate escape
        (JSON's ``\\ud800`` alone: no UTF-8 text can hold it, so Arrow and every output
        would fail on it), written as U+FFFD."""
        codes = _join(pieces, np.int32)
        values = list(self.lookup)
        # one search over every value at once: almost every trace has none
        bad = [i for i, v in enumerate(values) if _SURROGATE.search(v)] if _SURROGATE.search("".join(values)) else []
        if not bad:
            return pd.Categorical.from_codes(codes, categories=pd.Index(values, dtype=object)), 0
        for i in bad:
            values[i] = _SURROGATE.sub("\ufffd", values[i])
        # two names may now be one (first use keeps the order)
        inverse, first = pd.factorize(np.array(values, dtype=object))
        return (pd.Categorical.from_codes(np.where(codes < 0, -1, inverse[codes]), categories=pd.Index(first, dtype=object)),
                len(bad))


_SURROGATE = re.compile("[\ud800-\udfff]")


def _int64(values: list) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        return np.asarray([v if -(2**63) <= v < 2**63 else -1 for v in values], dtype=np.int64)


def _with_complete_events(slices, path, warnings: list, complete_counts: list):
    """The slices, then one more of the ranges written as B/E event pairs (legal Chrome trace
    format, which some exporters write), paired into complete events: a pair may span slices,
    so they are paired once all are read. Only a slice that held more than its complete
    events (``complete_counts``: what the table took of each) is searched for them."""
    found: list = []
    for events, blob in slices:
        yield events, blob
        if complete_counts[-1] < len(events):  # metadata, flows, instants ... or B/E
            found += duration_events(events, blob)
    if found:
        complete, alone = complete_events(found)
        if alone:
            warnings.append(f"{path}: {alone} begin/end (B/E) events without their other half left out")
        if complete:
            yield complete, None


def build_frame(slices, rank: int, base_ns: int, path, warnings: list, compact: bool = True, place=None):
    """Parsed event slices -> (DataFrame with COLUMNS, info dict). One pass per slice, so
    only one slice's Python objects are alive at a time: each slice becomes numpy arrays
    (category codes, int64, nullable parts) before the next is parsed. A slice is a list of
    event dicts (orjson / json) or of :class:`RawEvent` (typed decoding); both give the same
    table. ``compact``: nested plain CPU ops folded (compact.py), before the table is
    sorted, so that the full table is never copied. ``place``: called once every slice is
    read, -> (rank, base_ns) in place of those given (a streamed trace's header, which holds
    them, is read last: document.StreamedTrace)."""
    parts: dict = {k: [] for k in ("pid", "tid", "name", "cat", "start", "dur", "why", *_ARG_INTS)}
    names, cats = _Codes(bad=""), _Codes(bad=None)
    rpc, threads, p2p = {}, {}, {}
    foreign = 0
    n_before = 0
    complete_counts: list = []
    for events, blob in _with_complete_events(slices, path, warnings, complete_counts):
        typed = bool(events) and type(events[0]) is RawEvent
        extract = extract_structs if typed else extract_dicts
        cols: dict = {}
        x_index, ts, dur, n_foreign = extract(events, cols, rpc, threads, n_before, p2p)
        foreign += n_foreign
        complete_counts.append(len(dur) + n_foreign)
        start, no_ts = ts_to_ns(ts, events, x_index, blob, warnings, path)
        parts["start"].append(start)
        del events, ts
        dur_ns, no_dur, negative = dur_to_ns(dur)
        parts["dur"].append(dur_ns)
        # the first reason that applies (a row without a ts is counted as that alone)
        parts["why"].append(np.select([no_ts, no_dur, negative], [1, 2, 3], 0).astype(np.int8))
        parts["pid"].append(_int64(cols.pop("pid")))
        parts["tid"].append(_int64(cols.pop("tid")))
        parts["name"].append(names.add(cols.pop("name")))
        parts["cat"].append(cats.add(cols.pop("cat")))
        for key in _ARG_INTS:
            parts[key].append(_nullable_parts(cols.pop(key)))
        n_before += len(dur_ns)
        del dur, dur_ns, start, x_index, cols
    if foreign > 8:  # Kineto's own span events have string pids; more means a strange file
        warnings.append(f"{path}: skipped {foreign} events without numeric pid/tid")
    n = n_before
    if place is not None:
        rank, base_ns = place()
    release()  # the slices' objects, freed among the columns' pieces, back to the OS before the table's peak
    start = _join(parts.pop("start"), np.int64) + base_ns
    dur = _join(parts.pop("dur"), np.int64)
    why = _join(parts.pop("why"), np.int8)
    name_column, bad_names = names.categorical(parts.pop("name"))
    cat_column, bad_cats = cats.categorical(parts.pop("cat"))
    if bad_names + bad_cats:
        warnings.append(f"{path}: {bad_names + bad_cats} event names or categories hold a lone surrogate "
                        "escape (\\ud800 ...: no text can hold one); shown as U+FFFD")
    columns = {"pid": _join(parts.pop("pid"), np.int64), "tid": _join(parts.pop("tid"), np.int64),
               "name": name_column, "cat": cat_column, "start_ns": start, "dur_ns": dur}
    del start, dur
    for key in _ARG_INTS:
        pieces = parts.pop(key)
        columns[key] = pd.arrays.IntegerArray(_join([d for d, _ in pieces], np.int64),
                                              _join([m for _, m in pieces], bool))
        del pieces
    return finish_frame(columns, why, rank, path, warnings, compact=compact, rpc=rpc, threads=threads, p2p=p2p)


def finish_frame(columns: dict, why: np.ndarray, rank: int, path, warnings: list, *, compact: bool = True,
                 rpc: dict | None = None, threads: dict | None = None, p2p: dict | None = None):
    """The rank's table (COLUMNS, sorted) and info from its raw columns, whichever reader
    gathered them (build_frame from JSON slices, ingest/nsys from an export's rows):
    ``columns`` holds pid, tid (int64), name, cat (Categorical), start_ns, dur_ns (int64, on
    the rank's clock) and the _ARG_INTS as nullable ints; ``why`` the drop code of each row
    (0: kept). ``rpc``, ``p2p``: record_param_comms args and p2p facts by row; ``threads``:
    tid -> thread name. Classification, lanes, steps and NCCL links are decided here, once
    for every reader."""
    rpc, threads, p2p = dict(rpc or {}), dict(threads or {}), dict(p2p or {})
    start, dur = columns.pop("start_ns"), columns.pop("dur_ns")
    _mark_absurd(start, dur, why)
    n = len(start)
    df = pd.DataFrame({
        "rank": np.full(n, rank, dtype=np.int32),
        "pid": columns.pop("pid"), "tid": columns.pop("tid"),
        "name": columns.pop("name"),
        "cat": columns.pop("cat"),
        "start_ns": start, "end_ns": start + dur, "dur_ns": dur,
    }, copy=False)
    del start, dur
    for key in _ARG_INTS:
        df[key] = columns.pop(key)
    lost_steps = 0
    if why.any():
        df, rpc, p2p, lost_steps = _drop(df, why, rpc, p2p, path, warnings)
        n = len(df)
    infos, inverse = _classes(df)
    gpu = df["cat"].isin(GPU_CATS).to_numpy()
    main_tid = _main_tid(df, gpu, _per_row(infos, inverse, lambda d: d["category"] == "step"))
    folded = 0
    if compact:  # fold first: every column below is derived for the compact rows only
        nested = _nested(df, infos, inverse, rpc)
        folded = int(nested.sum())
        if folded:
            df, rpc, p2p = _keep_rows(df, ~nested, rpc, p2p)
            inverse, gpu = inverse[~nested], gpu[~nested]
    _add_classification(df, infos, inverse)
    # gpu_user_annotation events carry no "stream" arg; their tid is the stream.
    no_stream = gpu & df["stream"].isna().to_numpy()
    if no_stream.any():
        df.loc[no_stream, "stream"] = df.loc[no_stream, "tid"].to_numpy()
    _add_lanes(df, gpu, main_tid, threads)
    _add_rpc(df, rpc)
    add_p2p_args(df, p2p)
    link_nccl_kernels(df)
    _add_steps(df, gpu)
    infer_nccl_p2p(df, rank, warnings)  # plain NCCL traces: send/recv -> pp rows
    info = {
        "threads": {int(k): v for k, v in threads.items()},
        "main_tid": main_tid,
        "profiler_steps": sorted(int(s) for s in df.loc[df["category"] == "step", "step"].unique()),
        "n_events": n,
        "dropped_steps": lost_steps,  # ProfilerStep ranges among the dropped events
        "folded": folded,
    }
    df = with_schema_ints(df[list(COLUMNS)]).sort_values(["start_ns", "end_ns"], ascending=[True, False], kind="stable").reset_index(drop=True)
    df, info["duplicates"] = _drop_duplicates(df, path, warnings)
    return df, info


#: What makes two events the same one recorded twice: every field the table keeps of it.
_IDENTITY = ("pid", "tid", "name", "cat", "start_ns", "dur_ns", "correlation", "external_id")


def _drop_duplicates(df: pd.DataFrame, path, warnings: list) -> tuple[pd.DataFrame, int]:
    """The table without exact copies of an event (a trace concatenated or exported twice
    doubles every range, and the analyses would count each twice), and how many were
    dropped, with one warning. Copies share a span, so after the sort only rows whose start
    and end equal the previous row's are compared in full: nothing else to pay on a trace
    without copies. Zero-length events are left alone (distinct ones can share an instant)."""
    start, end = df["start_ns"].to_numpy(), df["end_ns"].to_numpy()
    same = np.flatnonzero((start[1:] == start[:-1]) & (end[1:] == end[:-1]) & (end[1:] > start[1:]))
    if not len(same):
        return df, 0
    rows = np.unique(np.r_[same, same + 1])
    copies = rows[df.iloc[rows].duplicated(subset=list(_IDENTITY), keep="first").to_numpy()]
    if not len(copies):
        return df, 0
    n = len(copies)
    warnings.append(f"{path}: {n} event{'s' * (n > 1)} recorded twice (the same name, thread, start and duration: "
                    "a trace concatenated or exported twice?); one copy of each is analyzed")
    keep = np.ones(len(df), bool)
    keep[copies] = False
    return df[keep].reset_index(drop=True), n


def _mark_absurd(start: np.ndarray, dur: np.ndarray, why: np.ndarray) -> None:
    """Set ``why`` to 4 for events whose start or end lies far outside the rank's other
    events: ABSURD_FLOOR_NS and ABSURD_SPREAD median distances from their median start."""
    ok = why == 0
    if ok.sum() < 2:
        return
    s = start[ok].astype(np.float64)
    mid = float(np.median(s))
    radius = max(ABSURD_SPREAD * float(np.median(np.abs(s - mid))), ABSURD_FLOOR_NS)
    t0 = start.astype(np.float64)
    far = ok & ((np.abs(t0 - mid) > radius) | (np.abs(t0 + dur - mid) > radius))
    why[far] = 4


def _drop(df: pd.DataFrame, why: np.ndarray, rpc: dict, p2p: dict, path, warnings: list):
    """(the table without the events ``why`` marks, rpc/p2p (keyed by row) renumbered, how
    many ProfilerStep ranges were among them), and one warning line counting them by reason."""
    keep = why == 0
    counts = np.bincount(why, minlength=len(_DROP_REASONS) + 1)
    detail = ", ".join(f"{counts[code]} {text}" for code, text in _DROP_REASONS.items() if counts[code])
    n = int((~keep).sum())
    names = df["name"].cat.categories.to_numpy(object)[df["name"].cat.codes.to_numpy()[~keep]]
    marks = [x for x in pd.unique(names) if profiler_step_number(x) is not None]  # per distinct name
    steps = int(np.isin(names, marks).sum()) if marks else 0
    lost = f" (of which {steps} ProfilerStep ranges)" if steps else ""
    warnings.append(f"{path}: {n} event{'s' * (n > 1)} dropped: {detail}{lost}; the other events are analyzed")
    df, rpc, p2p = _keep_rows(df, keep, rpc, p2p)
    return df, rpc, p2p, steps


def _keep_rows(df: pd.DataFrame, keep: np.ndarray, rpc: dict, p2p: dict):
    """The ``keep`` rows of ``df``, and rpc/p2p (keyed by row) renumbered to match."""
    row = np.cumsum(keep) - 1  # old row -> new row
    rpc = {int(row[k]): v for k, v in rpc.items() if keep[k]}
    p2p = {int(row[k]): v for k, v in p2p.items() if keep[k]}
    return df[keep].reset_index(drop=True), rpc, p2p



def _classes(df: pd.DataFrame) -> tuple[list, np.ndarray]:
    """(:func:`classify` of each distinct (name, cat), per row the index of its entry)."""
    names, cats = df["name"].cat, df["cat"].cat
    ncat = len(cats.categories) + 1
    key = names.codes.to_numpy().astype(np.int64) * ncat + (cats.codes.to_numpy().astype(np.int64) + 1)
    uniq, inverse = np.unique(key, return_inverse=True)
    infos = []
    for k in uniq:
        c = int(k % ncat) - 1
        infos.append(classify(names.categories[int(k // ncat)], cats.categories[c] if c >= 0 else None))
    return infos, inverse


def _per_row(infos: list, inverse: np.ndarray, test) -> np.ndarray:
    """``test`` of each row's classification, decided once per distinct (name, cat)."""
    return np.asarray([bool(test(d)) for d in infos], dtype=bool)[inverse] if infos else np.zeros(0, bool)


def _nested(df: pd.DataFrame, infos: list, inverse: np.ndarray, rpc: dict) -> np.ndarray:
    """compact.nested_cpu_ops of the table: a plain op has no contract name or tags
    (classification), no collective or group (its record_param_comms args) and a name
    that may fold."""
    plain = _per_row(infos, inverse, lambda d: d["category"] == "other" and d["kind"] is None and d["tags"] is None)
    plain &= foldable_names(df["name"].array)
    said = [r for r, a in rpc.items() if a.get(_RPC_FIELDS["collective"]) is not None
            or a.get(_RPC_FIELDS["group_ranks"]) is not None]
    plain[np.asarray(said, dtype=np.int64)] = False
    cpu = (df["cat"] == "cpu_op").to_numpy()
    return nested_cpu_ops(cpu, plain, df["pid"].to_numpy(), df["tid"].to_numpy(),
                          df["start_ns"].to_numpy(), df["end_ns"].to_numpy())


def _add_classification(df: pd.DataFrame, infos: list, inverse: np.ndarray) -> None:
    for column in ("kind", "op", "tags", "category"):
        codes, uniques = pd.factorize(pd.Series([d[column] for d in infos], dtype=object))
        df[column] = pd.Categorical.from_codes(codes[inverse], categories=pd.Index(uniques, dtype=object))
    for column in TAG_COLUMNS:
        df[column] = pd.array([d[column] for d in infos], dtype="Int64").take(inverse)
    df["is_nccl"] = np.asarray([d["is_nccl"] for d in infos], dtype=bool)[inverse] if infos else np.zeros(0, bool)


def _main_tid(df: pd.DataFrame, gpu: np.ndarray, is_step: np.ndarray) -> int | None:
    """The main thread: the most frequent host tid among events whose tid is their pid,
    else the tid of most ProfilerStep ranges, else the busiest (counted before folding)."""
    host = df.loc[~gpu, ["pid", "tid"]]
    if host.empty:
        return None
    own = host.loc[host["pid"] == host["tid"], "tid"]
    if not own.empty:
        return int(own.mode().iloc[0])
    stepped = host.loc[is_step[~gpu], "tid"]
    return int((stepped if not stepped.empty else host["tid"]).mode().iloc[0])


def _add_lanes(df: pd.DataFrame, gpu: np.ndarray, main_tid, threads: dict) -> None:
    tid = df["tid"].to_numpy()
    key = np.where(gpu, -1 - tid, tid)  # streams and host threads never share a key
    uniq, inverse = np.unique(key, return_inverse=True)
    labels = []
    for k in uniq:
        if k < 0:
            labels.append(f"stream {-1 - k}")
        elif k == main_tid:
            labels.append("main")
        else:
            labels.append(f"thread:{k} {threads.get(int(k), '')}".rstrip())
    df["lane"] = pd.Categorical.from_codes(inverse, categories=pd.Index(labels, dtype=object)) if len(uniq) else pd.Categorical([])
    df["lane_kind"] = pd.Categorical.from_codes(gpu.astype(np.int8), categories=["host", "gpu"])
    df["gpu_annotation"] = (df["cat"] == "gpu_user_annotation").to_numpy()
    df["inferred"] = np.zeros(len(df), dtype=bool)


def _add_rpc(df: pd.DataFrame, rpc: dict) -> None:
    n = len(df)
    rows = np.fromiter(rpc.keys(), dtype=np.int64, count=len(rpc))
    for column, key in _RPC_FIELDS.items():
        values = [rpc[r].get(key) for r in rows]
        if column in NULLABLE_INT_COLUMNS:
            full = _all_null(n)
            if len(rows):
                full[rows] = _nullable([v if type(v) is int else None for v in values])
            df[column] = full
        else:
            # categorize the few rpc rows, then spread their codes (as pd.Categorical of the
            # full column would: sorted categories, same dtype)
            small = pd.Categorical(np.array([str(v) if v is not None else None for v in values] or [None], dtype=object))
            codes = np.full(n, -1, dtype=small.codes.dtype)
            if len(rows):
                codes[rows] = small.codes
            df[column] = pd.Categorical.from_codes(codes, dtype=small.dtype)


def _add_steps(df: pd.DataFrame, gpu: np.ndarray) -> None:
    step = np.full(len(df), -1, dtype=np.int32)
    marks = df.loc[(df["category"] == "step").to_numpy() & ~gpu, ["name", "start_ns", "end_ns"]]
    if not marks.empty:
        marks = marks.assign(n=[profiler_step_number(x) for x in marks["name"]]).sort_values("start_ns")
        s0, s1, num = (marks[c].to_numpy() for c in ("start_ns", "end_ns", "n"))
        start = df["start_ns"].to_numpy()
        i = np.searchsorted(s0, start, side="right") - 1
        inside = (i >= 0) & (start < s1[np.clip(i, 0, None)])
        step = np.where(inside, num[np.clip(i, 0, None)], -1).astype(np.int32)
        # GPU work runs after its step's CPU side: give it the step of the launching call.
        corr = df["correlation"]
        launch = (~gpu) & corr.notna().to_numpy()
        if gpu.any() and launch.any():
            by_corr = pd.Series(step[launch], index=corr[launch].to_numpy())
            by_corr = by_corr[~by_corr.index.duplicated()]
            g = gpu & corr.notna().to_numpy()
            mapped = by_corr.reindex(corr[g].to_numpy()).to_numpy()
            step[g] = np.where(pd.isna(mapped), step[g], mapped).astype(np.int32)
    df["step"] = step
