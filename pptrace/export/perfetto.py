"""One Chrome/Perfetto trace for the whole run: ranks as processes, lanes as threads, aligned
clocks, p2p pairs as flow arrows. Opens in ui.perfetto.dev and chrome://tracing.

The trace is written as it is made, a slice of rows at a time, each slice's JSON text built
whole-array (pyarrow string kernels) from the events table: a run's merged trace never sits
in memory as Python objects (a dict per event took 3.5-4x the traces' size).

``write_simulated_trace`` writes the what-if's predicted timeline the same way for the eye:
stages as processes, compute and p2p as threads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..output import write_file
from ..progress import WRITE, phased
from ..vocab import ZB_H1

_LANE_ORDER = {"main": 0}
#: rows turned into JSON at a time: bounds the writer's memory whatever the run's size
CHUNK_ROWS = 1 << 16
_SLICE_BYTES = 1 << 28
_NUMBERS_WIDTH = 256  # the rest of an event's text: keys, ids and times
# "µs.fraction" text of ns % 1000, as a float's shortest repr writes it (1.5, 1.0, 1.001)
_FRACTIONS = pa.array(["0"] + [f"{i:03d}".rstrip("0") for i in range(1, 1000)])


def _lane_sort(lane: str) -> tuple:
    if lane in _LANE_ORDER:
        return (0, 0, lane)
    if lane.startswith("stream "):
        return (2, int(lane.split()[1]) if lane.split()[1].isdigit() else 0, lane)
    return (1, 0, lane)


def _micros(ns: np.ndarray) -> pa.Array:
    """Integer ns as µs text with up to 3 decimals: the value ``ns / 1000.0`` has (what the
    trace format wants), written from the integer so that no float rounding can move it."""
    ns = np.asarray(ns, dtype=np.int64)
    size = np.abs(ns)
    text = pc.binary_join_element_wise(pa.array(size // 1000).cast(pa.string()),
                                       _FRACTIONS.take(pa.array(size % 1000)), ".")
    negative = ns < 0
    if negative.any():
        text = pc.if_else(pa.array(negative), pc.binary_join_element_wise("-", text, ""), text)
    return text


def _integers(values) -> pa.Array:
    return pa.array(np.asarray(values, dtype=np.int64)).cast(pa.string())


def _literals(column: pd.Series, missing: str = "nan") -> tuple[pa.Array, np.ndarray]:
    """A column as JSON string literals, escaped once per distinct value, and each row's code
    into them (-1: missing, which reads ``missing``; "nan" is what ``astype(str)`` writes)."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        column = column.astype("category")
    literals = [orjson.dumps(str(c)).decode() for c in column.cat.categories] + [orjson.dumps(missing).decode()]
    return pa.array(literals), column.cat.codes.to_numpy()


def _take(literals: pa.Array, codes: np.ndarray) -> pa.Array:
    return literals.take(pa.array(np.where(codes < 0, len(literals) - 1, codes)))


def _rows_text(*parts) -> pa.Array:
    """Each row's parts (literal text or per-row arrays) joined into one string per row."""
    return pc.binary_join_element_wise(*parts, "")


def _text_bytes(text: pa.Array) -> memoryview:
    """The concatenated text of a string array, without copying it out row by row."""
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32, count=len(text) + 1, offset=4 * text.offset)
    return memoryview(text.buffers()[2])[offsets[0]:offsets[-1]]


class _Lanes:
    """Each rank's lanes as threads, tids from 1 in lane order (main thread, other threads,
    GPU streams by number). Rows are keyed rank x lane and looked up a slice at a time, so
    nothing here grows with the run but the list of lanes."""

    def __init__(self, ev: pd.DataFrame):
        lane = ev["lane"] if isinstance(ev["lane"].dtype, pd.CategoricalDtype) else ev["lane"].astype("category")
        self._labels = np.array([*map(str, lane.cat.categories), "nan"], dtype=object)
        self._codes, self._ranks = lane.cat.codes.to_numpy(), ev["rank"].to_numpy()
        keys = np.unique(np.concatenate([np.unique(self._key(slice(a, a + CHUNK_ROWS)))
                                         for a in range(0, len(ev), CHUNK_ROWS)] or [np.zeros(0, np.int64)]))
        width = len(self._labels)
        table = pd.DataFrame({"key": keys, "rank": keys // width, "lane": self._labels[keys % width]})
        order = {name: i for i, name in enumerate(sorted(set(table["lane"]), key=_lane_sort))}
        table = table.assign(position=table["lane"].map(order)).sort_values(["rank", "position"], kind="stable")
        table["tid"] = table.groupby("rank").cumcount() + 1
        self.table = table.drop(columns="position").sort_values("key").reset_index(drop=True)
        self._keys, self._tids = self.table["key"].to_numpy(), self.table["tid"].to_numpy(np.int64)

    def _key(self, rows) -> np.ndarray:
        codes = self._codes[rows]
        return self._ranks[rows].astype(np.int64) * len(self._labels) + np.where(codes < 0, len(self._labels) - 1, codes)

    def tids(self, rows) -> np.ndarray:
        """The tid of the events at ``rows`` (a slice or positions)."""
        return self._tids[np.searchsorted(self._keys, self._key(rows))]


def _metadata(run, lanes: pd.DataFrame) -> list[dict]:
    """Process (rank) and thread (lane) names and their order: per rank its process, then
    its threads."""
    ranks = sorted(set(lanes["rank"].tolist()))
    label = {r: run.describe(r) if hasattr(run, "describe") else f"rank {r}" for r in ranks}
    keyed = [((r, 0), {"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": label[r]}})
             for r in ranks]
    keyed += [((r, 1), {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
              for r in ranks]
    rows = list(zip(lanes["rank"].tolist(), lanes["lane"].tolist(), lanes["tid"].tolist()))
    keyed += [((r, 2 * t), {"ph": "M", "name": "thread_name", "pid": r, "tid": t, "args": {"name": lane}})
              for r, lane, t in rows]
    keyed += [((r, 2 * t + 1), {"ph": "M", "name": "thread_sort_index", "pid": r, "tid": t,
                                "args": {"sort_index": t}}) for r, _, t in rows]
    return [event for _, event in sorted(keyed, key=lambda item: item[0])]


def _slices(ev: pd.DataFrame, lanes: _Lanes, origin: int) -> Iterator[memoryview]:
    """The complete ("X") events, CHUNK_ROWS rows at a time, each text after a comma."""
    names, name_codes = _literals(ev["name"])
    cats, cat_codes = _literals(ev["cat"], missing="other")
    categories, category_codes = _literals(ev["category"])
    rank, step = ev["rank"].to_numpy(), ev["step"].to_numpy()
    start, dur = ev["start_ns"].to_numpy(), ev["dur_ns"].to_numpy()
    # a slice's text must stay under the 2 GB a string array holds, even when a hostile trace
    # names its events with megabytes
    widest = sum(pc.max(pc.binary_length(x)).as_py() for x in (names, cats, categories)) + _NUMBERS_WIDTH
    step_rows = max(1, min(CHUNK_ROWS, _SLICE_BYTES // widest))
    for a in range(0, len(ev), step_rows):
        rows = slice(a, a + step_rows)
        yield _text_bytes(_rows_text(
            ',{"ph":"X","name":', _take(names, name_codes[rows]), ',"cat":', _take(cats, cat_codes[rows]),
            ',"pid":', _integers(rank[rows]), ',"tid":', _integers(lanes.tids(rows)),
            ',"ts":', _micros(start[rows].astype(np.int64) - origin), ',"dur":', _micros(dur[rows]),
            ',"args":{"category":', _take(categories, category_codes[rows]),
            ',"step":', _integers(step[rows]), "}}",
        ))


def _flows(run, ev: pd.DataFrame, lanes: _Lanes, origin: int) -> Iterator[memoryview]:
    """Each p2p pair as a flow: it leaves the send when it starts and lands where the recv
    ends, i.e. on the enclosing slices ("bp": "e" binds the end to the slice around that
    instant); 1 ns inside both. Ids count every pair of the run, drawn or not."""
    pairs = getattr(run, "pairs", None)
    if pairs is None or pairs.empty:
        return
    send = ev.index.get_indexer(pairs["send_index"])
    recv = ev.index.get_indexer(pairs["recv_index"])
    keep = (send >= 0) & (recv >= 0)
    if not keep.any():
        return
    fid = _integers(np.flatnonzero(keep) + 1)
    p = pairs[keep]
    names, codes = _literals(p["kind"].astype(str) + ":" + p["direction"].astype(str) + " mb=" + p["mb"].astype(str))
    name = _take(names, codes)
    start = p["send_start_ns"].to_numpy(np.int64) - origin + 1
    end = np.maximum(p["recv_end_ns"].to_numpy(np.int64) - origin - 1, start)
    yield _text_bytes(_rows_text(
        ',{"ph":"s","id":', fid, ',"name":', name, ',"cat":"p2p","pid":', _integers(p["src"]),
        ',"tid":', _integers(lanes.tids(send[keep])), ',"ts":', _micros(start),
        '},{"ph":"f","bp":"e","id":', fid, ',"name":', name, ',"cat":"p2p","pid":', _integers(p["dst"]),
        ',"tid":', _integers(lanes.tids(recv[keep])), ',"ts":', _micros(end), "}",
    ))


def _trace_events(run, include_cpu_ops: bool) -> Iterator:
    """The text of the trace's events, piece by piece, each after a comma."""
    ev = run.events
    if not include_cpu_ops:
        ev = ev[(ev["category"] != "other").to_numpy() | (ev["lane_kind"] == "gpu").to_numpy()]
    if ev.empty:
        return
    origin = int(ev["start_ns"].min())
    lanes = _Lanes(ev)
    yield b"," + orjson.dumps(_metadata(run, lanes.table))[1:-1]
    yield from _slices(ev, lanes, origin)
    yield from _flows(run, ev, lanes, origin)


def _document(run, include_cpu_ops: bool) -> Iterator:
    head = {"displayTimeUnit": "ms",
            "otherData": {"pptrace": {"source": str(getattr(run, "path", "")), "clock": "aligned to the reference rank"}}}
    yield orjson.dumps(head)[:-1] + b',"traceEvents":['
    first = True
    for piece in _trace_events(run, include_cpu_ops):
        if first and len(piece):
            piece, first = piece[1:], False  # no comma before the first event
        yield piece
    yield b"]}"


def merge_events(run, *, include_cpu_ops: bool = True) -> list[dict]:
    """The merged trace's event list (see merge_run), parsed back: for small runs and tests."""
    return orjson.loads(b"".join(_document(run, include_cpu_ops)))["traceEvents"]


@phased(f"{WRITE} the merged trace")
def merge_run(run, out_path, *, include_cpu_ops: bool = True) -> Path:
    """Write the merged trace to ``out_path`` (``.json`` or ``.json.gz``); returns the path.

    Every rank is a process named like "rank 3 · pp1 tp1", every lane (main thread, gloo
    worker threads, GPU streams) a thread, times are on the aligned clock in µs from the
    run's first event, and each p2p pair is a flow arrow from send to recv. The file is
    written as its text is made, and replaces ``out_path`` only once complete.
    """
    return write_file(out_path, _document(run, include_cpu_ops), compresslevel=5)


@phased(f"{WRITE} the simulated trace")
def write_simulated_trace(result: dict, out_path) -> Path:
    """The predicted timeline as a Chrome/Perfetto trace: one process per stage, compute and
    p2p on separate threads. ``.gz`` paths are gzip-compressed."""
    pred = result["predicted"]
    cols = pred["timeline"]["columns"]
    events = []
    for s in range(result["measured"]["pp"]):
        events.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": f"stage {s} (simulated)"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": s, "tid": 0, "args": {"sort_index": s}})
        events.append({"ph": "M", "name": "thread_name", "pid": s, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": s, "tid": 1, "args": {"name": "p2p"}})
    names = {"F": "compute:fwd", "B": "compute:bwd_input" if pred["schedule"] == ZB_H1 else "compute:bwd",
             "I": "compute:bwd_input", "W": "compute:bwd_weight", "comm": "pp:exchange"}
    for row in pred["timeline"]["rows"]:
        r = dict(zip(cols, row))
        name = names[r["kind"]]
        if r["kind"] != "comm":
            name += f" mb={int(r['mb'])}" + (f" chunk={int(r['chunk'])}" if pred["vpp"] > 1 else "")
        events.append({
            "ph": "X", "name": name, "cat": "simulated", "pid": int(r["stage"]), "tid": int(r["kind"] == "comm"),
            "ts": r["start_s"] * 1e6, "dur": (r["end_s"] - r["start_s"]) * 1e6,
        })
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "pptrace_whatif": {k: v for k, v in pred.items() if k != "timeline"}}
    return write_file(out_path, orjson.dumps(doc))
