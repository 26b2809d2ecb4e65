"""Pipeline schedule tables (pure functions), checked against the schedules' definitions and
against an event simulation whose makespan must equal each schedule's closed-form theory."""
from __future__ import annotations

from collections import Counter

import pytest

from pptrace.whatif.schedules import (
    interleaved_forward_order,
    num_warmup_microbatches,
    schedule_table,
)


def simulate(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """Makespan of running every stage's schedule_table with per-microbatch-per-stage times
    t_f, t_b (input grad), t_w (weight grad; folded into B unless the table has W entries),
    split evenly over v chunks, zero-cost communication.

    Dependencies are those of the computation itself, independent of any schedule: F of
    virtual stage s needs F of s-1, B of s needs F of s and B of s+1, W needs B. Chunk c of
    stage r is virtual stage c*p + r."""
    tables = [schedule_table(schedule, p, r, m, v) for r in range(p)]
    has_w = any(op == "W" for op, _, _ in tables[0])
    duration = {"F": t_f / v, "B": (t_b if has_w else t_b + t_w) / v, "W": t_w / v}
    finish, clock, position = {}, [0.0] * p, [0] * p
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while position[r] < len(tables[r]):
                op, mb, chunk = tables[r][position[r]]
                stage = chunk * p + r
                deps = []
                if op == "F" and stage > 0:
                    deps.append(("F", stage - 1, mb))
                if op == "B":
                    deps.append(("F", stage, mb))
                    if stage < p * v - 1:
                        deps.append(("B", stage + 1, mb))
                if op == "W":
                    deps.append(("B", stage, mb))
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                finish[(op, stage, mb)] = clock[r] = start + duration[op]
                position[r] += 1
                progressed = True
    assert all(position[r] == len(tables[r]) for r in range(p)), f"{schedule} table deadlocks"
    return max(clock)


def _check_complete(table, m: int, v: int, ops: str) -> None:
    counts = Counter(table)
    assert set(counts.values()) == {1}, "every pass appears exactly once"
    assert set(counts) == {(op, mb, c) for op in ops for mb in range(m) for c in range(v)}
    index = {entry: i for i, entry in enumerate(table)}
    for mb in range(m):
        for c in range(v):
            assert index[("F", mb, c)] < index[("B", mb, c)]
            if "W" in ops:
                assert index[("B", mb, c)] < index[("W", mb, c)]


@pytest.mark.parametrize("r", range(4))
def test_1f1b_table_warmup_steady_cooldown(r):
    p, m = 4, 8
    table = schedule_table("1f1b", p, r, m)
    _check_complete(table, m, 1, "FB")
    ops = [op for op, _, _ in table]
    warmup = p - r - 1
    assert ops[:warmup] == ["F"] * warmup and ops[warmup] == "F" and ops[warmup + 1] == "B"
    # Steady state alternates F, B; the cool-down is the warm-up's backwards.
    assert ops[warmup:warmup + 2 * (m - warmup)] == ["F", "B"] * (m - warmup)
    assert ops[-warmup or len(ops):] == ["B"] * warmup
    # Both microbatch streams run in order.
    assert [mb for op, mb, _ in table if op == "F"] == list(range(m))
    assert [mb for op, mb, _ in table if op == "B"] == list(range(m))
    # In flight (forward done, backward not): never more than p - r (1F1B's memory bound).
    inflight = peak = 0
    for op in ops:
        inflight += 1 if op == "F" else -1
        peak = max(peak, inflight)
    assert peak == p - r


def test_interleaved_table_p2_v2_m4():
    p, v, m = 2, 2, 4
    # Megatron's get_schedule_table: groups of p microbatches, chunk 0 then chunk 1.
    assert interleaved_forward_order(p, m, v) == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)
    ]
    for r in range(p):
        table = schedule_table("interleaved", p, r, m, v)
        _check_complete(table, m, v, "FB")
        warmup = num_warmup_microbatches("interleaved", p, r, m, v)
        assert warmup == 2 * (p - r - 1) + (v - 1) * p
        first_b = next(i for i, (op, _, _) in enumerate(table) if op == "B")
        assert first_b == warmup + 1
        # Backward starts on the last chunk (the loss side) and walks chunks in reverse.
        assert table[first_b] == ("B", 0, v - 1)
    # Stage 1 by hand: 2 warm-up forwards, 6 F/B pairs, 2 cool-down backwards.
    assert schedule_table("interleaved", p, 1, m, v) == [
        ("F", 0, 0), ("F", 1, 0),
        ("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1),
        ("F", 2, 0), ("B", 0, 0), ("F", 3, 0), ("B", 1, 0),
        ("F", 2, 1), ("B", 2, 1), ("F", 3, 1), ("B", 3, 1),
        ("B", 2, 0), ("B", 3, 0),
    ]


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (3, 3)])
def test_zb_h1_table(p, m):
    for r in range(p):
        table = schedule_table("zb-h1", p, r, m)
        _check_complete(table, m, 1, "FBW")
        # F and B keep 1F1B's order; W's are deferred by r backwards.
        assert [e for e in table if e[0] != "W"] == schedule_table("1f1b", p, r, m)
        inflight = peak = 0
        for i, (op, mb, _) in enumerate(table):
            inflight += {"F": 1, "B": 0, "W": -1}[op]
            peak = max(peak, inflight)
            if op == "B" and mb >= r:
                assert table[i + 1] == ("W", mb - r, 0), "W(j) runs right after B(j + r)"
        assert peak <= p, "same peak memory as 1F1B's first stage"
        assert [mb for op, mb, _ in table if op == "W"] == list(range(m))


@pytest.mark.parametrize("p,m", [(4, 8), (2, 4), (4, 4), (8, 16)])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 2.0, 0.0), (10.0, 10.0, 10.0), (2.0, 3.0, 1.0)])
def test_simulated_makespan_matches_theory(p, m, t_f, t_b, t_w):
    full_bwd = t_b + t_w
    ideal = m * (t_f + full_bwd)
    assert simulate("gpipe", p, m, 1, t_f, t_b, t_w) == pytest.approx(ideal + (p - 1) * (t_f + full_bwd))
    assert simulate("1f1b", p, m, 1, t_f, t_b, t_w) == pytest.approx(ideal + (p - 1) * (t_f + full_bwd))
    assert simulate("zb-h1", p, m, 1, t_f, t_b, t_w) == pytest.approx(ideal + (p - 1) * (t_f + t_b - t_w))
    for v in (2, 4):
        if m % p == 0:
            assert simulate("interleaved", p, m, v, t_f, t_b, t_w) == pytest.approx(
                ideal + (p - 1) * (t_f + full_bwd) / v
            )


@pytest.mark.parametrize(
    "args,match",
    [
        (("interleaved", 4, 0, 6, 2), "microbatches % pp"),
        (("1f1b", 4, 0, 8, 2), "interleaved"),
        (("nope", 2, 0, 4, 1), "not one of"),
        (("1f1b", 2, 2, 4, 1), "outside"),
    ],
)
def test_schedule_table_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        schedule_table(*args)
