"""The normalized event schema: one row per complete ("X") trace event of one rank.

Columns (dtype) — every loader output and every cached table has exactly these:

=================  =========  ===================================================================
rank               int32      global rank the trace belongs to
lane               category   timeline row: ``"main"`` (the thread whose tid == pid),
                              ``"thread:<tid> <thread name>"`` for other host threads (gloo's
                              ``pt_gloo_runloop`` workers, autograd threads), ``"stream <n>"``
                              for GPU streams
lane_kind          category   ``"host"`` or ``"gpu"``
pid, tid           int64      as in the trace (GPU events: pid = device, tid = stream)
name               category   event name as written
cat                category   torch.profiler category (cpu_op, user_annotation, kernel, ...)
start_ns, end_ns   int64      **this rank's own clock**: baseTimeNanoseconds + ts*1000, exact to
                              the nanosecond (ts is parsed from its decimal text when a float
                              could not hold it). ``Run.events`` shifts them onto the reference
                              clock; ``Run.raw_ns`` gives them on the rank's own clock again.
dur_ns             int64      end_ns - start_ns
kind, op           category   from :func:`pptrace.naming.parse_name`, else Megatron-Core's own
                              names (:mod:`pptrace.ingest.megatron_names`); null for other names
mb, chunk, peer,   Int32      the contract-1 tags of that name (nullable; ``bytes`` is Int64).
ring_step, layer,             ``ring_step`` is the ``step=`` tag (CP ring step), renamed so that
bucket, bytes                 it cannot be mistaken for the profiler step below. ``gloo:send`` /
                              ``gloo:recv`` ranges carry ``bytes`` from their "Input Dims" /
                              "Input type"
tags               category   JSON object of the remaining tags (e.g. ``{"what":"grad_norm"}``,
                              ``{"op":"all_reduce"}`` for waits), null when there are none;
                              on the ``c10d::send`` / ``c10d::recv_`` posts of plain traces
                              ``{"group_peer": g, "tag": t}`` from their "Concrete Inputs"
                              (record_shapes=True), g a rank of the op's process group
category           category   one of :data:`CATEGORIES`, see below
step               int32      N of the ``ProfilerStep#N`` range containing the event, -1 outside;
                              GPU work takes the step of the runtime call that launched it
stream             Int32      GPU stream (kernels, memcpy, memset, gpu_user_annotation)
correlation        Int64      CUDA correlation id (runtime call <-> GPU activity)
external_id        Int64      Kineto "External id" (CPU op <-> GPU activity)
is_nccl            bool       GPU kernel named ``nccl*Kernel*`` (ncclKernel_ and ncclDevKernel_)
gpu_annotation     bool       a ``gpu_user_annotation``: a record_function range projected on
                              a stream
collective         category   record_param_comms / NCCL kernel "Collective name" (allreduce, ...);
                              NCCL kernels without it take it from the host op that launched
                              them (:mod:`pptrace.ingest.nccl`), as do group_ranks ... comm_seq
group_ranks        category   "Process Group Ranks" as written, e.g. ``"[0, 1]"``
pg_name            category   "Process Group Name"
in_nelems,         Int64      "In msg nelems" / "Out msg nelems"
out_nelems
in_splits,         category   "In split size" / "Out split size" as written (``"[3, 5]"``): an
out_splits                    all_to_all's elements to / from each peer (group-rank order)
dtype              category   "dtype" of the collective
comm_seq           Int32      "Seq" of the collective where the trace has it
src_rank,          Int32      record_param_comms "Src Rank" / "Dst Rank" of NCCL send/recv: the
dst_rank                      peer's *global* rank (PyTorch writes them since mid-2024)
inferred           bool       kind/op/tags were inferred from a foreign name or from the trace's
                              structure (plain traces, :mod:`pptrace.run.infer`), not read from a
                              contract-1 range name
=================  =========  ===================================================================

A nullable int column holds null where the trace's value does not fit its dtype (Int32: the
tags, stream, comm_seq and src/dst ranks, small numbers all: 5 bytes a row against Int64's 9,
on tables of tens of millions of rows). Until schema 10 ``Run.events`` also carried each
rank's own clock as columns, raw_start_ns / raw_end_ns: 16 bytes a row that only restated the
rank's offset; :meth:`pptrace.run.model.Run.raw_ns` computes them.

``category`` (exactly one per event, decided by name and torch category):

- ``compute``      a contract range of kind ``compute`` (``compute:fwd mb=3``)
- ``comm:tp|cp|dp|ep``  a contract range of that kind, except waits
- ``p2p``          a contract range of kind ``pp`` (send/recv of activations or gradients)
- ``wait``         a contract range with op ``wait`` (``dp:wait op=all_reduce``), any kind
- ``step``         ``ProfilerStep#N``
- ``kernel_compute``  a GPU kernel that is not NCCL
- ``kernel_comm``  an NCCL GPU kernel
- ``memcpy``       ``gpu_memcpy`` / ``gpu_memset``
- ``runtime``      ``cuda_runtime`` / ``cuda_driver`` calls
- ``other``        everything else: aten/c10d ops, ``gloo:*`` work, user ranges with other names
"""
from __future__ import annotations

import re
from typing import Any, Union

import msgspec
import numpy as np
import orjson
import pandas as pd

from .dualpipe_names import parse_dualpipe_name
from .megatron_names import parse_megatron_name
from ..naming import parse_name
from ..vocab import COMM_CATEGORIES, COMM_DIMS

# 2: NCCL kernels carry their launching collective (ingest/nccl.py), Megatron names classified
# 3: src_rank / dst_rank of NCCL p2p, the inferred flag (plain traces)
# 4: c10d send/recv posts carry their "Concrete Inputs" peer and tag, gloo p2p ranges bytes
# 5: events with an impossible ts or dur dropped and counted (frame.py), not clamped
# 6: the compact table: nested plain CPU ops folded (compact.py)
# 7: exact copies of an event (a trace concatenated twice) dropped and counted (frame.py)
# 8: B/E duration events paired into complete ones; lone surrogate escapes in names as U+FFFD
# 9: an all_to_all's per-peer split sizes (in_splits, out_splits); DualPipe phase names classified
# 10: the small nullable int columns Int32 (INT32_COLUMNS); Run.events without raw_start_ns/raw_end_ns
SCHEMA_VERSION = 10

CATEGORIES = (
    "compute", *COMM_CATEGORIES, "p2p", "wait", "step",
    "kernel_compute", "kernel_comm", "memcpy", "runtime", "other",
)
#: Contract tags that get their own nullable int column (``step`` is stored as ring_step).
TAG_COLUMNS = ("mb", "chunk", "peer", "ring_step", "layer", "bucket", "bytes")
INT_COLUMNS = ("pid", "tid", "start_ns", "end_ns", "dur_ns")
NULLABLE_INT_COLUMNS = (
    *TAG_COLUMNS, "stream", "correlation", "external_id", "in_nelems", "out_nelems", "comm_seq",
    "src_rank", "dst_rank",
)
#: Nullable columns of small numbers, stored as Int32 (see the table above); the others Int64.
INT32_COLUMNS = ("mb", "chunk", "peer", "ring_step", "layer", "bucket", "stream", "comm_seq", "src_rank", "dst_rank")
CATEGORY_COLUMNS = (
    "lane", "lane_kind", "name", "cat", "kind", "op", "tags", "category",
    "collective", "group_ranks", "pg_name", "dtype", "in_splits", "out_splits",
)
BOOL_COLUMNS = ("is_nccl", "gpu_annotation", "inferred")
COLUMNS = (
    "rank", "lane", "lane_kind", "pid", "tid", "name", "cat", "start_ns", "end_ns", "dur_ns",
    "kind", "op", *TAG_COLUMNS, "tags", "category", "step", "stream", "correlation",
    "external_id", "is_nccl", "gpu_annotation", "collective", "group_ranks", "pg_name",
    "in_nelems", "out_nelems", "in_splits", "out_splits", "dtype", "comm_seq", "src_rank", "dst_rank", "inferred",
)


def nullable_int(column: str, data: np.ndarray, mask: np.ndarray) -> pd.arrays.IntegerArray:
    """The nullable array of ``column`` (a NULLABLE_INT_COLUMNS name) from int64 ``data`` and
    its null ``mask``: Int32 for INT32_COLUMNS, where a value int32 cannot hold is null."""
    if column not in INT32_COLUMNS:
        return pd.arrays.IntegerArray(np.asarray(data, np.int64), np.asarray(mask, bool))
    data = np.asarray(data)
    if data.dtype != np.int32:
        mask = mask | (data < np.iinfo(np.int32).min) | (data > np.iinfo(np.int32).max)
        data = np.where(mask, 0, data).astype(np.int32)
    return pd.arrays.IntegerArray(data, np.asarray(mask, bool))


def with_schema_ints(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its INT32_COLUMNS as Int32 (built as Int64 by whatever filled them)."""
    for column in INT32_COLUMNS:
        col = df[column].array
        if col.dtype != pd.Int32Dtype():
            df[column] = nullable_int(column, col.to_numpy(np.int64, na_value=0), pd.isna(col))
    return df


GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
_NCCL_KERNEL = re.compile(r"^nccl\w*Kernel")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def profiler_step_number(name: str) -> int | None:
    match = _STEP.match(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


def is_nccl_kernel(name: str) -> bool:
    return bool(_NCCL_KERNEL.match(name))


def classify(name: str, cat: str | None) -> dict:
    """Everything derived from an event's name and torch category alone.

    Called once per distinct (name, cat), never per event, so it may be slow-ish.
    """
    out = {"kind": None, "op": None, "tags": None, **{t: None for t in TAG_COLUMNS}}
    out["is_nccl"] = cat == "kernel" and is_nccl_kernel(name)
    parsed = parse_name(name)
    if parsed is None:
        parsed = parse_megatron_name(name) or parse_dualpipe_name(name)
    if parsed is not None:
        out["kind"], out["op"] = parsed.kind, parsed.op
        rest = {}
        for key, value in parsed.tags.items():
            column = "ring_step" if key == "step" else key
            if column in TAG_COLUMNS and isinstance(value, int):
                out[column] = value
            else:
                rest[key] = value
        out["tags"] = orjson.dumps(rest, option=orjson.OPT_SORT_KEYS).decode() if rest else None
    out["category"] = _category(parsed, name, cat, out["is_nccl"])
    return out


def _category(parsed, name: str, cat: str | None, nccl: bool) -> str:
    if parsed is not None and not (cat and cat in GPU_CATS and cat != "gpu_user_annotation"):
        if parsed.op == "wait":
            return "wait"
        if parsed.kind == "compute":
            return "compute"
        if parsed.kind == "pp":
            return "p2p"
        if parsed.kind in COMM_DIMS:
            return f"comm:{parsed.kind}"
    if profiler_step_number(name) is not None:
        return "step"
    if cat == "kernel":
        return "kernel_comm" if nccl else "kernel_compute"
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    if cat in ("cuda_runtime", "cuda_driver"):
        return "runtime"
    return "other"


def tags_of(tags_json) -> dict:
    """The ``tags`` column value back as a dict ({} for null)."""
    if tags_json is None or tags_json != tags_json:  # None or NaN
        return {}
    return orjson.loads(tags_json)


# -------------------------------------------------------------------------------------------
# the raw fields the table is built from (typed decoding, see load.py)
# -------------------------------------------------------------------------------------------
_NO_RAW = msgspec.Raw(b"")


class RawArgs(msgspec.Struct, gc=False):
    """The ``args`` keys the table uses; msgspec skips every other key without building it.
    Values stay untyped (Any): the checks below treat odd values as the dict path does."""

    stream: Any = None
    correlation: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    collective: Any = msgspec.field(default=msgspec.UNSET, name="Collective name")
    group_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    in_splits: Any = msgspec.field(default=None, name="In split size")
    out_splits: Any = msgspec.field(default=None, name="Out split size")
    dtype: Any = None
    comm_seq: Any = msgspec.field(default=None, name="Seq")
    src_rank: Any = msgspec.field(default=None, name="Src Rank")
    dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
    name: Any = None  # thread_name metadata events
    # record_shapes=True puts these on every op; kept as raw JSON (no objects built) and
    # decoded only for the few p2p rows (p2p_args.P2P_OP_NAMES) that need them
    concrete: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Concrete Inputs")
    input_dims: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input Dims")
    input_type: msgspec.Raw = msgspec.field(default=_NO_RAW, name="Input type")


class RawEvent(msgspec.Struct, gc=False):
    """One trace event, only the keys the table uses (gc=False: no cycles, no GC tracking)."""

    ph: Any = None
    name: Any = None
    cat: Any = None
    pid: Any = None
    tid: Any = None
    ts: Any = msgspec.UNSET  # UNSET: no "ts" key (see extract.ts_to_ns); a non-number either way
    dur: Any = msgspec.UNSET  # UNSET: no "dur" key, an impossible X event (frame.py drops it)
    args: Union[RawArgs, None] = None
