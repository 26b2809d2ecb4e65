"""One Chrome/Perfetto trace for the whole run: ranks as processes, lanes as threads, aligned
clocks, p2p pairs as flow arrows. Opens in ui.perfetto.dev and chrome://tracing.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import orjson

from ..errors import TraceError

_LANE_ORDER = {"main": 0}


def _lane_sort(lane: str) -> tuple:
    if lane in _LANE_ORDER:
        return (0, 0, lane)
    if lane.startswith("stream "):
        return (2, int(lane.split()[1]) if lane.split()[1].isdigit() else 0, lane)
    return (1, 0, lane)


def merge_events(run, *, include_cpu_ops: bool = True) -> list[dict]:
    """The merged trace's event list (see merge_run)."""
    ev = run.events
    if not include_cpu_ops:
        ev = ev[(ev["category"] != "other").to_numpy() | (ev["lane_kind"] == "gpu").to_numpy()]
    origin = int(ev["start_ns"].min()) if len(ev) else 0
    out: list[dict] = []
    tids: dict = {}
    for rank in sorted(int(r) for r in ev["rank"].unique()):
        pid = rank
        label = run.describe(rank) if hasattr(run, "describe") else f"rank {rank}"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rank}})
        lanes = sorted(ev.loc[(ev["rank"] == rank).to_numpy(), "lane"].astype(str).unique(), key=_lane_sort)
        for i, lane in enumerate(lanes, start=1):
            tids[(rank, lane)] = i
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": i, "args": {"name": lane}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": i, "args": {"sort_index": i}})
    ranks = ev["rank"].to_numpy()
    lanes = ev["lane"].astype(str).to_numpy()
    names = ev["name"].astype(str).to_numpy()
    cats = ev["cat"].astype(object).to_numpy()
    category = ev["category"].astype(str).to_numpy()
    steps = ev["step"].to_numpy()
    # Microseconds relative to the run's first event, as floats with ns kept in 3 decimals.
    ts = (ev["start_ns"].to_numpy(np.int64) - origin) / 1000.0
    dur = ev["dur_ns"].to_numpy(np.int64) / 1000.0
    for i in range(len(ev)):
        r = int(ranks[i])
        out.append({
            "ph": "X", "name": names[i], "cat": cats[i] if isinstance(cats[i], str) else "other",
            "pid": r, "tid": tids[(r, lanes[i])], "ts": round(float(ts[i]), 3), "dur": round(float(dur[i]), 3),
            "args": {"category": category[i], "step": int(steps[i])},
        })
    out += _flows(run, ev, tids, origin)
    return out


def _flows(run, ev, tids, origin) -> list[dict]:
    pairs = getattr(run, "pairs", None)
    if pairs is None or pairs.empty:
        return []
    flows = []
    lane = ev["lane"].astype(str)
    for fid, row in enumerate(pairs.itertuples(index=False), start=1):
        if row.send_index not in ev.index or row.recv_index not in ev.index:
            continue
        s_lane, r_lane = lane.at[row.send_index], lane.at[row.recv_index]
        name = f"{row.kind}:{row.direction} mb={row.mb}"
        # The arrow leaves the send when it starts and lands where the recv ends, i.e. on
        # the enclosing slices; "bp": "e" binds the end to the slice around that instant.
        start = (int(row.send_start_ns) - origin) / 1000.0 + 0.001
        end = (int(row.recv_end_ns) - origin) / 1000.0 - 0.001
        flows.append({"ph": "s", "id": fid, "name": name, "cat": "p2p", "pid": int(row.src),
                      "tid": tids[(int(row.src), s_lane)], "ts": round(start, 3)})
        flows.append({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": "p2p", "pid": int(row.dst),
                      "tid": tids[(int(row.dst), r_lane)], "ts": round(max(end, start), 3)})
    return flows


def merge_run(run, out_path, *, include_cpu_ops: bool = True) -> Path:
    """Write the merged trace to ``out_path`` (``.json`` or ``.json.gz``); returns the path.

    Every rank is a process named like "rank 3 · pp1 tp1", every lane (main thread, gloo
    worker threads, GPU streams) a thread, times are on the aligned clock in µs from the
    run's first event, and each p2p pair is a flow arrow from send to recv.
    """
    out_path = Path(out_path)
    doc = {
        "displayTimeUnit": "ms",
        "otherData": {"pptrace": {"source": str(getattr(run, "path", "")), "clock": "aligned to the reference rank"}},
        "traceEvents": merge_events(run, include_cpu_ops=include_cpu_ops),
    }
    data = orjson.dumps(doc)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        if out_path.name.endswith(".gz"):
            with gzip.open(out_path, "wb", compresslevel=5) as fh:
                fh.write(data)
        else:
            out_path.write_bytes(data)
    except OSError as exc:
        raise TraceError(f"cannot write {out_path}: {exc.strerror or exc}; choose another output path") from None
    return out_path
