"""The dashboard as an output: gathers what the page draws — the report, the step
partitions it was built from (the timeline's grey is their pp_bubble) and the what-if
replay, or why there is none — and hands them to ``dashboards`` (which computes nothing)."""
from __future__ import annotations

from pathlib import Path

from ..analyzers.partition import partition_run
from ..progress import WRITE, phased
from ..whatif.predict import whatif


@phased(f"{WRITE} the dashboard")
def write_page(run, report: dict, path, png_dir=None) -> Path:
    """Write the dashboard of ``run`` beside its contract-4 ``report``; returns the path."""
    from dashboards import write_dashboard

    result, note = None, None
    if run.layout.pp > 1:
        try:
            result = whatif(run)
        except ValueError as exc:  # a run the simulator cannot replay: the page says why
            note = " ".join(str(exc).split())
    return write_dashboard(run, report, path, partitions=partition_run(run), whatif_result=result,
                           whatif_note=note, png_dir=png_dir)
