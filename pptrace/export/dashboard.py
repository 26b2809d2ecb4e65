"""The dashboard as an output: hands ``dashboards`` (which computes nothing) what the page
draws, all of it from one :class:`~pptrace.analysis.Analysis`: the report, the step
partitions it was built from (the timeline's grey is their pp_bubble), the ranges the timeline
draws and the what-if replay
of the step as measured, or why there is none."""
from __future__ import annotations

from pathlib import Path

from ..progress import WRITE, phased


@phased(f"{WRITE} the dashboard")
def write_page(analysis, path, png_dir=None) -> Path:
    """Write the dashboard of ``analysis`` (``pptrace.analyze(run)``) to ``path``; returns it."""
    from dashboards import write_dashboard

    result, note = analysis.replay
    return write_dashboard(analysis.run, analysis.to_json(), path, partitions=analysis.partitions,
                           ranges=analysis.drawn_ranges, whatif_result=result, whatif_note=note, png_dir=png_dir)


@phased(f"{WRITE} the diff page")
def write_diff_page(document: dict, path) -> Path:
    """Write the page of a diff document (``pptrace.diff(base, new)``) to ``path``; returns it."""
    from dashboards.diff_page import write_diff_page as write

    return write(document, path)
