"""Cross-check pptrace's GPU-timeline numbers against HTA (HolisticTraceAnalysis, installed as
the ``traceinsight`` distribution: ``pip install 'pptrace[hta]'``) on the same trace files.

HTA's ``get_temporal_breakdown`` splits each rank's GPU span into compute (non-NCCL,
non-memory kernels), non-compute (NCCL and memcpy/memset time not under compute) and idle;
``get_comm_comp_overlap`` gives the share of NCCL kernel time that ran under compute
kernels. pptrace's :mod:`pptrace.analyzers.gpu_timeline` computes the same quantities per step;
this module sums them over the steps HTA covers and prints both side by side.

Where the two differ by design (expect well under 2 percentage points on real traces):

- **Span.** HTA measures one span per rank, from the first to the last GPU activity
  launched before the *last* ProfilerStep began (it drops the last step as possibly
  incomplete, and keeps work launched before the first step). pptrace sums per-step GPU
  windows (first to last activity launched inside each ProfilerStep), so the gaps between
  steps and pre-step work are in HTA's idle time and in no pptrace step. The comparison
  uses the same steps (all profiled steps but the last) to keep the rest equal.
- **Memory kernels.** Both count memcpy/memset as neither compute nor communication;
  pptrace reports them apart (``memcpy_s``), HTA folds them into non-compute.
- **What is communication.** HTA: kernels named ``nccl*Kernel*``; pptrace the same, but it
  also tells point-to-point (pipeline) kernels from collectives through the op that launched
  them, which changes the attribution, not the totals compared here.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings as pywarnings
from pathlib import Path

import pandas as pd

from ..analyzers.gpu_timeline import gpu_timeline
from ..errors import TraceError
from ..sweeps import isin
from ..timeline.projection import KERNEL_CATEGORIES

INSTALL_HINT = "HTA is not installed: pip install 'pptrace[hta]' (the traceinsight package) to use --hta"
COLUMNS = (
    "rank", "steps", "pptrace_time_s", "hta_time_s",
    "pptrace_compute_pct", "hta_compute_pct", "pptrace_non_compute_pct", "hta_non_compute_pct",
    "pptrace_idle_pct", "hta_idle_pct", "pptrace_overlap_pct", "hta_overlap_pct",
    "pptrace_compute_s", "hta_compute_s", "pptrace_non_compute_s", "hta_non_compute_s",
    "pptrace_idle_s", "hta_idle_s", "max_diff_pp",
)


def hta_available() -> bool:
    try:
        import hta  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet():
    """HTA logs routine messages at INFO/WARNING to stdout and pandas 3 warns per call.
    The root logger's level is put back afterwards: importing hta reconfigures it."""
    root = logging.getLogger()
    level = root.level
    for name in ("hta", ""):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with pywarnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            pywarnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def run_hta(trace_files: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """HTA's (temporal breakdown, comm/comp overlap) for {rank: trace path}. HTA reads a
    whole directory, so it gets a temporary one holding links to exactly these files."""
    if not hta_available():
        raise TraceError(INSTALL_HINT)
    with tempfile.TemporaryDirectory(prefix="pptrace-hta-") as tmp, _quiet():
        from hta.trace_analysis import TraceAnalysis

        for rank, path in sorted(trace_files.items()):
            path = Path(path).resolve()
            suffix = ".json.gz" if path.name.endswith(".gz") else ".json"
            os.symlink(path, Path(tmp) / f"rank{rank}{suffix}")
        for name in ("hta", ""):  # importing hta re-configures logging
            logging.getLogger(name).setLevel(logging.ERROR)
        analysis = TraceAnalysis(trace_dir=tmp)
        temporal = analysis.get_temporal_breakdown(visualize=False)
        overlap = analysis.get_comm_comp_overlap(visualize=False)
    return temporal, overlap


def pptrace_side(events: pd.DataFrame, ranks, steps) -> pd.DataFrame:
    """pptrace's GPU numbers per rank summed over ``steps``: time, compute, non-compute
    (NCCL and memcpy not under compute), idle, overlap %."""
    table = gpu_timeline(events, set(steps))
    rows = []
    for rank in ranks:
        mine = table[table["rank"] == rank]
        if mine.empty:
            continue
        time, comm = mine["time_s"].sum(), mine["comm_s"].sum()
        rows.append({
            "rank": rank, "steps": sorted(int(s) for s in mine["step"]), "time_s": time,
            "compute_s": mine["compute_s"].sum(),
            "non_compute_s": (mine["comm_exposed_s"] + mine["memcpy_exposed_s"]).sum(),
            "idle_s": mine["idle_s"].sum(),
            "overlap_pct": 100.0 * mine["overlap_s"].sum() / comm if comm else None,
        })
    return pd.DataFrame(rows)


def compare(run) -> tuple[pd.DataFrame, list[str]]:
    """Per-rank pptrace vs HTA table (COLUMNS) for a loaded ``pptrace.run.Run``, and notes."""
    notes = []
    events = run.events
    if not isin(events["category"], KERNEL_CATEGORIES).any():
        raise TraceError(f"{run.path}: no GPU kernels in these traces; HTA analyses GPU traces only")
    steps = sorted(int(s) for s in run.steps)
    if len(steps) < 2:
        raise TraceError(
            f"{run.path}: HTA drops the last profiled step and only {len(steps)} was profiled; "
            "profile at least two steps to compare"
        )
    covered = steps[:-1]
    notes.append(f"steps {covered} (HTA drops the last profiled step, {steps[-1]})")
    files = {int(r): m["path"] for r, m in run.meta.items()}
    temporal, overlap = run_hta(files)
    ours = pptrace_side(events, sorted(files), covered).set_index("rank")
    temporal = temporal.set_index("rank")
    overlap = overlap.set_index("rank")
    rows = []
    for rank in ours.index:
        if rank not in temporal.index:
            notes.append(f"HTA has no result for rank {rank}")
            continue
        o, h = ours.loc[rank], temporal.loc[rank]
        span = h["kernel_time(us)"] / 1e6
        row = {
            "rank": int(rank), "steps": o["steps"], "pptrace_time_s": o["time_s"], "hta_time_s": span,
            "pptrace_compute_s": o["compute_s"], "hta_compute_s": h["compute_time(us)"] / 1e6,
            "pptrace_non_compute_s": o["non_compute_s"], "hta_non_compute_s": h["non_compute_time(us)"] / 1e6,
            "pptrace_idle_s": o["idle_s"], "hta_idle_s": h["idle_time(us)"] / 1e6,
            "pptrace_overlap_pct": o["overlap_pct"],
            "hta_overlap_pct": float(overlap.loc[rank, "comp_comm_overlap_pctg"]) if rank in overlap.index else None,
        }
        diffs = []
        for part in ("compute", "non_compute", "idle"):
            row[f"pptrace_{part}_pct"] = 100.0 * row[f"pptrace_{part}_s"] / row["pptrace_time_s"]
            row[f"hta_{part}_pct"] = 100.0 * row[f"hta_{part}_s"] / span if span else None
            if row[f"hta_{part}_pct"] is not None:
                diffs.append(abs(row[f"pptrace_{part}_pct"] - row[f"hta_{part}_pct"]))
        if row["pptrace_overlap_pct"] is not None and row["hta_overlap_pct"] is not None \
                and row["hta_overlap_pct"] == row["hta_overlap_pct"]:
            diffs.append(abs(row["pptrace_overlap_pct"] - row["hta_overlap_pct"]))
        row["max_diff_pp"] = max(diffs) if diffs else None
        rows.append(row)
    return pd.DataFrame(rows, columns=list(COLUMNS)), notes


def print_comparison(table: pd.DataFrame, notes: list[str], console) -> None:
    """One rich table per rank: compute / non-compute / idle (ms and % of the GPU span) and
    comm-comp overlap %, pptrace beside HTA."""
    from rich.table import Table

    for row in table.to_dict("records"):
        t = Table(title=f"rank {row['rank']}: pptrace vs HTA, GPU timeline, steps {row['steps']}")
        for col in ("", "pptrace ms", "HTA ms", "pptrace %", "HTA %", "diff pp"):
            t.add_column(col, justify="right")
        for part, label in (("compute", "compute"), ("non_compute", "comm + memcpy exposed"), ("idle", "idle")):
            p, h = row[f"pptrace_{part}_pct"], row[f"hta_{part}_pct"]
            t.add_row(label, f"{row[f'pptrace_{part}_s'] * 1e3:.2f}", f"{row[f'hta_{part}_s'] * 1e3:.2f}",
                      f"{p:.2f}", "-" if h is None else f"{h:.2f}", "-" if h is None else f"{p - h:+.2f}")
        t.add_row("span", f"{row['pptrace_time_s'] * 1e3:.2f}", f"{row['hta_time_s'] * 1e3:.2f}", "", "", "")
        po, ho = row["pptrace_overlap_pct"], row["hta_overlap_pct"]
        fmt = lambda x: "-" if x is None or x != x else f"{x:.2f}"  # noqa: E731
        t.add_row("comm under compute", "", "", fmt(po), fmt(ho),
                  "-" if po is None or ho is None or ho != ho else f"{po - ho:+.2f}")
        console.print(t)
    for note in notes:
        console.print(f"[dim]{note}[/]", highlight=False)
    console.print("[dim]differences by design: see the 'GPU traces' section of the README[/]")
