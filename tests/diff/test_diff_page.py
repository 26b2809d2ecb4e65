"""The diff page (`pptrace diff --html`) in real headless Chromium, offline: it loads, its three
figures render with what the document holds, and nothing errs or reaches for the network."""
from __future__ import annotations

from pathlib import Path

import pytest

from diff_docs import cell, document
from pptrace.diff import diff

pytestmark = pytest.mark.browser

def _page(tmp_path) -> tuple[Path, dict]:
    from pptrace.export.dashboard import write_diff_page

    doc = diff(document(lambda r, s, step: cell(), microbatches=3),
               document(lambda r, s, step: cell(bwd=0.020 + 0.004 * (s == 1), schedule=0.007), microbatches=3),
               gates=["step>+1%"])
    return write_diff_page(doc, tmp_path / "diff.html"), doc


def test_diff_page_renders_offline(browser, tmp_path):
    html, doc = _page(tmp_path)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors, blocked = [], []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://")
               else (blocked.append(r.request.url), r.abort()))
    page.goto(html.resolve().as_uri())
    ids = page.evaluate("[...document.querySelectorAll('.pptrace-fig')].map(d => d.id)")
    assert ids == ["fig-waterfall", "fig-stages", "fig-timelines"]
    for fig in ids:
        page.locator(f"#{fig}").scroll_into_view_if_needed()
        page.wait_for_function(f"document.getElementById('{fig}')._fullLayout", timeout=30000)
    drawn = page.evaluate("""() => {
      const w = document.getElementById('fig-waterfall')._fullData[0];
      const t = document.getElementById('fig-timelines')._fullData.filter(d => d.fill === 'toself');
      return {bars: w.x.length, first: w.x[0], last: w.x[w.x.length - 1], y0: w.y[0],
              sides: [...new Set(t.map(d => d.meta.side))], phases: [...new Set(t.map(d => d.meta.phase))],
              stacks: document.getElementById('fig-stages')._fullData.length}; }""")
    moved = [i for i in doc["waterfall"]["items"] if i["delta_s"]]
    assert drawn["bars"] == len(moved) + 2 and (drawn["first"], drawn["last"]) == ("BASE step", "NEW step")
    assert drawn["y0"] == pytest.approx(1e3 * doc["step"]["base_s"])
    assert sorted(drawn["sides"]) == ["BASE", "NEW"] and sorted(drawn["phases"]) == ["B", "F"]
    assert drawn["stacks"] >= 3  # compute, bubble, transfer, other
    assert doc["verdict"]["line"] in page.locator("header").inner_text()
    assert errors == [] and blocked == []
