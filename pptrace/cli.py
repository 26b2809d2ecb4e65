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
from .vocab import SCHEDULES


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

    stream = sys.stderr if stderr else sys.stdout
    # Rich assumes 80 columns when output is not a terminal, which folds the analysis tables
    # into unreadable slivers in logs and CI; files get the width of a wide terminal.
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, highlight=False, width=width)


def _load(run_dir, ranks=None, steps=None):
    from .ingest.run import load_run

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

    from .ingest.load import find_trace_files, rank_of, read_header

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


def _run_options(fn):
    """--steps/--ranks filters shared by the commands that load a run."""
    fn = click.option("--ranks", "ranks_text", metavar="LIST", help="Only these ranks, e.g. '0,1,4-7'.")(fn)
    fn = click.option("--steps", "steps_text", metavar="LIST", help="Only these profiled steps, e.g. '2-3'.")(fn)
    return fn


def _write_json(document: dict, target: str | None = None) -> None:
    import orjson

    blob = orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    if target in (None, "-"):
        click.echo(blob.decode())
    else:
        Path(target).write_bytes(blob + b"\n")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_run_options
@click.option("--json", "json_out", is_flag=True, help="Print the contract-4 JSON document instead of tables.")
@click.option("--html", "html_out", type=click.Path(path_type=Path), help="Also write the dashboard page here.")
@click.option("--hta", "with_hta", is_flag=True,
              help="GPU traces: also run HTA on the same files and show its numbers beside pptrace's "
                   "(needs pip install 'pptrace[hta]').")
@_one_line_errors
def analyze(run_dir: Path, steps_text, ranks_text, json_out, html_out, with_hta):
    """Where each rank's step time goes: compute, pipeline bubble, p2p wait vs transfer,
    exposed vs hidden TP/CP/DP communication, stragglers."""
    from .export.report import build_report, print_report

    if with_hta:
        from .export.hta import INSTALL_HINT, hta_available

        if not hta_available():
            raise click.ClickException(INSTALL_HINT)
    run = _load(run_dir, ranks=_int_list(ranks_text), steps=_int_list(steps_text))
    report = build_report(run)
    comparison = None
    if with_hta:
        from .export.hta import compare

        comparison = compare(run)
        report["hta"] = {"ranks": comparison[0].to_dict("records"), "notes": comparison[1]}
    if json_out:
        _write_json(report)
    else:
        print_report(report, _console())
        if comparison is not None:
            from .export.hta import print_comparison

            print_comparison(*comparison, _console())
    if html_out:
        from .export.dashboard import write_page

        write_page(run, report, html_out)
        _console(stderr=True).print(f"dashboard: {html_out}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_run_options
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="HTML file to write (default: RUN/report.html).")
@click.option("--png", "png_dir", type=click.Path(path_type=Path), help="Also write one PNG per figure here.")
@_one_line_errors
def dashboard(run_dir: Path, steps_text, ranks_text, output, png_dir):
    """One self-contained interactive HTML page: the pipeline as it ran, breakdowns, overlap, stragglers."""
    from .export.report import build_report

    run = _load(run_dir, ranks=_int_list(ranks_text), steps=_int_list(steps_text))
    output = output or (run_dir if run_dir.is_dir() else run_dir.parent) / "report.html"
    from .export.dashboard import write_page

    path = write_page(run, build_report(run), output, png_dir=png_dir)
    click.echo(f"dashboard: {path}")
    if png_dir:
        click.echo(f"figures: {png_dir}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_run_options
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Merged trace to write (.json or .json.gz).")
@_one_line_errors
def merge(run_dir: Path, steps_text, ranks_text, output):
    """One Perfetto / chrome://tracing trace of every rank on aligned clocks, p2p pairs as arrows."""
    from .export.perfetto import merge_run

    run = _load(run_dir, ranks=_int_list(ranks_text), steps=_int_list(steps_text))
    path = merge_run(run, output)
    click.echo(f"merged {len(run.ranks)} ranks into {path}")
    for warning in run.warnings:
        click.echo(f"warning: {warning}", err=True)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--schedule", type=click.Choice(SCHEDULES),
              help="Replay under this schedule (default: as measured).")
@click.option("--vpp", type=click.IntRange(min=1), help="Virtual chunks per stage for interleaved.")
@click.option("--microbatches", type=click.IntRange(min=1), help="Number of microbatches.")
@click.option("--no-straggler", is_flag=True, help="Replace the slowest rank's times by its peers' median.")
@click.option("--p2p-free", is_flag=True, help="Make pipeline transfers free.")
@click.option("--json", "json_out", is_flag=True, help="Print the prediction as JSON instead of a table.")
@click.option("--trace", "trace_out", type=click.Path(path_type=Path), help="Write the simulated timeline (Perfetto).")
@_one_line_errors
def whatif(run_dir: Path, schedule, vpp, microbatches, no_straggler, p2p_free, json_out, trace_out):
    """Predict the step time under another schedule, vpp, microbatch count, without the straggler."""
    from .whatif import predict as whatif_mod

    run = _load(run_dir)
    result = whatif_mod.whatif(run, schedule=schedule, vpp=vpp, microbatches=microbatches,
                               no_straggler=no_straggler, p2p_free=p2p_free)
    if trace_out:
        whatif_mod.write_simulated_trace(result, trace_out)
    if json_out:
        _write_json(result)
    else:
        whatif_mod.print_whatif(result, _console())
        if trace_out:
            click.echo(f"simulated trace: {trace_out}")


DEMO_TRAINER_ARGS = ["--tp", "2", "--cp", "2", "--pp", "2", "--dp", "1", "--sp", "--schedule", "1f1b",
                     "--microbatches", "4", "--steps", "4", "--profile-steps", "2-3"]


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True,
              help="Run directory to write.")
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
@_one_line_errors
def demo(out: Path, trainer_args):
    """Run the reference trainer on CPU (tp2 cp2 pp2 + SP, 1F1B, 8 gloo ranks), then analyze it
    and write the dashboard. Extra arguments go to the trainer
    (`python -m instrumented_model.train --help`), e.g. `pptrace demo -- --compute sleep`."""
    from instrumented_model.train import main as train_main

    argv = [*DEMO_TRAINER_ARGS, *trainer_args, "--out", str(out)]
    click.echo(f"training: python -m instrumented_model.train {' '.join(argv)}", err=True)
    if train_main(argv) != 0:
        raise click.ClickException("the reference trainer failed (see the line above)")

    from .export.report import build_report, print_report

    run = _load(out)
    report = build_report(run)
    print_report(report, _console())
    _write_json(report, str(out / "analysis.json"))
    from .export.dashboard import write_page

    html = write_page(run, report, out / "report.html")
    click.echo(f"\nanalysis: {out / 'analysis.json'}\ndashboard: {html}")
