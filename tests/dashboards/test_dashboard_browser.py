"""The dashboard page in real headless Chromium (Debian chromium driven by Playwright), offline.

Every request that is not a file:// URL is aborted and recorded, so a page that needed the
network would both fail to render and fail the test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard_runs import synthetic_report, write_gpipe_run

ARTIFACTS = Path(__file__).parents[1] / "artifacts"
FIGURES = ("timeline", "replay", "partition", "bubble", "comm", "p2p_links", "collectives", "stragglers")
P, M = 4, 4  # trainer run: 4 stages, 4 microbatches

pytestmark = pytest.mark.browser


class Page:
    """A page with the network cut off and console errors, page errors and dialogs recorded."""

    def __init__(self, browser):
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors, self.dialogs, self.blocked = [], [], []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", self._dialog)
        self.page.route("**/*", self._route)

    def _console(self, msg):
        if msg.type == "error" and "GPU stall due to ReadPixels" not in msg.text:
            self.errors.append(msg.text)

    def _dialog(self, dialog):
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def _route(self, route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def open(self, html: Path):
        """Load the page and scroll through it: figures are drawn when they come into run."""
        self.page.goto(html.resolve().as_uri())
        self.figure_ids = self.page.evaluate("[...document.querySelectorAll('.pptrace-fig')].map(d => d.id)")
        for fig_id in self.figure_ids:
            self.page.locator(f"#{fig_id}").scroll_into_view_if_needed()
            self.page.wait_for_function(f"document.getElementById('{fig_id}')._fullLayout",
                                        timeout=30000)
        self.page.wait_for_function(
            f"document.querySelectorAll('.js-plotly-plot').length === {len(self.figure_ids)} && "
            "[...document.querySelectorAll('.js-plotly-plot')].every(d => d._fullLayout)",
            timeout=30000)
        return self

    def hover_block(self, phase: str, contains: str) -> tuple[str, str]:
        """Move the mouse to the middle of the first visible ``phase`` block whose hover text
        contains ``contains``; return (the figure's hover text, what the page shows)."""
        found = self.page.evaluate(
            """([phase, contains]) => {
              const gd = document.getElementById('fig-timeline');
              gd.scrollIntoView();
              for (const t of gd._fullData) {  // decoded arrays (gd.data keeps base64 specs)
                // hover targets: a marker-less trace per phase, a few points inside each block
                if (t.visible !== true || !t.meta || t.meta.phase !== phase + ':hover') continue;
                for (let i = 0; i < t.x.length; i++) {
                  if (!t.hovertext[i].includes(contains)) continue;
                  const fl = gd._fullLayout, box = gd.getBoundingClientRect();
                  return {text: t.hovertext[i],
                          px: box.left + fl._size.l + fl.xaxis.l2p(t.x[i]),
                          py: box.top + fl._size.t + fl.yaxis.l2p(t.y[i])};
                }
              }
              return null;
            }""", [phase, contains])
        assert found, f"no visible {phase} block with {contains!r} in the timeline data"
        self.page.mouse.move(found["px"], found["py"])
        # the label of a previous hover may still be up: wait for this block's
        self.page.wait_for_function(
            "c => [...document.querySelectorAll('#fig-timeline .hoverlayer .hovertext')]"
            ".some(h => h.textContent.includes(c))", arg=contains, timeout=5000)
        return found["text"], self.page.locator("#fig-timeline .hoverlayer .hovertext").first.text_content()


def _trainer_run(out: Path) -> Path:
    cmd = [sys.executable, "-m", "instrumented_model.train", "--pp", str(P), "--microbatches",
           str(M), "--schedule", "1f1b", "--compute", "sleep", "--fwd-ms", "10", "--bwd-ms", "20",
           "--steps", "3", "--profile-steps", "1-2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _page_for(run_dir: Path, html: Path) -> Path:
    """The page as `pptrace dashboard` writes it: the report, the partitions it was built
    from and the what-if replay go in, computed here."""
    import pptrace
    from pptrace.export.dashboard import write_page

    return write_page(pptrace.analyze(run_dir, use_cache=False, progress=False), html)


@pytest.fixture(scope="module")
def trainer_page(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dash_trainer")
    return _page_for(_trainer_run(root / "run"), root / "report.html")


@pytest.mark.slow
def test_trainer_page_offline_every_figure_renders(browser, trainer_page, tmp_path):
    first = Page(browser)
    first.page.goto(trainer_page.resolve().as_uri())
    first.page.wait_for_function("document.getElementById('fig-timeline')._fullLayout")
    # below the fold nothing is drawn yet: figures are plotted as they scroll into view
    assert first.page.evaluate("!document.getElementById('fig-stragglers')._fullLayout")
    page = Page(browser).open(trainer_page)
    assert page.figure_ids == [f"fig-{key}" for key in FIGURES]
    counts = page.page.evaluate(
        "ids => ids.map(id => document.querySelectorAll('#fig-' + id + ' .main-svg').length)",
        list(FIGURES))
    assert all(c >= 2 for c in counts), dict(zip(FIGURES, counts))  # plot svg + hover layer
    # the timeline's blocks are filled SVG polygons: one path per visible block trace, drawn
    drawn = page.page.evaluate(
        """() => { const gd = document.getElementById('fig-timeline');
          const traces = gd._fullData.filter(t => t.visible === true && t.fill === 'toself').length;
          const paths = [...gd.querySelectorAll('path.js-fill')]
            .filter(p => (p.getAttribute('d') || '').length > 100).length;
          return [traces, paths]; }""")
    assert drawn[0] >= 4 and drawn[1] == drawn[0], drawn  # idle, F, B, sends, recvs, ...
    assert page.errors == [] and page.blocked == [] and page.dialogs == []
    shot = tmp_path / "timeline.png"
    page.page.locator("#fig-timeline").screenshot(path=str(shot))
    assert shot.stat().st_size > 20_000
    if ARTIFACTS.is_dir():
        shutil.copy(shot, ARTIFACTS / "timeline.png")


@pytest.mark.slow
def test_trainer_timeline_blocks_per_stage_and_hover(browser, trainer_page):
    page = Page(browser).open(trainer_page)
    counts = page.page.evaluate(
        """() => {
          const gd = document.getElementById('fig-timeline');
          const ya = gd.layout.yaxis, stageOf = {};
          ya.tickvals.forEach((y, i) => {
            const m = / · pp(\\d+)/.exec(ya.ticktext[i]); if (m) stageOf[y] = +m[1]; });
          const out = {};
          for (const t of gd._fullData) {  // decoded arrays (gd.data keeps base64 specs)
            if (t.visible !== true || !t.meta || !['F', 'B', 'W'].includes(t.meta.phase)) continue;
            // one filled polygon per trace; a block is 4 corners (x0,lo) (x0,hi) (x1,hi) (x1,lo)
            // (dashboards.blocks.polygon_rects); the strokes joining blocks never match that
            const x = t.x, y = t.y;
            for (let i = 0; i + 3 < x.length; i++) {
              if (!(x[i] === x[i + 1] && y[i + 1] > y[i] && y[i + 2] === y[i + 1] &&
                    x[i + 2] >= x[i + 1] && x[i + 3] === x[i + 2] && y[i + 3] === y[i])) continue;
              const mid = (y[i] + y[i + 1]) / 2;  // the lane: the last one starting above it
              const lane = Object.keys(stageOf).map(Number).filter(v => v - 0.5 <= mid)
                .reduce((a, b) => Math.max(a, b));
              const k = t.meta.phase + stageOf[lane];
              out[k] = (out[k] || 0) + 1;
            }
          }
          return out;
        }""")
    assert counts == {f"{ph}{s}": M for ph in "FB" for s in range(P)}
    expected, shown = page.hover_block("F", "microbatch 2")
    assert "compute:fwd mb=2" in shown and "microbatch 2" in shown, shown
    assert "rank" in shown and "ms long" in shown
    # block labels follow the zoom: only blocks in view are labelled, all of them again after
    labels = """() => { const gd = document.getElementById('fig-timeline');
      const t = gd._fullData.find(t => t.visible === true && t.meta && t.meta.phase === 'labels');
      return {x: [...t.x], text: [...t.text], range: gd._fullLayout.xaxis.range}; }"""
    full = page.page.evaluate(labels)
    assert sorted(set(full["text"])) == sorted(f"{ph}{j}" for ph in "FB" for j in range(M))
    page.page.evaluate("""() => { const gd = document.getElementById('fig-timeline');
      const r = gd._fullLayout.xaxis.range;
      return Plotly.relayout(gd, {'xaxis.range': [r[0], r[0] + (r[1] - r[0]) / 4]}); }""")
    zoomed = page.page.evaluate(labels)
    assert zoomed["text"] and len(zoomed["text"]) < len(full["text"])
    assert all(zoomed["range"][0] <= x <= zoomed["range"][1] for x in zoomed["x"])
    assert page.page.locator("#fig-timeline .textpoint").count() == len(zoomed["text"])
    page.page.evaluate("Plotly.relayout('fig-timeline', {'xaxis.autorange': true})")
    assert sorted(page.page.evaluate(labels)["text"]) == sorted(full["text"])
    # the step buttons switch every trace, labels included, to the other profiled step
    page.page.locator("#fig-timeline .updatemenu-button").nth(1).click()
    page.page.wait_for_function("""() => document.getElementById('fig-timeline')._fullData
      .some(t => t.visible === true && t.meta && t.meta.phase === 'labels' && t.meta.step === 2)""")
    assert sorted(set(page.page.evaluate(labels)["text"])) == sorted(set(full["text"]))
    assert page.page.evaluate("""() => document.getElementById('fig-timeline')._fullData
      .filter(t => t.visible === true).every(t => t.meta.step === 2)""")
    assert page.errors == [] and page.blocked == []


def test_hostile_names_show_as_text_and_run_nothing(browser, tmp_path):
    html = _page_for(write_gpipe_run(tmp_path / "run", hostile=True), tmp_path / "hostile.html")
    page = Page(browser).open(html)
    _, shown = page.hover_block("F", "onerror")
    assert "<img/src=x/onerror=alert(1)>" in shown
    _, shown = page.hover_block("send", "alert(2)")
    assert "</script><script>alert(2)</script>" in shown
    assert page.page.locator("#fig-timeline .hoverlayer img").count() == 0
    assert page.page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.dialogs == [] and page.errors == [] and page.blocked == []


def test_png_export_through_kaleido(browser, tmp_path):
    """--png: kaleido drives the same system Chromium; one real image per figure asked for."""
    from dashboards.figures import bubble_figure
    from dashboards.page import write_pngs
    from pptrace.topology import Layout

    paths = write_pngs({"bubble": bubble_figure(synthetic_report(Layout(pp=4)))}, tmp_path / "png")
    assert [p.name for p in paths] == ["bubble.png"]
    data = paths[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert int.from_bytes(data[16:20], "big") == 1400  # the width asked for


@pytest.mark.slow
def test_ep_panel_renders_and_the_hot_ranks_experts_are_the_hot_rows(browser, ep_run, tmp_path):
    """An MoE run (dp 4 / ep 4, ep rank 2's experts at 2x the mean tokens) gets the ep panel
    (and a dense run does not: the trainer page's figure list above); its tokens heatmap's
    largest rows are rank 2's experts and the pairs' wait column of rank 2 is the hot one."""
    page = Page(browser).open(_page_for(ep_run("ep-dp4-hot"), tmp_path / "ep.html"))
    assert "fig-ep_load" in page.figure_ids and "fig-ep_pairs" in page.figure_ids
    assert page.errors == [] and page.blocked == [] and page.dialogs == []
    load = page.page.evaluate(
        """() => { const t = document.getElementById('fig-ep_load')._fullData[0];
          return [Array.from(t.y), Array.from(t.z, row => Array.from(row).reduce((a, b) => a + b, 0))]; }""")
    labels, totals = load
    hottest = {labels[i] for i, v in enumerate(totals) if v == max(totals)}
    assert len(hottest) == 2 and all("rank 2" in label or "dp2" in label for label in hottest), labels
    wait = page.page.evaluate("() => Array.from(document.getElementById('fig-ep_pairs')._fullData[1].z, "
                              "row => Array.from(row, v => Number.isNaN(v) ? null : v))")
    col = [row[2] for i, row in enumerate(wait) if i != 2]
    others = [v for i, row in enumerate(wait) for j, v in enumerate(row) if i != j and j != 2 and v is not None]
    assert min(col) > 10 * max(others), wait
    svgs = page.page.evaluate("() => ['ep_load', 'ep_pairs'].map(k => "
                              "document.querySelectorAll('#fig-' + k + ' .main-svg').length)")
    assert all(c >= 2 for c in svgs), svgs
