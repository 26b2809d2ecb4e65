"""Theory for schedules without a closed form: the schedule's own action order replayed with
free p2p (replay.action_programs). Where a closed form exists the replay must reproduce it,
which is what makes it trustworthy where none exists."""
from __future__ import annotations

import numpy as np
import pytest

from pptrace.vocab import canonical, has_closed_form
from pptrace.schedules.tables import schedule_table, stage_placement
from pptrace.schedules.replay import PipelineTimes, action_programs, simulate

def _orders(schedule: str, p: int, m: int, v: int = 1) -> list:
    """pptrace's own tables as action orders over global stages (looped placement)."""
    ops = {"F": "F", "B": "I" if schedule == "zb-h1" else "B", "W": "W"}
    return [[(ops[op], chunk * p + r, mb) for op, mb, chunk in schedule_table(schedule, p, r, m, v)]
            for r in range(p)]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1)])
@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (4, 4), (8, 16)])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 2.0, 0.0), (10.0, 10.0, 10.0), (2.0, 3.0, 1.0)])
def test_replay_of_an_action_order_gives_the_closed_form(schedule, v, p, m, t_f, t_b, t_w):
    """Every table replayed with only the computation's own dependencies (a pass's input
    arrives when its producer ends: eager sends, no latency): the closed forms, t_b being
    the input grad and t_w the weight grad (folded into B outside ZB-H1). So the tables are
    the schedules and the replay is their theory; a table that deadlocked would raise."""
    times = PipelineTimes.uniform(p, m, t_f, t_b, t_w)
    progs = action_programs(_orders(schedule, p, m, v), stage_placement(schedule, p, v))
    timeline = simulate(schedule, times, v, sends="eager", programs=progs)
    expected = (p - 1) * (t_f + t_b - t_w) if schedule == "zb-h1" else (p - 1) * (t_f + t_b + t_w) / v
    assert timeline.makespan_s == pytest.approx(m * (t_f + t_b + t_w) + expected)
    bubble = timeline.makespan_s - timeline.stages["compute_s"].to_numpy()
    assert bubble == pytest.approx(np.full(p, expected), abs=1e-9)


def test_v_placement_hands_the_turn_over_locally():
    """A V schedule's stages p-1 and p share a rank: no message between them. Forward of
    one microbatch on p=2, v=2 (stages 0,1,2,3 on ranks 0,1,1,0) takes 4 t_f end to end."""
    p, t_f = 2, 0.010
    placement = stage_placement("ScheduleZBVZeroBubble", p, 2)
    assert placement == [0, 1, 1, 0]
    orders = [[("F", 0, 0), ("F", 3, 0)], [("F", 1, 0), ("F", 2, 0)]]
    progs = action_programs(orders, placement)
    assert sum(op.kind == "comm" for op in progs[1]) == 2  # recv from 0, send to 0; none for 1 -> 2
    times = PipelineTimes.uniform(p, 1, 2 * t_f, 0.0)  # a chunk pass is 1/v of the stage's forward
    assert simulate("ScheduleZBVZeroBubble", times, 2, sends="eager", programs=progs).makespan_s == pytest.approx(4 * t_f)


def test_names_with_and_without_closed_forms():
    assert canonical("Schedule1F1B") == "1f1b" and has_closed_form("ScheduleGPipe")
    for name in ("ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
                 "ScheduleDualPipeV", "ScheduleInterleaved1F1B", None):
        assert not has_closed_form(name)
    assert stage_placement("ScheduleLoopedBFS", 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_bad_action_is_an_error():
    with pytest.raises(ValueError, match="bad action"):
        action_programs([[("X", 0, 0)]], [0])
