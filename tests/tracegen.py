"""Synthetic torch.profiler traces with known ground truth, for loader and analysis tests.

Times are given in microseconds of *true* time from the run's origin; each rank writes them
on its own clock (``skew_ns`` ahead of true time), exactly as a host with a wrong clock
would, so alignment can be tested against the skew you chose.

    t = RankTrace(rank=1, layout=Layout(pp=2), skew_ns=5_000_000)
    with_step = t.step(1, 0, 100_000)                     # ProfilerStep#1, 0..100 ms
    t.region("compute:fwd", 10, 4000, mb=0)               # contract range, tags formatted
    t.add("aten::mm", 20, 300, cat="cpu_op")              # any event
    t.kernel("ncclDevKernel_AllReduce", 500, 80, stream=20, correlation=7)
    write_run(tmp_path, [t0, t1])                         # tmp_path/traces/rank{r}.json.gz

``pipeline_run`` builds a whole GPipe run (every send paired with a recv, a grad-norm
all-reduce over all ranks per step) and returns its ground truth; ``trace_doc`` writes one
rank's hand-timed ranges (µs from the origin) as a document, ``run_from_docs`` loads them.
One builder, one time base: every synthetic trace of the suite is a RankTrace.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pptrace.ingest.load import load_rank
from pptrace.run.model import Run
from pptrace.naming import format_name
from pptrace.topology import Layout

ORIGIN_NS = 1_790_000_000_000_000_000  # the run's true time zero (an epoch instant)
KINETO_BASE_NS = 1_789_990_000_000_000_000  # Kineto's baseTimeNanoseconds (whole seconds)


class RankTrace:
    def __init__(self, rank: int = 0, world_size: int | None = None, layout: Layout | None = None, *,
                 skew_ns: int = 0, pid: int | None = None, schedule: str | None = "1f1b",
                 microbatches: int | None = None, vpp: int | None = None, steps=None,
                 pptrace_block: bool = True, distributed: bool = True, base_ns: int = KINETO_BASE_NS):
        self.layout = layout or Layout(dp=world_size or 1)
        self.rank, self.world_size = rank, world_size or self.layout.world_size
        self.skew_ns, self.base_ns = int(skew_ns), base_ns
        self.pid = pid if pid is not None else 1000 + rank
        self.events: list[dict] = []
        self.threads = {self.pid: "python"}
        self.header: dict = {"schemaVersion": 1, "deviceProperties": []}
        if distributed:
            self.header["distributedInfo"] = {
                "backend": "gloo", "rank": rank, "world_size": self.world_size, "pg_count": 1,
                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": self.world_size,
                               "ranks": list(range(self.world_size))}],
            }
        if pptrace_block:
            self.header["pptrace"] = {
                "version": 1, "rank": rank, "world_size": self.world_size, "layout": self.layout.to_dict(),
                "coords": self.layout.coords(rank)._asdict() if rank < self.layout.world_size else None,
                "schedule": schedule, "microbatches": microbatches, "vpp": vpp,
                "steps": list(steps) if steps is not None else None, "hostname": "synthetic",
                "pid": self.pid, "clock": {},
            }
        self._ext = 0

    # -- time --------------------------------------------------------------------------------
    def ts(self, true_us: float) -> float:
        """Trace ts (µs on this rank's Kineto clock) of a true time in µs from the origin."""
        return (ORIGIN_NS + round(true_us * 1000) + self.skew_ns - self.base_ns) / 1000.0

    def raw_ns(self, true_us: float) -> int:
        """What the loader must report as start_ns for an event at ``true_us``."""
        return ORIGIN_NS + round(true_us * 1000) + self.skew_ns

    # -- events ------------------------------------------------------------------------------
    def add(self, name: str, start_us: float, dur_us: float, *, cat: str = "user_annotation",
            tid: int | None = None, pid: int | None = None, args: dict | None = None) -> dict:
        self._ext += 1
        event = {
            "ph": "X", "cat": cat, "name": name, "pid": self.pid if pid is None else pid,
            "tid": self.pid if tid is None else tid, "ts": round(self.ts(start_us), 3),
            "dur": round(dur_us, 3),
            "args": {"External id": self._ext, "Record function id": 0, "Ev Idx": len(self.events),
                     **(args or {})},
        }
        self.events.append(event)
        return event

    def region(self, name: str, start_us: float, dur_us: float, *, tid: int | None = None, **tags) -> dict:
        kind, _, rest = name.partition(":")
        op, *given = rest.split(" ")
        full = " ".join([format_name(kind, op, **tags), *given]) if given else format_name(kind, op, **tags)
        return self.add(full, start_us, dur_us, tid=tid)

    def step(self, n: int, start_us: float, dur_us: float) -> dict:
        return self.add(f"ProfilerStep#{n}", start_us, dur_us)

    def thread(self, tid: int, name: str) -> None:
        self.threads[tid] = name

    def kernel(self, name: str, start_us: float, dur_us: float, *, stream: int = 7,
               correlation: int | None = None, device: int = 0, cat: str = "kernel", **args) -> dict:
        return self.add(name, start_us, dur_us, cat=cat, pid=device, tid=stream,
                        args={"device": device, "stream": stream, "correlation": correlation, **args})

    def clock(self, when: str, true_us: float) -> None:
        """Record the pptrace wall/perf clock pair at a true time (wall on this rank's clock)."""
        if "pptrace" in self.header:
            wall = self.raw_ns(true_us)
            self.header["pptrace"]["clock"][when] = {
                "wall_ns": wall, "perf_ns": round(true_us * 1000) + 10**12, "monotonic_ns": round(true_us * 1000) + 10**12}

    # -- output ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        meta = [{"ph": "M", "name": "process_name", "ts": 0, "pid": self.pid, "tid": 0, "args": {"name": "python"}}]
        for tid, name in self.threads.items():
            meta.append({"ph": "M", "name": "thread_name", "ts": 0, "pid": self.pid, "tid": tid,
                         "args": {"name": f"thread {tid} ({name})"}})
        return {**self.header, "baseTimeNanoseconds": self.base_ns, "displayTimeUnit": "ms",
                "traceEvents": meta + self.events, "traceName": f"rank{self.rank}"}

    def dumps(self, compact: bool = False) -> bytes:
        """Kineto's layout (one indented event per block) unless ``compact``."""
        doc = self.to_dict()
        if compact:
            return orjson.dumps(doc)
        events = doc.pop("traceEvents")
        head = orjson.dumps(doc)[:-1]
        body = b",\n  ".join(orjson.dumps(e, option=orjson.OPT_INDENT_2).replace(b"\n", b"\n  ") for e in events)
        return head + b',\n  "traceEvents": [\n  ' + body + b"\n  ],\n" + b'  "traceName": "x"\n}'

    def write(self, path, compact: bool = False) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.dumps(compact)
        path.write_bytes(gzip.compress(data, compresslevel=1) if path.name.endswith(".gz") else data)
        return path


def write_run(out_dir, traces, gz: bool = True) -> Path:
    """Write each trace to ``out_dir/traces/rank{r}.json[.gz]``; returns out_dir."""
    out_dir = Path(out_dir)
    for t in traces:
        t.write(out_dir / "traces" / f"rank{t.rank}.json{'.gz' if gz else ''}")
    return out_dir


def pipeline_run(out_dir, *, pp: int = 2, dp: int = 1, microbatches: int = 4, steps=(1, 2),
                 fwd_us: float = 1000.0, bwd_us: float = 2000.0, latency_us: float = 50.0,
                 skew_ns: dict | None = None, cpu_ops_per_mb: int = 0, gz: bool = True):
    """A GPipe run on ``pp x dp`` ranks with exact, known timing -> (out_dir, truth).

    Every stage runs forwards then backwards; a recv waits until its send started plus
    ``latency_us``; each step ends with a grad-norm all-reduce over all ranks that every
    rank leaves when the last one arrives (+ latency). ``truth`` holds per rank the skew,
    and the pairs [(src, dst, direction, mb, step, send_start_us, recv_end_us)].
    """
    traces, truth = pipeline_traces(pp=pp, dp=dp, microbatches=microbatches, steps=steps, fwd_us=fwd_us,
                                    bwd_us=bwd_us, latency_us=latency_us, skew_ns=skew_ns,
                                    cpu_ops_per_mb=cpu_ops_per_mb)
    write_run(out_dir, traces, gz=gz)
    return Path(out_dir), truth


def pipeline_traces(*, pp: int = 2, dp: int = 1, microbatches: int = 4, steps=(1, 2),
                    fwd_us: float = 1000.0, bwd_us: float = 2000.0, latency_us: float = 50.0,
                    skew_ns: dict | None = None, cpu_ops_per_mb: int = 0):
    """pipeline_run's traces, in memory -> (traces, truth): the skeleton that
    :func:`write_dense` fills rank by rank when the whole run would not fit in memory."""
    layout = Layout(pp=pp, dp=dp)
    skew_ns = skew_ns or {}
    traces = [RankTrace(r, layout=layout, skew_ns=skew_ns.get(r, 0), schedule="gpipe",
                        microbatches=microbatches, steps=steps) for r in range(layout.world_size)]
    truth = {"skew_ns": {r: skew_ns.get(r, 0) for r in range(layout.world_size)}, "pairs": []}
    t0 = 0.0
    ext = {"n": 0}
    for step in steps:
        free = {r: t0 + 10 for r in range(layout.world_size)}
        sent: dict = {}
        phases = [("fwd", range(pp), fwd_us), ("bwd", range(pp - 1, -1, -1), bwd_us)]
        for direction, stages, dur in phases:
            for mb in range(microbatches):
                for stage in stages:
                    for d in range(dp):
                        r = layout.rank(pp=stage, dp=d)
                        t = traces[r]
                        src = layout.pipeline_prev_rank(r) if direction == "fwd" else layout.pipeline_next_rank(r)
                        dst = layout.pipeline_next_rank(r) if direction == "fwd" else layout.pipeline_prev_rank(r)
                        if src is not None:
                            post = free[r]
                            arrive = sent[(src, r, direction, mb)] + latency_us
                            end = max(post, arrive) + 5
                            t.region(f"pp:recv_{direction}", post, end - post, peer=src, mb=mb, bytes=4096)
                            truth["pairs"].append((src, r, direction, mb, step, sent[(src, r, direction, mb)], end))
                            free[r] = end + 5
                        start = free[r]
                        t.region(f"compute:{direction}", start, dur, mb=mb)
                        for k in range(cpu_ops_per_mb):
                            ext["n"] += 1
                            t.add("aten::mm", start + dur * k / (cpu_ops_per_mb + 1), dur / (cpu_ops_per_mb + 2),
                                  cat="cpu_op", args={"Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"],
                                                      "Sequence number": ext["n"], "Fwd thread id": 0})
                        free[r] = start + dur + 5
                        if dst is not None:
                            s = free[r]
                            t.region(f"pp:send_{direction}", s, 20, peer=dst, mb=mb, bytes=4096)
                            sent[(r, dst, direction, mb)] = s
                            free[r] = s + 25
        arrive = dict(free)
        leave = max(arrive.values()) + latency_us
        for r, t in enumerate(traces):
            t.region("dp:all_reduce", arrive[r], leave - arrive[r], what="grad_norm", bytes=4)
            t.step(step, t0, leave + 10 - t0)
            if step == steps[0]:
                t.clock("start", t0)
            t.clock("end", leave + 10)
        t0 = leave + 20
    return traces, truth


# -------------------------------------------------------------------------------------------
# whole trace documents of hand-timed ranges (µs from the run's origin, no skew)
# -------------------------------------------------------------------------------------------
US = 1000  # ns


def trace_doc(rank: int, world: int, ranges: list, workers: list = (), layout: Layout | None = None) -> dict:
    """One rank's Chrome trace document, a :class:`RankTrace` on the run's clock: ranges are
    (name, start_us, end_us) on the main thread; workers the same on a gloo worker thread.
    ``c10d::`` ops are CPU ops, the rest user annotations; a pptrace block only with a layout
    (without one the trace is a plain torch.profiler trace)."""
    trace = RankTrace(rank, world, layout, pptrace_block=layout is not None, schedule=None, base_ns=ORIGIN_NS)
    worker = 5000 + rank
    trace.thread(worker, "pt_gloo_runloop")
    for tid, items in ((None, ranges), (worker, workers)):
        for name, start, end in items:
            trace.add(name, start, end - start, cat="cpu_op" if name.startswith("c10d::") else "user_annotation", tid=tid)
    return trace.to_dict()


def run_from_docs(tmp_path, traces: dict, layout: Layout, **kwargs) -> Run:
    """The Run of these trace documents, each loaded by the real loader (no alignment,
    no loader pairing: what an analysis sees of a hand-built run)."""
    frames = []
    for rank, doc in traces.items():
        path = tmp_path / f"rank{rank}.json.gz"
        path.write_bytes(gzip.compress(orjson.dumps(doc)))
        frames.append(load_rank(path, rank)[0])
    events = pd.concat(frames, ignore_index=True)
    for column in frames[0].columns:
        if isinstance(frames[0][column].dtype, pd.CategoricalDtype):
            events[column] = events[column].astype(str).where(events[column].notna()).astype("category")
    return Run.from_events(events, layout, **kwargs)


# -------------------------------------------------------------------------------------------
# scenario 1: a 2-stage pipeline, 2 microbatches, one step [0, 260) µs on both ranks
# -------------------------------------------------------------------------------------------
STAGE0 = [
    ("ProfilerStep#1", 0, 260),
    ("compute:fwd mb=0", 10, 30),
    ("pp:send_fwd peer=1 mb=0 bytes=100", 30, 40),   # recv [5,38): transfer 8, then waits 2
    ("compute:fwd mb=1", 40, 60),
    ("pp:send_fwd peer=1 mb=1 bytes=100", 60, 62),   # recv posted at 103: all wait (2)
    ("pp:recv_bwd peer=1 mb=0 bytes=100", 62, 104),  # send [98,103): wait 36, transfer 5, wait 1
    ("compute:bwd mb=0", 104, 144),
    ("pp:recv_bwd peer=1 mb=1 bytes=100", 144, 172),  # send [166,170): wait 22, transfer 4, wait 2
    ("compute:bwd mb=1", 172, 212),
    ("dp:all_reduce what=grad_norm bytes=4", 212, 230),
    ("compute:optimizer", 232, 240),
]
STAGE1 = [
    ("ProfilerStep#1", 0, 260),
    ("pp:recv_fwd peer=0 mb=0 bytes=100", 5, 38),    # send at 30: wait 25, transfer 8
    ("compute:fwd mb=0", 38, 58),
    ("compute:bwd mb=0", 58, 98),
    ("pp:send_bwd peer=0 mb=0 bytes=100", 98, 103),  # recv posted at 62: transfer 5
    ("pp:recv_fwd peer=0 mb=1 bytes=100", 103, 106),  # send done at 62 (eager): transfer 3
    ("compute:fwd mb=1", 106, 126),
    ("compute:bwd mb=1", 126, 166),
    ("pp:send_bwd peer=0 mb=1 bytes=100", 166, 170),  # recv posted at 144: transfer 4
    ("dp:all_reduce what=grad_norm bytes=4", 175, 230),  # blocked until stage 0 is done
    ("compute:optimizer", 232, 240),
]


# -------------------------------------------------------------------------------------------
# large traces, written a slice at a time (benchmarks: 1,024 ranks, 128 ranks x 150 MB)
# -------------------------------------------------------------------------------------------
#: the op names a MoE layer's forward and backward launch, and the kernels they run
MOE_OPS = ("aten::linear", "aten::mm", "aten::topk", "aten::softmax", "aten::index_select",
           "aten::scatter_add_", "aten::bmm", "aten::cat", "aten::mul", "aten::add_")
MOE_KERNELS = (
    "void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"
    "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>"
    "(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<c10::BFloat16, "
    "unsigned int>, at::cuda::detail::TensorInfo<long, unsigned int>, int, int, unsigned int, unsigned int, long)",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float, "
    "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, "
    "at::cuda::detail::TensorInfo<float, unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, "
    "unsigned int>, unsigned int)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "void at::native::_scatter_gather_elementwise_kernel<128, 4, "
    "at::native::_cuda_scatter_gather_internal_kernel<true, c10::BFloat16>::operator()>(int, "
    "at::native::_cuda_scatter_gather_internal_kernel<true, c10::BFloat16>::operator())",
)
_DENSE_CHUNK_OPS = 20_000  # ops turned into text at a time: bounds the writer's memory


def _ns_text(ns) -> pa.Array:
    """Integer ns as Kineto's µs with 3 decimals."""
    ns = np.asarray(ns, dtype=np.int64)
    frac = pc.utf8_lpad(pa.array(ns % 1000).cast(pa.string()), 3, "0")
    return pc.binary_join_element_wise(pa.array(ns // 1000).cast(pa.string()), frac, ".")


def _int_text(values) -> pa.Array:
    return pa.array(np.asarray(values, dtype=np.int64)).cast(pa.string())


def _pick(names, k) -> pa.Array:
    """names[k % len(names)] as JSON string literals, per op."""
    literals = pa.array([orjson.dumps(n).decode() for n in names])
    return literals.take(pa.array(np.asarray(k, dtype=np.int64) % len(names)))


def _event_text(head: list, timing: list, args: list | None = None) -> pa.Array:
    """Events in Kineto's layout, each after a comma: ``head`` and ``timing`` are (key, JSON text
    or array of it) pairs on one line each, ``args`` one pair a line."""
    def line(pairs, sep):
        out = []
        for i, (key, value) in enumerate(pairs):
            out += [f'{sep if i else ""}"{key}": ', value]
        return out

    parts = [",\n  {\n    ", *line(head, ", "), ",\n    ", *line(timing, ", ")]
    if args:
        parts += [',\n    "args": {\n      ', *line(args, ",\n      "), "\n    }"]
    merged = []  # neighbouring literals as one: fewer arrays to join
    for part in [*parts, "\n  }"]:
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    return pc.binary_join_element_wise(*merged, "")


_KERNEL_ARGS = [("queued", "0"), ("device", "0"), ("context", "1"), ("stream", "7")]
_KERNEL_SHAPE = [("registers per thread", "90"), ("shared memory", "49152"), ("blocks per SM", "0.5925926"),
                 ("warps per SM", "2.3703704"), ("grid", "[64, 1, 1]"), ("block", "[128, 1, 1]"),
                 ("est. achieved occupancy %", "4")]


def _dense_events(trace: RankTrace, start, dur, k, n, first_id: int, gpu: bool) -> list:
    """The text of the ops of one slice (op k of n in the compute range [start, start+dur) ns on
    the trace's clock; ids from ``first_id``), one array per kind of event."""
    ids = first_id + np.arange(len(k), dtype=np.int64)
    pid = str(trace.pid)
    on_host = [("pid", pid), ("tid", pid)]
    if not gpu:  # pipeline_run's aten::mm ops, timed as it times them
        return [_event_text(
            [("ph", '"X"'), ("cat", '"cpu_op"'), ("name", '"aten::mm"'), *on_host],
            [("ts", _ns_text(start + dur * k // (n + 1))), ("dur", _ns_text(dur // (n + 2)))],
            [("External id", _int_text(ids)), ("Record function id", "0"), ("Ev Idx", _int_text(ids)),
             ("Input Dims", "[[64, 64], [64, 64]]"), ("Input type", '["float", "float"]'),
             ("Sequence number", _int_text(ids)), ("Fwd thread id", "0")])]
    slot = dur // n
    t0 = start + k * slot
    launch, kernel = t0 + 3 * slot // 10, t0 + 45 * slot // 100
    on_gpu = [("pid", "0"), ("tid", "7")]
    # the op, the allocation nested in it (folded at load), its launch, the flow to its kernel
    return [
        _event_text([("ph", '"X"'), ("cat", '"cpu_op"'), ("name", _pick(MOE_OPS, k)), *on_host],
                    [("ts", _ns_text(t0 + slot // 50)), ("dur", _ns_text(6 * slot // 10))],
                    [("External id", _int_text(2 * ids)), ("Record function id", "0"), ("Ev Idx", _int_text(3 * ids)),
                     ("Input Dims", "[[4096, 1024], [1024, 4096]]"),
                     ("Input type", '["c10::BFloat16", "c10::BFloat16"]'),
                     ("Sequence number", _int_text(ids)), ("Fwd thread id", "0")]),
        _event_text([("ph", '"X"'), ("cat", '"cpu_op"'), ("name", '"aten::empty"'), *on_host],
                    [("ts", _ns_text(t0 + slot // 20)), ("dur", _ns_text(slot // 20))],
                    [("External id", _int_text(2 * ids + 1)), ("Record function id", "0"),
                     ("Ev Idx", _int_text(3 * ids + 1)), ("Input Dims", "[[], [], [], [], [], []]"),
                     ("Input type", '["ScalarList", "Scalar", "", "", "", ""]')]),
        _event_text([("ph", '"X"'), ("cat", '"cuda_runtime"'), ("name", '"cudaLaunchKernel"'), *on_host],
                    [("ts", _ns_text(launch)), ("dur", _ns_text(slot // 5))],
                    [("External id", _int_text(2 * ids)), ("cbid", "211"), ("correlation", _int_text(ids))]),
        _event_text([("ph", '"s"'), ("id", _int_text(ids)), *on_host],
                    [("ts", _ns_text(launch)), ("cat", '"ac2g"'), ("name", '"ac2g"')]),
        _event_text([("ph", '"f"'), ("id", _int_text(ids)), *on_gpu],
                    [("ts", _ns_text(kernel)), ("cat", '"ac2g"'), ("name", '"ac2g"'), ("bp", '"e"')]),
        _event_text([("ph", '"X"'), ("cat", '"kernel"'), ("name", _pick(MOE_KERNELS, k)), *on_gpu],
                    [("ts", _ns_text(kernel)), ("dur", _ns_text(slot // 2))],
                    [("External id", _int_text(2 * ids)), *_KERNEL_ARGS, ("correlation", _int_text(ids)),
                     *_KERNEL_SHAPE]),
    ]


def write_dense(trace: RankTrace, path, ops_per_range: int, *, gpu: bool = False) -> Path:
    """Write ``trace`` with ``ops_per_range`` ops inside each of its ``compute:`` ranges, made and
    gzipped a slice at a time, so that a trace of hundreds of MB never sits in memory.

    ``gpu=False``: pipeline_run's nested ``aten::mm`` CPU ops (what its ``cpu_ops_per_mb`` adds).
    ``gpu=True``: a MoE GPU trace's density: per op, a CPU op with an allocation nested in it, its
    ``cudaLaunchKernel`` and the ac2g flow, and its kernel on stream 7 of device 0 (names from
    MOE_OPS and MOE_KERNELS), about 1.9 kB of JSON per op; the kernels keep the range's device busy."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = trace.to_dict()
    if gpu:
        doc["deviceProperties"] = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045477376,
                                    "computeMajor": 9, "computeMinor": 0, "numSms": 132}]
    events = doc.pop("traceEvents")
    ranges = [e for e in events if e["name"].startswith("compute:")]
    start = np.array([round(e["ts"] * 1000) for e in ranges], dtype=np.int64)
    dur = np.array([round(e["dur"] * 1000) for e in ranges], dtype=np.int64)
    which = np.repeat(np.arange(len(ranges)), ops_per_range)
    k = np.tile(np.arange(ops_per_range, dtype=np.int64), len(ranges))
    tmp = path.with_name(path.name + ".tmp")
    opener = gzip.open(tmp, "wb", compresslevel=1) if path.name.endswith(".gz") else open(tmp, "wb")
    with opener as out:
        out.write(orjson.dumps(doc)[:-1] + b', "traceEvents": [\n  ')
        out.write(b",\n  ".join(orjson.dumps(e, option=orjson.OPT_INDENT_2).replace(b"\n", b"\n  ") for e in events))
        for a in range(0, len(k), _DENSE_CHUNK_OPS):
            rows = slice(a, a + _DENSE_CHUNK_OPS)
            r = which[rows]
            for text in _dense_events(trace, start[r], dur[r], k[rows], ops_per_range, trace._ext + 1 + a, gpu):
                offsets = np.frombuffer(text.buffers()[1], dtype=np.int32, count=len(text) + 1, offset=4 * text.offset)
                out.write(memoryview(text.buffers()[2])[offsets[0]:offsets[-1]])
        out.write(b"\n  ]}\n")
    tmp.replace(path)
    return path
