"""Issue 25 item 14: printed (or saved as PDF), no figure is split across two pages.

The timeline of 8 ranks is taller than a landscape page, so ``break-inside: avoid`` could not
keep it on one and the PDF split it in two. Printing now draws a figure no taller than its
section can be on one page. Checked in real headless Chromium: each section printed alone
(the others hidden) must make a one-page PDF, and back on screen each figure has its height
again."""
from __future__ import annotations

import json
import re

import pytest

from hostile import pptrace
from test_dashboard_browser import Page
from tracegen import pipeline_run

pytestmark = pytest.mark.browser


def _pages(pdf: bytes) -> int:
    assert pdf[:5] == b"%PDF-"
    return len(re.findall(rb"/Type\s*/Page(?!s)", pdf))


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    """The dashboard of an 8-rank run (pp4 dp2): its timeline is taller than a page."""
    root = tmp_path_factory.mktemp("print")
    run_dir, _ = pipeline_run(root / "run", pp=4, dp=2)
    html = root / "page.html"
    r = pptrace("dashboard", run_dir, "-o", html)
    assert r.returncode == 0, r.stderr[-2000:]
    return html


def _open(browser, html) -> Page:
    page = Page(browser)
    page.page.goto(html.resolve().as_uri())
    page.page.wait_for_function("document.getElementById('fig-timeline')._fullLayout")
    return page


def test_the_timeline_is_taller_than_a_page_on_screen(browser, page_file):
    page = _open(browser, page_file)
    # landscape A4 less the 10 mm margins: 190 mm at 96 px/in
    assert page.page.evaluate("document.getElementById('timeline').offsetHeight") > 190 / 25.4 * 96


def test_every_section_prints_on_one_page(browser, page_file):
    page = _open(browser, page_file)
    sections = page.page.evaluate("[...document.querySelectorAll('section')].map(s => s.id)")
    assert sections[0] == "timeline" and len(sections) >= 6
    screen = page.page.evaluate("[...document.querySelectorAll('.pptrace-fig')].map(d => d.offsetHeight)")
    page.page.evaluate("document.head.appendChild(Object.assign(document.createElement('style'), {id: 'alone'}))")
    for section in sections:
        page.page.evaluate(f"document.getElementById('alone').textContent = '@media print {{ header, "
                           f"section:not(#{section}) {{ display: none !important }} }}'")
        assert _pages(page.page.pdf(prefer_css_page_size=True, print_background=True)) == 1, section
    page.page.evaluate("document.getElementById('alone').remove()")
    assert _pages(page.page.pdf(prefer_css_page_size=True, print_background=True)) <= len(sections) + 1
    # back on screen: the heights the page was made with
    page.page.wait_for_function("JSON.stringify([...document.querySelectorAll('.pptrace-fig')].map(d => d.offsetHeight))"
                                f" == '{json.dumps(screen, separators=(',', ':'))}'", timeout=10_000)
    assert page.errors == [] and page.blocked == []
