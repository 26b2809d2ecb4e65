"""Instrumentation anyone can drop into a training loop: ``profile`` wraps torch.profiler with a
step schedule and writes ``out_dir/traces/rank{r}.json.gz`` with the ``pptrace`` metadata
block (contract 2), the integrations patched in while it runs; its ranges are
:class:`pptrace.ranges.region` (``pptrace.region``).
"""
from __future__ import annotations

import dataclasses
import operator
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import orjson
import torch

from .integrations import DEFAULT as DEFAULT_INTEGRATIONS
from .integrations import instrument_all, merged_metadata, remove_all
from .output import cannot_write, replacing
from .ranges import profiler_enabled
from .topology import Layout

METADATA_KEY = "pptrace"
METADATA_VERSION = 1


# --------------------------------------------------------------------------------------
# profile()
# --------------------------------------------------------------------------------------


def _step_number(value) -> int:
    # operator.index, not int(): int() would turn 1.7 into step 1 and True into step 1
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def parse_steps(steps) -> tuple[int, int]:
    """``"2-4"``, ``(2, 4)`` (inclusive), ``range(2, 5)`` or ``3`` -> ``(first, last)``."""
    try:
        if isinstance(steps, range):
            if steps.step != 1:
                raise ValueError(steps)
            first, last = steps.start, steps.stop - 1
        elif isinstance(steps, str):
            a, _, b = steps.partition("-")
            first, last = int(a), int(b or a)
        elif hasattr(steps, "__index__"):
            first = last = _step_number(steps)
        else:
            first, last = (_step_number(x) for x in steps)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"steps {steps!r} must look like 'A-B', (A, B), range(A, B+1) or A") from exc
    if first < 0 or last < first:
        raise ValueError(f"steps {steps!r}: need 0 <= first <= last, got {first}..{last}")
    return first, last


def _distributed_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def library_versions() -> dict:
    """What the run ran with, for ``pptrace diff`` to tell a library upgrade from a regression."""
    import platform

    from . import __version__

    return {"pptrace": __version__, "torch": torch.__version__, "python": platform.python_version()}


def clock_sample(tries: int = 5) -> dict:
    """A wall-clock / perf-clock pair, for alignment across hosts and to detect clock steps.

    The wall clock is read between two perf-clock reads, several times; the tightest bracket
    wins, so a preemption between reads (milliseconds on a loaded box) cannot fake a clock
    step. ``bracket_ns`` is how far apart the two perf reads were."""
    best = None
    for _ in range(tries):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall, (before + after) // 2)
    return {"wall_ns": best[1], "perf_ns": best[2], "monotonic_ns": time.monotonic_ns(), "bracket_ns": best[0]}


@contextmanager
def _without_kineto_markers():
    """Kineto writes a "USDT:... profiler_start" / "profiler_stop" line to the process's
    stderr (fd 2, from C++) whenever the profiler starts or stops: tracepoint markers, not
    messages, two per rank and run. No kineto log level hides them but keeps its errors, so
    while the profiler starts or stops fd 2 goes to a file, and everything in it but those
    lines is written back after (another thread's stderr output of that moment comes late,
    never lost)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no stderr to keep clean
        yield
        return
    sink = tempfile.TemporaryFile()
    try:
        os.dup2(sink.fileno(), 2)
        yield
    finally:
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        sink.seek(0)
        kept = memoryview(b"".join(line for line in sink if not line.startswith(b"USDT:")))
        sink.close()
        while kept:
            try:
                kept = kept[os.write(2, kept):]
            except OSError:  # stderr closed or full: nothing more can be said
                break


def _as_layout(layout) -> Layout | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    if isinstance(layout, Mapping):
        # Layout.from_dict skips keys it does not know; from a user, {"pipeline": 4} is a typo
        known = [f.name for f in dataclasses.fields(Layout)]
        unknown = [str(key) for key in layout if key not in known]
        if unknown:
            raise ValueError(f"layout {dict(layout)!r}: unknown key {', '.join(unknown)}; "
                             f"expected some of {', '.join(known)}")
        return Layout.from_dict(layout)
    raise ValueError(f"layout {layout!r} must be a pptrace.Layout or a mapping like {{'tp': 2, 'pp': 4}}")


#: The profile that is inside its ``with`` block in this process. torch.profiler cannot tell
#: while a profile waits for its first step, and a second one started then crashes the process.
_active: "profile | None" = None


class profile:
    """Profile chosen steps of a training loop and write one trace per rank.

    >>> with pptrace.profile("run/", steps="2-3") as prof:
    ...     for batch in data:
    ...         train_step(batch)
    ...         prof.step()

    ``steps`` counts calls of ``.step()`` from 0; the profiler records steps first..last
    (one warm-up step before, when there is room). Ranks outside ``ranks`` record nothing.
    ``layout`` is a :class:`Layout` or a mapping of its fields (``{"tp": 2, "pp": 4}``).
    One profile at a time per process: nest :class:`region` inside it, not a second profile.

    ``integrations`` (default: all of :mod:`pptrace.integrations`) instrument the pipeline
    libraries the process uses for as long as the profiler runs, and fill in the layout,
    schedule, microbatches and vpp the arguments leave out (arguments given win);
    ``integrations=()`` turns them off.
    """

    def __init__(
        self,
        out_dir,
        steps="1-2",
        ranks=None,
        record_shapes: bool = False,
        with_stack: bool = False,
        layout: Layout | Mapping | None = None,
        schedule: str | None = None,
        microbatches: int | None = None,
        vpp: int | None = None,
        extra: dict | None = None,
        integrations=DEFAULT_INTEGRATIONS,
    ):
        self.out_dir = Path(out_dir)
        self.first_step, self.last_step = parse_steps(steps)
        self.rank, self.world_size = _distributed_rank()
        layout = _as_layout(layout)
        # What the caller said, which the integrations' findings never override.
        self._given = {"layout": layout is not None, "schedule": schedule, "microbatches": microbatches,
                       "vpp": vpp, **(extra or {})}
        if layout is None:
            layout = Layout(dp=self.world_size)
        if layout.world_size != self.world_size:
            raise ValueError(
                f"layout {layout} has world size {layout.world_size} but the process group has "
                f"{self.world_size} ranks"
            )
        self.layout = layout
        self.enabled = ranks is None or self.rank in set(ranks)
        self.trace_path = self.out_dir / "traces" / f"rank{self.rank}.json.gz"
        self._block = {
            "version": METADATA_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "layout": layout.to_dict(),
            "coords": layout.coords(self.rank)._asdict(),
            "schedule": schedule,
            "microbatches": microbatches,
            "vpp": vpp,
            "steps": list(range(self.first_step, self.last_step + 1)),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "versions": library_versions(),
            **(extra or {}),
        }
        self._record_shapes, self._with_stack = record_shapes, with_stack
        self._profiler = None
        self._integration_names = tuple(integrations or ())
        self._integrations: list = []

    def _on_trace_ready(self, prof) -> None:
        # through a hidden file beside it: a full disk or a kill mid-export leaves the
        # previous trace, never a truncated one for the loader to trip over
        with replacing(self.trace_path) as tmp:
            prof.export_chrome_trace(str(tmp))

    def _write_metadata(self, when: str) -> None:
        # Kineto takes metadata only while a trace is being recorded, so the block is written
        # when the active window opens and rewritten, with the closing clock sample, just
        # before it closes.
        self._block.setdefault("clock", {})[when] = clock_sample()
        if self._integrations:
            self._merge_integrations(merged_metadata(self._integrations))
        self._profiler.add_metadata_json(METADATA_KEY, orjson.dumps(self._block).decode())

    def _merge_integrations(self, found: dict) -> None:
        if "layout" in found and not self._given["layout"]:
            try:
                layout = Layout.from_dict(found["layout"])
            except ValueError:
                layout = None
            if layout is not None and layout.world_size == self.world_size:
                self.layout = layout
                self._block["layout"] = layout.to_dict()
                self._block["coords"] = layout.coords(self.rank)._asdict()
        for key, value in found.items():
            if key != "layout" and self._given.get(key) is None:
                self._block[key] = value

    def __enter__(self):
        global _active
        # Refused on every rank, enabled or not, so that no rank trains on while the others stop.
        if _active is not None:
            raise RuntimeError(
                f"pptrace.profile is already active in this process (started for {_active.out_dir}); "
                "nest pptrace.region inside it instead of a second pptrace.profile"
            )
        if self.enabled:
            if profiler_enabled():
                raise RuntimeError(
                    "a torch.profiler is already recording in this process and only one profiler can "
                    "run at a time; stop it before entering pptrace.profile"
                )
            self._check_writable()
            self._integrations = instrument_all(self._integration_names)
            try:
                self._start()
            except BaseException:
                remove_all(self._integrations)
                self._integrations = []
                raise
        _active = self
        return self

    def _check_writable(self) -> None:
        # The trace is written by prof.step() once the last profiled step ends: an unwritable
        # directory found only then costs the user every step run so far.
        folder = self.trace_path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".pptrace-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise cannot_write(folder, exc) from None

    def _start(self):
        # A warm-up step lets the profiler settle before recording; step 0 has none to spare.
        warmup = 1 if self.first_step >= 1 else 0
        with warnings.catch_warnings():
            # Profiling from step 0 leaves no earlier step to warm up in: that is what the user
            # asked for, not something torch's warning could help them fix.
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup", category=UserWarning)
            schedule = torch.profiler.schedule(
                wait=self.first_step - warmup,
                warmup=warmup,
                active=self.last_step - self.first_step + 1,
                repeat=1,
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._clock_start = clock_sample()
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._on_trace_ready,
            record_shapes=self._record_shapes,
            with_stack=self._with_stack,
        )
        self._warmup = warmup
        with _without_kineto_markers():
            self._profiler.__enter__()
        self._step_num = 0
        if self.first_step == 0:
            self._write_metadata("start")
        return self

    def step(self) -> None:
        """Mark the end of one training step."""
        if self._profiler is None:
            return
        if self._step_num == self.last_step:
            self._write_metadata("end")
        if self.first_step - self._warmup - 1 <= self._step_num <= self.last_step:  # may start or stop
            with _without_kineto_markers():
                self._profiler.step()
        else:
            self._profiler.step()
        self._step_num += 1
        if self._step_num == self.first_step:
            self._write_metadata("start")

    def __exit__(self, *exc):
        global _active
        try:
            if self._profiler is not None:
                with _without_kineto_markers():
                    self._profiler.__exit__(*exc)
                self._profiler = None
        finally:
            remove_all(self._integrations)
            self._integrations = []
            if _active is self:
                _active = None
        return False
