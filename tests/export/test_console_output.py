"""Issue 15, the console: tables that never cut a value at any width (item 16), columns
explained and counts as integers (17), progress for every phase, only on a terminal (18).
Everything runs the real ``pptrace`` command in a subprocess (tests/hostile.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.cells import cell_len

from hostile import no_traceback, pptrace
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

PIPE_WIDTH = 160  # pptrace.cli.PIPE_WIDTH: the width when neither COLUMNS nor a terminal says


def four_d_run(out_dir, *, microbatches: int = 2, steps=(1, 2), fwd_us: float = 1_500_000.0,
               bwd_us: float = 3_000_000.0, tp_us: float = 200_000.0, cp_us: float = 100_000.0,
               latency_us: float = 50.0) -> Path:
    """A GPipe run on tp2 x cp2 x pp2 x dp2 (16 ranks) with second-long passes, so that the
    tables hold every dimension's columns and wide numbers (15300.27 ms steps). Every rank of
    a stage runs the same timeline: each pass followed by a tp all-reduce and a cp all-gather
    in its groups, p2p paired rank to rank, a grad-norm all-reduce over all ranks per step."""
    layout = Layout(tp=2, cp=2, pp=2, dp=2)
    traces = {r: RankTrace(r, layout=layout, schedule="gpipe", microbatches=microbatches, steps=steps)
              for r in range(layout.world_size)}
    stage_of = {r: layout.coords(r).pp for r in traces}
    t0 = 0.0
    for step in steps:
        free = [t0 + 10, t0 + 10]

        def work(stage, op, mb, dur):
            start = free[stage]
            for r in traces:
                if stage_of[r] == stage:
                    traces[r].region(f"compute:{op}", start, dur, mb=mb)
                    traces[r].region("tp:all_reduce", start + dur, tp_us, bytes=1 << 20)
                    traces[r].region("cp:all_gather", start + dur + tp_us, cp_us, bytes=1 << 18)
            free[stage] = start + dur + tp_us + cp_us + 5

        def p2p(src, dst, direction, mb):
            send, post = free[src], free[dst]
            end = max(post, send + latency_us) + 5
            forward = direction == "fwd"
            for r in traces:
                if stage_of[r] == src:
                    peer = layout.pipeline_next_rank(r) if forward else layout.pipeline_prev_rank(r)
                    traces[r].region(f"pp:send_{direction}", send, 20, peer=peer, mb=mb, bytes=4096)
                elif stage_of[r] == dst:
                    peer = layout.pipeline_prev_rank(r) if forward else layout.pipeline_next_rank(r)
                    traces[r].region(f"pp:recv_{direction}", post, end - post, peer=peer, mb=mb, bytes=4096)
            free[src], free[dst] = send + 25, end + 5

        for mb in range(microbatches):
            work(0, "fwd", mb, fwd_us)
            p2p(0, 1, "fwd", mb)
            work(1, "fwd", mb, fwd_us)
        for mb in range(microbatches):
            work(1, "bwd", mb, bwd_us)
            p2p(1, 0, "bwd", mb)
            work(0, "bwd", mb, bwd_us)
        leave = max(free) + latency_us
        for r, t in traces.items():
            arrive = free[stage_of[r]]
            t.region("dp:all_reduce", arrive, leave - arrive, what="grad_norm", bytes=4)
            t.step(step, t0, leave + 10 - t0)
            if step == steps[0]:
                t.clock("start", t0)
            t.clock("end", leave + 10)
        t0 = leave + 20
    return write_run(out_dir, list(traces.values()))


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory) -> Path:
    return four_d_run(tmp_path_factory.mktemp("console") / "run")


@pytest.fixture(scope="module")
def wide_report(wide_run) -> dict:
    r = pptrace("analyze", wide_run, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _tokens(text: str) -> set:
    return set(re.findall(r"[^\s│┃]+", text))


def _ms(x) -> str:
    return f"{x * 1e3:.2f}"


def _assert_fits(text: str, width: int) -> None:
    for line in text.splitlines():
        assert cell_len(line) <= width, (width, cell_len(line), line)
        assert "…" not in line, line


# -- 16 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("columns, width", [("80", 80), ("120", 120), ("", PIPE_WIDTH)],
                         ids=["80", "120", "pipe"])
def test_16_tables_never_cut_a_value(wide_run, wide_report, columns, width):
    """At 80 and 120 columns and through a pipe (no COLUMNS: 160), no line is wider than the
    console, nothing is cut with "…", and every number the JSON holds for the tables is printed
    whole; columns zero in every row (ep) are left out and named."""
    r = pptrace("analyze", wide_run, env={"COLUMNS": columns})
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_fits(r.stdout, width)
    tokens = _tokens(r.stdout)
    rep = wide_report
    expected = set()
    for rank in rep["ranks"]:
        m = rank["mean"]
        expected |= {_ms(m["time_s"]), *(_ms(v) for v in m["breakdown_s"].values() if round(v * 1e3, 2))}
        expected |= set(rank["describe"].split())
    for s in rep["pipeline"]["stages"]:
        expected |= {_ms(s["step_s"]), _ms(s["bubble_s"]), _ms(s["theory_bubble_s"]), _ms(s["t_bwd_s"])}
    for link in rep["p2p"]["links"]:
        expected |= {_ms(link["wait_s"]), str(link["bytes"])}
    for c in rep["collectives"]:
        expected |= {str(c["bytes"]), _ms(c["time_s"])}
    assert len(expected) > 10
    assert expected <= tokens, sorted(expected - tokens)
    assert "15300.27" in tokens  # the step time: five digits before the point
    # the dimension nothing used is named, not drawn as a column of zeros
    assert re.search(r"not shown: .*ep exposed", r.stdout.replace("\n", " "))
    assert "┃ ep" not in r.stdout
    explained = pptrace("analyze", wide_run, "--explain", env={"COLUMNS": columns})
    assert explained.returncode == 0
    _assert_fits(explained.stdout, width)
    # the what-if's tables go through the same fitting
    predicted = pptrace("whatif", wide_run, "--schedule", "1f1b", env={"COLUMNS": columns})
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    _assert_fits(predicted.stdout, width)
    assert "configuration" in predicted.stdout and "1f1b m=2" in predicted.stdout


@pytest.mark.slow
def test_16_trainer_run_fits_80_columns_and_a_pipe(tmp_path):
    """The same on a real tp/cp/pp run of the reference trainer (with sequence parallelism)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-m", "instrumented_model.train", "--tp", "2", "--cp", "2", "--pp", "2",
                           "--sp", "--steps", "3", "--profile-steps", "2", "--out", str(out)],
                          cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(pptrace("analyze", out, "--json").stdout)
    for columns, width in (("80", 80), ("", PIPE_WIDTH)):
        r = pptrace("analyze", out, env={"COLUMNS": columns})
        no_traceback(r)
        assert r.returncode == 0
        _assert_fits(r.stdout, width)
        tokens = _tokens(r.stdout)
        for rank in report["ranks"]:
            assert _ms(rank["mean"]["time_s"]) in tokens
            assert _ms(rank["mean"]["breakdown_s"]["tp_exposed"]) in tokens


# -- 17 --------------------------------------------------------------------------------------
def test_17_columns_explained_counts_whole_no_jargon(wide_run, wide_report):
    """Counts are integers in the JSON (still per-step means); a legend under the tables
    explains the jargon of the columns shown, --explain every column; --help and the
    dashboard's notes speak no internal jargon ("contract-4", "DESIGN contract 3")."""
    raw = pptrace("analyze", wide_run, "--json").stdout
    assert re.search(r'"pairs": 32,', raw)  # 32 pairs per step, not 32.0
    p2p = wide_report["p2p"]
    assert p2p["pairs"] == 32 and type(p2p["pairs"]) is int
    assert all(type(link["count"]) is int and link["count"] == 2 for link in p2p["links"])
    assert all(type(c["count"]) is int for c in wide_report["collectives"])

    r = pptrace("analyze", wide_run)
    legend = r.stdout[r.stdout.index("legend"):]
    for jargon in ("schedule =", "latency =", "theory / theory frac =", "warm-up / steady / cool-down =",
                   "t_fwd / t_bwd / t_w =", "where =", "exposed =", "wait ms ="):
        assert jargon in " ".join(legend.split()), jargon
    assert "pptrace analyze --explain" in legend

    from pptrace.export.report import LEGEND

    explained = " ".join(pptrace("analyze", wide_run, "--explain").stdout.split())
    for table, (_, entries) in LEGEND.items():
        if table == "experts":
            continue  # an MoE run's table: tests/trainer/test_ep_sleep.py
        for names, _, long in entries:
            if any(n in ("ep exposed", "ep hidden", "tp hidden", "cp hidden", "dp hidden", "slowdown", "metric",
                         "cost ms/step", "evidence", "rank", "steady", "t_w", "hidden ms", "wait ms",
                         "pp bubble or transfer") for n in names):
                continue  # columns this run leaves out (zero everywhere) or tables it has none of
            assert " ".join(long.split()) in explained, names

    for command in ([], ["analyze"], ["whatif"], ["dashboard"], ["merge"], ["demo"], ["info"]):
        text = pptrace(*command, "--help").stdout
        assert not re.search(r"contract|DESIGN", text), (command, text)
    from dashboards.page import SECTIONS

    for _, heading, note in SECTIONS:
        assert not re.search(r"contract|DESIGN", heading + note), note


# -- 18 --------------------------------------------------------------------------------------
LABELS = {"loading traces", "matching p2p and collectives, aligning clocks", "analysing"}


def test_18_progress_for_every_phase_only_when_asked(wide_run, tmp_path):
    """PPTRACE_PROGRESS=1 shows every phase on stderr (cold: parsing, cached: the cache),
    through a pipe as one line per phase with its time; without it, a pipe gets nothing."""
    on = {"PPTRACE_PROGRESS": "1"}
    run = tmp_path / "run"  # a copy without the cache the other tests left: parsed again
    shutil.copytree(wide_run / "traces", run / "traces", ignore=shutil.ignore_patterns(".pptrace-cache"))
    cold = pptrace("analyze", run, "--html", tmp_path / "page.html", env=on)
    assert cold.returncode == 0, cold.stderr[-2000:]
    lines = [line for line in cold.stderr.splitlines() if line.startswith("pptrace: ")]
    for label in (*LABELS, "loading traces 16/16", "what-if replay", "writing the dashboard"):
        assert any(label in line for line in lines), (label, cold.stderr)
    assert all(re.search(r"\(\d+\.\d\d s\)$", line) for line in lines), lines
    assert "pptrace:" not in cold.stdout

    cached = pptrace("analyze", run, env=on)  # every rank from the cache now
    for label in (*LABELS, "loading traces: assembling the events table"):
        assert label in cached.stderr, (label, cached.stderr)
    assert "loading traces 16/16" not in cached.stderr  # nothing parsed

    assert "what-if replay" in pptrace("whatif", wide_run, env=on).stderr
    assert "writing the merged trace" in pptrace("merge", wide_run, "-o", tmp_path / "m.json.gz", env=on).stderr

    quiet = pptrace("analyze", wide_run, "--html", tmp_path / "page2.html")  # stderr is a pipe
    assert quiet.returncode == 0
    assert quiet.stderr.strip().splitlines() == [f"dashboard: {tmp_path / 'page2.html'}"]
    off = pptrace("analyze", wide_run, env={"PPTRACE_PROGRESS": "0"})
    assert off.stderr == ""


def _with_terminal_stderr(*args) -> tuple[str, str]:
    """``pptrace ARGS`` with stdout a pipe and stderr a pseudo-terminal: (stdout, stderr)."""
    master, slave = os.openpty()
    env = {**os.environ, "TERM": "xterm", "NO_COLOR": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    env.pop("PPTRACE_PROGRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "pptrace", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def drain():  # a full pty would block the command
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO once the command has exited
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks)[-2000:]
    return out.decode(), b"".join(chunks).decode(errors="replace")


def test_18_progress_on_a_terminal_leaves_stdout_clean(wide_run, tmp_path):
    """With stderr a terminal (and no PPTRACE_PROGRESS), rich shows each phase there; the
    report on stdout is the same as without any progress, with no control codes."""
    out, err = _with_terminal_stderr("whatif", wide_run, "--trace", tmp_path / "sim.json")
    for label in ("loading traces", "aligning clocks", "what-if replay", "writing the simulated trace"):
        assert label in err, (label, err[-2000:])
    assert "\x1b" not in out
    out, err = _with_terminal_stderr("analyze", wide_run)
    for label in LABELS:
        assert label in err, (label, err[-2000:])
    assert "\x1b" not in out
    assert out == pptrace("analyze", wide_run).stdout


def test_issue25_11_a_console_too_narrow_still_prints_lines_that_read(wide_run, wide_report):
    """COLUMNS=1 printed one character a line: the width is at least pptrace.cli.MIN_WIDTH (40),
    and every value is still there, never cut."""
    r = pptrace("analyze", wide_run, env={"COLUMNS": "1"})
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    _assert_fits(r.stdout, 40)
    assert max(map(cell_len, r.stdout.splitlines())) > 20
    assert _ms(wide_report["ranks"][0]["mean"]["time_s"]) in _tokens(r.stdout)


def test_issue25_11_a_stream_that_holds_only_ascii_gets_ascii(wide_run):
    """PYTHONIOENCODING=ascii failed the whole command on an em dash: its punctuation falls back
    to ASCII (and rich draws ASCII boxes), the same numbers printed."""
    utf8 = pptrace("analyze", wide_run)
    ascii_ = pptrace("analyze", wide_run, env={"PYTHONIOENCODING": "ascii"})
    no_traceback(ascii_)
    assert ascii_.returncode == 0, ascii_.stderr
    assert ascii_.stdout.isascii() and "?" not in ascii_.stdout
    numbers = re.compile(r"\d+\.\d+%?")
    assert numbers.findall(ascii_.stdout) == numbers.findall(utf8.stdout)
