"""The latency-free replay of measured steps (timeline/programs.py ``latency_free_lengths``), all
ranks and steps at once, against the event engine (schedules/replay.py ``replay``) run on
each step's programs built one rank at a time, as the bubble split used to: random steps
of random ranges, passes and other compute (an optimizer: replayed, yet the step's window
ends at its last pass), p2p ops nested or not, matched pairs inside a step, across steps,
to senders never replayed, and deadlocks (which both leave out)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from pptrace.schedules.replay import Msg, Op, replay
from pptrace.timeline.programs import latency_free_lengths


def _engine_ends(events: pd.DataFrame, pairs: pd.DataFrame, windows: dict) -> dict:
    """The reference: per step, each rank's program as a list of Ops, replayed by the engine;
    the step ends where its last pass does (a pass's run marked ``mb=1``)."""
    messages: dict = {}
    for k, p in enumerate(pairs.itertuples()):
        for index, is_send in ((p.send_index, True), (p.recv_index, False)):
            messages[index] = messages.get(index, ()) + (Msg("fwd", is_send, p.src, p.dst, 0, 0, k),)
    out = {}
    for step, (lo, hi) in windows.items():
        ev = events[(events["step"] == step) & (events["lane"] == "main")]
        if ev.empty:
            continue
        ev = ev[(ev["start_ns"] >= lo) & (ev["end_ns"] <= hi)]
        programs = []
        for _, mine in ev.groupby("rank"):
            mine = mine.assign(neg=-mine["end_ns"]).sort_values(["start_ns", "neg"], kind="stable")
            is_pp = ((mine["category"] == "p2p") & mine.index.isin(list(messages))).to_numpy()
            start, end = mine["start_ns"].to_numpy(), mine["end_ns"].to_numpy()
            is_pass = (mine["op"] == "fwd").to_numpy()
            entries, reach = [], None
            for i, (s, e, pp, index, a_pass) in enumerate(zip(start, end, is_pp, mine.index, is_pass)):
                if pp:
                    entries.append((s, 1, i, Op("post", msgs=messages[index], handle=index)))
                    entries.append((e, 0 if e > s else 2, i, Op("wait", handle=index)))
                    continue
                if reach is None or s >= reach:
                    entries.append((s, 1, i, Op("run", mb=int(a_pass), duration=int(e - s))))
                reach = e if reach is None else max(reach, e)
            programs.append([op for *_, op in sorted(entries, key=lambda t: t[:3])])
        try:
            rows = replay(programs, lambda op, stage: op.duration, lambda msg: 0, sends="eager")
        except ValueError:
            continue
        out[step] = max((row[5] for row in rows if row[1] == "run" and row[2] == 1), default=0)
    return out


def _random_run(rng, ranks: int, steps: int):
    rows, p2p = [], []
    for step in range(steps):
        for rank in range(ranks):
            t = step * 10_000 + int(rng.integers(0, 50))
            for _ in range(int(rng.integers(2, 9))):
                if rng.random() < 0.1:  # another thread's range: never replayed
                    rows.append((rank, "thread:1 w", "compute", "fwd", step, t, t + 40))
                length = int(rng.integers(1, 120))
                category = "p2p" if rng.random() < 0.45 else "compute"
                op = "send_fwd" if category == "p2p" else ("fwd" if rng.random() < 0.8 else "optimizer")
                rows.append((rank, "main", category, op, step, t, t + length))
                if category == "p2p":
                    p2p.append((len(rows) - 1, rank, step))
                    if rng.random() < 0.3:  # a pass run while the exchange is open (ZB-H1's W)
                        rows.append((rank, "main", "compute", "fwd", step, t + 1, t + max(length - 1, 2)))
                elif rng.random() < 0.3:  # a range nested in a pass: part of the pass
                    rows.append((rank, "main", "compute", "fwd", step, t + 1, t + 1 + length // 2))
                t += length + int(rng.integers(0, 30))
    events = pd.DataFrame(rows, columns=["rank", "lane", "category", "op", "step", "start_ns", "end_ns"])
    events["kind"] = np.where(events["category"] == "p2p", "pp", "compute")
    start = events["start_ns"].to_numpy()
    end = events["end_ns"].to_numpy()
    pairs = []
    order = rng.permutation(len(p2p))
    for a, b in zip(order[0::2], order[1::2]):
        (send, s_rank, s_step), (recv, r_rank, r_step) = p2p[a], p2p[b]
        if start[send] > end[recv]:  # as measured: a message is received after it was sent
            (send, s_rank, s_step), (recv, r_rank, r_step) = (recv, r_rank, r_step), (send, s_rank, s_step)
        if s_rank == r_rank or start[send] > end[recv]:
            continue
        if s_step == r_step or rng.random() < 0.1:  # a few pairs across steps: those steps block
            pairs.append((s_step, send, recv, s_rank, r_rank))
    if len(pairs) and rng.random() < 0.2:  # a message received before it was sent: may deadlock
        _, send, recv, s_rank, r_rank = pairs[0]
        pairs.append((pairs[0][0], recv, send, r_rank, s_rank))
    if len(p2p) and rng.random() < 0.2:  # a recv whose sender is outside every window
        events.loc[len(events)] = (0, "main", "p2p", "send_fwd", 0, 10**9, 10**9 + 5, "pp")
        pairs.append((0, len(events) - 1, p2p[0][0], 0, p2p[0][1]))
    pairs = pd.DataFrame(pairs, columns=["step", "send_index", "recv_index", "src", "dst"])
    windows = {s: (s * 10_000, s * 10_000 + 9_000) for s in range(steps)}
    return events, pairs, windows


@pytest.mark.parametrize("seed", range(40))
def test_latency_free_lengths_equal_the_engine(seed):
    rng = np.random.default_rng(seed)
    events, pairs, windows = _random_run(rng, int(rng.integers(1, 6)), int(rng.integers(1, 4)))
    want = _engine_ends(events, pairs, windows)
    got = latency_free_lengths(SimpleNamespace(events=events), pairs, windows)
    assert got == want


def test_random_runs_hold_deadlocks_and_replays_alike():
    """The generator is worth something only if it makes both: steps left out and steps kept."""
    left_out = kept = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        events, pairs, windows = _random_run(rng, int(rng.integers(1, 6)), int(rng.integers(1, 4)))
        got = latency_free_lengths(SimpleNamespace(events=events), pairs, windows)
        kept += len(got)
        left_out += len(set(events["step"])) - len(got)
    assert kept >= 10 and left_out >= 10


def test_a_recv_waits_for_its_sender_s_post_and_nothing_else():
    """By hand: rank 0 computes 100 ns, then sends (posted at 100); rank 1 receives at 0 and
    computes 50 ns after: with free p2p its recv ends at 100, so the window lasts 150. Rank
    0's optimizer after its send (150 ns, to 460 free) is replayed but is no pass: the window
    ends at the last pass (a send waited on after it, torch's runtime schedules', neither)."""
    events = pd.DataFrame([
        (0, "main", "compute", "fwd", 0, 0, 100), (0, "main", "p2p", "send_fwd", 0, 300, 310),
        (0, "main", "compute", "optimizer", 0, 310, 460),
        (1, "main", "p2p", "recv_fwd", 0, 5, 400), (1, "main", "compute", "fwd", 0, 400, 450),
    ], columns=["rank", "lane", "category", "op", "step", "start_ns", "end_ns"])
    events["kind"] = np.where(events["category"] == "p2p", "pp", "compute")
    pairs = pd.DataFrame([(0, 1, 3, 0, 1)], columns=["step", "send_index", "recv_index", "src", "dst"])
    assert latency_free_lengths(SimpleNamespace(events=events), pairs, {0: (0, 1000)}) == {0: 150}
    # the same from wherever the span starts: a length, not a time
    events[["start_ns", "end_ns"]] += 5_000
    assert latency_free_lengths(SimpleNamespace(events=events), pairs, {0: (5_000, 6_000)}) == {0: 150}
