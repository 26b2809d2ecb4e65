"""The dashboard of a large run: the timeline is down-sampled to a bounded number of blocks, and
the page says so above the figure (how many ranges, how many blocks), in real headless Chromium
for a 128-rank run."""
from __future__ import annotations

import html
import json
import re
import time

import pytest

import pptrace
from dashboards.page import page_html
from dashboards.pipeline_figures import timeline_figure
from dashboards.timeline import build_timeline
from pptrace.export.dashboard import write_page
from tracegen import pipeline_run, pipeline_traces, write_dense

MAX_BLOCKS = 60000  # build_timeline's default: what a page draws at most (about)


def _timeline(analysis, **kwargs):
    run = analysis.run
    return build_timeline(analysis.drawn_ranges, run.layout, run.step_windows, run.pipeline_windows,
                          analysis.partitions, ranks=run.events["rank"].unique(), **kwargs)


def _note_numbers(text: str) -> tuple[int, int, int]:
    ranges, blocks, merged = re.search(r"([\d,]+) ranges are drawn as ([\d,]+) blocks \(([\d,]+) merged",
                                       text).groups()
    return tuple(int(n.replace(",", "")) for n in (ranges, blocks, merged))


def test_a_decimated_timeline_says_so_above_the_figure(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=4, dp=1, microbatches=8, steps=(1, 2))
    analysis = pptrace.analyze(run_dir)
    full = _timeline(analysis)
    assert full.merged_blocks == 0
    fig = timeline_figure(full)
    assert fig.layout.title.text == "Pipeline timeline" and fig.layout.meta["notes"] == []

    small = _timeline(analysis, max_blocks=40)
    assert small.merged_blocks > 0 and len(small.blocks) <= 40
    fig = timeline_figure(small)
    assert "down-sampled" in fig.layout.title.text
    [note] = fig.layout.meta["notes"]
    assert _note_numbers(note) == (len(full.blocks), len(small.blocks), small.merged_blocks)
    assert len(full.blocks) == len(small.blocks) + small.merged_blocks

    page = page_html("t", "", [("timeline", "Pipeline timeline", "")], {"timeline": fig})
    assert page.index(html.escape(note)) < page.index('id="fig-timeline"')  # read before the figure


def test_a_gpu_traces_bubble_is_drawn_merged_and_keeps_its_sum(tmp_path):
    """On a dense GPU trace every gap between two kernels is pp_bubble: thousands of intervals per
    rank. Merged for the drawing, each (rank, step) still holds the report's bubble, which the grey
    blocks' hover gives."""
    traces, _ = pipeline_traces(pp=2, microbatches=2, steps=(1,), fwd_us=2000, bwd_us=4000)
    for t in traces:
        write_dense(t, tmp_path / "traces" / f"rank{t.rank}.json.gz", 300, gpu=True)
    analysis = pptrace.analyze(tmp_path)
    full, small = _timeline(analysis), _timeline(analysis, max_blocks=200)
    assert len(full.idle) > 2000 and full.merged_idle == 0  # ~one interval per kernel
    assert len(small.idle) <= 200 and small.merged_idle == len(full.idle) - len(small.idle)
    assert small.idle["merged"].sum() == len(full.idle)
    reported = {(r["rank"], s["step"]): s["breakdown_s"]["pp_bubble"] * 1e3
                for r in analysis.to_json()["ranks"] for s in r["steps"]}
    drawn = small.idle.groupby(["rank", "step"])["bubble_ms"].sum().to_dict()
    assert drawn.keys() == reported.keys()
    for key, ms in reported.items():
        assert abs(drawn[key] - ms) < 1e-3, (key, drawn[key], ms)
    fig = timeline_figure(small)
    [note] = fig.layout.meta["notes"]
    assert f"{len(full.idle):,} pp_bubble intervals as {len(small.idle):,} grey blocks" in note
    hover = next(t for t in fig.data if t.meta and t.meta["phase"] == "idle:hover")
    assert any(" intervals merged at full view" in h and "of bubble" in h for h in hover.hovertext)


@pytest.fixture(scope="module")
def page_128(tmp_path_factory):
    """A 128-rank GPipe run (pp=8 x dp=16, 48 microbatches, 2 steps: ~68k timeline ranges) and its page."""
    root = tmp_path_factory.mktemp("dash128")
    run_dir, _ = pipeline_run(root / "run", pp=8, dp=16, microbatches=48, steps=(1, 2))
    analysis = pptrace.analyze(run_dir)
    tl = _timeline(analysis)
    path = write_page(analysis, root / "page.html")
    return path, tl


@pytest.mark.slow
@pytest.mark.browser
def test_128_rank_page_opens_down_sampled_with_its_note(browser, page_128):
    path, tl = page_128
    assert tl.merged_blocks > 0, "the run is meant to be larger than the dashboard draws"
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://") else r.abort())
    t0 = time.perf_counter()
    page.goto(path.resolve().as_uri())
    page.wait_for_function("document.getElementById('fig-timeline')._fullLayout", timeout=60000)
    opened = time.perf_counter() - t0

    note = page.locator("#timeline .fig-notes li")
    assert note.count() == 1 and note.is_visible()
    assert _note_numbers(note.inner_text()) == (len(tl.blocks) + tl.merged_blocks, len(tl.blocks), tl.merged_blocks)
    assert note.bounding_box()["y"] < page.locator("#fig-timeline").bounding_box()["y"]
    assert "down-sampled" in page.locator("#fig-timeline .gtitle").text_content()

    spec = json.loads(page.locator("#data-fig-timeline").text_content())
    drawn = sum(len(t["meta"]["hover_repeat"]) for t in spec["data"]
                if (t.get("meta") or {}).get("hover_repeat") and t["meta"]["phase"] != "idle:hover")
    assert drawn == len(tl.blocks) <= MAX_BLOCKS
    merged_hover = page.evaluate(
        "() => document.getElementById('fig-timeline')._fullData.some(t => t.hovertext &&"
        " t.hovertext.some(h => / ops merged at full view/.test(h)))")
    assert merged_hover

    # not frozen: a zoom into the timeline and back is drawn within seconds, and the page answers
    t1 = time.perf_counter()
    page.evaluate("() => { const gd = document.getElementById('fig-timeline'), r = gd._fullLayout.xaxis.range;"
                  " return Plotly.relayout(gd, {'xaxis.range': [r[0], r[0] + (r[1] - r[0]) / 50]})"
                  ".then(() => Plotly.relayout(gd, {'xaxis.autorange': true})); }")
    zoom = time.perf_counter() - t1
    assert page.evaluate("1 + 1") == 2
    assert not errors, errors
    # generous bounds for a loaded 2-core box (the benchmark's realistic mode has the tight ones)
    assert opened < 60 and zoom < 20, (opened, zoom)
    page.close()
