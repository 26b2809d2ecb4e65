"""p2p exchanges (pptrace.timeline.exchanges): one grouping, by nesting, for the report's
wait/transfer split, the what-if latencies and the critical path.

Each scenario is a hand-built 2-stage trace (whole µs) whose exchanges and numbers are
worked out in the comments. Rules (exchanges.py): a pair moves data from both posted until
the first side is done, but not before the exchange of that side had every message ready;
the receiver's passes do not count as its wait, nor the first side's as transfer.
"""
from __future__ import annotations

import numpy as np
import pytest

from pptrace.analyzers.critical_path import critical_path
from pptrace.analyzers.p2p import match_pairs, split_by_rank
from pptrace.timeline.exchanges import exchange_ids
from pptrace.topology import Layout
from pptrace.whatif import costs, predict
from tracegen import US, run_from_docs, trace_doc

LAYOUT = Layout(pp=2)


def _run(tmp_path, rank0: list, rank1: list):
    step = ("ProfilerStep#1", 0, 1000)
    docs = {r: trace_doc(r, 2, [step, *ranges], layout=LAYOUT) for r, ranges in ((0, rank0), (1, rank1))}
    return run_from_docs(tmp_path, docs, LAYOUT, schedule="1f1b", microbatches=4)


def _p2p(rank: int, op: str, mb: int, start: int, end: int) -> tuple:
    return (f"pp:{op} peer={1 - rank} mb={mb} bytes=64", start, end)


def _label(run) -> dict:
    """event index -> "rank op mb" of every p2p range."""
    ev = run.events
    p2p = ev[(ev["category"] == "p2p").to_numpy()]
    return {int(i): f"{r} {op} {int(mb)}" for i, r, op, mb in zip(p2p.index, p2p["rank"], p2p["op"].astype(str), p2p["mb"])}


def _groups(ids: dict, label: dict) -> set:
    """The partition of ranges into exchanges that an id per range (event index -> id) makes."""
    out: dict = {}
    for idx, ex in ids.items():
        out.setdefault(int(ex), set()).add(label[int(idx)])
    return {frozenset(g) for g in out.values()}


def _same_exchanges_everywhere(run) -> tuple:
    """The exchanges as the report's pairs, the what-if latencies and the critical path group
    them (asserted equal), the pairs, and the what-if latency per exchange (ns)."""
    label = _label(run)
    pairs, unmatched = match_pairs(run)
    assert unmatched.empty
    by_pairs = {**dict(zip(pairs["send_index"], pairs["send_exchange"])),
                **dict(zip(pairs["recv_index"], pairs["recv_exchange"]))}
    path = critical_path(run, 1)
    assert _groups(by_pairs, label) == _groups(path.exchanges.to_dict(), label)
    ops = predict._pipeline_ops(predict._main_events(run))
    lat = costs.exchange_latencies(run, run.steps, ops, {0: 0, 1: 1})
    # what-if observes whole exchanges: every observation is one of the pairs' exchanges
    assert set(lat["exchange"]) <= set(by_pairs.values()) and lat["exchange"].is_unique
    members = {}
    for idx, ex in by_pairs.items():
        members.setdefault(int(ex), set()).add(label[int(idx)])
    latency = {frozenset(members[int(ex)]): int(ns) // US for ex, ns in zip(lat["exchange"], lat["latency_ns"])}
    return _groups(by_pairs, label), pairs, latency


def _numbers(pairs) -> dict:
    """(src, direction, mb) -> (wait µs, transfer µs)."""
    return {(int(p.src), p.direction, int(p.mb)): (int(p.wait_ns) // US, int(p.transfer_ns) // US)
            for p in pairs.itertuples()}


def _intervals(iv) -> list:
    return [(int(a) // US, int(b) // US) for a, b in zip(iv.starts, iv.ends)]


def test_blocking_combined_op_is_one_exchange(tmp_path):
    """(a) Megatron's send_forward_recv_backward on stage 0 and send_backward_recv_forward on
    stage 1: each op's two ranges nest, one exchange per rank."""
    run = _run(tmp_path,
               [_p2p(0, "send_fwd", 1, 100, 140), _p2p(0, "recv_bwd", 0, 101, 139)],
               [_p2p(1, "send_bwd", 0, 120, 141), _p2p(1, "recv_fwd", 1, 121, 140)])
    groups, pairs, latency = _same_exchanges_everywhere(run)
    assert groups == {frozenset({"0 send_fwd 1", "0 recv_bwd 0"}), frozenset({"1 send_bwd 0", "1 recv_fwd 1"})}
    # fwd mb1: both posted at 121, the send (first done, 140) moved 19. bwd mb0: posted at
    # 120, but rank 0's exchange had its other message ready only at 121: moved 121..139 = 18,
    # while rank 0's recv waited 101..120 = 19.
    assert _numbers(pairs) == {(0, "fwd", 1): (0, 19), (1, "bwd", 0): (19, 18)}
    # each exchange's tail after its last message was ready (121): 140 - 121, 141 - 121
    assert latency == {frozenset({"0 send_fwd 1", "0 recv_bwd 0"}): 19,
                       frozenset({"1 send_bwd 0", "1 recv_fwd 1"}): 20}


def test_interleaved_four_way_exchange_is_one_exchange(tmp_path):
    """(b) The interleaved schedule's send_forward_backward_recv_forward_backward: four
    nested ranges per rank, one exchange that moves nothing before its last message (233)."""
    run = _run(tmp_path,
               [_p2p(0, "send_fwd", 0, 200, 260), _p2p(0, "send_bwd", 1, 201, 259),
                _p2p(0, "recv_fwd", 2, 202, 258), _p2p(0, "recv_bwd", 3, 203, 257)],
               [_p2p(1, "recv_fwd", 0, 230, 262), _p2p(1, "recv_bwd", 1, 231, 261),
                _p2p(1, "send_fwd", 2, 232, 260), _p2p(1, "send_bwd", 3, 233, 259)])
    groups, pairs, latency = _same_exchanges_everywhere(run)
    assert groups == {frozenset({"0 send_fwd 0", "0 send_bwd 1", "0 recv_fwd 2", "0 recv_bwd 3"}),
                      frozenset({"1 recv_fwd 0", "1 recv_bwd 1", "1 send_fwd 2", "1 send_bwd 3"})}
    # every first-done side is rank 0's, whose exchange had all four ready at 233
    assert _numbers(pairs) == {(0, "fwd", 0): (0, 27), (0, "bwd", 1): (0, 26),
                               (1, "fwd", 2): (30, 25), (1, "bwd", 3): (30, 24)}
    assert sorted(latency.values()) == [260 - 233, 262 - 233]


OVERLAP = (
    # rank 0: the forward exchange posted after F, the backward pass run inside it, the
    # backward exchange posted after B, the forward exchange waited, F inside the backward
    # exchange, which is waited last: the two overlap without nesting
    [_p2p(0, "send_fwd", 0, 300, 360), _p2p(0, "recv_fwd", 1, 301, 359), ("compute:bwd mb=9", 310, 340),
     _p2p(0, "send_bwd", 2, 345, 400), _p2p(0, "recv_bwd", 3, 346, 399), ("compute:fwd mb=9", 365, 390)],
    [_p2p(1, "recv_fwd", 0, 340, 362), _p2p(1, "send_fwd", 1, 341, 361),
     _p2p(1, "recv_bwd", 2, 352, 410), _p2p(1, "send_bwd", 3, 353, 409)],
)


def test_overlapped_forward_and_backward_exchanges_stay_apart(tmp_path):
    """(c) overlap_p2p_comm: a forward and a backward exchange open at once, each waited on
    its own. Grouped by overlap they would be one, and the forward messages would wait for
    the backward ones (ready at 353) before moving."""
    run = _run(tmp_path, *OVERLAP)
    groups, pairs, latency = _same_exchanges_everywhere(run)
    assert groups == {frozenset({"0 send_fwd 0", "0 recv_fwd 1"}), frozenset({"0 send_bwd 2", "0 recv_bwd 3"}),
                      frozenset({"1 recv_fwd 0", "1 send_fwd 1"}), frozenset({"1 recv_bwd 2", "1 send_bwd 3"})}
    # fwd mb0: rank 0's send is first done (360); its exchange ready at 341: 19 moved.
    # fwd mb1: rank 0's recv first done (359), 341..359 = 18; it waited 301..341 less its
    # backward pass (30) = 10. bwd mb2/mb3: ready at 353, moved until 400/399, less the
    # forward pass rank 0 ran meanwhile (25): 22 and 21; the recv waited 346..353 = 7.
    assert _numbers(pairs) == {(0, "fwd", 0): (0, 19), (1, "fwd", 1): (10, 18),
                               (0, "bwd", 2): (0, 22), (1, "bwd", 3): (7, 21)}
    # rank 0's exchanges hold passes: no latency seen there; rank 1's two are seen apart
    assert latency == {frozenset({"1 recv_fwd 0", "1 send_fwd 1"}): 362 - 341,
                       frozenset({"1 recv_bwd 2", "1 send_bwd 3"}): 410 - 353}
    # the what-if host gap counts each op's end: B ended 340 -> backward exchange posted 345,
    # forward exchange waited 360 -> F 365; rank 1 has nothing between its ops
    ops = predict._pipeline_ops(predict._main_events(run))
    assert costs.overhead(ops) == pytest.approx(5e-6)


def test_overlapped_exchanges_on_the_critical_path(tmp_path):
    """(c) walked back: rank 0 waited for its forward exchange after its backward pass
    (340..360) and for the backward one after its forward pass (390..400); the passes run
    inside open exchanges are rank 0's compute, and the segments tile the step."""
    path = critical_path(_run(tmp_path, *OVERLAP), 1)
    seg = path.segments
    assert (seg["end_ns"].to_numpy()[:-1] == seg["start_ns"].to_numpy()[1:]).all()
    assert path.length_s == pytest.approx(path.span_s)
    mine = seg[(seg["rank"] == 0) & (seg["start_ns"] >= seg["start_ns"].min() + 340 * US)]
    rel = [(p, (int(a) - int(seg["start_ns"].min())) // US, (int(b) - int(seg["start_ns"].min())) // US)
           for p, a, b in zip(mine["phase"], mine["start_ns"], mine["end_ns"])]
    assert ("compute:fwd", 365, 390) in rel and ("pp:transfer", 390, 400) in rel


def test_pass_nested_in_an_open_exchange(tmp_path):
    """(d) ZB-H1: stage 1 posts its exchange, runs W inside it, then waits."""
    run = _run(tmp_path,
               [_p2p(0, "recv_bwd", 0, 510, 530), _p2p(0, "send_fwd", 1, 511, 529)],
               [_p2p(1, "send_bwd", 0, 500, 560), _p2p(1, "recv_fwd", 1, 501, 559),
                ("compute:bwd_weight mb=0", 505, 545)])
    groups, pairs, latency = _same_exchanges_everywhere(run)
    assert groups == {frozenset({"0 recv_bwd 0", "0 send_fwd 1"}), frozenset({"1 send_bwd 0", "1 recv_fwd 1"})}
    # ready at 511 on both ranks; rank 0's ranges are done first. Rank 1's recv waited
    # 501..511 less W's 505..511 = 4.
    assert _numbers(pairs) == {(1, "bwd", 0): (0, 19), (0, "fwd", 1): (4, 18)}
    # W inside rank 1's exchange: its tail is W's, no latency seen there
    assert latency == {frozenset({"0 recv_bwd 0", "0 send_fwd 1"}): 530 - 511}


def test_buffered_send_holds_its_exchange_up_for_nothing(tmp_path):
    """(e) Rank 0's combined op holds a send the transport buffered (done at 605, before rank
    1 posted the recv at 625): the exchange moves once its other message is ready (610)."""
    run = _run(tmp_path,
               [_p2p(0, "recv_bwd", 1, 600, 640), _p2p(0, "send_fwd", 0, 601, 605)],
               [_p2p(1, "send_bwd", 1, 610, 618), _p2p(1, "recv_fwd", 0, 625, 628)])
    groups, pairs, latency = _same_exchanges_everywhere(run)
    assert groups == {frozenset({"0 recv_bwd 1", "0 send_fwd 0"}), frozenset({"1 send_bwd 1"}),
                      frozenset({"1 recv_fwd 0"})}
    # the buffered message only copies out of the buffer: the whole recv, 3
    assert _numbers(pairs) == {(1, "bwd", 1): (10, 8), (0, "fwd", 0): (0, 3)}
    split = split_by_rank(*match_pairs(run))
    wait, transfer = split[0]
    origin = run.events.loc[run.events["category"] == "step", "start_ns"].min()
    assert [(a - origin // US, b - origin // US) for a, b in _intervals(transfer)] == [(610, 618)]
    assert wait.total == (40 - 8) * US
    assert latency == {frozenset({"0 recv_bwd 1", "0 send_fwd 0"}): 640 - 610,
                       frozenset({"1 send_bwd 1"}): 8, frozenset({"1 recv_fwd 0"}): 3}


def test_exchange_ids_nest_per_rank_and_kind():
    # rank 0: [0,10) holds [1,9); [5,20) outlives it (a second op posted meanwhile); [20,30)
    # starts when nothing is open. Ties in start: the shorter is waited first, its own.
    rank = np.array([0, 0, 0, 0, 1, 1, 0, 0])
    start = np.array([0, 1, 5, 20, 0, 0, 40, 40])
    end = np.array([10, 9, 20, 30, 10, 10, 50, 45])
    kind = np.array(["pp", "pp", "pp", "pp", "pp", "cp", "pp", "pp"], dtype=object)
    ids = exchange_ids(rank, start, end, kind)
    assert ids[0] == ids[1] and len({ids[0], ids[2], ids[3], ids[6], ids[7]}) == 5
    assert ids[4] != ids[5]  # a rank's pp and cp ops never share an exchange
    assert exchange_ids([], [], []).size == 0
