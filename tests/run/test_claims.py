"""pptrace/run/claims.py: what a trace's pptrace block claims (layout, microbatches, vpp,
schedule) checked against what its events show, each contradiction replaced by the evidence
with one warning naming both.

The events are real loader output (tracegen.RankTrace written to disk, read back with
load_rank) of two-stage pipelines whose order of passes is written out below by hand, so
which schedule they follow is known without pptrace's tables.
"""
from __future__ import annotations

import pandas as pd
import pytest

from pptrace.ingest.load import load_rank
from pptrace.run.claims import cross_check, is_count, is_index, shape
from pptrace.topology import Layout
from tracegen import RankTrace

PP2 = Layout(pp=2)
SAID = "the pptrace block says layout {}"
NOTHING = {"schedule": None, "microbatches": None, "vpp": None}

#: stage -> its order of passes in one step, pp=2, 4 microbatches ("F<mb>" or "F<mb>.<chunk>")
ORDERS = {
    "gpipe": ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"],
    # stage 0 warms up with pp - 1 = 1 extra forward; the last stage alternates from the start
    "1f1b": ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    # Megatron's interleaved, vpp 2
    "interleaved": ["F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
                    "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"],
    # no schedule's table: stage 0 runs a backward before its first forward
    "scrambled": ["B0 F0 F1 F2 F3 B1 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
}


def _traces(order: str, *, steps=(1, 2), p2p: bool = True, chunk_tags: bool = True, mb_tags: bool = True):
    """One RankTrace per stage of Layout(pp=2) running ORDERS[order] every step, each pass in
    its p2p (recv before, send after, peers the pipeline neighbours) when ``p2p``."""
    traces = []
    for rank in range(2):
        t, now = RankTrace(rank, layout=PP2), 0.0

        def put(name, t=t, **tags):
            nonlocal now
            t.region(name, now, 8, **tags)
            now += 10

        for step in steps:
            begin = now
            for action in ORDERS[order][rank].split():
                op = "fwd" if action[0] == "F" else "bwd"
                mb, _, chunk = action[1:].partition(".")
                tags = {"mb": int(mb)} if mb_tags else {}
                if chunk and chunk_tags:
                    tags["chunk"] = int(chunk)
                link = p2p and ((op == "fwd") == (rank == 1))  # stage 1 receives forwards
                if link:
                    put(f"pp:recv_{op}", peer=1 - rank, mb=int(mb))
                put(f"compute:{op}", **tags)
                if p2p and not link:
                    put(f"pp:send_{op}", peer=1 - rank, mb=int(mb))
            t.step(step, begin - 1, now - begin + 2)
            now += 5
        traces.append(t)
    return traces


def _load(tmp_path, traces):
    """(events, metas) as load_run's cross-check gets them: every rank's table, one frame."""
    frames, metas = [], {}
    for t in traces:
        events, meta = load_rank(t.write(tmp_path / f"rank{t.rank}.json.gz"), t.rank)
        frames.append(events)
        metas[t.rank] = meta
    events = pd.concat(frames, ignore_index=True)
    for column in frames[0].columns:  # categories of different ranks union to object: back to category
        if isinstance(frames[0][column].dtype, pd.CategoricalDtype):
            events[column] = events[column].astype(str).where(events[column].notna()).astype("category")
    return events, metas


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """order name -> (events, metas), loaded once per module."""
    cache = {}

    def get(order, **kwargs):
        key = (order, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = _load(tmp_path_factory.mktemp(order), _traces(order, **kwargs))
        return cache[key]

    return get


def _check(loaded_run, given, layout=PP2, said=None):
    events, metas = loaded_run
    claimed = {k for k, v in given.items() if v is not None}
    return cross_check(events, layout, {**NOTHING, **given}, claimed, metas, said)


# -- helpers --------------------------------------------------------------------------------
def test_shape_names_every_dimension():
    assert shape(Layout(tp=2, pp=4, dp=2)) == "tp2 cp1 pp4 dp2"
    assert shape(Layout()) == "tp1 cp1 pp1 dp1"


@pytest.mark.parametrize("value, count, index", [
    (1, True, True), (8, True, True), (0, False, True), (-1, False, False),
    (True, False, False), (False, False, False),   # JSON booleans are no numbers here
    (1.0, False, False), ("2", False, False), (None, False, False), ([1], False, False),
])
def test_is_count_and_is_index(value, count, index):
    assert is_count(value) is count
    assert is_index(value) is index


# -- nothing claimed, or claims that hold ---------------------------------------------------
def test_no_claims_leaves_everything_and_copies_given(loaded):
    events, metas = loaded("gpipe")
    given = dict(NOTHING)
    layout, out, warnings = cross_check(events, PP2, given, set(), metas, None)
    assert layout is PP2 and out == NOTHING and warnings == []
    assert out is not given


@pytest.mark.parametrize("order, given", [
    ("gpipe", {"schedule": "gpipe", "microbatches": 4, "vpp": 1}),
    ("1f1b", {"schedule": "1f1b", "microbatches": 4, "vpp": 1}),
    ("1f1b", {"schedule": "Schedule1F1B"}),      # torch's name for 1F1B is checked as 1F1B
    ("gpipe", {"schedule": "ScheduleGPipe"}),
    ("interleaved", {"schedule": "interleaved", "microbatches": 4, "vpp": 2}),
])
def test_true_claims_hold_without_warnings(loaded, order, given):
    layout, out, warnings = _check(loaded(order, p2p=order != "interleaved"), given, said=SAID)
    assert warnings == [] and layout == PP2
    assert out == {**NOTHING, **given}


def test_the_caller_s_layout_is_not_checked(loaded):
    # layout_said None: the layout was given (or inferred), so a wrong one stands
    layout, _, warnings = _check(loaded("gpipe"), {}, layout=Layout(dp=2), said=None)
    assert layout == Layout(dp=2) and warnings == []


# -- microbatches ---------------------------------------------------------------------------
def test_a_wrong_microbatch_count_is_replaced_by_the_mb_tags(loaded):
    _, out, warnings = _check(loaded("gpipe"), {"microbatches": 8})
    assert out["microbatches"] == 4
    assert warnings == ["the pptrace block says 8 microbatches, but a rank's step runs forwards of 4 distinct "
                        "microbatches (mb tags); using 4"]


@pytest.mark.parametrize("claim", [0, -2, True, "four", 2.5])
def test_an_impossible_microbatch_count_is_replaced(loaded, claim):
    _, out, warnings = _check(loaded("gpipe"), {"microbatches": claim})
    assert out["microbatches"] == 4
    assert warnings == [f"the pptrace block says microbatches {claim!r}, not a positive count; using 4 from the mb tags"]


def test_microbatches_without_mb_tags(loaded):
    untagged = loaded("gpipe", p2p=False, mb_tags=False)
    # no evidence: a count stands, an impossible one goes
    assert _check(untagged, {"microbatches": 8})[1:] == ({**NOTHING, "microbatches": 8}, [])
    _, out, warnings = _check(untagged, {"microbatches": "8"})
    assert out["microbatches"] is None
    assert warnings == ["the pptrace block says microbatches '8', not a positive count; ignored"]


# -- vpp ------------------------------------------------------------------------------------
def test_vpp_against_chunk_tags(loaded):
    _, out, warnings = _check(loaded("interleaved", p2p=False), {"vpp": 3})
    assert out["vpp"] == 2
    assert warnings == ["the pptrace block says vpp 3, but the traces show 2 model chunks per rank "
                        "(distinct chunk tags of a rank's forwards); using 2"]
    # a tag refutes vpp 1 as well
    _, out, warnings = _check(loaded("interleaved", p2p=False), {"vpp": 1})
    assert out["vpp"] == 2 and len(warnings) == 1


def test_vpp_without_chunk_tags_only_refutes_above_one(loaded):
    # each microbatch forwarded once per step: not 2 chunks
    _, out, warnings = _check(loaded("gpipe"), {"vpp": 2})
    assert out["vpp"] == 1
    assert warnings == ["the pptrace block says vpp 2, but the traces show 1 model chunk per rank "
                        "(forwards per microbatch in a rank's step); using 1"]
    # twice per step could be recomputation: vpp 1 stands
    untagged = loaded("interleaved", p2p=False, chunk_tags=False)
    assert _check(untagged, {"vpp": 1})[1:] == ({**NOTHING, "vpp": 1}, [])
    _, out, warnings = _check(untagged, {"vpp": 4})
    assert out["vpp"] == 2 and "(forwards per microbatch in a rank's step); using 2" in warnings[0]


@pytest.mark.parametrize("order, kwargs, want, tail", [
    ("interleaved", {"p2p": False}, 2, "using 2 from the chunk tags"),
    ("gpipe", {}, None, "ignored"),
])
def test_an_impossible_vpp(loaded, order, kwargs, want, tail):
    _, out, warnings = _check(loaded(order, **kwargs), {"vpp": 0})
    assert out["vpp"] == want
    assert warnings == [f"the pptrace block says vpp 0, not a positive count; {tail}"]


# -- schedule -------------------------------------------------------------------------------
@pytest.mark.parametrize("order, claim, seen", [("gpipe", "1f1b", "gpipe"), ("1f1b", "gpipe", "1f1b"),
                                                ("gpipe", "Schedule1F1B", "gpipe")])
def test_a_schedule_the_order_refutes_is_replaced(loaded, order, claim, seen):
    _, out, warnings = _check(loaded(order), {"schedule": claim})
    assert out["schedule"] == seen
    assert warnings == [f"the pptrace block says schedule {claim!r}, but every rank's order of forwards and "
                        f"backwards is {seen}'s; using {seen}"]


def test_interleaved_order_under_a_one_chunk_claim_brings_its_vpp(loaded):
    _, out, warnings = _check(loaded("interleaved", p2p=False), {"schedule": "1f1b"})
    assert out["schedule"] == "interleaved" and out["vpp"] == 2
    assert warnings == ["the pptrace block says schedule '1f1b', but every rank's order of forwards and "
                        "backwards is interleaved's (vpp 2); using interleaved"]


def test_an_unknown_schedule_name_is_kept_with_a_warning(loaded):
    _, out, warnings = _check(loaded("gpipe"), {"schedule": "MySchedule"})
    assert out["schedule"] == "MySchedule"
    assert warnings == ["the pptrace block names schedule 'MySchedule', which pptrace does not know; its theory "
                        "is the replay of the measured order of passes (the order of gpipe)"]
    _, out, warnings = _check(loaded("scrambled"), {"schedule": "MySchedule"})
    assert out["schedule"] == "MySchedule" and warnings[0].endswith("the replay of the measured order of passes")


@pytest.mark.parametrize("claim", ["zb-h1", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"])
def test_schedules_without_a_forward_backward_table_are_not_checked(loaded, claim):
    assert _check(loaded("gpipe"), {"schedule": claim})[1:] == ({**NOTHING, "schedule": claim}, [])


def test_an_order_no_table_has_is_no_evidence(loaded):
    assert _check(loaded("scrambled"), {"schedule": "1f1b"})[1:] == ({**NOTHING, "schedule": "1f1b"}, [])


@pytest.mark.parametrize("order, claim, want, tail", [
    ("1f1b", 3, "1f1b", "using 1f1b from the order of passes"),
    ("gpipe", ["gpipe"], "gpipe", "using gpipe from the order of passes"),
    ("scrambled", {"name": "x"}, None, "ignored"),
])
def test_a_schedule_that_is_no_name(loaded, order, claim, want, tail):
    _, out, warnings = _check(loaded(order), {"schedule": claim})
    assert out["schedule"] == want
    assert warnings == [f"the pptrace block says schedule {claim!r}, not a name; {tail}"]


def test_all_three_claims_wrong_give_three_warnings_in_order(loaded):
    _, out, warnings = _check(loaded("gpipe"), {"schedule": "1f1b", "microbatches": 8, "vpp": 2})
    assert out == {"schedule": "gpipe", "microbatches": 4, "vpp": 1}
    assert [w.split(",")[0] for w in warnings] == ["the pptrace block says 8 microbatches",
                                                   "the pptrace block says vpp 2",
                                                   "the pptrace block says schedule '1f1b'"]


# -- layout ---------------------------------------------------------------------------------
def test_a_layout_the_p2p_peers_refute_is_replaced(loaded):
    layout, _, warnings = _check(loaded("1f1b"), {}, layout=Layout(dp=2), said=SAID)
    assert layout == PP2
    assert len(warnings) == 1
    assert warnings[0].startswith("the pptrace block says layout tp1 cp1 pp1 dp2, but rank 0 exchanges p2p with "
                                  "rank 1, not a pipeline neighbour in that layout; using tp1 cp1 pp2 dp1 (")


def test_the_said_template_carries_the_claimed_shape(loaded):
    said = "with no layout in the traces, {} was assumed"
    _, _, warnings = _check(loaded("1f1b"), {}, layout=Layout(dp=2), said=said)
    assert warnings[0].startswith("with no layout in the traces, tp1 cp1 pp1 dp2 was assumed, but ")


def test_inferred_p2p_rows_are_no_evidence(loaded):
    events, metas = loaded("1f1b")
    events = events.assign(inferred=events["category"] == "p2p")  # peers that came from a layout
    assert cross_check(events, Layout(dp=2), dict(NOTHING), set(), metas, SAID) == (Layout(dp=2), NOTHING, [])


def test_a_peer_outside_the_world_with_no_other_layout_keeps_it(tmp_path):
    traces = _traces("1f1b", steps=(1,))
    traces[0].step(2, 499, 10)
    traces[0].region("pp:send_fwd", 500, 2, peer=5, mb=0)
    layout, _, warnings = _check(_load(tmp_path, traces), {}, said=SAID)
    assert layout == PP2
    assert warnings == ["the pptrace block says layout tp1 cp1 pp2 dp1, but rank 0 exchanges p2p with rank 5, not "
                        "a pipeline neighbour in that layout; the traces show no other layout, so per-stage "
                        "results follow it and may be wrong"]


def _pg_traces(layout: Layout, groups: dict) -> list:
    """No p2p: one forward per rank, and pg_config naming ``groups`` (desc -> ranks)."""
    traces = []
    for rank in range(layout.world_size):
        t = RankTrace(rank, layout=layout)
        for i, (desc, ranks) in enumerate(groups.items(), 1):
            t.header["distributedInfo"]["pg_config"].append(
                {"pg_name": str(i), "pg_desc": desc, "pg_size": len(ranks), "ranks": ranks})
        t.step(1, 0, 100)
        t.region("compute:fwd", 10, 5, mb=0)
        traces.append(t)
    return traces


def test_a_layout_pg_config_refutes_is_replaced(tmp_path):
    run = _load(tmp_path, _pg_traces(Layout(dp=2), {"PIPELINE_MODEL_PARALLEL_GROUP": [0, 1]}))
    layout, _, warnings = _check(run, {}, layout=Layout(dp=2), said=SAID)
    assert layout == PP2
    assert warnings[0].startswith("the pptrace block says layout tp1 cp1 pp1 dp2, but distributedInfo.pg_config "
                                  "puts rank 0 in the pp group [0, 1], the layout in [0]; using tp1 cp1 pp2 dp1 (")
    # the layout it names is not contradicted
    assert _check(run, {}, layout=PP2, said=SAID)[2] == []


def test_a_tp_group_counts_too(tmp_path):
    run = _load(tmp_path, _pg_traces(Layout(dp=2), {"TENSOR_MODEL_PARALLEL_GROUP": [0, 1]}))
    _, _, warnings = _check(run, {}, layout=Layout(dp=2), said=SAID)
    assert "distributedInfo.pg_config puts rank 0 in the tp group [0, 1], the layout in [0]" in warnings[0]
    assert _check(run, {}, layout=Layout(tp=2), said=SAID)[2] == []


@pytest.mark.parametrize("rank, peer, ok", [
    (1, 2, True), (2, 1, True),   # neighbours
    (3, 0, True), (0, 3, True),   # last and first stage: interleaved schedules wrap around
    (1, 1, True),                 # itself
    (0, 2, False), (1, 3, False),
])
def test_pipeline_neighbours_on_a_ring(tmp_path, rank, peer, ok):
    layout = Layout(pp=4)
    traces = []
    for r in range(4):
        t = RankTrace(r, layout=layout)
        t.step(1, 0, 100)
        if r == rank:
            t.region("pp:send_fwd", 10, 5, peer=peer, mb=0)
        traces.append(t)
    _, _, warnings = _check(_load(tmp_path, traces), {}, layout=layout, said=SAID)
    if ok:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert f"but rank {rank} exchanges p2p with rank {peer}, not a pipeline neighbour in that layout" in warnings[0]


def test_the_schedule_is_checked_on_the_corrected_layout(loaded):
    # under the claimed pp1 no order could refute a schedule; on the pp2 the peers show, it does
    layout, out, warnings = _check(loaded("1f1b"), {"schedule": "gpipe"}, layout=Layout(dp=2), said=SAID)
    assert layout == PP2 and out["schedule"] == "1f1b"
    assert [w.split(",")[0] for w in warnings] == ["the pptrace block says layout tp1 cp1 pp1 dp2",
                                                   "the pptrace block says schedule 'gpipe'"]
