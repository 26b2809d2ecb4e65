"""The analysis on real runs of the reference trainer (4 gloo processes, sleep mode: the
shared runs of tests/sleep_runs.py), whose ground truth is set by the flags: p=4 stages, m=8
microbatches, forward 10 ms, backward 20 ms per microbatch per stage, so 1F1B's bubble is
(p-1)(t_f+t_b) = 90 ms per stage.

Sleep mode keeps 4 processes cheap on 2 cores (they sleep). p2p latency on the critical
path adds real bubble on top of the closed forms; the analysis separates it
(``bubble_latency_s``) from the schedule's own bubble (``bubble_schedule_s``, what a replay of
the step with free p2p leaves idle), and the latter is held to the issue's 10%.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import orjson
import pytest

import box
from sleep_runs import DELAY_S, DELAYED_RANK, M, P, PROFILED, T_F
from truth_checks import Bracket, assert_inside, schedule_part_misses

pytestmark = pytest.mark.slow

T_B = 0.020  # the whole backward (input and weight grad) of a microbatch on a stage
SLEEP_RUNS = ("1f1b", "interleaved", "zb-h1", "delay")
CP_MODEL = ["--cp", "2", "--compute", "model", "--layers", "2", "--hidden", "128", "--heads", "4",
            "--seq-len", "512", "--micro-batch-size", "2", "--microbatches", "1", "--steps", "3",
            "--profile-steps", "1-2"]
RUNS = {"cp_overlap": CP_MODEL, "cp_no_overlap": [*CP_MODEL, "--no-cp-overlap"]}


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory, sleep_run):
    """name -> (Run, report, run directory); each trainer run happens once per session, on
    first use (the sleep-mode ones are the suite's shared runs)."""
    if importlib.util.find_spec("instrumented_model.train") is None:
        pytest.skip("instrumented_model.train does not exist yet")
    from pptrace.export.report import build_report
    from pptrace.run.build import load_run

    cache = {}

    def get(name):
        if name not in cache:
            if name in SLEEP_RUNS:
                out = sleep_run(name)
            else:
                out = tmp_path_factory.mktemp(name)
                with box.alone():
                    proc = subprocess.run([sys.executable, "-m", "instrumented_model.train", *RUNS[name], "--out",
                                           str(out)], capture_output=True, text=True, timeout=300)
                assert proc.returncode == 0, proc.stderr[-2000:]
            run = load_run(out)
            cache[name] = (run, build_report(run), out)
        return cache[name]

    return get


KIND = {"fwd": "F", "bwd": "B", "bwd_input": "B", "bwd_weight": "W"}  # truth op -> replay op


def _truth_replay(run, report, out, step: int) -> tuple[list, float]:
    """(per stage its bubble in a zero-latency replay (eager sends, as the analysis' own split)
    of the trainer's schedule with every pass as long as the trainer timed it in ``step``
    (truth/rank{r}.json): makespan - that stage's passes; the largest sum over a stage's
    passes of |the trainer's span - pptrace's range|, the most the replay can move by)."""
    import dataclasses

    import pandas as pd

    from pptrace.schedules.replay import PipelineTimes, simulate, stage_program

    truths = {t["pp_rank"]: t for t in (orjson.loads(f.read_bytes()) for f in (out / "truth").glob("rank*.json"))}
    schedule, v = report["run"]["schedule"], report["run"]["vpp"] or 1
    overlap = orjson.loads((out / "run.json").read_bytes())["config"]["overlap_p2p_comm"]
    programs = []
    for pos in range(P):
        own = {(KIND[op], mb, chunk): (end - start) / 1e9 for op, mb, chunk, start, end in truths[pos]["steps"][str(step)]}
        programs.append([dataclasses.replace(o, duration=own[o.kind, o.mb, o.chunk]) if o.kind in ("F", "B", "W") else o
                         for o in stage_program(schedule, P, pos, M, v, overlap)])
    timeline = simulate(schedule, PipelineTimes.uniform(P, M, 0.0, 0.0), v, sends="eager", programs=programs)
    ev = run.events
    compute = ev[(ev["category"] == "compute") & (ev["step"] == step) & ev["op"].isin(list(KIND)) & ev["mb"].notna()]
    traced = {(int(r), str(o), int(b), 0 if pd.isna(c) else int(c)): d / 1e9
              for r, o, b, c, d in zip(compute["rank"], compute["op"], compute["mb"], compute["chunk"], compute["dur_ns"])}
    gaps = [sum(abs((end - start) / 1e9 - traced[key]) for op, mb, chunk, start, end in t["steps"][str(step)]
                if (key := (t["rank"], op, mb, chunk)) in traced) for t in truths.values()]
    return (timeline.makespan_s - timeline.stages["compute_s"]).tolist(), max(gaps)


def _general_theory(report) -> tuple[list, float]:
    """(per stage the theory's bubble from the report's own per-stage pass times, by the
    closed forms of analyzers/bubble.py's docstring: a step lasts m rounds of the slowest
    stage plus one fill/drain of the others, step - m T_stage with T = t_f + t_b; the most
    that stages unequal by T_max - T_min can move a stage's theory off the textbook form:
    (m + p - 1)(T_max - T_min))."""
    stages = [_stage(report, k) for k in range(P)]
    schedule, v = report["run"]["schedule"], report["run"]["vpp"] or 1
    t = np.array([st["t_fwd_s"] + st["t_bwd_s"] for st in stages])
    w = np.array([st["t_wgrad_s"] for st in stages])
    short = t - 2 * w if schedule == "zb-h1" else t
    fill = (short.sum() - short.max()) / (v if schedule == "interleaved" else 1)
    spread = max(float(t.max() - t.min()), float(short.max() - short.min()))
    return [float(M * t.max() + fill - M * tk) for tk in t], (M + P - 1) * spread


def _check_bubbles(run, report, out, closed_form) -> None:
    """Per stage, the issue's criterion: the bubble the schedule causes is within 10% of what
    the schedule makes of the step's own passes. The closed forms assume free p2p; here a
    gloo hop costs ~0.5 ms (2 cores) and the critical path crosses ~2(m+p-1) of them, which
    every stage idles through too: the analysis reports that part of the bubble as
    ``bubble_latency_s``, by replaying the step in its measured order with free p2p (exact on
    simulated schedules, tests/analyzers/test_bubble_split.py), and the rest, ``bubble_schedule_s``, is
    held per step to the truth's free-p2p replay of the same step (the passes as the trainer
    timed them: on a busy box they jitter by a few ms, which the 30 ms bubble of ZB-H1 feels),
    within 10% + TOLERANCE_MS, widened by twice the gap between the trainer's spans and
    pptrace's ranges of the same passes, and no more than the stage's bubble (time moving
    data is none).
    The whole bubble is at least the theory. The theory is the report's ``theory_bubble_s``:
    the closed form of all stages' median passes (a slightly slower stage paces every round,
    m T_max: on a busy box one stage 1.5 ms slower puts interleaved's 48 ms 30% higher), at
    least the textbook ``closed_form`` of the stage's own times.
    """
    replays = {step: _truth_replay(run, report, out, step) for step in report["run"]["steps"]}
    general, imbalance = _general_theory(report)
    for stage in range(P):
        s = _stage(report, stage)
        theory = s["theory_bubble_s"]
        # the rounds are paced by the slowest stage; equal stages give the textbook form
        assert theory == pytest.approx(general[stage], abs=1e-6)
        assert abs(theory - closed_form(s)) <= imbalance + 1e-6, (stage, theory, closed_form(s), imbalance)
        bubble = float(np.median([x["bubble_s"] for x in s["steps"]]))
        assert bubble >= 0.95 * theory, f"stage {stage}: bubble {bubble * 1e3:.1f} ms, theory {theory * 1e3:.1f} ms"
    misses = schedule_part_misses(report["pipeline"]["stages"], replays)
    assert not misses, f"(stage, step) -> (schedule part ms, truth replay ms, span gap ms): {misses}"


def _stage(report, stage):
    return next(s for s in report["pipeline"]["stages"] if s["stage"] == stage)


#: The trace's µs timestamps against the truth's ns, on a sum of a microbatch's passes.
PASS_TOLERANCE_MS = 0.25
PASS_OPS = {"t_fwd_s": ("fwd",), "t_bwd_s": ("bwd", "bwd_input", "bwd_weight"), "t_wgrad_s": ("bwd_weight",)}


def _pass_bracket(report, out, stage: int, key: str) -> Bracket:
    """The stage's per-microbatch pass time ``key`` (t_fwd_s, t_bwd_s, t_wgrad_s: a median over
    (step, mb) of a microbatch's passes summed over chunks) against the trainer's sleep-mode
    truth (truth/rank{r}.json): at least the sleeps, at most the same median of the passes'
    spans the trainer timed around each region."""
    import pandas as pd

    ops = PASS_OPS[key]
    truths = [orjson.loads(f.read_bytes()) for f in sorted((out / "truth").glob("rank*.json"))]
    mine = [t for t in truths if t["pp_rank"] == stage]
    spans = pd.DataFrame([(t["rank"], int(step), op, mb, (end - start) / 1e9)
                          for t in mine for step, passes in t["steps"].items() if int(step) in report["run"]["steps"]
                          for op, mb, _, start, end in passes if op in ops],
                         columns=["rank", "step", "op", "mb", "seconds"])
    sleeps = mine[0]["sleeps_s"]
    least = sum(sleeps[op] for op in ("bwd_input", "bwd_weight") if op in ops) + (sleeps["fwd"] if "fwd" in ops else 0)
    most = float(spans.groupby(["rank", "step", "mb"])["seconds"].sum().median())
    return Bracket(_stage(report, stage)[key], least, most)


def _pass_slowdown(out, rank: int, steps) -> float:
    """The median over ``steps`` of ``rank``'s pass time over the median other rank's, less
    one: the truth of a compute straggler's slowdown (the trainer times every pass)."""
    truths = [orjson.loads(f.read_bytes()) for f in sorted((out / "truth").glob("rank*.json"))]
    per_step = []
    for step in steps:
        busy = {t["rank"]: sum(end - start for *_, start, end in t["steps"][str(step)]) for t in truths}
        others = np.median([s for r, s in busy.items() if r != rank])
        per_step.append(busy[rank] / others - 1)
    return float(np.median(per_step))


def _check_passes(report, out, keys=("t_fwd_s", "t_bwd_s")) -> None:
    assert (out / "truth").is_dir(), "sleep mode wrote no truth"
    assert_inside({(stage, key): _pass_bracket(report, out, stage, key) for stage in range(P) for key in keys},
                  "per-microbatch pass times", PASS_TOLERANCE_MS)


def _stage_bubbles(report) -> np.ndarray:
    """Per stage, the median over profiled steps of the stage's pp_bubble (a median because a
    loaded box now and then stalls a step)."""
    out = []
    for stage in range(P):
        ranks = [r for r in report["ranks"] if r["coords"]["pp"] == stage]
        out.append(np.median([s["breakdown_s"]["pp_bubble"] for r in ranks for s in r["steps"]]))
    return np.asarray(out)


def test_1f1b_bubble_matches_theory(trainer_run):
    run, report, _ = trainer_run("1f1b")
    assert report["run"]["schedule"] == "1f1b" and report["run"]["microbatches"] == M
    # measured per-microbatch times are the sleeps and what the pass did around them
    _check_passes(report, trainer_run("1f1b")[2])
    for stage in range(P):
        s = _stage(report, stage)
        assert s["theory_bubble_balanced_s"] == pytest.approx((P - 1) * (s["t_fwd_s"] + s["t_bwd_s"]))
    _check_bubbles(run, report, trainer_run("1f1b")[2], lambda s: (P - 1) * (s["t_fwd_s"] + s["t_bwd_s"]))


def test_partition_sums_to_step_time(trainer_run):
    _, report, out = trainer_run("1f1b")
    metrics = {m["step"]: m["step_time_s"] for m in map(orjson.loads, (out / "metrics.jsonl").read_bytes().splitlines())}
    for rank in report["ranks"]:
        assert [s["step"] for s in rank["steps"]] == report["run"]["steps"] == PROFILED
        for step in rank["steps"]:
            assert sum(step["breakdown_s"].values()) == pytest.approx(step["time_s"], rel=1e-9)
            # the profiled step is the trainer's own step (rank 0 times it between prof.step()s)
            assert step["time_s"] == pytest.approx(metrics[step["step"]], rel=0.05)
            assert step["breakdown_s"]["compute"] >= M * (T_F + T_B) * 0.98


def test_interleaved_bubble_matches_theory(trainer_run):
    run, report, out = trainer_run("interleaved")
    assert report["run"]["vpp"] == 2
    assert orjson.loads((out / "run.json").read_bytes())["config"]["overlap_p2p_comm"] is True
    for stage in range(P):
        s = _stage(report, stage)
        assert [c["chunk"] for c in s["chunks"]] == [0, 1]
        # t_f is the whole stage (both chunks) per microbatch
        assert s["t_fwd_s"] == pytest.approx(sum(c["t_fwd_s"] for c in s["chunks"]), rel=0.25)
    _check_passes(report, out)
    _check_bubbles(run, report, out, lambda s: (P - 1) * (s["t_fwd_s"] + s["t_bwd_s"]) / 2)


def test_zb_h1_bubble_matches_theory(trainer_run):
    run, report, out = trainer_run("zb-h1")
    _check_passes(report, out, ("t_fwd_s", "t_bwd_s", "t_wgrad_s"))
    # Qi et al.: (p-1)(T_F + T_B - T_W) with T_B the input gradient alone (t_bwd_s holds B + W)
    # Delayed by latency, some W passes (placed to fill a latency-free bubble) hold up a late
    # message; the free-p2p replay puts them back, so that delay counts as latency.
    _check_bubbles(run, report, out, lambda s: (P - 1) * (s["t_fwd_s"] + (s["t_bwd_s"] - s["t_wgrad_s"]) - s["t_wgrad_s"]))


def test_delay_names_the_straggler_and_moves_bubble_to_the_others(trainer_run):
    """Rank 2 (stage 2) sleeps 5 ms more per forward. Every microbatch round is then paced
    by it, so the other stages wait m x 5 ms more, while its own extra time is compute.
    Compared within the run, so a loaded box slows both sides alike."""
    _, slow, out = trainer_run("delay")
    top = slow["stragglers"][0]
    assert top["rank"] == DELAYED_RANK and top["metric"] == "compute"
    assert top["cost_s"] == pytest.approx(M * DELAY_S, rel=0.3)
    # its slowdown is that of the passes it ran, as the trainer timed them (a loaded box
    # stretches every rank's passes beyond their sleeps: not a fixed 5 / (10 + 20))
    assert top["slowdown"] == pytest.approx(_pass_slowdown(out, DELAYED_RANK, slow["run"]["steps"]), rel=0.3)
    bubbles = _stage_bubbles(slow)
    others = np.delete(bubbles, DELAYED_RANK)
    # the others' bubble exceeds the straggler's by about m x delay ...
    assert others.mean() - bubbles[DELAYED_RANK] == pytest.approx(M * DELAY_S, rel=0.5), bubbles
    # ... while the straggler's own bubble stays that of a balanced pipeline of its speed
    fwd = _pass_bracket(slow, out, DELAYED_RANK, "t_fwd_s")
    assert_inside({DELAYED_RANK: fwd}, "the straggler's forward", PASS_TOLERANCE_MS)
    assert fwd.lo == pytest.approx(T_F + DELAY_S)
    # and the generalised theory (slowest stage paces the rounds) predicts the same split
    theory = [_stage(slow, k)["theory_bubble_s"] for k in range(P)]
    assert np.mean(np.delete(theory, DELAYED_RANK)) - theory[DELAYED_RANK] == pytest.approx(M * DELAY_S, rel=0.3)


def _cp_forward_split(run, report):
    """(hidden, exposed) seconds of CP communication inside forward ranges, all ranks and
    steps: the ring overlaps only the forward's K/V exchange (its backward is blocking)."""
    from pptrace.timeline.activity import rank_activity
    from pptrace.timeline.intervals import union

    hidden = exposed = 0
    for rank, ev in run.events.groupby("rank", observed=True):
        act = rank_activity(ev, int(rank), run.layout)
        fwd = ev[(ev["category"] == "compute") & (ev["op"] == "fwd") & ev["step"].isin(report["run"]["steps"])]
        window = union(fwd["start_ns"].to_numpy(), fwd["end_ns"].to_numpy())
        cp = act.comm["cp"] & window
        hidden += (cp & act.compute).total
        exposed += (cp - act.compute).total
    return hidden / 1e9, exposed / 1e9


def test_cp_ring_overlap_hidden_vs_exposed(trainer_run):
    run_o, rep_o, _ = trainer_run("cp_overlap")
    run_n, rep_n, _ = trainer_run("cp_no_overlap")
    h_o, e_o = _cp_forward_split(run_o, rep_o)
    h_n, e_n = _cp_forward_split(run_n, rep_n)
    # overlapped: the exchange runs under the attention of the block in hand
    assert h_o > e_o, (h_o, e_o)
    # not overlapped: posted and waited before the compute, so nothing hides it
    assert h_n < 0.1 * (h_n + e_n), (h_n, e_n)
    mean = lambda rep, key: np.mean([r["mean"]["hidden_s" if key == "h" else "breakdown_s"]["cp" if key == "h" else "cp_exposed"]
                                     for r in rep["ranks"]])
    assert mean(rep_o, "h") > 5 * mean(rep_n, "h")
    assert any(c["dim"] == "cp" and c["ops"].get("send_kv") for c in rep_o["collectives"])
