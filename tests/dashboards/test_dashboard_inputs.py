"""The dashboard on the inputs people really debug with (issue 15, items 4 and 20): a rank
missing, unreadable or filtered out, a single rank's file, a plain GPU trace — the page is
written, through the real ``pptrace`` command, and shows only what applies to the run; and
printed (or saved as PDF) every figure is drawn, at a width the paper holds."""
from __future__ import annotations

import base64
import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from dashboards.figures import collectives_figure, p2p_matrix_figure, straggler_figure
from dashboards.style import PHASE_STYLE
from dashboards.page import PRINT_WIDTH_PX
from dashboard_runs import synthetic_report
from hostile import checksums, no_traceback, pptrace, stderr_lines
from pptrace.topology import Layout
from test_dashboard_browser import Page
from tracegen import pipeline_run

GPU_FIXTURES = sorted((Path(__file__).parents[1] / "data" / "hta-gpu").glob("*.json.gz"))
P = 4  # stages of the pipeline run; one rank each


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """A 4-stage GPipe run, one rank per stage, every rank's trace present."""
    return pipeline_run(tmp_path_factory.mktemp("pipeline") / "run", pp=P)[0]


@pytest.fixture
def run_copy(full_run, tmp_path) -> Path:
    """A private copy (the test breaks one of its ranks)."""
    dst = tmp_path / "run"
    shutil.copytree(full_run, dst, ignore=shutil.ignore_patterns(".pptrace-cache"))
    return dst


def figures_of(html: Path) -> dict:
    """figure key -> the figure's JSON as the page carries it."""
    text = html.read_text(encoding="utf-8")
    return {key: json.loads(body) for key, body in
            re.findall(r'<script type="application/json" id="data-fig-([a-z_0-9]+)">(.*?)</script>', text, re.S)}


def is_placeholder(fig: dict) -> bool:
    """A figure with nothing to draw: dashboards.style.empty_figure, an axis-less note."""
    return (fig["layout"].get("xaxis") or {}).get("visible") is False and not fig["data"]


def dashboard(target, out: Path, *args) -> dict:
    """``pptrace dashboard`` on ``target``: it succeeds, says nothing or one line on stderr,
    leaves the trace files as they were, and writes a page; returns the page's figures."""
    root = Path(target) if Path(target).is_dir() else Path(target).parent
    before = checksums(root)
    result = pptrace("dashboard", target, "-o", out, *args)
    no_traceback(result)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(stderr_lines(result)) <= 1, result.stderr
    assert checksums(root) == before
    assert out.is_file()
    return figures_of(out)


def array(values) -> np.ndarray:
    """A figure's data array as the page carries it (plotly writes numeric arrays as
    {dtype, bdata})."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
    return np.asarray(values, dtype=float)


def replay_lanes(figures: dict) -> list[str]:
    return list(figures["replay"]["layout"]["yaxis"]["ticktext"])


def replayed_stages(figures: dict) -> set[int]:
    """Stages with replayed blocks drawn: the rectangle corners' lanes in the replay figure."""
    lanes = replay_lanes(figures)
    drawn = set()
    for trace in figures["replay"]["data"]:
        if trace.get("fill") != "toself":
            continue
        for y in array(trace["y"]):
            label = lanes[int(round(float(y)))] if 0 <= round(float(y)) < len(lanes) else ""
            if label.startswith("replayed"):
                drawn.add(int(label.split("stage ")[1].split()[0]))
    return drawn


# ------------------------------------------------------------------------------------------
# item 4: a rank missing or filtered out still gives a page (was: KeyError ('replayed', N))
# ------------------------------------------------------------------------------------------
def _assert_pipeline_page(figures: dict, traced: set[int]):
    """Every stage keeps its measured and replayed lanes; an untraced stage's measured lane
    says so, and the replay (which assumes its passes) is drawn for every stage."""
    assert {"timeline", "replay", "partition", "bubble"} <= set(figures)
    lanes = replay_lanes(figures)
    assert lanes == [f"{source} · stage {s}" + (" (not traced)" if source == "measured" and s not in traced else "")
                     for s in range(P) for source in ("measured", "replayed")]
    assert replayed_stages(figures) == set(range(P))
    assert not is_placeholder(figures["replay"])


def test_ranks_0_and_3_of_4(run_copy, tmp_path):
    for rank in (1, 2):
        (run_copy / "traces" / f"rank{rank}.json.gz").unlink()
    figures = dashboard(run_copy, tmp_path / "page.html")
    _assert_pipeline_page(figures, traced={0, 3})
    # the what-if's assumption for the stages it could not see is printed under the figure
    html = (tmp_path / "page.html").read_text()
    assert "stage 1 has no traced passes" in html and "ranks shown</b> 2 of 4: 0, 3" in html


def test_one_rank_garbage(run_copy, tmp_path):
    (run_copy / "traces" / "rank2.json.gz").write_bytes(b"\x00garbage, not a trace\xff" * 100)
    _assert_pipeline_page(dashboard(run_copy, tmp_path / "page.html"), traced={0, 1, 3})


def test_one_rank_truncated(run_copy, tmp_path):
    """Rank 2's profiler died in step 2: its file stops mid-event, step 1 complete."""
    path = run_copy / "traces" / "rank2.json.gz"
    text = gzip.decompress(path.read_bytes())
    step1 = text.index(b'"ProfilerStep#1"')
    path.write_bytes(gzip.compress(text[: text.index(b"}", text.index(b"}", step1) + 1) + 300]))
    figures = dashboard(run_copy, tmp_path / "page.html")
    # whatever of the rank the loader keeps, the page has every stage's replay
    assert replayed_stages(figures) == set(range(P))


def test_one_rank_symlinked(run_copy, tmp_path):
    outside = tmp_path / "elsewhere" / "rank2.json.gz"
    outside.parent.mkdir()
    link = run_copy / "traces" / "rank2.json.gz"
    shutil.move(link, outside)
    link.symlink_to(outside)
    figures = dashboard(run_copy, tmp_path / "page.html")
    assert replayed_stages(figures) == set(range(P))
    assert outside.is_file() and link.is_symlink()


def test_ranks_filtered_to_0_and_3(full_run, tmp_path):
    figures = dashboard(full_run, tmp_path / "page.html", "--ranks", "0,3")
    _assert_pipeline_page(figures, traced={0, 3})


def test_a_single_rank_file(full_run, tmp_path):
    figures = dashboard(full_run / "traces" / "rank1.json.gz", tmp_path / "page.html")
    _assert_pipeline_page(figures, traced={1})


# ------------------------------------------------------------------------------------------
# item 20: what does not apply is not drawn; the numbers say what they are
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", GPU_FIXTURES, ids=[p.name.split(".")[0] for p in GPU_FIXTURES])
def test_gpu_fixture_page_has_no_empty_panels(fixture, tmp_path):
    """Plain GPU traces have no pipeline: no bubble, p2p, replay or microbatch count on the
    page, and no panel that only says it has nothing to show."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(fixture, run_dir / fixture.name)
    out = tmp_path / "page.html"
    figures = dashboard(run_dir, out)
    assert not {"bubble", "p2p_links", "replay"} & set(figures), sorted(figures)
    # the timeline applies to every run; with nothing to draw it says why, nothing else may
    empty = {key: fig["layout"]["annotations"][0]["text"] for key, fig in figures.items() if is_placeholder(fig)}
    assert set(empty) <= {"timeline"}, empty
    assert all("no pipeline, communication or compute ranges" in why for why in empty.values())
    html = out.read_text()
    assert "<b>microbatches</b>" not in html and "<b>bubble</b>" not in html
    assert "<title>pptrace · run · " in html
    if "stragglers" in figures:  # only with two ranks or more, and then no pp_bubble panel
        assert all(t["type"] == "heatmap" for t in figures["stragglers"]["data"])
        assert len(figures["stragglers"]["data"]) == 1


def test_cp_ring_exchanges_show_in_the_communication_per_rank():
    """A ring attention's cp exchanges are p2p ranges: the report's collectives rows have no
    wait/transfer split for cp, but every rank's partition holds its cp time. The figure draws
    each rank's cp_exposed and hidden cp, as the report gives them."""
    layout = Layout(cp=2, pp=2)
    report = synthetic_report(layout)
    for i, r in enumerate(report["ranks"]):
        r["mean"]["breakdown_s"]["cp_exposed"] = 0.1 + 0.01 * i
        r["mean"]["hidden_s"]["cp"] = 0.02
    report["collectives"] = [{"dim": "cp", "count": 8.0, "exposed_s": 0.115, "hidden_s": 0.02,
                              "wait_s": 0.0, "transfer_s": 0.0}]
    fig = collectives_figure(report)
    by_name = {t.name: t for t in fig.data}
    order = [r["rank"] for r in sorted(report["ranks"], key=lambda r: (r["coords"]["pp"], r["rank"]))]
    assert [round(v, 6) for v in by_name["cp exposed"].y] == [round(100 + 10 * r, 6) for r in order]
    assert list(by_name["cp hidden under compute"].y) == pytest.approx([20.0] * 4)
    assert not any(name.startswith("wait") for name in by_name)  # no split: no empty panel
    # the straggler's slowdown is a relative excess for compute: +50%, not "0.50x"
    report["stragglers"] = [{"rank": 1, "metric": "compute", "slowdown": 0.5, "cost_s": 0.004}]
    title = straggler_figure(report).layout.title.text
    assert "+50% vs the median rank" in title and "0.50x" not in title


def test_legend_order_is_fixed(run_copy, tmp_path):
    """The timeline's legend lists the phases in one order whatever order they first occur
    in (the last stage starts with a recv, the first with a forward)."""
    figures = dashboard(run_copy, tmp_path / "page.html", "--ranks", "3")
    first = min(t["meta"]["step"] for t in figures["timeline"]["data"])
    names = [t["name"] for t in figures["timeline"]["data"] if t.get("showlegend", True) and t.get("name")
             and t["meta"]["step"] == first and t["meta"]["phase"] in PHASE_STYLE]
    style_order = [PHASE_STYLE[p][0] for p in PHASE_STYLE]
    assert names == sorted(names, key=style_order.index) and len(names) >= 3


# ------------------------------------------------------------------------------------------
# item 20: printed, every figure is drawn and fits the paper (real headless Chromium)
# ------------------------------------------------------------------------------------------
@pytest.mark.browser
def test_print_to_pdf_draws_every_figure(browser, run_copy, tmp_path):
    (run_copy / "traces" / "rank2.json.gz").unlink()
    html = tmp_path / "page.html"
    figures = dashboard(run_copy, html)
    page = Page(browser)
    page.page.goto(html.resolve().as_uri())
    page.page.wait_for_function("document.getElementById('fig-timeline')._fullLayout")
    ids = page.page.evaluate("[...document.querySelectorAll('.pptrace-fig')].map(d => d.id)")
    assert ids == [f"fig-{key}" for key in figures] and len(ids) == 8
    # figures are drawn as they scroll into view: most are blank before printing
    assert page.page.evaluate("[...document.querySelectorAll('.pptrace-fig')].filter(d => !d._fullLayout).length") >= 3
    # what every figure holds while the page is laid out for print (this listener runs after
    # the page's own)
    page.page.evaluate("""() => { window.__printed = null; window.addEventListener('beforeprint', () => {
        window.__printed = [...document.querySelectorAll('.pptrace-fig')].map(d => ({
          id: d.id, width: d._fullLayout ? d._fullLayout.width : null,
          svgs: d.querySelectorAll('.main-svg').length,
          marks: d.querySelectorAll('.overplot path, .overplot image, .overplot text').length,
          svg_width: d.querySelector('.main-svg') ? d.querySelector('.main-svg').getBoundingClientRect().width : 0}));
      }); }""")
    pdf = page.page.pdf(prefer_css_page_size=True, print_background=True)
    printed = page.page.evaluate("window.__printed")
    assert printed is not None, "printing sent no beforeprint"
    for fig in printed:
        assert fig["svgs"] >= 2 and fig["marks"] > 0, fig  # drawn: plot and hover layers, marks
        assert fig["width"] == PRINT_WIDTH_PX and fig["svg_width"] <= PRINT_WIDTH_PX, fig
    pages = len(re.findall(rb"/Type\s*/Page(?!s)", pdf))
    assert pdf[:5] == b"%PDF-" and pages > 1 and len(pdf) > 50_000, (pages, len(pdf))
    # back on screen the figures take the window's width again
    page.page.wait_for_function(
        f"[...document.querySelectorAll('.pptrace-fig')].every(d => d._fullLayout.width > {PRINT_WIDTH_PX})")
    assert page.errors == [] and page.blocked == [] and page.dialogs == []


def test_hover_units_and_axes(run_copy, tmp_path):
    """One unit in hover text (ms; bytes in B), no hover on a rank pair without a link (it
    read "bytes: NaN"), and the replay's axis reaching past its last block."""
    (run_copy / "traces" / "rank2.json.gz").unlink()
    figures = dashboard(run_copy, tmp_path / "page.html")
    hover = [h for t in figures["timeline"]["data"] for h in t.get("hovertext") or []]
    assert hover and all(h.endswith(" long") and " ms" in h for h in hover), hover[:3]
    assert not any("µs" in h for h in hover)
    links = synthetic_report(Layout(pp=4))
    heatmaps = p2p_matrix_figure(links).data
    assert all(h.hoverongaps is False for h in heatmaps)
    assert "B<extra>" in heatmaps[0].hovertemplate and "ms<extra>" in heatmaps[1].hovertemplate
    replay = figures["replay"]
    last_end = max(array(t["x"]).max() for t in replay["data"] if t.get("fill") == "toself")
    assert replay["layout"]["xaxis"]["range"][1] > last_end
