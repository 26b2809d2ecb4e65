"""Per-rank activity (timeline/activity.py): gloo worker work attributed through its FIFO
queue, and all ranks at once equal to one rank at a time."""
from __future__ import annotations

import numpy as np

from pptrace.timeline.activity import activities, rank_activity
from pptrace.ingest.frame import build_frame
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, pipeline_run

WORKER = 77


def _frame(t: RankTrace):
    ev, _ = build_frame([(t.to_dict()["traceEvents"], None)], t.rank, t.base_ns, "x", [])
    return ev


def _us(intervals, origin_ns):
    return [((s - origin_ns) / 1e3, (e - origin_ns) / 1e3) for s, e in zip(intervals.starts, intervals.ends)]


def test_gloo_worker_takes_its_queue_head_only_once_posted():
    """A worker event that starts before the head of its queue was enqueued takes nothing and
    leaves the head for the next one: the next event runs the TP all-reduce (enqueued inside
    tp:all_reduce), the one after it the DP one."""
    t = RankTrace(rank=0, layout=Layout(tp=2, dp=2), steps=[1])
    t.thread(WORKER, "pt_gloo_runloop")
    t.step(1, 0, 1000)
    t.region("tp:all_reduce", 0, 100)
    t.region("dp:all_reduce", 120, 80)
    t.add("c10d::allreduce_", 50, 1, cat="cpu_op")
    t.add("c10d::allreduce_", 150, 1, cat="cpu_op")
    t.add("gloo:all_reduce", 40, 5, cat="cpu_op", tid=WORKER)    # nothing enqueued yet
    t.add("gloo:all_reduce", 60, 50, cat="cpu_op", tid=WORKER)   # the TP one
    t.add("gloo:all_reduce", 160, 100, cat="cpu_op", tid=WORKER)  # the DP one
    act = rank_activity(_frame(t), 0, t.layout)
    origin = t.raw_ns(0)
    assert _us(act.comm["tp"], origin) == [(0, 110)]
    assert _us(act.comm["dp"], origin) == [(120, 260)]


def _same(a, b):
    def iv(x, y):
        return np.array_equal(x.starts, y.starts) and np.array_equal(x.ends, y.ends)

    assert (a.rank, a.gpu, a.unknown_groups) == (b.rank, b.gpu, b.unknown_groups)
    assert iv(a.compute, b.compute) and iv(a.p2p, b.p2p) and iv(a.memcpy, b.memcpy)
    for d in a.comm:
        assert iv(a.comm[d], b.comm[d]) and iv(a.step_final[d], b.step_final[d]), d


def test_all_ranks_at_once_equal_one_rank_at_a_time(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2, skew_ns={1: 2_000_000})
    run = load_run(run_dir, use_cache=False, progress=False)
    together = activities(run.events, None, run.layout, run.process_groups)
    assert list(together) == [0, 1, 2, 3]
    for rank, ev in run.events.groupby("rank", observed=True):
        alone = rank_activity(ev, int(rank), run.layout, run.process_groups.get(int(rank)))
        _same(alone, together[int(rank)])
        assert alone.compute.total > 0 and alone.step_final["dp"].total > 0
    # a rank asked for without events has none
    assert activities(run.events, [3, 9], run.layout)[9].compute.total == 0


def test_ranks_taken_a_few_at_a_time_equal_all_at_once(tmp_path, monkeypatch):
    """activities takes whole ranks' slices of a rank-ordered table (ACTIVITY_ROWS): one rank
    a pass gives every rank the activity one pass over the table gives it, ranks asked for
    without events included, in the order asked."""
    import pptrace.timeline.activity as activity

    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2)
    run = load_run(run_dir, use_cache=False, progress=False)
    together = activities(run.events, [3, 9, 0, 1, 2], run.layout, run.process_groups)
    rank_of_row = run.events["rank"].to_numpy()
    assert (np.diff(rank_of_row) >= 0).all()  # the loader's table comes rank by rank
    monkeypatch.setattr(activity, "ACTIVITY_ROWS", 1)
    passes = activity._rank_slices(rank_of_row, [3, 9, 0, 1, 2], 1)
    assert [mine for _, mine in passes] == [[0], [1], [2], [3, 9]]
    apart = activities(run.events, [3, 9, 0, 1, 2], run.layout, run.process_groups)
    assert list(apart) == list(together) == [3, 9, 0, 1, 2]
    for rank in together:
        _same(apart[rank], together[rank])
    assert apart[9].compute.total == 0 and apart[0].compute.total > 0


def test_range_order_is_lexsorts_whether_or_not_the_rows_come_sorted():
    """_by_lane_start_longest takes a stable sort by lane when each lane's rows already come
    in (start, longest first) order, as a rank's table has them; else it falls back to the
    lexsort. Both must give the lexsort's order, ties (same start and end) included."""
    from pptrace.timeline.activity import _by_lane_start_longest

    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(0, 60))
        lane = rng.integers(0, 4, n)
        starts = rng.integers(0, 10, n)
        ends = starts + rng.integers(0, 4, n)
        row = np.sort(rng.choice(1000, n, replace=False))
        if trial % 2:  # each lane's rows in the table's order: the fast path
            by = np.lexsort((row, -ends, starts))
            lane, starts, ends = lane[by], starts[by], ends[by]
        want = np.lexsort((row, -ends, starts, lane))
        assert _by_lane_start_longest(lane, starts, ends, row).tolist() == want.tolist(), trial
