"""The diff's page (``pptrace diff --html``): a header with the verdict, the sentences and what
changed in the set-up, then the diff figures; assembled as the run dashboard is (page.py:
self-contained, offline, figures drawn as they scroll into view)."""
from __future__ import annotations

import html
from pathlib import Path

from pptrace.output import write_file

from .diff_figures import diff_figures
from .page import page_html

SECTIONS = (
    ("waterfall", "What the step's change is made of",
     "From BASE's step time (mean over ranks) to NEW's: each bar is the change of one part of the step "
     "partition (compute by pass type, the bubble's schedule and latency parts, p2p transfer, exposed "
     "communication, other); they add up to the measured change. * = beyond both runs' own noise."),
    ("stages", "Per stage, side by side", "Each stage's step partition in BASE and in NEW."),
    ("timelines", "The two pipelines", "A typical step of each run (the one nearest its median step time), "
     "the first rank of each stage, on one time axis: gaps are the bubble."),
)


def _header(doc: dict) -> str:
    b, n = doc["base"], doc["new"]
    verdict = doc["verdict"]
    css = "#fde2e1" if verdict["status"] == "fail" else "#e6f4ea" if verdict["status"] == "pass" else "#eef1f6"
    lines = "".join(f"<li>{html.escape(s)}</li>" for s in doc["explanation"])
    warn = "".join(f"<li>{html.escape(w)}</li>" for w in doc["warnings"])
    side = lambda s: (f"<b>{html.escape(str(s['label']))}</b> {html.escape(s['layout_text'])}, "  # noqa: E731
                      f"{html.escape(str(s['schedule'] or '?'))}, m {html.escape(str(s['microbatches'] or '?'))}")
    return (f"<header><h1>pptrace diff</h1><div class=\"facts\"><span>BASE {side(b)}</span><span>NEW {side(n)}</span>"
            f"</div><p style=\"background:{css};padding:6px 12px\"><b>{html.escape(verdict['line'])}</b></p>"
            f"<ul class=\"note\">{lines}</ul>"
            + (f'<div class="warnings"><ul>{warn}</ul></div>' if warn else "") + "</header>")


def render_diff_html(doc: dict) -> str:
    title = f"pptrace diff · {doc['base']['label']} vs {doc['new']['label']}"
    return page_html(title, _header(doc), SECTIONS, diff_figures(doc))


def write_diff_page(doc: dict, out_path) -> Path:
    """Write the diff document's page to ``out_path``; returns it."""
    out_path = Path(out_path)
    write_file(out_path, render_diff_html(doc).encode("utf-8"))
    return out_path
