"""The bubble's split into the schedule's own part and the part owed to p2p latency, on
traces whose every time is known: the simulator runs a balanced schedule with a fixed
latency per message, and its timeline is written as per-rank torch.profiler traces (whole
µs, the trainer's range names and tags), loaded and analysed like a real run.

Ground truth: a balanced pipeline with free p2p idles exactly the closed form on every
stage; latency lengthens the step and every stage idles that much more. So the schedule
part must equal the closed form to the microsecond, whatever the latency.
"""
from __future__ import annotations

import numpy as np
import pytest

from pptrace.analyzers.partition import partition_run
from pptrace.analyzers.p2p import match_pairs
from pptrace.analyzers.bubble import balanced_theory_bubble, bubble_split, pipeline_stages
from pptrace.schedules.replay import PipelineTimes, simulate, stage_program
from pptrace.topology import Layout

from tracegen import run_from_docs, trace_doc

P, M = 4, 8
T_F, T_B, T_W = 10_000, 20_000, 10_000  # µs


def _msg_name(msg) -> str:
    op = ("send_" if msg.is_send else "recv_") + msg.direction
    peer = msg.dst if msg.is_send else msg.src
    return f"pp:{op} peer={peer} mb={msg.mb}"


def _ranges(schedule: str, stage: int, v: int, timeline, overlap: bool = False) -> list:
    """The stage's ranges in µs: its passes and, per exchange, one range per message from
    posting to completion (the trainer's regions), passes run between posting and waiting
    (ZB-H1's W's, overlap_p2p_comm) nested inside."""
    chunked = (lambda name, chunk: f"{name} chunk={chunk}") if v > 1 else (lambda name, chunk: name)
    rows = timeline.ops[timeline.ops["stage"] == stage].itertuples()
    names = {"F": "compute:fwd", "B": "compute:bwd_input" if schedule == "zb-h1" else "compute:bwd",
             "W": "compute:bwd_weight"}
    out, posted = [], {}  # handle -> (messages, where their ranges go in ``out``)
    for op in stage_program(schedule, P, stage, M, v, overlap):
        if op.kind == "post":  # its ranges open here; the passes that follow nest inside them
            posted[op.handle] = (op.msgs, len(out))
            continue
        row = next(rows)
        start, end = round(row.start_s * 1e6), round(row.end_s * 1e6)
        if op.kind in names:
            out.append((chunked(f"{names[op.kind]} mb={op.mb}", op.chunk), start, end))
        else:
            msgs, at = (op.msgs, len(out)) if op.kind == "comm" else posted.pop(op.handle)
            out[at:at] = [(chunked(_msg_name(msg), msg.chunk), start, end) for msg in msgs]
            for handle, (other, where) in posted.items():  # still-open ranges sit after them
                posted[handle] = (other, where + len(msgs) if where >= at else where)
    return out


def _run(tmp_path, schedule: str, v: int, latency_us: int, label: str | None = None):
    overlap = schedule == "interleaved-overlap"
    schedule = "interleaved" if overlap else schedule
    wgrad = T_W if schedule == "zb-h1" else 0
    times = PipelineTimes.uniform(P, M, T_F / 1e6, (T_B - wgrad) / 1e6, wgrad / 1e6, latency_s=latency_us / 1e6)
    timeline = simulate(schedule, times, vpp=v, overlap_p2p_comm=overlap)
    end = round(timeline.makespan_s * 1e6) + 10
    layout = Layout(pp=P)
    traces = {s: trace_doc(s, P, [("ProfilerStep#1", 0, end), *_ranges(schedule, s, v, timeline, overlap)], layout=layout)
              for s in range(P)}
    run = run_from_docs(tmp_path, traces, layout, schedule=label or schedule, microbatches=M, vpp=v)
    pairs, unmatched = match_pairs(run)
    assert unmatched.empty
    partitions = partition_run(run)
    latency = bubble_split(run, partitions, pairs)
    stages, _ = pipeline_stages(run, partitions, latency)
    return stages, timeline, pairs


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved-overlap", 2)]


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("latency_us", [0, 500, 2000])
def test_partition_matches_the_simulated_schedule(tmp_path, schedule, v, latency_us):
    """The simulator's ground truth per stage: compute, transfer (blocked after every message
    of the exchange had both sides posted) and bubble (the rest of the step), to the µs. In
    a combined exchange an early-matched message does not make the wait for the others
    transfer."""
    stages, timeline, pairs = _run(tmp_path, schedule, v, latency_us)
    truth = timeline.stages.set_index("stage")
    for s in stages.itertuples():
        assert round(s.bubble_s * 1e6) == round(truth.loc[s.stage, "bubble_s"] * 1e6), s.stage
    # every message moved for exactly the latency, however long its exchange waited for others
    transfer_us = np.round(pairs["transfer_ns"] / 1000).astype(int)
    if schedule not in ("zb-h1", "interleaved-overlap"):
        assert set(transfer_us) == {latency_us}
    else:
        # A pass runs between posting and waiting (ZB-H1's W, overlap_p2p_comm): what moved
        # during the pass was hidden, only the rest of the latency is exposed transfer.
        assert (transfer_us <= latency_us).all() and transfer_us.max() == latency_us


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("latency_us", [0, 500, 2000])
def test_schedule_bubble_is_the_closed_form_whatever_the_latency(tmp_path, schedule, v, latency_us):
    stages, timeline, _ = _run(tmp_path, schedule, v, latency_us)
    theory_us = balanced_theory_bubble(schedule.removesuffix("-overlap"), P, v, T_F + T_B, T_W if schedule == "zb-h1" else 0)
    makespan_us = round(timeline.makespan_s * 1e6)
    assert (makespan_us == M * (T_F + T_B) + theory_us) == (latency_us == 0)
    for s in stages.itertuples():
        bubble, schedule_part, latency_part = (round(x * 1e6) for x in (s.bubble_s, s.bubble_schedule_s, s.bubble_latency_s))
        assert schedule_part + latency_part == bubble
        if latency_us == 0:
            assert latency_part == 0 and bubble == theory_us
        else:
            # ZB-H1 too: delayed by latency, some W passes (placed to fill a latency-free
            # bubble) hold up a late message; the replay puts them back, so that is latency.
            # A stage whose own transfers exceed the latency on the critical path moved data
            # in part of its schedule slack: that part is transfer, not bubble.
            assert schedule_part == min(bubble, theory_us), s.stage
    assert (stages["bubble_latency_s"] > 0).any() == (latency_us > 0)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_theory_without_a_closed_form_replays_the_measured_order(tmp_path, schedule, v):
    """A schedule pptrace has no formula for (here: the same runs under a name it does not
    know) gets its theory from its own measured order replayed with free p2p: on these
    balanced runs, the closed form to the µs, and never another schedule's formula."""
    stages, _, _ = _run(tmp_path, schedule, v, 500, label="MyOwnSchedule")
    theory_us = balanced_theory_bubble(schedule.removesuffix("-overlap"), P, v, T_F + T_B, T_W if schedule == "zb-h1" else 0)
    assert [round(b * 1e6) for b in stages["theory_bubble_s"]] == [theory_us] * P


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_whatif_replays_a_schedule_without_a_table_from_its_own_order(tmp_path, schedule, v):
    """What-if on a run whose schedule pptrace has no table for: the replay follows the
    measured order; with free p2p it reproduces the measured step, and changing the
    microbatch count without naming a schedule is refused (the order is known for m only)."""
    import gzip

    import orjson

    from pptrace import load_run
    from pptrace.whatif.predict import whatif

    wgrad = T_W if schedule == "zb-h1" else 0
    times = PipelineTimes.uniform(P, M, T_F / 1e6, (T_B - wgrad) / 1e6, wgrad / 1e6)
    timeline = simulate(schedule, times, vpp=v)
    end = round(timeline.makespan_s * 1e6)
    layout = Layout(pp=P)
    for s in range(P):
        doc = trace_doc(s, P, [("ProfilerStep#1", 0, end), *_ranges(schedule, s, v, timeline)], layout=layout)
        doc["pptrace"].update(schedule="MyOwnSchedule", vpp=v)
        doc = {"pptrace": doc.pop("pptrace"), **doc}  # where Kineto writes it: before the events
        path = tmp_path / "traces" / f"rank{s}.json.gz"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(gzip.compress(orjson.dumps(doc)))
    run = load_run(tmp_path, progress=False)
    result = whatif(run, replications=1)
    assert result["measured"]["microbatches"] == M
    assert abs(result["replay"]["error_fraction"]) < 0.01
    with pytest.raises(ValueError, match="no table"):
        whatif(run, microbatches=2 * M, replications=1)
    assert whatif(run, schedule="1f1b", microbatches=2 * M, replications=1)["predicted"]["step_time_s"] > 0
