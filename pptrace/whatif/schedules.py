"""The order in which one pipeline stage runs its forward (F), backward (B) and weight-grad (W)
passes, as pure functions of (schedule, p, r, m, v). The reference trainer's executing
schedules (``instrumented_model/pipeline_parallel.py``) follow these tables, the what-if
simulator replays them, and the tests compare traced order with them. They live in pptrace,
not in the trainer, so that analysing a run never needs the trainer package.

Notation: p pipeline stages, r this stage, m microbatches, v virtual chunks per stage.
Entries are ``(op, microbatch, chunk)``; op "B" is the whole backward except in ZB-H1,
where "B" is the input gradient and "W" the weight gradient.
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
#: Other trainers' names for schedules whose order is one of the tables below, so that their
#: closed forms hold (torch.distributed.pipelining's class names).
ALIASES = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}
#: torch.distributed.pipelining schedules that place a rank's two stages in a V (stage s on
#: rank s, stage 2p-1-s on rank s too); every other multi-stage schedule loops (s on s % p).
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
#: Ops of an action order: forward, whole backward, input grad, weight grad, and the post of
#: the send of a stage's activation (SF) or input gradient (SB), where an order places them
#: itself (torch's runtime schedules post a send after a later pass: DualPipeV's overlapped
#: F;B sends the forward's output once the backward is done too).
ACTION_OPS = ("F", "B", "I", "W", "SF", "SB")


def canonical(schedule: str | None) -> str | None:
    """pptrace's name for a schedule whose order it knows, else the name as given."""
    return ALIASES.get(schedule, schedule) if schedule else schedule


def has_closed_form(schedule: str | None) -> bool:
    return canonical(schedule) in SCHEDULES


def stage_placement(schedule: str | None, p: int, v: int) -> list[int]:
    """Global stage index (0 .. p*v-1) -> pipeline position (the rank's pp coordinate)."""
    if v == 2 and schedule in V_SCHEDULES:
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def _check(schedule: str, p: int, r: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p} m={m} v={v}")
    if not 0 <= r < p:
        raise ValueError(f"stage r={r} outside 0..{p - 1}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"v={v} > 1 needs schedule 'interleaved', got {schedule!r}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"interleaved needs microbatches % pp == 0, got m={m} p={p}")


def num_warmup_microbatches(schedule: str, p: int, r: int, m: int, v: int = 1) -> int:
    """Forwards run before the first backward (for interleaved: counted in (mb, chunk) units)."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        # Megatron: 2(p-r-1) + (v-1)*g with group size g = p, capped at m*v.
        return min(2 * (p - r - 1) + (v - 1) * p, m * v)
    return min(p - r - 1, m)


def interleaved_forward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward: groups of p microbatches, chunk 0 over the
    group, then chunk 1, ... (Megatron's get_schedule_table)."""
    order = []
    for group_start in range(0, m, p):
        for chunk in range(v):
            order.extend((mb, chunk) for mb in range(group_start, group_start + p))
    return order


def interleaved_backward_order(p: int, m: int, v: int) -> list[tuple[int, int]]:
    # Backward walks the chunks in reverse: the k-th backward uses chunk v-1-c.
    return [(mb, v - 1 - c) for mb, c in interleaved_forward_order(p, m, v)]


def zb_h1_deferred_w(r: int) -> int:
    """ZB-H1 (Qi et al. 2023): stage r runs W(j) right after B(j + r), so later stages keep
    more weight grads pending, every stage holds at most p microbatches (same peak memory as
    1F1B's stage 0), and the deferred W's fill the cool-down bubble. Simulated with any
    t_w <= t_f this order gives the paper's bubble (p-1)(t_f+t_b-t_w)."""
    return r


def schedule_table(schedule: str, p: int, r: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Execution order on stage r: list of ("F"|"B"|"W", microbatch, chunk)."""
    _check(schedule, p, r, m, v)
    if schedule == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    if schedule == "interleaved":
        total = m * v
        w = num_warmup_microbatches(schedule, p, r, m, v)
        fwd, bwd = interleaved_forward_order(p, m, v), interleaved_backward_order(p, m, v)
        table = [("F", *fwd[k], ) for k in range(w)]
        for k in range(total - w):
            table += [("F", *fwd[w + k]), ("B", *bwd[k])]
        table += [("B", *bwd[k]) for k in range(total - w, total)]
        return table
    # 1F1B (and ZB-H1's order of F and B): warm-up, steady 1F1B, cool-down.
    w = num_warmup_microbatches(schedule, p, r, m)
    table = [("F", j, 0) for j in range(w)]
    for j in range(m - w):
        table += [("F", w + j, 0), ("B", j, 0)]
    table += [("B", j, 0) for j in range(m - w, m)]
    if schedule == "1f1b":
        return table
    delay = zb_h1_deferred_w(r)
    with_w = []
    for entry in table:
        with_w.append(entry)
        if entry[0] == "B" and entry[1] >= delay:
            with_w.append(("W", entry[1] - delay, 0))
    with_w += [("W", j, 0) for j in range(max(m - delay, 0), m)]
    return with_w
