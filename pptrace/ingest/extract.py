"""One slice of parsed events -> plain lists of its kept X events (name, cat, pid, tid,
ts, dur, the args that become columns), its rpc and p2p args and thread names, and their
times in int64 nanoseconds. The per-slice half of :func:`.frame.build_frame`: it reads the
events of both decoders (event dicts, msgspec's :class:`RawEvent`), so only one slice's
Python objects are alive at a time; the frame module does the whole-table rest."""
from __future__ import annotations

import re
from itertools import compress
from operator import attrgetter

import msgspec
import numpy as np
import pandas as pd

from ..sweeps import running_max
from .p2p_args import p2p_positions, raw_value, p2p_args
from .schema import RawArgs, RawEvent

_EMPTY_ARGS = RawArgs()
_RPC_ATTRS = (
    ("Collective name", "collective"), ("Process Group Ranks", "group_ranks"),
    ("Process Group Name", "pg_name"), ("In msg nelems", "in_nelems"),
    ("Out msg nelems", "out_nelems"), ("dtype", "dtype"), ("Seq", "comm_seq"),
    ("Src Rank", "src_rank"), ("Dst Rank", "dst_rank"),
    ("In split size", "in_splits"), ("Out split size", "out_splits"),
)

_TS_TEXT = re.compile(rb'"ts"\s*:\s*(-?)(\d+)(?:\.(\d*))?')
# Beyond 2**43 us a float64 ts is coarser than 1 ns (epoch-microsecond traces), so the
# nanoseconds must come from the decimal text.
_EXACT_FLOAT_US = float(2**43)
#: A ts or dur (us) this large has no int64 nanosecond value once baseTimeNanoseconds is
#: added (int64 ends at 9.2e18 ns): such an event cannot have happened, it is dropped.
_MAX_US = 4e15
_THREAD_PAREN = re.compile(r"^thread \d+ \((.*)\)\s*$")


def _ns_from_text(sign: bytes, whole: bytes, frac: bytes) -> int:
    frac = frac or b""
    ns = int(whole) * 1000 + int((frac + b"000")[:3])
    if len(frac) > 3 and frac[3:4] >= b"5":
        ns += 1
    return -ns if sign else ns


def _floats(values: list) -> np.ndarray:
    """float64 of each value; NaN where it is not an int or float (None, a string, a bool,
    an int too large for a float)."""
    if set(map(type, values)) <= {int, float}:
        try:
            return np.asarray(values, dtype=np.float64)
        except OverflowError:
            pass
    out = np.full(len(values), np.nan)
    numeric = [i for i, v in enumerate(values) if type(v) in (int, float) and abs(v) < 1e300]
    out[numeric] = [float(values[i]) for i in numeric]
    return out


def ts_to_ns(ts: list, events: list, x_index: list, blob, warnings: list, path) -> tuple:
    """-> (ns of each ts, whether it has none usable: missing, not a number, NaN, or beyond
    int64 nanoseconds; those rows hold 0 and are dropped by the caller)."""
    t = _floats(ts)
    bad = ~(np.abs(t) < _MAX_US)  # NaN compares False: bad too
    if bad.any():
        t = np.where(bad, 0.0, t)
    if t.size and np.abs(t).max() >= _EXACT_FLOAT_US and any(type(v) is float for v in ts):
        if blob is not None:
            texts = _TS_TEXT.findall(blob)
            if events and type(events[0]) is RawEvent:
                unset = msgspec.UNSET
                has_ts = [e.ts is not unset for e in events]
                x_index = _struct_x_index(events) if x_index is None else x_index
            else:
                has_ts = [type(e) is dict and "ts" in e for e in events]
            if len(texts) == sum(has_ts):
                slot, position = [], 0
                for has in has_ts:
                    slot.append(position)
                    position += has
                exact = np.array([_ns_from_text(*texts[slot[i]]) if has_ts[i] else 0 for i in x_index], dtype=np.int64)
                return np.where(bad, 0, exact), bad
        if not any("nanosecond" in w for w in warnings):
            warnings.append(f"{path}: epoch-microsecond timestamps; nanosecond fractions rounded")
        return np.rint(t * 1000.0).astype(np.int64), bad
    # Split off the integer microseconds (exact) so the fraction keeps full float precision.
    whole = np.floor(t)
    return whole.astype(np.int64) * 1000 + np.rint((t - whole) * 1000.0).astype(np.int64), bad


def dur_to_ns(dur: list) -> tuple:
    """-> (ns of each dur, without a usable one (missing, not a number, NaN, infinite,
    beyond int64), negative); the rows of the last two hold 0 and are dropped by the caller."""
    d = _floats(dur)
    missing = ~(np.abs(d) < _MAX_US)
    negative = ~missing & (d < 0)
    d = np.where(missing | negative, 0.0, d)
    return np.rint(d * 1000.0).astype(np.int64), missing, negative


def _thread_label(name: str | None) -> str:
    if not name:
        return ""
    match = _THREAD_PAREN.match(name)
    return match.group(1) if match else name.strip()


_NO_ARGS: dict = {}


def extract_dicts(events: list, cols: dict, rpc: dict, threads: dict, n_before: int, p2p: dict):
    """One slice of event dicts -> ``cols`` (name, cat, pid, tid and frame._ARG_INTS: one list
    each, the slice's kept X events in order), rpc rows, thread names; returns
    (x_index, ts, dur, events skipped for a non-numeric pid/tid)."""
    try:
        x_index = [i for i, e in enumerate(events) if e.get("ph") == "X"]
    except AttributeError:  # a non-object in the array: skip it
        x_index = [i for i, e in enumerate(events) if type(e) is dict and e.get("ph") == "X"]
    xs = [events[i] for i in x_index]
    pids, tids = [e.get("pid") for e in xs], [e.get("tid") for e in xs]
    foreign = 0
    # Kineto's own span events have string pids ("Spans"): not events of the run. A bad ts
    # or dur is counted and dropped by the caller (build_frame), not here.
    if not (set(map(type, pids)) | set(map(type, tids))) <= {int}:
        ok = [type(p) is int and type(t) is int for p, t in zip(pids, tids)]
        x_index = [i for i, good in zip(x_index, ok) if good]
        xs = [events[i] for i in x_index]
        foreign = len(ok) - len(xs)
        pids, tids = [e["pid"] for e in xs], [e["tid"] for e in xs]
    ts = [e.get("ts") for e in xs]
    for e in [e for e in events if type(e) is dict and e.get("ph") == "M" and e.get("name") == "thread_name"]:
        _name_thread(threads, e.get("tid"), (e.get("args") or {}).get("name"))
    cols["name"] = [e.get("name") for e in xs]
    cols["cat"] = [e.get("cat") for e in xs]
    cols["pid"] = pids
    cols["tid"] = tids
    args = [e.get("args") or _NO_ARGS for e in xs]
    if {type(a) for a in args} != {dict}:
        args = [a if type(a) is dict else _NO_ARGS for a in args]
    cols["stream"] = [a.get("stream") for a in args]
    cols["correlation"] = [a.get("correlation") for a in args]
    cols["external_id"] = [a.get("External id") for a in args]
    for i in [i for i, a in enumerate(args) if "Collective name" in a]:
        rpc[n_before + i] = args[i]
    for i in p2p_positions(cols["name"]):
        a = args[i]
        p2p[n_before + i] = p2p_args(cols["name"][i], a.get("Concrete Inputs"), a.get("Input Dims"), a.get("Input type"))
    return x_index, ts, [e.get("dur") for e in xs], foreign


_X_FIELDS = tuple(attrgetter(f) for f in ("name", "cat", "pid", "tid", "ts", "dur", "args"))
_ARG_FIELDS = tuple(attrgetter(f) for f in ("stream", "correlation", "external_id", "collective"))


def extract_structs(events: list, cols: dict, rpc: dict, threads: dict, n_before: int, p2p: dict):
    """:func:`extract_dicts` for a slice of :class:`RawEvent` (absent keys are None, like
    ``dict.get``; ``ts`` and ``dur`` default to UNSET, "Collective name" too). Columns
    are read in C (map + attrgetter), and x_index is None: only the rare exact-ts path
    needs it (see :func:`_struct_x_index`)."""
    xs = [e for e in events if e.ph == "X"]
    name, cat, pid, tid, ts, dur, args = (list(map(get, xs)) for get in _X_FIELDS)
    foreign = 0
    if not (set(map(type, pid)) | set(map(type, tid))) <= {int}:
        ok = [type(p) is int and type(t) is int for p, t in zip(pid, tid)]
        foreign = len(ok) - sum(ok)
        name, cat, pid, tid, ts, dur, args = (list(compress(c, ok)) for c in (name, cat, pid, tid, ts, dur, args))
    for e in [e for e in events if e.ph == "M" and e.name == "thread_name"]:
        _name_thread(threads, e.tid, (e.args or _EMPTY_ARGS).name)
    cols["name"], cols["cat"], cols["pid"], cols["tid"] = name, cat, pid, tid
    if args.count(None) == len(args):
        nothing = [None] * len(args)
        cols["stream"] = cols["correlation"] = cols["external_id"] = nothing
        return None, ts, dur, foreign
    args = [a or _EMPTY_ARGS for a in args]
    cols["stream"], cols["correlation"], cols["external_id"], collective = (list(map(get, args)) for get in _ARG_FIELDS)
    unset = msgspec.UNSET
    if collective.count(unset) != len(collective):
        for i in [i for i, c in enumerate(collective) if c is not unset]:
            rpc[n_before + i] = {key: getattr(args[i], attr) for key, attr in _RPC_ATTRS}
    for i in p2p_positions(name):
        a = args[i]
        if name[i].startswith("c10d::"):  # only what each kind of row uses is decoded
            p2p[n_before + i] = p2p_args(name[i], raw_value(a.concrete), None, None)
        else:
            p2p[n_before + i] = p2p_args(name[i], None, raw_value(a.input_dims), raw_value(a.input_type))
    return None, ts, dur, foreign


def _struct_x_index(events: list) -> list:
    """Positions in the slice of the X events :func:`extract_structs` keeps."""
    return [i for i, e in enumerate(events) if e.ph == "X" and type(e.pid) is int and type(e.tid) is int]


def _name_thread(threads: dict, tid, name) -> None:
    label = _thread_label(name)
    # Kineto may name one tid twice ("python", then the real worker name).
    if label and (label != "python" or tid not in threads):
        threads[tid] = label


# ---------------------------------------------------------------------------------------
# duration events: a range written as a begin ("B") and an end ("E") event
# ---------------------------------------------------------------------------------------
#: B/E events in a slice's bytes (most traces have none: a byte search, then no per-event pass)
_BEGIN_END = re.compile(rb'"ph"\s*:\s*"[BE]"')
_BE = ("B", "E")


def duration_events(events: list, blob: bytes | None) -> list:
    """The B and E events of one slice, as (ph, pid, tid, ts, name, cat, args) tuples."""
    if blob is not None and not _BEGIN_END.search(blob):
        return []
    if events and type(events[0]) is RawEvent:
        unset = msgspec.UNSET
        return [(e.ph, e.pid, e.tid, None if e.ts is unset else e.ts, e.name, e.cat, {})
                for e in events if e.ph in _BE]
    return [(e.get("ph"), e.get("pid"), e.get("tid"), e.get("ts"), e.get("name"), e.get("cat"),
             e.get("args") if type(e.get("args")) is dict else {})
            for e in events if type(e) is dict and e.get("ph") in _BE]


def complete_events(found: list) -> tuple[list, int]:
    """B/E events (``duration_events`` of every slice, in file order) paired into X event dicts
    the way a trace viewer nests them: per thread, each E closes the innermost open B (ties
    at one time in file order). -> (the X events, how many B or E had no partner)."""
    ok = [type(p) is int and type(t) is int and type(s) in (int, float) for _, p, t, s, *_ in found]
    rows = [f for f, good in zip(found, ok) if good]
    if not rows:
        return [], len(found)
    ph, pid, tid, ts = (np.array(c) for c in list(zip(*rows))[:4])
    lane = pd.factorize(pd.MultiIndex.from_arrays([pid, tid]))[0]
    order = np.lexsort((np.arange(len(rows)), ts.astype(float), lane))
    lane_o, begin = lane[order], ph[order] == "B"
    step = np.where(begin, 1, -1)
    walk = np.cumsum(step)
    first = np.r_[True, lane_o[1:] != lane_o[:-1]]
    walk -= np.repeat(walk[first] - step[first], np.diff(np.r_[np.flatnonzero(first), len(order)]))
    # the depth of open ranges, an E that closes none not counted: the walk less the lowest
    # point it reached below 0 (a walk reflected at 0)
    depth = walk - np.minimum(0, -running_max(lane_o, -walk))
    before = np.where(first, 0, np.r_[0, depth[:-1]])
    # a B opens level depth, an E closes level depth + 1 (level 0: it closed none)
    level = np.where(begin, depth, before)
    by_level = np.lexsort((np.arange(len(order)), level, lane_o))
    pos = order[by_level]
    same = (lane_o[by_level][:-1] == lane_o[by_level][1:]) & (level[by_level][:-1] == level[by_level][1:])
    pairs = np.flatnonzero(same & begin[by_level][:-1] & ~begin[by_level][1:] & (level[by_level][:-1] > 0))
    out = []
    for b, e in zip(pos[pairs].tolist(), pos[pairs + 1].tolist()):
        _, p, t, start, name, cat, args = rows[b]
        out.append({"ph": "X", "name": name if name is not None else rows[e][4], "cat": cat, "pid": p, "tid": t,
                    "ts": start, "dur": rows[e][3] - start, "args": {**rows[e][6], **args}})
    return out, len(found) - 2 * len(out)
