"""Pipeline schedule tables (pure functions), checked against the schedules' definitions, and
the trainer's interleaved schedule against the program the simulator replays. That the tables
give each schedule's closed-form theory is tests/schedules/test_theory_replay.py (the replay engine run
with the computation's own dependencies only)."""
from __future__ import annotations

from collections import Counter

import pytest

from pptrace.schedules.tables import (
    interleaved_forward_order,
    num_warmup_microbatches,
    schedule_table,
)


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


_DIRECTION = {"send_next": ("fwd", True), "send_prev": ("bwd", True),
              "recv_prev": ("fwd", False), "recv_next": ("bwd", False)}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 4)])
def test_trainer_executes_the_simulators_interleaved_program(monkeypatch, p, m, v, overlap):
    """One rule for Megatron's interleaved schedule: the trainer, its p2p replaced by a
    recorder, posts and waits the simulator's messages (direction, mb, consuming chunk)
    around the simulator's passes, each pass gets the tensor its message brought, and each
    send carries the output of the pass that made it."""
    pytest.importorskip("torch")
    from instrumented_model import pp_communications
    from instrumented_model.pipeline_parallel import PipelineRun, get_forward_backward_func
    from pptrace.schedules.replay import stage_program

    for r in range(p):
        traced = []

        def post(ctx, **directions):
            posted = {k: msg for k, msg in directions.items() if msg is not None}
            for k, msg in posted.items():  # a send carries what its pass made, of the same mb
                produced = {"send_next": "output", "send_prev": "input_grad"}.get(k)
                assert produced is None or msg.tensor[:2] == (produced, msg.mb), (k, msg)
            traced.append(("post", {(*_DIRECTION[k], msg.mb, msg.chunk) for k, msg in posted.items()}))
            at = len(traced) - 1

            class Posted:
                def wait(self):
                    traced.append(("wait", at))
                    got = {k: ("input" if k == "recv_prev" else "grad", msg.mb, msg.chunk) for k, msg in posted.items()}
                    return got.get("recv_prev"), got.get("recv_next")
            return Posted()

        class Recorder:
            def forward(self, mb, chunk, x):
                assert x == (None if r == 0 and chunk == 0 else ("input", mb, chunk))
                traced.append(("F", mb, chunk))
                return ("output", mb, chunk)

            def backward(self, mb, chunk, grad):
                assert grad == (None if r == p - 1 and chunk == v - 1 else ("grad", mb, chunk))
                traced.append(("B", mb, chunk))
                return ("input_grad", mb, chunk)

        monkeypatch.setattr(pp_communications, "post", post)
        get_forward_backward_func("interleaved", p, v)(PipelineRun(Recorder(), None, m, r, p, v, overlap))
        expected, opened = [], {}
        for op in stage_program("interleaved", p, r, m, v, overlap):
            if op.kind in ("comm", "post"):
                expected.append(("post", {(msg.direction, msg.is_send, msg.mb, msg.chunk) for msg in op.msgs}))
                opened[op.handle] = len(expected) - 1
            if op.kind in ("comm", "wait"):
                expected.append(("wait", opened.pop(op.handle)))
            elif op.kind != "post":
                expected.append((op.kind, op.mb, op.chunk))
        assert traced == expected, r
