"""The reference trainer end to end, on real gloo processes spawned by ``train.main``.

Sleep-mode runs check schedules against their tables and theory (known per-pass times);
model-mode runs check that every parallel layout trains exactly like one process.
"""
from __future__ import annotations

import gzip
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pptrace.schedules.tables import schedule_table
from instrumented_model.train import main
from instrumented_model.train_config import config_from_args
from pptrace.naming import parse_name
from sleep_runs import PROFILED, STEPS

REPO = Path(__file__).resolve().parents[2]
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16",
        "--vocab-size", "64", "--steps", "3", "--profile-steps", "0-0"]


def _train(out: Path, args: list[str]) -> Path:
    assert main([*args, "--out", str(out)]) == 0
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _median_step_s(run: Path) -> float:
    return statistics.median(row["step_time_s"] for row in _metrics(run)[1:])


def _ranges(run: Path, rank: int) -> dict[int, list]:
    """Contract-1 ranges of each profiled step: {step: [(ts, dur, RangeName)] in start order}."""
    trace = json.load(gzip.open(run / "traces" / f"rank{rank}.json.gz"))
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = {int(e["name"].split("#")[1]): e for e in events if e["name"].startswith("ProfilerStep#")}
    out = {}
    for step, s in steps.items():
        inside = [e for e in events if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        named = [(e["ts"], e["dur"], parse_name(e["name"])) for e in inside]
        out[step] = sorted([n for n in named if n[2] is not None], key=lambda n: n[0])
    return out


_PASS = {"fwd": "F", "bwd": "B", "bwd_input": "B", "bwd_weight": "W"}


def _traced_order(ranges) -> list[tuple[str, int, int]]:
    return [
        (_PASS[n.op], n.tags["mb"], n.tags.get("chunk", 0))
        for _, _, n in ranges
        if n.kind == "compute" and n.op in _PASS
    ]


@pytest.fixture(scope="module")
def sleep_runs(sleep_run):
    """schedule -> run directory: the suite's shared sleep-mode runs (tests/sleep_runs.py)."""
    return {"1f1b": sleep_run("1f1b"), "interleaved": sleep_run("interleaved-no-overlap"),
            # Megatron's default for interleaved, overlap_p2p_comm: same passes and messages,
            # exchanges split and waited late.
            "interleaved-overlap": sleep_run("interleaved"), "zb-h1": sleep_run("zb-h1")}


SCHEDULES = ["1f1b", "interleaved", "interleaved-overlap", "zb-h1"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_traced_order_equals_schedule_table(sleep_runs, schedule):
    run, v = sleep_runs[schedule], 2 if schedule.startswith("interleaved") else 1
    for rank in range(4):
        for step, ranges in _ranges(run, rank).items():
            assert _traced_order(ranges) == schedule_table(schedule.split("-overlap")[0], 4, rank, 8, v), (rank, step)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_rank_traces_contract_ranges(sleep_runs, schedule):
    run = sleep_runs[schedule]
    interleaved = schedule.startswith("interleaved")
    for rank in range(4):
        steps = _ranges(run, rank)
        assert sorted(steps) == PROFILED
        for ranges in steps.values():
            names = Counter(f"{n.kind}:{n.op}" for _, _, n in ranges)
            if schedule == "zb-h1":
                assert names["compute:bwd_input"] == names["compute:bwd_weight"] == 8
            else:
                assert names["compute:bwd"] == 8 * (2 if interleaved else 1)
            assert names["dp:all_reduce"] == 1 and names["compute:optimizer"] == 1
            p2p = [n for _, _, n in ranges if n.kind == "pp"]
            for n in p2p:
                assert {"peer", "mb", "bytes"} <= set(n.tags)
                assert ("chunk" in n.tags) == interleaved
            ops = {n.op for n in p2p}
            # Interleaved: a ring, every stage both sends and receives in both directions.
            expect = {"send_fwd", "recv_bwd"} if rank < 3 or interleaved else set()
            expect |= {"recv_fwd", "send_bwd"} if rank > 0 or interleaved else set()
            assert ops == expect
            grad_norm = [n for _, _, n in ranges if n.kind == "dp"]
            assert grad_norm[-1].tags["what"] == "grad_norm"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_send_has_exactly_one_recv(sleep_runs, schedule):
    run = sleep_runs[schedule]
    per_rank = {rank: _ranges(run, rank) for rank in range(4)}
    for step in PROFILED:
        sends, recvs = Counter(), Counter()
        for rank, steps in per_rank.items():
            for _, _, n in steps[step]:
                if n.kind != "pp":
                    continue
                direction, kind = n.op.split("_")[1], n.op.split("_")[0]
                key_chunk = n.tags.get("chunk")
                if kind == "send":
                    sends[(rank, n.tags["peer"], direction, n.tags["mb"], key_chunk)] += 1
                else:
                    recvs[(n.tags["peer"], rank, direction, n.tags["mb"], key_chunk)] += 1
        assert sends and set(sends.values()) == {1}
        assert sends == recvs


#: the sleeps alone of each run (p=4, m=8, t_f=10 ms, backward 20 ms): 1F1B (m+p-1)(t_f+t_b);
#: interleaved v=2 m(t_f+t_b) + (p-1)(t_f+t_b)/v; ZB-H1 (t_b = 10 ms input grad + t_w = 10 ms)
#: m(t_f+t_b+t_w) + (p-1)(t_f+t_b-t_w).
SLEEP_THEORY_S = {"1f1b": 0.330, "interleaved": 0.285, "interleaved-overlap": 0.285, "zb-h1": 0.270}


@pytest.mark.slow
def test_sleep_mode_step_times_follow_theory(sleep_runs):
    """No schedule runs faster than its sleeps allow: the firm side of the truth, on any
    machine. How much more than its sleeps a run pays (p2p latency and wake-ups on the
    critical path) depends on the machine's load at the moment of that run, so comparing it
    across runs is a speed measurement (benchmarks/bench_schedules.py); the analysis of each
    run is held to that run's own truth replay (test_analyze_trainer)."""
    steps = {name: _median_step_s(run) for name, run in sleep_runs.items()}
    for name, step in steps.items():
        assert step >= SLEEP_THEORY_S[name] - 0.002, (name, step, SLEEP_THEORY_S[name])


# -- numerical equivalence ------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """Single-process losses for 4 and 8 microbatches (one process with dp*M microbatches sees
    the rows of a whole data-parallel group)."""
    base = tmp_path_factory.mktemp("ref")
    return {
        m: [r["loss"] for r in _metrics(_train(base / f"m{m}", [*TINY, "--microbatches", str(m)]))]
        for m in (4, 8)
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--tp", "2", "--pp", "2"],
        # pp x dp, ZB-H1's split backward and the overlapped DP reducer armed before the last W.
        ["--pp", "2", "--dp", "2", "--dp-overlap", "--schedule", "zb-h1"],
        ["--pp", "2", "--schedule", "interleaved", "--vpp", "2", "--no-overlap-p2p-comm"],
        ["--pp", "2", "--schedule", "interleaved", "--vpp", "2"],
        ["--tp", "2", "--sp", "--cp", "2"],
        ["--cp", "2", "--cp-algo", "ulysses"],
    ],
    ids=lambda a: "-".join(x.strip("-") for x in a),
)
def test_loss_equals_single_process(tmp_path, reference_losses, args):
    dp = int(args[args.index("--dp") + 1]) if "--dp" in args else 1
    losses = [r["loss"] for r in _metrics(_train(tmp_path, [*TINY, "--microbatches", "4", *args]))]
    assert losses == pytest.approx(reference_losses[4 * dp], rel=1e-5)
    assert losses[0] != losses[-1], "the optimizer must change the model"


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--pp", "2", "--schedule", "interleaved", "--vpp", "2", "--microbatches", "3"], "--microbatches (3)"),
        (["--tp", "3", "--vocab-size", "96"], "--heads 4 must be divisible by --tp 3"),
        (["--tp", "3"], "--vocab-size 128 must be divisible by --tp 3"),
        (["--sp"], "--sp"),
        (["--schedule", "zb-h1"], "zb-h1 needs --pp >= 2"),
        (["--pp", "3"], "--layers 4 must be divisible by pp*vpp = 3"),
        (["--cp", "2", "--seq-len", "6"], "divisible by 2*cp = 4"),
        (["--delay", "9:fwd:5", "--pp", "2"], "--delay rank 9"),
        (["--delay", "1:fast:5", "--pp", "2"], "phase 'fast'"),
        (["--out", "x", "--steps", "2", "--profile-steps", "1-2"], "raise --steps to 3"),
        (["--pp", "2", "--overlap-p2p-comm"], "--overlap-p2p-comm needs --schedule interleaved"),
    ],
)
def test_bad_combination_exits_2_with_one_line(capsys, args, needle):
    start = time.perf_counter()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err
    assert time.perf_counter() - start < 1.0, "validation must not start processes"


def test_overlap_p2p_comm_defaults_as_in_megatrons_training_scripts():
    """On for the interleaved schedule (Megatron's --no-overlap-p2p-communication turns it
    off), off for the others, whose exchanges the trainer always blocks on."""
    interleaved = ["--pp", "2", "--schedule", "interleaved", "--vpp", "2"]
    assert config_from_args(interleaved).overlap_p2p_comm is True
    assert config_from_args([*interleaved, "--no-overlap-p2p-comm"]).overlap_p2p_comm is False
    assert config_from_args(["--pp", "2"]).overlap_p2p_comm is False
    assert config_from_args(["--pp", "2", "--no-overlap-p2p-comm"]).overlap_p2p_comm is False


def test_bad_combination_from_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "instrumented_model.train", "--pp", "2", "--schedule", "interleaved",
         "--vpp", "2", "--microbatches", "3", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_failing_rank_is_reported_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    code = main(["--compute", "sleep", "--pp", "2", "--steps", "1", "--profile-steps", "0-0",
                 "--out", str(blocker / "run")])
    err = capsys.readouterr().err
    assert code == 1
    # whichever rank fails first is named: rank 0 writing run.json, or any rank's profile
    # checking its trace directory at __enter__
    assert err.count("\n") == 1 and re.search(r"rank \d: ", err), err
    assert "NotADirectoryError" in err or f"cannot write {blocker / 'run' / 'traces'}: Not a directory" in err, err


@pytest.mark.slow
def test_run_directory_contents(sleep_runs):
    run = sleep_runs["1f1b"]
    info = json.loads((run / "run.json").read_text())
    assert info["config"]["schedule"] == "1f1b" and info["config"]["compute"] == "sleep"
    assert info["layout"] == {"tp": 1, "cp": 1, "pp": 4, "dp": 1, "order": "tp-cp-dp-pp"}
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["step_time_s"] > 0 for r in rows)
    trace = json.load(gzip.open(run / "traces" / "rank3.json.gz"))
    block = trace["pptrace"]
    assert block["schedule"] == "1f1b" and block["microbatches"] == 8 and block["coords"]["pp"] == 3
    assert block["compute"] == "sleep" and block["fwd_ms"] == 10.0 and block["steps"] == PROFILED
    # sleep mode's known timeline: every pass of every step, its span around its sleeps
    for rank in range(4):
        truth = json.loads((run / "truth" / f"rank{rank}.json").read_text())
        assert truth["pp_rank"] == rank and truth["sleeps_s"] == {"fwd": 0.010, "bwd_input": 0.010, "bwd_weight": 0.010}
        assert sorted(map(int, truth["steps"])) == list(range(STEPS))
        for passes in truth["steps"].values():
            assert Counter(op for op, *_ in passes) == {"fwd": 8, "bwd": 8}
            assert all(end - start >= (0.010 if op == "fwd" else 0.020) * 1e9 for op, _, _, start, end in passes)
