"""One self-contained, offline HTML page per run: header, timeline, and the report's views.

plotly.js is embedded once (a CDN link would fail offline). Plotly's own JSON writer escapes
``<``, ``>`` and ``/`` as ``\\u003c`` etc., so trace names cannot close the script tag; the header
is plain HTML and goes through :func:`html.escape`.
"""
from __future__ import annotations

import html
import json
import logging
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import plotly.io as pio
from plotly.offline import get_plotlyjs

from pptrace.errors import TraceError
from pptrace.output import cannot_write, replacing, write_file
from pptrace.vocab import LAYOUT_DIMS

from .blocks import LABEL_MIN_FONT_PX, MAX_LABELS_IN_VIEW
from .figures import report_figures
from .pipeline_figures import replay_figure, timeline_figure
from .timeline import build_timeline

SECTIONS = (  # (figure key, heading, what to read in it)
    ("timeline", "Pipeline timeline",
     "One lane group per rank, pipeline stages top to bottom. F (forward), B (backward) and W "
     "(weight-gradient) blocks are labelled by microbatch (.chunk when interleaved) where the "
     "label fits: zoom in on a large run. Grey = the rank's pipeline bubble, idle while waiting "
     "for another stage (the report's number, interval by interval); dotted lines = the "
     "pipeline window, from the step's first to its last pipeline work. Drag to zoom, "
     "double-click to reset, buttons switch steps."),
    ("replay", "Measured vs replayed schedule",
     "The what-if simulator replays this run's schedule from its measured pass times and p2p "
     "latencies (`pptrace whatif`); a gap between the two lanes is time the model does not explain."),
    ("partition", "Where each rank's step goes",
     "Compute, the communication compute did not hide (per parallel dimension), pipeline "
     "transfer and bubble, and the rest: the parts add up to the step time."),
    ("bubble", "Bubble: measured vs theory",
     "Theory: the bubble the schedule itself leaves with free p2p, from this run's measured "
     "forward and backward pass times."),
    ("comm", "Communication",
     "Exposed = communication while nothing else ran (it lengthens the step); hidden = "
     "communication under compute."),
    ("p2p_links", "p2p links",
     "Wait = a receive posted before its send, waiting for it (bubble); transfer = moving the "
     "data once both sides had posted."),
    ("collectives", "Collectives", ""),
    ("ep_load", "Experts and expert parallelism",
     "Tokens each expert processed per step (one row per expert and the rank holding it): a hot "
     "row is the rank the others wait for in the all-to-alls. Beside it, each rank's ep time: "
     "exposed vs hidden under compute, and its collectives' wait for the slowest peer vs transfer."),
    ("ep_pairs", "ep rank pairs",
     "Tokens each rank sent each peer in its all-to-alls (dispatch and combine, forward and "
     "backward), and how long the sender waited for that peer: the last to arrive."),
    ("stragglers", "Stragglers", ""),
)
# Nothing on this page needs the network; the policy makes that a guarantee. No eval either:
# the page draws no WebGL traces (regl compiles its shaders with Function()).
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; worker-src blob:")
_STYLE = """
body{font-family:system-ui,sans-serif;margin:0 24px 40px;color:#222}
header{border-bottom:1px solid #ccc;padding:12px 0}
h1{font-size:20px;margin:6px 0} h2{font-size:17px;margin:28px 0 2px}
.facts span{display:inline-block;margin-right:18px;font-size:14px}
.note{color:#666;font-size:13px;margin:0 0 6px}
.warnings{background:#fff6e0;border:1px solid #e8c66d;padding:6px 12px;font-size:13px}
.warnings li{margin:2px 0}
.fig-notes{color:#666;font-size:13px;margin:0 0 6px}
@page{size:landscape;margin:10mm}
@media print{
body{margin:0}
section,.warnings{break-inside:avoid;page-break-inside:avoid}
h2{break-after:avoid;page-break-after:avoid}
.modebar-container{display:none!important}
}
"""
# Printed, a figure is drawn this wide: inside a landscape A4 or Letter page less the @page
# margins (277 mm ~ 1047 px, 259 mm ~ 980 px), so nothing is clipped at the right edge.
PRINT_WIDTH_PX = 960
# ... and a section (heading, note, figure) at most this tall: a landscape A4 page less the
# margins (190 mm ~ 718 px; Letter 196 mm), less a little for the line breaks the print width
# moves. A taller figure (the timeline of 8 ranks or more) is drawn shorter: break-inside:
# avoid cannot keep a section taller than the page on one page.
PRINT_HEIGHT_PX = 690


def _run_name(run) -> str | None:
    """What the run is called: its folder (the one above traces/), or its one trace file."""
    source = getattr(run, "path", None) or getattr(run, "run_dir", None)
    if not source:
        return None
    source = Path(source)
    return source.parent.name if source.name == "traces" and source.parent.name else source.name


def page_title(run, report: dict) -> str:
    """The browser tab's and the printout's title: which run, which layout (every page said
    "pptrace dashboard", so open tabs and printed pages could not be told apart)."""
    info = report.get("run") or {}
    layout = info.get("layout") or {}
    parts = [_run_name(run), " ".join(f"{d}{layout[d]}" for d in LAYOUT_DIMS if d in layout) or None]
    if (layout.get("pp") or 1) > 1 and info.get("schedule"):
        parts.append(str(info["schedule"]))
    return " · ".join(["pptrace", *(str(p) for p in parts if p)])


def _header(run, report: dict) -> str:
    info = report.get("run") or {}
    layout = info.get("layout") or {}
    layout_text = " ".join(f"{d}={layout[d]}" for d in LAYOUT_DIMS if d in layout)
    if layout.get("order"):
        layout_text += f" (order {layout['order']})"
    pipeline = (layout.get("pp") or 1) > 1
    world, traced = info.get("world_size"), info.get("ranks")
    facts = [
        ("layout", layout_text or "unknown"),
        ("world size", world),
        # a rank missing or filtered out changes every view: say which ones the page shows
        ("ranks shown", f"{len(traced)} of {world}: {_rank_list(traced)}"
         if traced is not None and world and len(traced) < world else None),
        # schedule, microbatches and vpp describe a pipeline; 0 microbatches means unknown
        ("schedule", info.get("schedule") if pipeline else None),
        ("microbatches", info.get("microbatches") if pipeline and info.get("microbatches") else None),
        ("vpp", info.get("vpp") if pipeline else None),
        ("steps", ", ".join(str(s) for s in info.get("steps") or []) or None),
    ]
    pipe = report.get("pipeline") or {}
    if pipeline and pipe.get("bubble_fraction") is not None:
        facts.append(("bubble", f"{100 * pipe['bubble_fraction']:.1f}% of step"))
    facts_html = "".join(
        f"<span><b>{html.escape(k)}</b> {html.escape(str(v))}</span>"
        for k, v in facts if v not in (None, ""))
    warnings = list(dict.fromkeys([*(report.get("warnings") or []),
                                   *(getattr(run, "warnings", None) or [])]))
    warn_html = ""
    if warnings:
        items = "".join(f"<li>{html.escape(str(w))}</li>" for w in warnings)
        warn_html = f'<div class="warnings"><b>{len(warnings)} warning(s)</b><ul>{items}</ul></div>'
    source = getattr(run, "path", None) or getattr(run, "run_dir", None)
    title = f"pptrace — {source}" if source else "pptrace run"
    return (f'<header><h1>{html.escape(str(title))}</h1><div class="facts">{facts_html}</div>'
            f"{warn_html}</header>")


def _rank_list(ranks, shown: int = 16) -> str:
    ranks = [str(r) for r in ranks]
    return ", ".join(ranks[:shown]) + (f", … ({len(ranks) - shown} more)" if len(ranks) > shown else "")


def build_figures(run, report: dict, *, partitions, ranges, whatif_result: dict | None = None,
                  whatif_note: str | None = None) -> dict:
    """The page's figures, drawn from what the caller computed: the contract-4 ``report``,
    the Partitions it was built from (``partitions``: the timeline's grey is their
    pp_bubble), the ranges the timeline draws, where they ran (``ranges``:
    ``projection.drawn_ranges``) and the what-if result of the run (``whatif_result``; when
    there is none, ``whatif_note`` says why). Nothing is analysed here: the windows are the
    Run's own."""
    steps = (report.get("run") or {}).get("steps") or None
    tl = build_timeline(ranges, run.layout, run.step_windows, run.pipeline_windows,
                        partitions, ranks=run.events["rank"].unique(), steps=steps)
    figures = {"timeline": timeline_figure(tl)}
    if run.layout.pp > 1:
        figures["replay"] = replay_figure(report, whatif_result, why_none=whatif_note)
    figures.update(report_figures(report))
    return figures


_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False,
           "toImageButtonOptions": {"format": "png", "scale": 2}}
# Figures are drawn when they scroll into view: on a 64-rank run each plot costs a few hundred
# ms of layout, and nobody looks at the heatmaps before the timeline. The figure JSON sits in
# inert application/json blocks and is parsed with JSON.parse, never evaluated.
# Block labels (F3, B3.1, ...) are drawn only where they can be read: the figure carries the
# ones readable at full view, and each zoom, pan or step switch redraws those of the blocks in
# view by the rule of dashboards.blocks.fitting_labels (all of a step's labels ride along in
# the label trace's meta). Labels are built from numbers, never from trace names.
_BOOT = """(function () {
  var config = __CONFIG__, LABELS = __LABELS__, PRINT_WIDTH = __PRINT_WIDTH__, PRINT_HEIGHT = __PRINT_HEIGHT__;
  function fitLabels(gd) {
    var xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
    if (!xa || !ya || !xa.range || !ya.range) return;
    var xlo = Math.min(xa.range[0], xa.range[1]), xhi = Math.max(xa.range[0], xa.range[1]);
    var ylo = Math.min(ya.range[0], ya.range[1]), yhi = Math.max(ya.range[0], ya.range[1]);
    var pxPerMs = xa._length / (xhi - xlo), font = Math.min(11, 0.55 * ya._length / (yhi - ylo));
    var idx = [], xs = [], ys = [], texts = [];
    gd.data.forEach(function (t, i) {
      var L = t.meta && t.meta.labels, x = [], y = [], text = [];
      if (!L) return;
      if (t.visible === true && font >= LABELS.min_font) {
        for (var j = 0; j < L.x.length; j++) {
          if (L.x[j] < xlo || L.x[j] > xhi || L.y[j] < ylo || L.y[j] > yhi) continue;
          if (L.w[j] * pxPerMs < 0.62 * font * L.text[j].length + 4) continue;
          x.push(L.x[j]); y.push(L.y[j]); text.push(L.text[j]);
        }
        if (x.length > LABELS.max_in_view) { x = []; y = []; text = []; }
      }
      idx.push(i); xs.push(x); ys.push(y); texts.push(text);
    });
    if (idx.length) Plotly.restyle(gd, {x: xs, y: ys, text: texts, 'textfont.size': font}, idx);
  }
  function draw(div) {
    if (div.getAttribute('data-drawn')) return;
    div.setAttribute('data-drawn', '1');
    var fig = JSON.parse(document.getElementById('data-' + div.id).textContent);
    fig.data.forEach(function (t) {  // see _inert_json: one hover text per block on the page
      if (!t.meta || !t.meta.hover_packed) return;
      var counts = t.meta.hover_repeat, packed = t.hovertext, text = [];
      for (var i = 0; i < packed.length; i++)
        for (var k = 0; k < counts[i]; k++) text.push(packed[i]);
      t.hovertext = text;
    });
    var labelled = fig.data.some(function (t) { return t.meta && t.meta.labels; });
    Plotly.newPlot(div, fig.data, fig.layout, config).then(function (gd) {
      if (!labelled) return;
      gd.on('plotly_relayout', function () { fitLabels(gd); });
      gd.on('plotly_update', function () { fitLabels(gd); });
    });
  }
  var divs = document.querySelectorAll('.pptrace-fig');
  // Printing (or saving as PDF) lays out every page at once, and a figure never scrolled to
  // would print blank: draw them all first, at a width that fits the paper, and give the
  // screen its width back afterwards. The print media query is watched as well as the
  // beforeprint event, whichever a browser sends first. (A figure is drawn at the screen's
  // width and then resized: one plotted with a width cannot be given back to autosize,
  // Plotly fails on {width: null}.)
  var printing = false;
  function forPrint() {
    if (printing) return;
    printing = true;
    divs.forEach(function (d) {
      draw(d);
      if (!d._fullLayout) return;
      var update = {}, room = PRINT_HEIGHT - (d.parentNode.offsetHeight - d.offsetHeight);
      if (d._fullLayout.width !== PRINT_WIDTH) update.width = PRINT_WIDTH;
      if (d._fullLayout.height > room) {  // its section on one page
        d.__screen = {height: d._fullLayout.height, style: d.style.height};
        update.height = room;
        d.style.height = room + 'px';
      }
      if (Object.keys(update).length) Plotly.relayout(d, update);
    });
  }
  function forScreen() {
    if (!printing) return;
    printing = false;
    divs.forEach(function (d) {
      if (!d._fullLayout) return;
      var back = {width: null};
      if (d.__screen) { back.height = d.__screen.height; d.style.height = d.__screen.style; d.__screen = null; }
      Plotly.relayout(d, back);
    });
  }
  window.addEventListener('beforeprint', forPrint);
  window.addEventListener('afterprint', forScreen);
  if (window.matchMedia) {
    var media = window.matchMedia('print'), onMedia = function (m) { m.matches ? forPrint() : forScreen(); };
    if (media.addEventListener) media.addEventListener('change', onMedia); else media.addListener(onMedia);
  }
  if (!('IntersectionObserver' in window)) { divs.forEach(function (d) { draw(d); }); return; }
  var seen = new IntersectionObserver(function (entries) {
    entries.forEach(function (e) {
      if (e.isIntersecting) { seen.unobserve(e.target); draw(e.target); }
    });
  }, {rootMargin: '300px'});
  divs.forEach(function (d) { seen.observe(d); });
})();"""


def _inert_json(fig) -> str:
    """The figure's JSON for the page. A hover trace repeats each block's text on its points
    (``meta.hover_repeat``: how many, block by block); the page carries it once per block and
    the loader repeats it back before plotting (most of a large timeline's bytes are hover text)."""
    spec = fig.to_plotly_json()
    for trace in spec.get("data", []):
        counts = (trace.get("meta") or {}).get("hover_repeat")
        text = trace.get("hovertext")
        if counts and isinstance(text, (list, tuple)) and len(text) == sum(counts):
            starts = np.cumsum([0, *counts[:-1]])
            trace["hovertext"] = [text[i] for i in starts]
            trace["meta"] = {**trace["meta"], "hover_packed": True}
    # Plotly already writes < > / as \u003c-style escapes; this keeps "</script" out regardless.
    return pio.json.to_json_plotly(spec).replace("</", "<\\/")


def render_html(run, report: dict, figures: dict) -> str:
    return page_html(page_title(run, report), _header(run, report), SECTIONS, figures)


def page_html(title: str, header_html: str, sections, figures: dict) -> str:
    """A page: ``header_html`` (escaped by the caller), then each of ``sections`` ((figure
    key, heading, note), as SECTIONS) whose figure is in ``figures``, drawn as it scrolls into
    view; plotly.js inline, no network."""
    body = []
    for key, heading, note in sections:
        if key not in figures:
            continue
        height = int(figures[key].layout.height or 450)
        note_html = f'<p class="note">{html.escape(note)}</p>' if note else ""
        # what the figure's source said about its numbers (the what-if's assumptions, a
        # down-sampled timeline), above the figure: under a tall timeline nobody would see it
        meta = figures[key].layout.meta
        fig_notes = meta.get("notes") if isinstance(meta, dict) else None
        notes_html = ("<ul class=\"fig-notes\">" + "".join(
            f"<li>{html.escape(str(n))}</li>" for n in fig_notes) + "</ul>") if fig_notes else ""
        body.append(
            f'<section id="{key}"><h2>{html.escape(heading)}</h2>{note_html}{notes_html}'
            f'<div id="fig-{key}" class="pptrace-fig" style="height:{height}px"></div>'
            f'<script type="application/json" id="data-fig-{key}">{_inert_json(figures[key])}</script>'
            "</section>")
    labels = {"min_font": LABEL_MIN_FONT_PX, "max_in_view": MAX_LABELS_IN_VIEW}
    boot = (_BOOT.replace("__CONFIG__", json.dumps(_CONFIG)).replace("__LABELS__", json.dumps(labels))
            .replace("__PRINT_WIDTH__", str(PRINT_WIDTH_PX)).replace("__PRINT_HEIGHT__", str(PRINT_HEIGHT_PX)))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        f"{header_html}{''.join(body)}<script>{boot}</script></body></html>\n"
    )


def write_pngs(figures: dict, png_dir) -> list[Path]:
    """Static images through kaleido and the system Chromium."""
    given = os.environ.get("BROWSER_PATH")
    if given and not os.access(given, os.X_OK):
        raise ValueError(f"cannot write PNGs: BROWSER_PATH={given} is not an executable; "
                         "point it at a Chrome/Chromium binary or unset it")
    if not given:
        found = shutil.which("chromium") or shutil.which("chromium-browser")
        if found:
            os.environ["BROWSER_PATH"] = found  # kaleido's choreographer looks here first
    png_dir = Path(png_dir)
    paths = [png_dir / f"{key}.png" for key in figures]
    # choreographer logs (with a traceback) every browser message it cannot parse and then
    # carries on; the images are fine, so its chatter stays out of the user's terminal.
    chatter = logging.getLogger("choreographer")
    level = chatter.level
    chatter.setLevel(logging.CRITICAL)
    try:
        # each image whole or not at all, and none replaced unless all were made
        with ExitStack() as stack:
            temporary = [stack.enter_context(replacing(path)) for path in paths]
            pio.write_images(list(figures.values()), temporary, width=1400, scale=1)
            # kaleido deletes the file of a render that failed (a browser tab that timed out
            # on a loaded machine) and may carry on: those get one more try, then one line
            missing = [k for k, tmp in enumerate(temporary) if not tmp.exists() or not tmp.stat().st_size]
            if missing:
                pio.write_images([list(figures.values())[k] for k in missing], [temporary[k] for k in missing],
                                 width=1400, scale=1)
            missing = [paths[k].name for k, tmp in enumerate(temporary) if not tmp.exists() or not tmp.stat().st_size]
            if missing:
                raise ValueError(f"Chromium made no image for {', '.join(missing)} (twice)")
    except TraceError:
        raise
    except OSError as exc:  # the disk, not the browser: no Chromium hint
        raise cannot_write(png_dir, exc) from None
    except Exception as exc:  # kaleido's errors are long; the user needs the fix, in one line
        raise ValueError(
            f"could not write PNGs to {png_dir}: {type(exc).__name__}: {' '.join(str(exc).split())[:200]} "
            "(install Debian 'chromium' or set BROWSER_PATH to a Chrome/Chromium binary)"
        ) from None
    finally:
        chatter.setLevel(level)
    return paths


def write_dashboard(run, report: dict, out_path, *, partitions, ranges, whatif_result: dict | None = None,
                    whatif_note: str | None = None, png_dir=None) -> Path:
    """Write the page for ``run`` (a :class:`pptrace.run.Run`), its contract-4 ``report``
    and the results beside it (see :func:`build_figures`); with ``png_dir``, also one PNG per
    figure. Returns the HTML path."""
    out_path = Path(out_path)
    figures = build_figures(run, report, partitions=partitions, ranges=ranges, whatif_result=whatif_result,
                            whatif_note=whatif_note)
    write_file(out_path, render_html(run, report, figures).encode("utf-8"))
    if png_dir is not None:
        write_pngs(figures, png_dir)
    return out_path
