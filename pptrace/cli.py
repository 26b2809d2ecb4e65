"""The `pptrace` command: a thin click layer over the library.

Library errors (TraceError, ValueError) become one-line ``click.ClickException``s; anything
unexpected is reported in one line too, with the traceback only under PPTRACE_DEBUG=1.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click

from . import __version__
from .errors import TraceError


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.Abort, click.exceptions.Exit):
            raise
        except (TraceError, ValueError, FileNotFoundError, PermissionError) as exc:
            raise click.ClickException(" ".join(str(exc).split())) from None
        except Exception as exc:  # never a traceback for users; PPTRACE_DEBUG shows it
            if os.environ.get("PPTRACE_DEBUG"):
                raise
            raise click.ClickException(
                f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())} "
                "(set PPTRACE_DEBUG=1 for the traceback and please report it)"
            ) from None

    return wrapper


def _int_list(text: str | None) -> list[int] | None:
    """'0,1,4-6' -> [0, 1, 4, 5, 6]."""
    if not text:
        return None
    out = []
    try:
        for part in text.split(","):
            a, _, b = part.strip().partition("-")
            out.extend(range(int(a), int(b or a) + 1))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list like '0,1,4-6'") from None
    return out


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _load(run_dir, ranks=None, steps=None):
    from .run import load_run

    return load_run(run_dir, ranks=ranks, steps=steps, progress=sys.stderr.isatty())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pptrace")
def cli():
    """pptrace: where the time of a distributed training step goes.

    Profile with `pptrace.profile` + `pptrace.region`, then point these commands at the
    run directory (it holds traces/rank<r>.json.gz).
    """


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_one_line_errors
def info(run_dir: Path):
    """What a run directory holds: ranks, layout, steps, trace sizes."""
    from rich.table import Table

    from .load import find_trace_files, rank_of, read_header

    files = find_trace_files(run_dir)
    table = Table(title=f"{run_dir}", title_justify="left")
    for col in ("rank", "coords", "steps", "schedule", "size", "file"):
        table.add_column(col, justify="right" if col in ("rank", "size") else "left")
    problems, layouts, ranks = [], set(), []
    for path in files:
        try:
            header = read_header(path)
        except TraceError as exc:
            problems.append(str(exc))
            continue
        block = header.get("pptrace") or {}
        rank = rank_of(header, path)
        ranks.append(rank)
        if block.get("layout"):
            layouts.add(json.dumps(block["layout"], sort_keys=True))
        coords = " ".join(f"{k}{v}" for k, v in (block.get("coords") or {}).items())
        steps = block.get("steps") or []
        table.add_row(
            "?" if rank is None else str(rank),
            coords or "-",
            f"{steps[0]}-{steps[-1]}" if steps else "-",
            str(block.get("schedule") or "-"),
            _human_size(path.stat().st_size),
            path.name,
        )
    if not ranks:
        raise TraceError(f"{run_dir}: none of its {len(files)} trace files could be read: {problems[0]}")
    console = _console()
    console.print(table)
    known = sorted(r for r in ranks if r is not None)
    console.print(f"ranks: {len(ranks)} ({', '.join(map(str, known)) or 'unknown'})")
    for layout in sorted(layouts):
        console.print(f"layout: {layout}")
    if len(layouts) > 1:
        console.print("[yellow]warning:[/] traces disagree on the layout: are two runs mixed here?")
    for problem in problems:
        console.print(f"[yellow]warning:[/] {problem}")


def _human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
