"""Two-stage interleaved pipelines in plain traces (issue 24, the pp=2 direction ambiguity).

With two stages the next stage and the previous one are the same rank, so the stage order
cannot say whether a message from the last stage to the first is a backward gradient or
an interleaved schedule's forward wrap-around (stage 1's activation into stage 2, the first
rank's second chunk). Where nothing names the direction the passes beside each op do
(pptrace.run.infer.pipeline.directions_of_two_stages): Megatron-Core's interleaved schedule
with record_shapes=True read every rank-1 -> rank-0 message as backward before, 24 forwards
and 16 backwards on rank 0, no schedule and 24 microbatches, with a warning.

Real runs with stages that sleep known times: torch.distributed.pipelining's
Interleaved1F1B on 2 gloo ranks with plain torch.profiler, with and without record_shapes
(compute within 8% of the sleeps, idle within 15 ms of the truth's bracket, no wait booked as
transfer, no warning beyond the record_shapes hint), and Megatron-Core's interleaved schedule
on 2 ranks (tests/run/test_infer.py::test_plain_megatron_core, world 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from pptrace.run import infer
from pptrace.run.build import load_run
from truth_checks import (assert_compute_is_the_sleeps, assert_inside, breakdowns, idle_brackets, passes, sends_per_step,
                          sleeps)

RUN = dict(world=2, microbatches=8, steps=3, profile_steps="1-2", fwd_ms=20, bwd_ms=40, loss_ms=10)
PROFILED = (1, 2)
COMPUTE_SHARE, IDLE_MS = 0.08, 15.0


@dataclass
class Measured:
    mode: str
    run: object
    report: dict
    truth: dict


@pytest.fixture(scope="module", params=["plain", "plain-noshapes"])
def interleaved(request, tmp_path_factory) -> Measured:
    from pipelining_run import load_truth, run
    from pptrace.analysis import analyze

    out = run(tmp_path_factory.mktemp(request.param) / "run", "ScheduleInterleaved1F1B", mode=request.param, **RUN)
    loaded = load_run(out, use_cache=False)
    return Measured(request.param, loaded, analyze(loaded).to_json(), load_truth(out))


@pytest.mark.slow
def test_two_stage_interleaved_pipeline_found_without_warnings(interleaved):
    m = interleaved
    run = m.report["run"]
    assert (run["layout"]["pp"], run["layout"]["dp"], run["vpp"], run["microbatches"]) == (2, 1, 2, 8)
    assert run["schedule"] == "ScheduleInterleaved1F1B"
    for rank in m.report["ranks"]:
        assert rank["coords"]["pp"] == m.truth[rank["rank"]]["pp_rank"]
    hint = [w for w in m.report["warnings"] if infer.NO_PEERS_HINT in w]
    assert len(hint) == (m.mode == "plain-noshapes")
    assert [w for w in m.report["warnings"] if infer.NO_PEERS_HINT not in w] == []


@pytest.mark.slow
def test_two_stage_interleaved_every_message_pairs_and_no_wait_is_transfer(interleaved):
    """4 stages on 2 ranks: each microbatch crosses 3 boundaries each way, rank 1 -> rank 0
    forward once (stage 1 -> 2) and backward twice (3 -> 2, 1 -> 0)."""
    m = interleaved
    pairs = m.run.pairs[m.run.pairs["step"].isin(PROFILED)]
    expected = sends_per_step(m.truth)
    assert expected == 2 * 3 * 8 and len(pairs) == expected * len(PROFILED)
    counts = pairs.groupby(["src", "dst", "direction"]).size().to_dict()
    assert counts == {(0, 1, "fwd"): 32, (0, 1, "bwd"): 16, (1, 0, "fwd"): 16, (1, 0, "bwd"): 32}
    # as test_pipelining's plain runs hold it: a rank-step's transfer below its bubble (a
    # loaded box can stall a send's pick-up by ms; a wait booked as transfer is ~100 ms)
    for key, parts in breakdowns(m.report).items():
        assert parts["pp_transfer"] < parts["pp_bubble"], (key, parts)


@pytest.mark.slow
def test_two_stage_interleaved_compute_is_the_sleeps(interleaved):
    """Within 8% of the sleeps per rank and step (at most what the pass functions and loss
    calls spanned where a busy box stalled them beyond that)."""
    assert_compute_is_the_sleeps(interleaved.report, interleaved.truth, PROFILED, COMPUTE_SHARE)


@pytest.mark.slow
def test_two_stage_interleaved_idle_lies_within_the_idle_time(interleaved):
    assert_inside(idle_brackets(interleaved.report, interleaved.truth, PROFILED, sleeps, passes), "bubble + p2p",
                  tolerance_ms=IDLE_MS)
