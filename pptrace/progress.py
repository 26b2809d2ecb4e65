"""What a command is doing while it works: one line per phase on stderr (load, match and
align, analyse, what-if, write), each with its elapsed time and, when it counts items, a bar.

On by default only when stderr is a terminal (a rich display that vanishes when done), so
pipes, logs and tests stay silent. ``PPTRACE_PROGRESS=1`` forces it on (on a non-terminal,
one plain line per finished phase with its time: a timing log), ``PPTRACE_PROGRESS=0`` off;
a function's own ``progress=`` argument wins over both.

A phase never shows while anything writes to stdout: a live display on the same terminal
would be overwritten by, or erase, the report. Callers therefore wrap only work that prints
nothing (loading, analysing, writing files), never the printing of tables.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from contextlib import contextmanager

ENV = "PPTRACE_PROGRESS"

# The phases every command goes through, named once so that the labels users see (and
# tests look for) stay the same wherever a phase starts.
HEADERS = "loading traces: reading headers"
LOAD = "loading traces"
ASSEMBLE = "loading traces: assembling the events table"
ALIGN = "matching p2p and collectives, aligning clocks"
ANALYSE = "analysing"
WHATIF = "what-if replay"
WRITE = "writing"

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")

_display = None  # the one rich Progress on screen; nested phases add rows to it


def wanted(flag: bool | None = None) -> bool:
    """Whether to show progress: ``flag`` if given, else ``$PPTRACE_PROGRESS``, else whether
    stderr is a terminal."""
    if flag is not None:
        return bool(flag)
    env = os.environ.get(ENV, "").strip().lower()
    if env in _ON:
        return True
    if env in _OFF:
        return False
    return _stderr_is_terminal()


def _stderr_is_terminal() -> bool:
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class _Quiet:
    """What a phase hands out when nothing is shown."""

    def advance(self, n: int = 1) -> None:
        pass

    def describe(self, label: str) -> None:
        pass


class _Row:
    """One phase's row of the rich display."""

    def __init__(self, display, label: str, total, note: str = ""):
        self._display, self._label, self._note = display, label, note
        self._task = display.add_task(label, total=total, count=_count_text(0, total) + note)
        self._total, self._done = total, 0

    def advance(self, n: int = 1) -> None:
        self._done += n
        self._display.update(self._task, advance=n, count=_count_text(self._done, self._total) + self._note)

    def describe(self, label: str) -> None:
        self._label = label
        self._display.update(self._task, description=label)

    def finish(self) -> None:
        # a phase without a count has no total: give it one so rich stops its clock
        total = self._total if self._total is not None else 1
        self._display.update(self._task, total=total, completed=total)


class _Line:
    """One phase on a stderr that is not a terminal: a plain line when it ends."""

    def __init__(self, label: str, total, note: str = ""):
        self._label, self._total, self._done, self._t0 = label, total, 0, time.perf_counter()
        self._note = note

    def advance(self, n: int = 1) -> None:
        self._done += n

    def describe(self, label: str) -> None:
        self._label = label

    def finish(self) -> None:
        count = f" {_count_text(self._done, self._total)}" if self._total else ""
        try:
            print(f"pptrace: {self._label}{count}{self._note} ({time.perf_counter() - self._t0:.2f} s)",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed under us: progress is never worth a crash
            pass


def _count_text(done: int, total) -> str:
    return f"{done}/{total}" if total else ""


def _new_display():
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(), console=Console(stderr=True), transient=True,
        # stdout is the report's: progress never takes it over (see the module docstring)
        redirect_stdout=False,
    )


@contextmanager
def phase(label: str, total: int | None = None, enabled: bool | None = None, note: str = ""):
    """Show ``label`` while the block runs; ``total`` items make it a bar (``advance()`` the
    handle it yields); ``note`` is said after the count (how the work is done: " (2 workers:
    ...)"), so that the label stays the phase's name. Phases inside phases share one display."""
    global _display
    if not wanted(enabled):
        yield _Quiet()
        return
    if not _stderr_is_terminal():
        row = _Line(label, total, note)
        try:
            yield row
        except BaseException:
            row.describe(f"{label}: failed")
            raise
        finally:
            row.finish()
        return
    outermost = _display is None
    if outermost:
        _display = _new_display()
        _display.start()
    row = _Row(_display, label, total, note)
    try:
        yield row
    finally:
        row.finish()
        if outermost:
            display, _display = _display, None
            display.stop()


def phased(label: str):
    """Decorator: the whole call is one phase named ``label``."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(label):
                return fn(*args, **kwargs)

        return inner

    return wrap
