"""The `pptrace` command: a thin click layer over the library.

Library errors (TraceError, ValueError) become one-line ``click.ClickException``s; anything
unexpected is reported in one line too, with the traceback only under PPTRACE_DEBUG=1.

One module though past 500 lines: beside the commands it holds only what they share (the
one-line errors around each command, the --ranks/--steps lists, output paths checked before a
load, the console's width), all of it click's and the terminal's side and used by nothing
else; a command reads with its helpers at hand, and a split would only add modules that the
cli layer (tests/foundation/test_import_layers.py) holds just for the commands.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import sys
from pathlib import Path

import click

from . import __version__
from .errors import TraceError
from .ingest.memory import prefer_heap_for_large_blocks, prefer_small_pages, prefer_system_arrow_pool
from .ingest.files import human_size
from .vocab import SCHEDULES

prefer_system_arrow_pool()  # before anything imports pyarrow: see ingest/memory.py
prefer_small_pages()  # before anything imports numpy: see there
prefer_heap_for_large_blocks()  # see there


#: What the output writes beyond ASCII, for a stream that cannot hold it
_ASCII_PUNCTUATION = str.maketrans({"\u2014": "-", "\u2013": "-", "\u00b7": "-", "\u00b5": "u", "\u2026": "...",
                                    "\u2192": "->", "\u2190": "<-", "\u00d7": "x", "\u2265": ">=", "\u2264": "<=",
                                    "\u00b1": "+/-", "\u2248": "~", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


class _StdoutGuard:
    """``sys.stdout`` while a command runs: it marks an OSError raised by writing to standard
    output (a closed pipe, a full disk behind ``>``), which the command then reports as that,
    not as an internal error or a failure of the file it was reading."""

    def __init__(self, stream):
        self._stream = stream

    def _marked(self, call, *args):
        try:
            return call(*args)
        except OSError as exc:
            exc.pptrace_stdout = True
            raise

    def write(self, text):
        try:
            return self._marked(self._stream.write, text)
        except UnicodeEncodeError:  # a stream that holds no such text (PYTHONIOENCODING=ascii)
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            plain = text.translate(_ASCII_PUNCTUATION).encode(encoding, "replace").decode(encoding)
            return self._marked(self._stream.write, plain)

    def flush(self):
        return self._marked(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _drop_stdout() -> None:
    """Point the process's stdout at /dev/null, so that the interpreter's flush at exit does
    not fail a second time and print its own traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (tests): nothing to flush
        pass


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        guard = sys.stdout = _StdoutGuard(sys.stdout) if sys.stdout is not None else None
        try:
            result = fn(*args, **kwargs)
            if guard is not None:
                guard.flush()
            return result
        except (click.ClickException, click.Abort, click.exceptions.Exit):
            raise
        except OSError as exc:
            if getattr(exc, "pptrace_stdout", False):
                _drop_stdout()
                if exc.errno == errno.EPIPE:  # the reader left (| head): nothing to say
                    raise SystemExit(1) from None
                raise click.ClickException(f"cannot write standard output: {exc.strerror or exc}") from None
            if exc.filename is None:
                raise _internal(exc) from None
            raise click.ClickException(_one_line(exc)) from None
        except (TraceError, ValueError) as exc:
            raise click.ClickException(_one_line(exc)) from None
        except Exception as exc:  # never a traceback for users; PPTRACE_DEBUG shows it
            raise _internal(exc) from None
        finally:
            if guard is not None and sys.stdout is guard:
                sys.stdout = guard._stream

    return wrapper


def _one_line(exc: BaseException) -> str:
    """An error as one line a terminal shows as it is (names in it may hold escapes)."""
    from .export.tables import printable

    return printable(" ".join(str(exc).split()))


def _internal(exc: BaseException) -> click.ClickException:
    if os.environ.get("PPTRACE_DEBUG"):
        raise exc
    return click.ClickException(
        f"internal error: {type(exc).__name__}: {_one_line(exc)} "
        "(set PPTRACE_DEBUG=1 for the traceback and please report it)"
    )


class _BadOption(click.UsageError):
    """A bad option value in one line (click's usage block around it would make four)."""

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True)


#: Most ids a --ranks/--steps list may name beyond the run's trace files: no run profiles
#: more steps, and a longer list is a typo (0-1000000000) that would cost seconds and GBs.
MAX_LISTED = 4096
_MAX_ID = 2**31 - 1  # ranks and steps are int32 in the events table


def _id_ranges(text: str | None, option: str) -> list[tuple[int, int]] | None:
    """'0,1,4-6' -> [(0, 0), (1, 1), (4, 6)], nothing materialised yet."""
    if not text:
        return None
    ranges = []
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        if dash and not b.strip():  # '0-' is no range (the end was lost), not rank 0
            raise _BadOption(f"{option} {text!r}: {part.strip()} has no end; write {a.strip()}-N")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise _BadOption(f"{option} {text!r} is not a list like '0,1,4-6'") from None
        if hi < lo:
            raise _BadOption(f"{option} {text!r}: {part.strip()} runs backwards; write {hi}-{lo}")
        if hi > _MAX_ID:
            raise _BadOption(f"{option} {text!r}: {hi} is larger than any rank or step ({_MAX_ID})")
        ranges.append((lo, hi))
    return ranges


def _int_list(text: str | None, option: str = "--ranks", limit: int = MAX_LISTED) -> list[int] | None:
    """'0,1,4-6' -> [0, 1, 4, 5, 6]; a list of more than ``limit`` ids is refused in one line
    before any is made."""
    ranges = _id_ranges(text, option)
    if ranges is None:
        return None
    count = sum(hi - lo + 1 for lo, hi in ranges)
    if count > limit:
        what = "ranks" if option == "--ranks" else "steps"
        raise _BadOption(f"{option} {text!r} names {count} {what}; at most {limit} can be kept: name the "
                         f"{what} to keep (pptrace info RUN lists them), or leave {option} out for all")
    return sorted({i for lo, hi in ranges for i in range(lo, hi + 1)})


#: Width of output that reaches no terminal (logs, CI) when COLUMNS does not say: rich's own
#: 80 would fold the tables into many parts; the tables fit any width without cutting a value.
PIPE_WIDTH = 160
#: Narrower than this, no line of output reads (COLUMNS=1 printed a character a line)
MIN_WIDTH = 40


def _width(stream) -> int:
    """COLUMNS when set; else the terminal's width, also when only stderr is one (``pptrace
    analyze RUN | less`` reads on that terminal); else PIPE_WIDTH."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return max(int(columns), MIN_WIDTH)
    for candidate in (stream, sys.stdout, sys.stderr):
        try:
            if candidate.isatty() and os.get_terminal_size(candidate.fileno()).columns > 0:
                return max(os.get_terminal_size(candidate.fileno()).columns, MIN_WIDTH)
        except (AttributeError, OSError, ValueError):  # closed, replaced or sizeless streams
            continue
    return PIPE_WIDTH


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, width=_width(sys.stderr if stderr else sys.stdout))


def _load(run_dir, ranks=None, steps=None, **options):
    from .run.build import load_run

    return load_run(run_dir, ranks=ranks, steps=steps, **options)  # progress: pptrace.progress.wanted()


def _filters(run_dir, ranks_text, steps_text) -> tuple:
    """--ranks and --steps as lists of at most MAX_LISTED ids (--ranks: or as many as the run
    has trace files)."""
    limit = MAX_LISTED
    if ranks_text:
        from .ingest.files import find_trace_files

        limit = max(limit, len(find_trace_files(run_dir)))
    return _int_list(ranks_text, "--ranks", limit), _int_list(steps_text, "--steps")


def _is_stdout(path) -> bool:
    """Whether ``path`` is where stdout goes (-o /dev/stdout): a status line printed there
    would land inside the file just written."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):
        return False


def _output(run_dir, path, option: str):
    """An output path, checked before the run is loaded: a directory, or one of the run's own
    trace files, is refused in one line (whether it can be written shows when it is)."""
    if path is None:
        return None
    if Path(path).is_dir():
        raise click.ClickException(f"cannot write {path}: it is a directory; give {option} a file name")
    from .ingest.files import find_trace_files

    try:
        traces = find_trace_files(run_dir)
    except TraceError:  # loading the run says what is wrong with it
        return path
    real = os.path.realpath(path)
    if any(os.path.realpath(trace) == real for trace in traces):
        raise click.ClickException(f"{option} {path} is one of the run's trace files; choose another output path")
    return path


def main() -> None:
    """The console script and ``python -m pptrace``: :func:`cli`, then a quick exit. The
    interpreter's own teardown of pandas, pyarrow and numpy takes 70-100 ms after every
    command on the benchmark's 2-core machine (a cached 1.6 s analysis of 256 ranks waits
    for it), once every result is out. So when the command returned a status and the main
    thread is all that runs, the exit handlers run (atexit: temporary files, pools), the
    streams are flushed and the process ends there; anything else exits as usual."""
    import atexit
    import threading

    try:
        cli()
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code
    else:
        code = 0
    if not isinstance(code, int) or threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a reader gone (| head): the usual exit says what it says
        sys.exit(code)
    os._exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pptrace")
def cli():
    """pptrace: where the time of a distributed training step goes.

    Profile with `pptrace.profile` + `pptrace.region`, then point these commands at the
    run directory (it holds traces/rank<r>.json.gz). Each phase shows its progress on stderr
    when that is a terminal (PPTRACE_PROGRESS=1 or 0 forces it on or off); tables take the
    terminal's width, or COLUMNS.
    """


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_one_line_errors
def info(run_dir: Path):
    """What a run directory holds: ranks, layout, steps, trace sizes."""
    from rich.markup import escape
    from rich.table import Table

    from .export.tables import printable
    from .run.build import run_headers

    problems: list[str] = []
    # analyze's checks, so that info never describes a run it refuses; every header read whole
    # (within the limits the load meets: a bomb is skipped here too), not from the cache
    by_rank = run_headers(run_dir, problems, cached=False, enough=()).by_rank
    table = Table(title=escape(printable(run_dir)), title_justify="left")
    for col in ("rank", "coords", "steps", "schedule", "size", "file"):
        table.add_column(col, justify="right" if col in ("rank", "size") else "left")
    layouts = set()
    for rank, (path, header) in sorted(by_rank.items()):
        block = header.get("pptrace") or {}
        if block.get("layout"):
            layouts.add(json.dumps(block["layout"], sort_keys=True))
        coords = " ".join(f"{k}{v}" for k, v in (block.get("coords") or {}).items())
        steps = block.get("steps") or []
        table.add_row(
            str(rank),
            coords or "-",
            f"{steps[0]}-{steps[-1]}" if steps else "-",
            str(block.get("schedule") or "-"),
            human_size(path.stat().st_size),
            escape(printable(path.name)),
        )
    console = _console()
    console.print(table)
    console.print(f"ranks: {len(by_rank)} ({', '.join(map(str, sorted(by_rank)))})")
    for layout in sorted(layouts):
        console.print(f"layout: {layout}")
    for problem in problems:
        console.print(f"[yellow]warning:[/] {escape(printable(problem))}", soft_wrap=True)  # one line, as analyze's


def _run_options(fn):
    """--steps/--ranks filters shared by the commands that load a run."""
    fn = click.option("--ranks", "ranks_text", metavar="LIST", help="Only these ranks, e.g. '0,1,4-7'.")(fn)
    fn = click.option("--steps", "steps_text", metavar="LIST", help="Only these profiled steps, e.g. '2-3'.")(fn)
    return fn


def _load_options(fn):
    """How the run is loaded, handed to the command as ``loading`` (the keyword arguments of
    _load that say it): --workers/--scheduler, where the ranks' traces are parsed
    (pptrace.ingest.cluster), --comm-kernel, kernels that communicate beyond those
    pptrace knows (pptrace.ingest.comm_kernels), and --assume-same-run (run.build.load_run)."""

    @functools.wraps(fn)
    def wrapper(*args, workers=None, scheduler=None, comm_kernel=(), assume_same_run=False, **kwargs):
        loading = {"assume_same_run": True} if assume_same_run else {}
        if comm_kernel:
            from .ingest.comm_kernels import parse_rule

            try:
                loading["comm_kernels"] = tuple(parse_rule(text) for text in comm_kernel)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
        if workers is not None or scheduler is not None:
            import importlib.util

            from .ingest.cluster import INSTALL_HINT, LOCAL

            if workers is not None and scheduler is not None:
                raise _BadOption("--workers starts a local Dask cluster, --scheduler uses an existing one: give one of them")
            if importlib.util.find_spec("distributed") is None:
                raise click.ClickException(INSTALL_HINT)
            loading.update(scheduler=scheduler or LOCAL, workers=workers)
        return fn(*args, loading=loading, **kwargs)

    wrapper = click.option("--assume-same-run", is_flag=True,
                           help="Traces whose clocks lie hours apart are one run whose clocks disagree (not "
                                "two runs mixed): align those ranks on their collectives and p2p.")(wrapper)
    wrapper = click.option("--comm-kernel", "comm_kernel", multiple=True, metavar="REGEX=DIM",
                           help="GPU kernels whose name REGEX finds communicate for DIM (tp, cp, dp or ep), "
                                "beyond the NCCL, DeepEP, NVSHMEM and custom all-reduce kernels pptrace knows; "
                                "repeat for more.")(wrapper)
    wrapper = click.option("--scheduler", metavar="ADDRESS",
                           help="Parse the traces on the Dask cluster of this scheduler (tcp://HOST:8786), whose "
                                "workers see RUN at the same path (needs pip install 'pptrace[distributed]').")(wrapper)
    wrapper = click.option("--workers", type=click.IntRange(min=1), metavar="N",
                           help="Parse the traces on a local Dask cluster of N processes, started for the load "
                                "(needs pip install 'pptrace[distributed]').")(wrapper)
    return wrapper


def _write_json(document: dict, target: str | None = None) -> None:
    import orjson

    blob = orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    if target in (None, "-"):
        sys.stdout.write(blob.decode() + "\n")  # through the guard of _one_line_errors
        sys.stdout.flush()
    else:
        from .output import write_file

        write_file(target, blob + b"\n")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_run_options
@click.option("--json", "json_out", is_flag=True,
              help="Print the analysis as JSON (schema pptrace.analysis/1) instead of tables.")
@click.option("--explain", is_flag=True, help="After the tables, explain every column at length.")
@click.option("--html", "html_out", type=click.Path(path_type=Path), help="Also write the dashboard page here.")
@click.option("--hta", "with_hta", is_flag=True,
              help="GPU traces: also run HTA on the same files and show its numbers beside pptrace's "
                   "(needs pip install 'pptrace[hta]').")
@_load_options
@_one_line_errors
def analyze(run_dir: Path, steps_text, ranks_text, json_out, explain, html_out, with_hta, loading):
    """Where each rank's step time goes: compute, pipeline bubble (idle, waiting for another
    stage), pipeline sends and receives, the tensor-, context- and data-parallel communication
    that compute did not hide, and the ranks that hold the others back. A legend under the
    tables says what their columns mean."""
    from .analysis import analyze as analyze_run
    from .export.report import print_report

    if with_hta:
        from .export.hta import INSTALL_HINT, hta_available

        if not hta_available():
            raise click.ClickException(INSTALL_HINT)
    html_out = _output(run_dir, html_out, "--html")
    run = _load(run_dir, *_filters(run_dir, ranks_text, steps_text), **loading)
    analysis = analyze_run(run)
    report = analysis.to_json()
    comparison = None
    if with_hta:
        from .export.hta import compare

        comparison = compare(run)
        report["hta"] = {"ranks": comparison[0].to_dict("records"), "notes": comparison[1]}
    if json_out:
        _write_json(report)
    else:
        print_report(report, _console(), explain=explain)
        if comparison is not None:
            from .export.hta import print_comparison

            print_comparison(*comparison, _console())
    if html_out:
        from .export.dashboard import write_page

        write_page(analysis, html_out)
        _console(stderr=True).print(f"dashboard: {html_out}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_run_options
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="HTML file to write (default: RUN/report.html).")
@click.option("--png", "png_dir", type=click.Path(path_type=Path), help="Also write one PNG per figure here.")
@_load_options
@_one_line_errors
def dashboard(run_dir: Path, steps_text, ranks_text, output, png_dir, loading):
    """One self-contained interactive HTML page: the pipeline as it ran, breakdowns, overlap, stragglers."""
    from .analysis import analyze as analyze_run
    from .export.dashboard import write_page

    output = _output(run_dir, output or (run_dir if run_dir.is_dir() else run_dir.parent) / "report.html", "-o")
    run = _load(run_dir, *_filters(run_dir, ranks_text, steps_text), **loading)
    path = write_page(analyze_run(run), output, png_dir=png_dir)
    click.echo(f"dashboard: {path}", err=_is_stdout(path))
    if png_dir:
        click.echo(f"figures: {png_dir}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@_run_options
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Merged trace to write (.json or .json.gz).")
@_load_options
@_one_line_errors
def merge(run_dir: Path, steps_text, ranks_text, output, loading):
    """One Perfetto / chrome://tracing trace of every rank on aligned clocks, p2p pairs as arrows."""
    from .export.perfetto import merge_run

    output = _output(run_dir, output, "-o")
    # every op: the analyses' compact table folds nested CPU ops away (ingest/compact.py)
    run = _load(run_dir, *_filters(run_dir, ranks_text, steps_text), compact=False, **loading)
    path = merge_run(run, output)
    click.echo(f"merged {len(run.ranks)} ranks into {path}", err=_is_stdout(path))
    from .export.tables import printable

    for warning in run.warnings:
        click.echo(f"warning: {printable(warning)}", err=True)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--schedule", type=click.Choice(SCHEDULES),
              help="Replay under this schedule (default: as measured).")
@click.option("--vpp", type=click.IntRange(min=1),
              help="Model chunks per pipeline stage (the interleaved schedule's virtual stages).")
@click.option("--microbatches", type=click.IntRange(min=1), help="Number of microbatches.")
@click.option("--no-straggler", is_flag=True, help="Replace the slowest rank's times by its peers' median.")
@click.option("--p2p-free", is_flag=True, help="Assume pipeline sends and receives take no time.")
@click.option("--balanced-experts", is_flag=True,
              help="Spread the MoE tokens evenly: each rank's expert time at its ep group's mean tokens.")
@click.option("--json", "json_out", is_flag=True, help="Print the prediction as JSON instead of a table.")
@click.option("--trace", "trace_out", type=click.Path(path_type=Path), help="Write the simulated timeline (Perfetto).")
@_load_options
@_one_line_errors
def whatif(run_dir: Path, schedule, vpp, microbatches, no_straggler, p2p_free, balanced_experts, json_out, trace_out,
           loading):
    """Predict the step time under another pipeline schedule, number of model chunks per stage
    or of microbatches, without the slowest rank, with free pipeline transfers, or with the
    experts' tokens spread evenly over the ep ranks."""
    from .whatif import predict as whatif_mod

    trace_out = _output(run_dir, trace_out, "--trace")
    run = _load(run_dir, **loading)
    result = whatif_mod.whatif(run, schedule=schedule, vpp=vpp, microbatches=microbatches,
                               no_straggler=no_straggler, p2p_free=p2p_free, balanced_experts=balanced_experts)
    if trace_out:
        from .export.perfetto import write_simulated_trace

        write_simulated_trace(result, trace_out)
    if json_out:
        _write_json(result)
    else:
        from .export.report import print_whatif

        print_whatif(result, _console())
        if trace_out:
            click.echo(f"simulated trace: {trace_out}")


#: `pptrace diff`'s exit code when a --gate fails (1 is bad input, 2 a usage error)
GATE_FAILED = 3


@cli.command()
@click.argument("base", type=click.Path(path_type=Path))
@click.argument("new", type=click.Path(path_type=Path))
@click.option("--json", "json_out", is_flag=True, help="Print the diff as JSON (schema pptrace.diff/1) instead of tables.")
@click.option("--html", "html_out", type=click.Path(path_type=Path), help="Also write the diff's page here.")
@click.option("--gate", "gates", multiple=True, metavar="SPEC",
              help="Fail (exit 3) when NEW is worse beyond this threshold and beyond noise: 'step>+3%', "
                   "'pp_bubble>+5ms', 'stage2.dp_exposed>+10%'; repeat for more.")
@_load_options
@_one_line_errors
def diff(base: Path, new: Path, json_out, html_out, gates, loading):
    """What changed between two runs and why: BASE's step time taken to NEW's, part by part
    and stage by stage, against each run's own noise, with the set-up changes and the
    schedule's theory. BASE and NEW are run directories or the analysis.json that
    `pptrace analyze RUN --json` writes. The verdict is the last line; with --gate, exit code
    3 when it fails."""
    from .diff import diff as diff_runs, parse_gate

    parsed = [parse_gate(g) for g in gates]  # a bad spec is said before anything loads
    html_out = _output(base, _output(new, html_out, "--html"), "--html")
    document = diff_runs(base, new, gates=parsed, **loading)
    if json_out:
        _write_json(document)
    else:
        from .export.diff_tables import print_diff

        print_diff(document, _console())
    if html_out:
        from .export.dashboard import write_diff_page

        write_diff_page(document, html_out)
        _console(stderr=True).print(f"diff page: {html_out}")
    if document["verdict"]["status"] == "fail":
        raise click.exceptions.Exit(GATE_FAILED)


DEMO_TRAINER_ARGS = ["--tp", "2", "--cp", "2", "--pp", "2", "--dp", "1", "--sp", "--schedule", "1f1b",
                     "--microbatches", "4", "--steps", "4", "--profile-steps", "2-3"]


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True,
              help="Run directory to write.")
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
@_one_line_errors
def demo(out: Path, trainer_args):
    """Run the reference trainer on CPU (8 gloo processes: tensor, context and pipeline
    parallel 2 each, sequence parallel, 1F1B schedule), then analyze it and write the dashboard. Extra arguments go to the trainer
    (`python -m instrumented_model.train --help`), e.g. `pptrace demo -- --compute sleep`."""
    from instrumented_model.train import main as train_main

    argv = [*DEMO_TRAINER_ARGS, *trainer_args, "--out", str(out)]
    click.echo(f"training: python -m instrumented_model.train {' '.join(argv)}", err=True)
    if train_main(argv) != 0:
        raise click.ClickException("the reference trainer failed (see the line above)")

    from .analysis import analyze as analyze_run
    from .export.dashboard import write_page
    from .export.report import print_report

    analysis = analyze_run(_load(out))
    report = analysis.to_json()
    print_report(report, _console())
    _write_json(report, str(out / "analysis.json"))
    html = write_page(analysis, out / "report.html")
    click.echo(f"\nanalysis: {out / 'analysis.json'}\ndashboard: {html}")
