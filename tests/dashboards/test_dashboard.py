"""Figure builders and page assembly on synthetic runs whose every block and gap is known.

The synthetic run is a GPipe schedule written as real torch.profiler-shaped trace files and read
back through ``pptrace.run.load_run``: forward F(s, j) starts at s*(tf+g) + j*tf, backward
B(s, j) at T_F + (p-1-s)*(tb+g) + j*tb, every p2p transfer takes g. So each stage computes
m*(tf+tb) and is idle (p-1)*(tf+tb+2g) inside the pipeline window.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from dashboards.blocks import (
    HOVER_POINTS, HOVER_SPACING_PX, MAX_LABELS_IN_VIEW, fitting_labels, hover_points, polygon_rects, rect_polygon,
)
from dashboards.figures import bubble_figure, collectives_figure, comm_figure, p2p_matrix_figure, partition_figure, straggler_figure
from dashboards.pipeline_figures import replay_figure, timeline_figure
from dashboards.style import esc
from dashboards.page import render_html, write_dashboard
from dashboards.timeline import build_timeline, decimate
from pptrace.analyzers.partition import partition_run
from pptrace.export.report import build_report
from pptrace.timeline.projection import drawn_ranges
from pptrace.run.build import load_run
from pptrace.topology import Layout
from dashboard_runs import STEP_LEAD_US, synthetic_report, write_gpipe_run

@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    return load_run(write_gpipe_run(tmp_path_factory.mktemp("gpipe")), use_cache=False)


def timeline_of(run):
    """The timeline as the page draws it: the run's windows, the step partition's pp_bubble."""
    return build_timeline(drawn_ranges(run.events), run.layout, run.step_windows, run.pipeline_windows,
                          partition_run(run))


def _lane_of(tl, y: float):
    """The lane whose three rows (compute at lane.y, p2p, comm) hold the point at ``y``."""
    return max((lane for lane in tl.lanes if lane.y - 0.5 <= y), key=lambda lane: lane.y)


def _blocks_per_stage(fig, tl, phase):
    """Count the drawn blocks of one phase per pipeline stage from the figure's own data: the
    rectangles of the phase's filled polygon, each on the lane its centre lies in."""
    counts = {}
    for trace in fig.data:
        if trace.meta and trace.meta["phase"] == phase and trace.visible:
            for _, _, y in polygon_rects(trace.x, trace.y):
                stage = _lane_of(tl, y).stage
                counts[stage] = counts.get(stage, 0) + 1
    return counts


def test_timeline_blocks_match_the_schedule(gpipe_run):
    p, m, tf, tb, g = 4, 4, 1.0, 2.0, 0.05  # ms
    tl = timeline_of(gpipe_run)
    assert tl.steps == [1]
    assert [lane.stage for lane in tl.lanes] == [0, 1, 2, 3]
    assert tl.lanes[2].label == "rank 2 · pp2"
    b = tl.blocks
    ev = gpipe_run.events
    offset = (ev["start_ns"] - gpipe_run.raw_ns()["raw_start_ns"]).groupby(ev["rank"]).first() / 1e6  # ms
    origin = offset.min()
    for rank in range(p):
        mine = b[b["rank"] == rank]
        assert (mine["phase"] == "F").sum() == m and (mine["phase"] == "B").sum() == m
        n_p2p = (mine["row"] == "p2p").sum()
        assert n_p2p == 2 * m * (1 if rank in (0, p - 1) else 2)
        f = mine[mine["phase"] == "F"].sort_values("start_ms")
        # ms since the step's start on aligned clocks: the earliest aligned ProfilerStep start
        expected = [STEP_LEAD_US / 1000 + rank * (tf + g) + j * tf + offset[rank] - origin
                    for j in range(m)]
        np.testing.assert_allclose(f["start_ms"], expected, atol=1e-6)
        np.testing.assert_allclose(f["dur_ns"], tf * 1e6, atol=1)
    # the pipeline window drawn: stage 0's first forward to its last backward
    t_end = (p - 1) * (tf + g) + m * tf + (p - 1) * (tb + g) + m * tb
    lead = STEP_LEAD_US / 1000 + offset[0] - origin
    np.testing.assert_allclose(tl.pipeline_ms[1], (lead, lead + t_end), atol=1e-6)
    # the grey lies inside it
    assert (tl.idle["start_ms"] >= lead - 1e-6).all() and (tl.idle["end_ms"] <= lead + t_end + 1e-6).all()


def test_timeline_figure_counts_and_hover(gpipe_run):
    tl = timeline_of(gpipe_run)
    fig = timeline_figure(tl)
    assert _blocks_per_stage(fig, tl, "F") == {s: 4 for s in range(4)}
    assert _blocks_per_stage(fig, tl, "B") == {s: 4 for s in range(4)}
    # the F polygon draws exactly the forward blocks: their measured start, end and lane
    y_of = {lane.rank: lane.y for lane in tl.lanes}
    fwd = tl.blocks[tl.blocks["phase"] == "F"]
    f = next(t for t in fig.data if t.meta["phase"] == "F")
    np.testing.assert_allclose(sorted(polygon_rects(f.x, f.y)),
                               sorted(zip(fwd["start_ms"], fwd["end_ms"], fwd["rank"].map(y_of))),
                               atol=1e-5)
    # every hover target lies inside one forward block and tells that block's microbatch
    hover = next(t for t in fig.data if t.meta["phase"] == "F:hover")
    counts = hover.meta["hover_repeat"]
    assert len(counts) == len(fwd) and min(counts) >= HOVER_POINTS
    assert len(hover.x) == sum(counts) == len(hover.hovertext)
    for x, y, text in zip(hover.x, hover.y, hover.hovertext):
        inside = fwd[(fwd["start_ms"] < x) & (x < fwd["end_ms"])
                     & ((fwd["rank"].map(y_of) - y).abs() < 1e-4)]
        assert len(inside) == 1, (x, y)
        assert f"microbatch {int(inside['mb'].iloc[0])}" in text and ", 1.000 ms long" in text
    labels = next(t for t in fig.data if t.meta["phase"] == "labels")
    assert sorted(set(labels.text)) == sorted({f"{ph}{j}" for ph in "FB" for j in range(4)})
    assert sorted(labels.text) == sorted(labels.meta["labels"]["text"])  # all fit at full view
    ticks = dict(zip(fig.layout.yaxis.tickvals, fig.layout.yaxis.ticktext))
    assert ticks[tl.lanes[3].y] == "rank 3 · pp3"


def test_block_polygon_fills_exactly_its_rectangles():
    """One polygon per trace: the strokes joining the rectangles must enclose no area, so the
    polygon's area is the rectangles' and each rectangle is found back where it was put."""
    rng = np.random.default_rng(1)
    x0 = rng.uniform(0, 100, 300)
    x1 = x0 + rng.uniform(0, 3, 300)
    y = rng.choice([0.0, 3.0, 6.6, 9.6, 12.6], 300) + 1.18
    xs, ys = rect_polygon(x0, x1, y, 0.32)
    assert not np.isnan(xs).any()  # no gaps: Plotly draws one path, not one per block
    area = 0.5 * np.sum(xs * np.roll(ys, -1) - np.roll(xs, -1) * ys)  # shoelace, closed polygon
    np.testing.assert_allclose(abs(area), np.sum((x1 - x0) * 0.32), rtol=1e-5)
    np.testing.assert_allclose(sorted(polygon_rects(xs, ys)), sorted(zip(x0, x1, y)), atol=1e-5)


def test_hover_targets_cover_wide_blocks():
    """At full view every pixel of a block is within Plotly's 20 px hover radius of one of its
    targets: three for a narrow block, one every HOVER_SPACING_PX on a wide one."""
    x0, x1 = np.array([0.0, 10.0]), np.array([1.0, 110.0])  # 10 px and 1000 px at 10 px/ms
    xs, ys, text, counts = hover_points(x0, x1, np.array([0.0, 3.0]), ["a", "b"], 10.0)
    assert counts == [HOVER_POINTS, int(np.ceil(1000 / HOVER_SPACING_PX))]
    assert text == ["a"] * counts[0] + ["b"] * counts[1] and len(xs) == len(ys) == sum(counts)
    wide = np.sort(xs[counts[0]:])
    assert 10.0 < wide[0] and wide[-1] < 110.0 and (ys[counts[0]:] == 3.0).all()
    gaps_px = 10 * np.diff(np.r_[10.0, wide, 110.0])
    assert gaps_px.max() <= 2 * 20 and gaps_px[1:-1].max() <= HOVER_SPACING_PX


def test_labels_only_where_readable():
    x, y, text, w = [1.0, 5.0, 9.0], [0.0, 0.0, 3.0], ["F0", "F10", "B1.1"], [2.0, 0.1, 2.0]
    # 100 px per ms: F10 in a 10 px block does not fit, the others do
    assert fitting_labels(x, y, text, w, px_per_ms=100, row_px=20) == [0, 2]
    assert fitting_labels(x, y, text, w, px_per_ms=100, row_px=20, x_range=(0, 6)) == [0]
    assert fitting_labels(x, y, text, w, px_per_ms=100, row_px=20, y_range=(2, 4)) == [2]
    assert fitting_labels(x, y, text, w, px_per_ms=100, row_px=8) == []  # font too small
    many = MAX_LABELS_IN_VIEW + 1
    assert fitting_labels([1.0] * many, [0.0] * many, ["F0"] * many, [1.0] * many,
                          px_per_ms=100, row_px=20) == []  # zoom in to see them


def test_hostile_names_are_escaped(tmp_path):
    run = load_run(write_gpipe_run(tmp_path, hostile=True), use_cache=False)
    fig = timeline_figure(timeline_of(run))
    hover = [h for t in fig.data if t.hovertext for h in t.hovertext if h]
    assert any("&lt;img/src=x/onerror=alert(1)&gt;" in h for h in hover)
    assert any("&lt;/script&gt;&lt;script&gt;alert(2)" in h for h in hover)
    assert not any("<img" in h or "<script" in h or "</script" in h for h in hover)
    html = render_html(run, synthetic_report(run.layout), {"timeline": fig})
    # plotly.js, the figure's JSON block and the loader: data cannot close a script element
    assert html.count("</script>") == 3
    assert "<img/src" not in html and "<b>9</b>" not in html and "<script>alert" not in html
    assert esc("a<b>&c") == "a&lt;b&gt;&amp;c"


def test_decimation_bounds_blocks_and_keeps_time():
    rng = np.random.default_rng(0)
    n = 40000
    start = np.sort(rng.uniform(0, 100, n))
    blocks = pd.DataFrame({
        "step": 1, "rank": rng.integers(0, 4, n), "row": "compute", "phase": "F",
        "start_ms": start, "end_ms": start + 0.001, "dur_ns": 1000, "name": "k", "mb": np.nan,
        "chunk": np.nan, "peer": np.nan, "bytes": np.nan, "merged": 1,
    })
    out, merged = decimate(blocks, 2000)
    assert len(out) <= 2000 and merged == n - len(out)
    assert out["merged"].sum() == n and out["dur_ns"].sum() == blocks["dur_ns"].sum()
    assert out["start_ms"].min() == blocks["start_ms"].min()
    same, _ = decimate(blocks.head(100), 2000)
    assert len(same) == 100


def test_partition_bars_sum_to_step_time():
    layout = Layout(tp=2, cp=1, pp=2, dp=1)
    report = synthetic_report(layout, steps=(1, 2))
    fig = partition_figure(report)
    bars = [t for t in fig.data if t.type == "bar"]
    total = np.sum([np.asarray(t.y, dtype=float) for t in bars], axis=0)
    np.testing.assert_allclose(total, 20.0, atol=1e-9)  # ms
    assert list(fig.data[0].x) == [f"rank {r} · {layout.describe(r)}" for r in (0, 1, 2, 3)]
    compute = next(t for t in bars if t.name == "compute")
    np.testing.assert_allclose(compute.y, [10.0, 11.0, 12.0, 13.0])


def test_report_views_show_report_values():
    layout = Layout(tp=1, cp=1, pp=4, dp=2)
    report = synthetic_report(layout)
    z = np.asarray(p2p_matrix_figure(report).data[0].z, dtype=float)
    assert z.shape == (8, 8) and z[1, 2] == 512 and np.isnan(z[2, 1])
    bubble = bubble_figure(report)
    np.testing.assert_allclose(bubble.data[0].y, [40.0, 39.0, 38.0, 37.0])
    # with the split: schedule part + latency part stacked on one bar, beside the theory
    for s in report["pipeline"]["stages"]:
        s.update(step_s=0.02, bubble_latency_s=0.002,
                 bubble_schedule_s=s["bubble_fraction"] * 0.02 - 0.002)
    split = bubble_figure(report)
    assert [t.name for t in split.data] == ["measured: schedule", "measured: p2p latency + host gaps",
                                           "theory (from measured t_f, t_b)"]
    np.testing.assert_allclose(split.data[1].y, [10.0] * 4)
    np.testing.assert_allclose(np.add(split.data[0].y, split.data[1].y), [40.0, 39.0, 38.0, 37.0])
    np.testing.assert_allclose(split.data[1].base, split.data[0].y)
    np.testing.assert_allclose(split.data[0].customdata,
                               [1000 * s["bubble_schedule_s"] for s in report["pipeline"]["stages"]])
    comm = comm_figure(report)
    dp = list(comm.data[1].x).index("dp")
    np.testing.assert_allclose(comm.data[1].y[dp], 1000 * np.mean([0.0001 * (r + 1) for r in range(8)]))
    strag = straggler_figure(report)
    assert np.asarray(strag.data[0].z).shape == (8, 1) and "rank 2" in strag.layout.title.text
    # each rank's own exposed and hidden time, stage by stage; no wait/transfer panel while
    # the report has no such split
    coll = collectives_figure(report)
    order = sorted(range(8), key=lambda r: (layout.coords(r).pp, r))
    by_name = {t.name: t for t in coll.data}
    assert list(by_name) == ["dp exposed", "dp hidden under compute"]
    np.testing.assert_allclose(by_name["dp exposed"].y, [0.2] * 8)
    np.testing.assert_allclose(by_name["dp hidden under compute"].y, [0.1 * (r + 1) for r in order])
    np.testing.assert_allclose(by_name["dp hidden under compute"].base, [0.2] * 8)
    report["collectives"] = [{"dim": "dp", "op": "all_reduce", "wait_s": 0.002, "transfer_s": 0.001}]
    split = {t.name: t for t in collectives_figure(report).data}
    np.testing.assert_allclose(split["wait (for the last rank to arrive)"].y, [2.0])
    np.testing.assert_allclose(split["transfer"].y, [1.0])
    np.testing.assert_allclose(split["transfer"].base, [2.0])


def test_page_carries_hover_text_once_per_block(gpipe_run):
    """The loader repeats each block's text on its hover points; the page holds it once."""
    fig = timeline_figure(timeline_of(gpipe_run))
    html = render_html(gpipe_run, synthetic_report(gpipe_run.layout), {"timeline": fig})
    packed = json.loads(re.search(r'id="data-fig-timeline">(.*?)</script>', html, re.S).group(1))
    for trace, sent in zip(fig.data, packed["data"]):
        if trace.meta["phase"].endswith(":hover"):
            counts = sent["meta"]["hover_repeat"]
            assert sent["meta"]["hover_packed"] and counts == trace.meta["hover_repeat"]
            assert len(sent["hovertext"]) == len(counts) < len(trace.hovertext)
            assert [h for h, k in zip(sent["hovertext"], counts) for _ in range(k)] == list(trace.hovertext)
        else:
            assert sent.get("hovertext") == (list(trace.hovertext) if trace.hovertext else None)


def test_write_dashboard_is_self_contained(gpipe_run, tmp_path):
    from pptrace.whatif.predict import whatif

    out = write_dashboard(gpipe_run, synthetic_report(gpipe_run.layout), tmp_path / "d" / "r.html",
                          partitions=partition_run(gpipe_run), ranges=drawn_ranges(gpipe_run.events),
                          whatif_result=whatif(gpipe_run))
    html = out.read_text()
    assert html.count("<script") == 1 + 8 + 1  # plotly.js once, a JSON block per figure, loader
    assert html.count('type="application/json"') == 8
    assert not re.search(r"<script[^>]+src=", html)  # nothing fetched from elsewhere
    for key in ("timeline", "replay", "partition", "bubble", "comm", "p2p_links", "collectives", "stragglers"):
        assert f'id="fig-{key}"' in html
    assert "rank &lt;b&gt;9&lt;/b&gt; missing &amp; more" in html
    assert "<b>schedule</b> gpipe" in html


def test_plain_gpu_style_run_falls_back_to_kernels():
    """No pptrace ranges: kernels are drawn instead, NCCL ones on the comm row."""
    n = 6
    ev = pd.DataFrame({
        "rank": np.zeros(n + 1, dtype=np.int32), "category": ["step"] + ["kernel_compute", "kernel_comm"] * 3,
        "name": ["ProfilerStep#0"] + ["gemm<float>", "ncclDevKernel_AllReduce"] * 3,
        "op": None, "start_ns": np.arange(n + 1, dtype=np.int64) * 1000,
        "end_ns": np.arange(n + 1, dtype=np.int64) * 1000 + 500, "dur_ns": 500, "step": 0,
        "mb": pd.array([None] * (n + 1), dtype="Int64"), "chunk": pd.array([None] * (n + 1), dtype="Int64"),
        "peer": pd.array([None] * (n + 1), dtype="Int64"), "bytes": pd.array([None] * (n + 1), dtype="Int64"),
        "gpu_annotation": False,
    })
    ev.loc[0, "end_ns"] = 10_000
    tl = build_timeline(drawn_ranges(ev), Layout(tp=1, cp=1, pp=1, dp=1), {(0, 0): (0, 10_000)})
    assert sorted(tl.blocks["phase"].unique()) == ["kernel", "nccl"]
    assert set(tl.blocks.loc[tl.blocks["phase"] == "nccl", "row"]) == {"comm"}
    fig = timeline_figure(tl)
    assert any("gemm&lt;float&gt;" in h for t in fig.data if t.hovertext for h in t.hovertext if h)


def test_empty_report_gives_placeholders_not_errors():
    empty = {"run": {}, "ranks": [], "warnings": []}
    for builder in (partition_figure, bubble_figure, comm_figure, p2p_matrix_figure,
                    collectives_figure, straggler_figure):
        assert builder(empty).layout.annotations
    run = SimpleNamespace(events=None, layout=None, warnings=["w"])
    assert "<li>w</li>" in render_html(run, empty, {})


def test_replay_figure_puts_measured_and_replayed_passes_side_by_side(gpipe_run):
    from pptrace.whatif.predict import whatif

    report, result = build_report(gpipe_run), whatif(gpipe_run)
    fig = replay_figure(report, result)
    lanes = {}
    for trace in fig.data:
        if trace.meta["phase"].endswith(":hover"):
            continue
        phase = trace.name.split()[0]
        for _, _, y in polygon_rects(trace.x, trace.y):
            lanes.setdefault(int(round(y)), Counter())[phase] += 1
    # every stage x (measured, replayed), each lane with every microbatch's forward and backward
    m, p = report["run"]["microbatches"], gpipe_run.layout.pp
    assert sorted(lanes) == list(range(2 * p))
    assert all(c == Counter({"forward": m, "backward": m}) for c in lanes.values()), lanes
    assert list(fig.layout.yaxis.ticktext) == [f"{source} · stage {s}" for s in range(p)
                                               for source in ("measured", "replayed")]
    assert f"{result['measured']['step_time_s'] * 1e3:.1f} ms measured" in fig.layout.title.text


def test_replay_figure_draws_a_replayed_input_grad_pass_as_a_backward(gpipe_run):
    """torch's runtime schedules replay input-grad passes ("I"); the replayed lane draws them in
    the backward's style, as the measured lane draws a measured one, not leaves them out."""
    import copy

    from pptrace.whatif.predict import whatif

    report, result = build_report(gpipe_run), copy.deepcopy(whatif(gpipe_run))
    timeline = result["predicted"]["timeline"]
    kind = timeline["columns"].index("kind")
    timeline["rows"] = [[*r[:kind], "I" if r[kind] == "B" else r[kind], *r[kind + 1:]] for r in timeline["rows"]]
    fig = replay_figure(report, result)
    backward = Counter()
    for trace in fig.data:
        if not trace.meta["phase"].endswith(":hover") and trace.name.split()[0] == "backward":
            backward.update(int(round(y)) for _, _, y in polygon_rects(trace.x, trace.y))
    m, p = report["run"]["microbatches"], gpipe_run.layout.pp
    assert backward == Counter({y: m for y in range(2 * p)})


def _grey_per_rank_step_us(fig, tl) -> Counter:
    """(rank, step) -> µs of grey the timeline figure draws: the rectangles of each step's
    idle polygon, each on the lane its centre lies in."""
    drawn = Counter()
    for trace in fig.data:
        if trace.meta and trace.meta["phase"] == "idle":
            for x0, x1, y in polygon_rects(trace.x, trace.y):
                drawn[_lane_of(tl, y).rank, trace.meta["step"]] += 1000 * (x1 - x0)
    return drawn


@pytest.mark.parametrize("which", ["gpipe", "trainer"])
def test_grey_idle_is_the_reports_pp_bubble(which, request):
    """What the timeline draws grey on a rank in a step is the report's pp_bubble of that
    rank and step, to the microsecond, and its dotted window is the analysis' pipeline window."""
    run = (request.getfixturevalue("gpipe_run") if which == "gpipe"
           else load_run(request.getfixturevalue("trainer_run"), use_cache=False))
    report = build_report(run)
    tl = timeline_of(run)
    drawn = _grey_per_rank_step_us(timeline_figure(tl), tl)
    reported = {(r["rank"], s["step"]): 1e6 * s["breakdown_s"]["pp_bubble"]
                for r in report["ranks"] for s in r["steps"]}
    assert len(reported) == len(run.ranks) * len(run.steps) and sum(reported.values()) > 0
    assert set(drawn) <= set(reported)
    for key, us in reported.items():
        assert abs(drawn[key] - us) < 1.0, (key, drawn[key], us)
    for step, (lo, hi) in run.pipeline_windows.items():
        origin = min(w[0] for (_, s), w in run.step_windows.items() if s == step)
        np.testing.assert_allclose(tl.pipeline_ms[step], ((lo - origin) / 1e6, (hi - origin) / 1e6))


def test_page_draws_the_given_whatif_and_never_runs_one(gpipe_run, tmp_path, monkeypatch):
    """The what-if is the caller's (33 simulations): building the page must not start one."""
    import pptrace.whatif.predict as predict

    report, partitions, result = build_report(gpipe_run), partition_run(gpipe_run), predict.whatif(gpipe_run)

    def simulate(*args, **kwargs):
        raise AssertionError("the dashboard ran the what-if simulator")

    monkeypatch.setattr(predict, "whatif", simulate)
    html = write_dashboard(gpipe_run, report, tmp_path / "r.html", partitions=partitions,
                           ranges=drawn_ranges(gpipe_run.events), whatif_result=result).read_text()
    replay = re.search(r'id="data-fig-replay">(.*?)</script>', html, re.S).group(1)
    assert "replayed · stage 0" in replay and f"{result['predicted']['step_time_s'] * 1e3:.1f} ms replayed" in replay
    # none given: the page says why, still without simulating
    html = write_dashboard(gpipe_run, report, tmp_path / "r.html", partitions=partitions,
                           ranges=drawn_ranges(gpipe_run.events), whatif_note="no compute:fwd/bwd ranges").read_text()
    replay = json.loads(re.search(r'id="data-fig-replay">(.*?)</script>', html, re.S).group(1))
    assert replay["layout"]["annotations"][0]["text"] == "no what-if replay: no compute:fwd/bwd ranges"
