"""The diff page's figures, pure functions of the diff document (``pptrace.diff/1``): the
waterfall from BASE's step to NEW's, each stage's partition side by side, and the two runs'
pipelines in a typical step one above the other on a shared time axis. They draw the
document's numbers; nothing is compared here."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .blocks import PLOT_WIDTH_PX, block_traces
from .style import PART_COLORS, PARTS, PHASE_STYLE, TOP_LEGEND, empty_figure, esc, fmt_ms
from .timeline import PASS_PHASES, PIPELINE_PHASES

_ITEM_NAMES = {"compute_fwd": "compute: forward", "compute_bwd": "compute: backward",
               "compute_bwd_input": "compute: input grad", "compute_bwd_weight": "compute: weight grad",
               "compute_other": "compute: other", "pp_bubble_schedule": "bubble: schedule",
               "pp_bubble_latency": "bubble: latency"}


def _noise_note(change: dict) -> str:
    if change.get("significant") is None:
        return "noise unknown"
    noise = change.get("noise_s")
    return ("beyond" if change["significant"] else "within") + f" noise (3 x {fmt_ms(1e3 * (noise or 0))})"


def waterfall_figure(doc: dict) -> go.Figure:
    """BASE's step, each item's change (compute by pass, bubble by cause, ...), NEW's step;
    items beyond noise are labelled with a star."""
    step, fall = doc["step"], doc["waterfall"]
    items = [i for i in fall["items"] if i["delta_s"]]
    if abs(fall["unexplained_s"]) >= 5e-7:
        items.append({"item": "unexplained", "delta_s": fall["unexplained_s"], "significant": None, "noise_s": None})
    x = ["BASE step", *(esc(_ITEM_NAMES.get(i["item"], i["item"].replace("_", " "))) for i in items), "NEW step"]
    y = [1e3 * step["base_s"], *(1e3 * i["delta_s"] for i in items), 1e3 * step["new_s"]]
    text = [f"{y[0]:.1f}", *(f"{v:+.2f}" + ("*" if i["significant"] else "") for v, i in zip(y[1:-1], items)),
            f"{y[-1]:.1f}"]
    hover = [f"BASE step {fmt_ms(y[0])}", *(f"{esc(label)}: {v:+.3f} ms, {_noise_note(i)}"
                                            for label, v, i in zip(x[1:-1], y[1:-1], items)),
             f"NEW step {fmt_ms(y[-1])}, {_noise_note(step)}"]
    fig = go.Figure(go.Waterfall(
        x=x, y=y, measure=["absolute", *("relative" for _ in items), "total"], text=text, textposition="outside",
        hovertext=hover, hoverinfo="text", connector=dict(line=dict(color="#999", width=1)),
        increasing=dict(marker_color=PART_COLORS["pp_transfer"]), decreasing=dict(marker_color="#54A24B"),
        totals=dict(marker_color=PART_COLORS["compute"])))
    low = min(np.cumsum(y[:-1]).min(), y[-1])
    fig.update_layout(title=f"Step time BASE -> NEW: {step['delta_s'] * 1e3:+.1f} ms ({_noise_note(step)}); "
                            "* beyond noise", yaxis_title="ms per step (mean over ranks)", height=440,
                      yaxis_range=[max(0.0, 0.9 * low), 1.05 * max(np.cumsum(y[:-1]).max(), y[-1])],
                      showlegend=False, margin=dict(b=120))
    return fig


def stage_bars_figure(doc: dict) -> go.Figure:
    """Per stage, BASE's and NEW's partition of the step side by side (stacked parts, ms)."""
    stages = doc["stages"]
    if not stages:
        why = "; ".join(doc["setup"]["not_comparable"]) or "the runs have no pipeline stages to compare"
        scopes = [("run", doc["parts"])]
        note = f"per stage not comparable ({why}): the run's means"
    else:
        scopes = [(f"stage {s['stage']}", s["parts"]) for s in stages]
        note = "each stage's ranks, mean over steps"
    x = [[label for label, _ in scopes for _ in (0, 1)], ["BASE", "NEW"] * len(scopes)]
    fig = go.Figure()
    for part in PARTS:
        ms = [1e3 * parts[part][side] for _, parts in scopes for side in ("base_s", "new_s")]
        if not any(ms):
            continue
        delta = [1e3 * parts[part]["delta_s"] for _, parts in scopes for _ in (0, 1)]
        fig.add_trace(go.Bar(x=x, y=ms, name=part, marker_color=PART_COLORS[part], customdata=delta,
                             hovertemplate=f"{part}: %{{y:.3f}} ms (change %{{customdata:+.3f}} ms)<extra></extra>"))
    fig.update_layout(barmode="stack", title=f"Where each stage's step goes, BASE and NEW ({note})",
                      yaxis_title="ms per step", height=440, legend=TOP_LEGEND, legend_traceorder="normal")
    return fig


def timelines_figure(doc: dict) -> go.Figure:
    """BASE's pipeline in its typical step above NEW's, on one time axis (ms from each step's
    pipeline window start): the first rank of each stage, its F/B/W passes."""
    title = "Pipelines of a typical step: BASE above NEW"
    sides = [(name, doc["timelines"][key]) for name, key in (("BASE", "base"), ("NEW", "new"))]
    if not any(t["passes"] for _, t in sides):
        return empty_figure(title, "neither document holds pipeline passes (pipeline.microbatch_times)")
    stages = [sorted({p["stage"] for p in t["passes"]}) for _, t in sides]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[max(len(s), 1) for s in stages],
                        subplot_titles=[f"{name}: step {t['step']}" for name, t in sides])
    span = max((p["start_s"] + p["dur_s"] for _, t in sides for p in t["passes"]), default=1.0) * 1e3
    shown = set()
    for row, ((name, tl), lanes) in enumerate(zip(sides, stages), start=1):
        passes = tl["passes"]
        lane = {s: i for i, s in enumerate(lanes)}
        for phase in (*PASS_PHASES, "compute"):
            mine = [p for p in passes if PIPELINE_PHASES.get(p["op"], "compute") == phase]
            if not mine:
                continue
            x0 = np.array([p["start_s"] for p in mine]) * 1e3
            x1 = x0 + np.array([p["dur_s"] for p in mine]) * 1e3
            text = [f"{name} stage {p['stage']} (rank {p['rank']})<br>{phase} mb {p['mb']}"
                    + (f" chunk {p['chunk']}" if p.get("chunk") else "") + f"<br>{fmt_ms(1e3 * p['dur_s'])}"
                    for p in mine]
            legend, color = PHASE_STYLE[phase]
            for trace in block_traces(x0, x1, np.array([lane[p["stage"]] for p in mine], dtype=float), 0.7, text,
                                      name=legend, color=color, meta={"phase": phase, "side": name},
                                      px_per_unit=PLOT_WIDTH_PX / max(span, 1e-9), legend=phase not in shown):
                fig.add_trace(trace, row=row, col=1)
            shown.add(phase)
        fig.update_yaxes(tickvals=list(lane.values()), ticktext=[f"{name} · stage {s}" for s in lanes],
                         range=[len(lanes) - 0.5, -0.5], ticklabeloverflow="allow", row=row, col=1)
    fig.update_xaxes(range=[0, 1.02 * span], ticklabeloverflow="allow")
    fig.update_xaxes(title_text="ms from the step's pipeline window start", row=2, col=1)
    n = sum(max(len(s), 1) for s in stages)
    fig.update_layout(title=title, height=max(320, 34 * n + 200), legend=TOP_LEGEND, margin=dict(l=130, t=110))
    return fig


def diff_figures(doc: dict) -> dict:
    """The page's figures by name."""
    return {"waterfall": waterfall_figure(doc), "stages": stage_bars_figure(doc), "timelines": timelines_figure(doc)}
