"""Plotly figure builders: pure functions of the analysis report (contract 4) and of a
:class:`dashboards.timeline.Timeline`. They only display what the analyzers computed.

Every string that can come from a trace (range names, kernel names, warnings) goes through
:func:`esc`: Plotly renders hover text, tick labels and legend names as a small HTML subset, so a
range called ``<img src=x onerror=...>`` must reach it as entities to show up as text.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pptrace import vocab

from .ep_figures import ep_load_figure, ep_pairs_figure, has_ep
from .style import (
    PART_COLORS,
    PARTS,
    TOP_LEGEND,
    cheap_ticks,
    empty_figure,
    esc,
    fmt_ms,
    layout_of,
    rank_axis_margin,
    rank_label,
)


# -- views of the report -------------------------------------------------------------------------
def _mean(values) -> float:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def _ranks_in_stage_order(report: dict) -> list[dict]:
    ranks = report.get("ranks") or []
    return sorted(ranks, key=lambda r: ((r.get("coords") or {}).get("pp", 0), r.get("rank", 0)))


def partition_figure(report: dict) -> go.Figure:
    """Stacked bars per rank: the report's step time partition (its mean over profiled steps, ms)."""
    ranks = [r for r in _ranks_in_stage_order(report) if r.get("mean")]
    if not ranks:
        return empty_figure("Step partition per rank", "the report has no per-rank steps")
    labels = [esc(rank_label(report, r["rank"])) for r in ranks]
    fig = go.Figure()
    for part in PARTS:
        ms = [1000 * float(r["mean"]["breakdown_s"].get(part) or 0) for r in ranks]
        if not any(ms):
            continue
        fig.add_trace(go.Bar(x=labels, y=ms, name=part, marker_color=PART_COLORS[part],
                             hovertemplate=f"{part}: %{{y:.3f}} ms<extra>%{{x}}</extra>"))
    step_ms = [1000 * float(r["mean"]["time_s"]) for r in ranks]
    fig.add_trace(go.Scatter(x=labels, y=step_ms, mode="markers", name="step time",
                             marker=dict(symbol="line-ew-open", size=24, color="black"),
                             hovertemplate="step time %{y:.3f} ms<extra>%{x}</extra>"))
    fig.update_layout(barmode="stack", title="Step time partition per rank (mean over steps)",
                      yaxis_title="ms per step", height=420, legend_traceorder="normal",
                      legend=TOP_LEGEND)
    if len(labels) > 8:  # upright labels would overlap: turn them, and make room below
        fig.update_layout(height=420 + rank_axis_margin(labels),
                          margin=dict(b=rank_axis_margin(labels) + 20))
        fig.update_xaxes(tickangle=-90)
    return fig


def _traced(stage: dict) -> bool:
    """Whether any rank of the stage was loaded: a stage whose ranks are all missing or
    filtered out has no measurement, and its zeros (and a theory from t_f = t_b = 0) are not
    numbers to draw."""
    return stage.get("ranks") is None or bool(stage["ranks"])


def bubble_figure(report: dict) -> go.Figure:
    """Measured vs theoretical bubble fraction per pipeline stage; the measured bar is split
    into the part the schedule causes and the part owed to p2p latency when the report has
    that split. A stage with no traced rank keeps its place, with no bars."""
    stages = (report.get("pipeline") or {}).get("stages") or []
    if not stages:
        return empty_figure("Pipeline bubble per stage", "the report has no pipeline stages")
    traced = [_traced(s) for s in stages]
    x = [f"stage {s.get('stage')}" + ("" if on else " (not traced)") for s, on in zip(stages, traced)]

    def per_stage(value):
        return [value(s) if on else None for s, on in zip(stages, traced)]

    measured = per_stage(lambda s: 100 * float(s.get("bubble_fraction") or 0))
    theory = per_stage(lambda s: None if s.get("theory_bubble_fraction") is None
                       else 100 * float(s["theory_bubble_fraction"]))
    bubble_ms = per_stage(lambda s: 1000 * float(s.get("bubble_s") or 0))
    theory_bar = go.Bar(x=x, y=theory, name="theory (from measured t_f, t_b)", marker_color="#4C78A8",
                        offsetgroup="theory", hovertemplate="theory %{y:.2f}%<extra>%{x}</extra>")
    if all(s.get("bubble_latency_s") is not None and s.get("bubble_schedule_s") is not None
           and s.get("step_s") for s, on in zip(stages, traced) if on):
        latency_ms = per_stage(lambda s: 1000 * float(s["bubble_latency_s"]))
        latency = per_stage(lambda s: 100 * float(s["bubble_latency_s"]) / float(s["step_s"]))
        schedule = per_stage(lambda s: 100 * float(s["bubble_schedule_s"]) / float(s["step_s"]))
        bars = [
            go.Bar(x=x, y=schedule, name="measured: schedule", marker_color=PART_COLORS["pp_bubble"],
                   offsetgroup="measured", customdata=per_stage(lambda s: 1000 * float(s["bubble_schedule_s"])),
                   hovertemplate="caused by the schedule %{y:.2f}% (%{customdata:.3f} ms)<extra>%{x}</extra>"),
            go.Bar(x=x, y=latency, base=schedule, name="measured: p2p latency + host gaps",
                   marker_color="#F2CF5B", offsetgroup="measured", customdata=latency_ms,
                   hovertemplate="owed to p2p latency on the critical path %{y:.2f}% (%{customdata:.3f} ms)"
                                 "<extra>%{x}</extra>"),
        ]
    else:
        bars = [go.Bar(x=x, y=measured, name="measured", marker_color=PART_COLORS["pp_bubble"],
                       offsetgroup="measured", customdata=bubble_ms,
                       hovertemplate="measured %{y:.2f}% (%{customdata:.3f} ms)<extra>%{x}</extra>")]
    fig = go.Figure([*bars, theory_bar])
    pipe = report.get("pipeline") or {}
    sub = ""
    if pipe.get("bubble_fraction") is not None:
        sub = f" — run: {100 * pipe['bubble_fraction']:.1f}% measured"
        if pipe.get("theory_bubble_fraction") is not None:
            sub += f", {100 * pipe['theory_bubble_fraction']:.1f}% theory"
    fig.update_layout(barmode="group", title="Pipeline bubble per stage" + sub,
                      yaxis_title="% of step", height=380, legend=TOP_LEGEND, legend_traceorder="normal")
    return fig


def _pp_size(report: dict) -> int:
    layout = layout_of(report)
    return layout.pp if layout else 1


def comm_figure(report: dict) -> go.Figure:
    """Exposed vs hidden communication per dimension as the report's collectives rows give it
    (mean per rank per step, ms), and, on a pipeline, its p2p transfer (pp_transfer, the
    ranks' reported means averaged)."""
    rows = [r for r in _collective_rows(report)
            if r.get("exposed_s") is not None or r.get("hidden_s") is not None]
    means = [r["mean"] for r in report.get("ranks") or [] if r.get("mean")]
    transfer_ms = 1000 * _mean(m["breakdown_s"].get("pp_transfer") for m in means)
    with_pp = bool(means) and (_pp_size(report) > 1 or transfer_ms > 0)
    if not rows and not with_pp:
        return empty_figure("Communication exposed vs hidden", "the report has no communication")
    x = [esc(r.get("dim", r.get("kind"))) for r in rows]
    exposed = [1000 * float(r.get("exposed_s") or 0) for r in rows]
    hidden = [1000 * float(r.get("hidden_s") or 0) for r in rows]
    if with_pp:
        x.append("pp (transfer)")
        exposed.append(transfer_ms)
        hidden.append(0.0)
    fig = go.Figure([
        go.Bar(x=x, y=exposed, name="exposed (no compute running)",
               marker_color="#E45756", hovertemplate="exposed %{y:.3f} ms<extra>%{x}</extra>"),
        go.Bar(x=x, y=hidden, name="hidden under compute", marker_color="#54A24B",
               hovertemplate="hidden %{y:.3f} ms<extra>%{x}</extra>"),
    ])
    fig.update_layout(barmode="group", title="Communication: exposed vs hidden per dimension",
                      yaxis_title="ms per step (mean over ranks)", height=360, legend=TOP_LEGEND,
                      legend_traceorder="normal")
    return fig


def p2p_matrix_figure(report: dict) -> go.Figure:
    """rank x rank heatmaps of the p2p links: bytes, wait (peer not posted yet), transfer."""
    links = (report.get("p2p") or {}).get("links") or []
    if not links:
        return empty_figure("p2p links", "no matched pipeline send/recv pairs in the report")
    world = int((report.get("run") or {}).get("world_size") or 0)
    n = max([world, *[int(link["src"]) + 1 for link in links], *[int(link["dst"]) + 1 for link in links]])
    # (report key, panel title, hover name, scale, hover value, cell text)
    metrics = (("bytes", "bytes per step", "bytes", 1.0, "%{z:,.0f} B", "%{z:.3~s}"),
               ("wait_s", "wait (ms per step)", "wait", 1000.0, "%{z:.3f} ms", "%{z:.3~f}"),
               ("transfer_s", "transfer (ms per step)", "transfer", 1000.0, "%{z:.3f} ms", "%{z:.3~f}"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[title for _, title, *_ in metrics],
                        horizontal_spacing=0.08)
    for col, (key, _, label, scale, hover, text) in enumerate(metrics, start=1):
        z = np.full((n, n), np.nan)
        for link in links:
            z[int(link["src"]), int(link["dst"])] = float(link.get(key) or 0) * scale
        fig.add_trace(go.Heatmap(
            z=z, x=list(range(n)), y=list(range(n)), colorscale="Viridis", showscale=False,
            texttemplate=text if n <= 16 else None, textfont=dict(size=10),
            hoverongaps=False,  # a pair with no link has no value: no "NaN" label to hover
            hovertemplate=f"src rank %{{y}} → dst rank %{{x}}<br>{label}: {hover}<extra></extra>",
        ), row=1, col=col)
        ticks = dict(tickmode="linear", dtick=1 if n <= 16 else max(1, n // 16))
        fig.update_xaxes(title_text="dst rank", row=1, col=col, **ticks)
        fig.update_yaxes(title_text="src rank" if col == 1 else None, autorange="reversed",
                         row=1, col=col, **ticks)
    fig.update_layout(title="p2p links (sender row, receiver column)",
                      height=max(360, min(760, 260 + 8 * n)))
    return fig


def _collective_rows(report: dict) -> list[dict]:
    """Per-dimension collective rows in whichever shape the report gives them."""
    col = report.get("collectives")
    if isinstance(col, dict):
        rows = col.get("by_dim") or col.get("dims") or [
            {"dim": k, **v} for k, v in col.items() if isinstance(v, dict)]
    else:
        rows = col or []
    return [r for r in rows if isinstance(r, dict) and ("dim" in r or "kind" in r)]


def _rank_comm(report: dict) -> tuple[list[dict], dict]:
    """The ranks (stage order) and, per dimension with any communication, each rank's
    exposed and hidden ms per step: the report's ``mean.breakdown_s[<dim>_exposed]`` and
    ``mean.hidden_s[<dim>]``, which hold every exchange of the dimension — collectives and
    p2p alike (a ring attention's cp exchanges are p2p ranges, and no collective row has them)."""
    ranks = [r for r in _ranks_in_stage_order(report) if r.get("mean")]
    dims = {}
    for dim in vocab.COMM_DIMS:
        exposed = [1000 * float((r["mean"].get("breakdown_s") or {}).get(f"{dim}_exposed") or 0) for r in ranks]
        hidden = [1000 * float((r["mean"].get("hidden_s") or {}).get(dim) or 0) for r in ranks]
        if any(exposed) or any(hidden):
            dims[dim] = (exposed, hidden)
    return ranks, dims


def _split_rows(report: dict) -> list[dict]:
    return [r for r in _collective_rows(report)
            if float(r.get("wait_s") or 0) + float(r.get("transfer_s") or 0) > 0]


def collectives_figure(report: dict) -> go.Figure:
    """Each rank's communication per dimension, exposed and hidden (ms per step); beside it,
    when the report has them, the collectives' time split into waiting for the last rank to
    arrive vs transferring."""
    title = "Communication per rank and dimension"
    ranks, dims = _rank_comm(report)
    split = _split_rows(report)
    if not dims and not split:
        return empty_figure(title, "the report has no tp/cp/dp/ep communication")
    cols = (1 if dims else 0) + (1 if split else 0)
    fig = make_subplots(rows=1, cols=cols, horizontal_spacing=0.1,
                        column_widths=[0.72, 0.28] if cols == 2 else None)
    axis_titles = [t for t, on in (("ms per step: exposed + hidden", dims),
                                   ("collectives, ms per step: wait + transfer", split)) if on]
    for col, text in enumerate(axis_titles, start=1):
        fig.update_yaxes(title_text=text, row=1, col=col)
    labels = [esc(rank_label(report, r["rank"])) for r in ranks]
    for dim, (exposed, hidden) in dims.items():  # COMM_DIMS order: the same legend on every run
        color = PART_COLORS[f"{dim}_exposed"]
        fig.add_trace(go.Bar(x=labels, y=exposed, name=f"{dim} exposed", marker_color=color,
                             offsetgroup=dim, legendgroup=dim,
                             hovertemplate=f"{dim} exposed %{{y:.3f}} ms<extra>%{{x}}</extra>"), row=1, col=1)
        fig.add_trace(go.Bar(x=labels, y=hidden, base=exposed, name=f"{dim} hidden under compute",
                             marker=dict(color=color, opacity=0.45, pattern_shape="/"),
                             offsetgroup=dim, legendgroup=dim,
                             hovertemplate=f"{dim} hidden %{{y:.3f}} ms<extra>%{{x}}</extra>"), row=1, col=1)
    if split:
        x = [esc(r.get("dim", r.get("kind"))) + (f" {esc(r['op'])}" if r.get("op") else "")
             for r in split]
        wait = [1000 * float(r.get("wait_s") or 0) for r in split]
        fig.add_trace(go.Bar(x=x, y=wait, name="wait (for the last rank to arrive)", marker_color="#BDBDBD",
                             offsetgroup="split",
                             hovertemplate="wait %{y:.3f} ms<extra>%{x}</extra>"), row=1, col=cols)
        fig.add_trace(go.Bar(x=x, y=[1000 * float(r.get("transfer_s") or 0) for r in split], base=wait,
                             name="transfer", marker_color="#E45756", offsetgroup="split",
                             hovertemplate="transfer %{y:.3f} ms<extra>%{x}</extra>"), row=1, col=cols)
    height = 380
    if dims and len(labels) > 8:  # upright labels would overlap: turn them, and make room below
        height += rank_axis_margin(labels)
        fig.update_xaxes(tickangle=-90, row=1, col=1)
        fig.update_layout(margin=dict(b=rank_axis_margin(labels) + 20))
    fig.update_layout(barmode="group", title=title, height=height, legend=TOP_LEGEND,
                      legend_traceorder="normal")
    return fig


def _straggler_what(row: dict) -> str:
    """The straggler row's ``slowdown`` in words: its meaning depends on the metric
    (pptrace.analyzers.stragglers)."""
    metric, slowdown = str(row.get("metric", "")), row.get("slowdown")
    if slowdown is None:
        return esc(metric)
    if metric == "compute":  # rank / median - 1
        return f"computes {float(slowdown):+.0%} vs the median rank"
    if metric == "collective_arrival":  # share of its collectives it arrived last at
        return f"last to arrive at {float(slowdown):.0%} of its collectives"
    return f"{esc(metric)} {float(slowdown):.3g}"


def straggler_figure(report: dict) -> go.Figure:
    """rank x step heatmaps: compute time and, on a pipeline, time spent waiting (pp_bubble)
    — a straggler is the row hot on the left and cold on the right."""
    ranks = sorted(report.get("ranks") or [], key=lambda r: r.get("rank", 0))
    steps = sorted({s["step"] for r in ranks for s in r.get("steps", [])})
    if not ranks or not steps:
        return empty_figure("Stragglers", "the report has no per-rank steps")
    parts = ("compute", "pp_bubble") if _pp_size(report) > 1 else ("compute",)
    titles = {"compute": "compute (ms)", "pp_bubble": "waiting: pp_bubble (ms)"}
    fig = make_subplots(rows=1, cols=len(parts), subplot_titles=[titles[p] for p in parts],
                        horizontal_spacing=0.12)
    ylabels = [esc(rank_label(report, r["rank"])) for r in ranks]
    for col, part in enumerate(parts, start=1):
        z = np.full((len(ranks), len(steps)), np.nan)
        for i, r in enumerate(ranks):
            for s in r.get("steps", []):
                z[i, steps.index(s["step"])] = 1000 * float(s.get("breakdown_s", {}).get(part) or 0)
        fig.add_trace(go.Heatmap(
            z=z, x=[f"step {s}" for s in steps], y=ylabels, showscale=False,
            colorscale="Blues" if col == 1 else "Greys", hoverongaps=False,
            texttemplate="%{z:.1f}" if z.size <= 400 else None, textfont=dict(size=10),
            hovertemplate=f"%{{y}} %{{x}}<br>{part}: %{{z:.3f}} ms<extra></extra>"), row=1, col=col)
        fig.update_yaxes(autorange="reversed", showticklabels=col == 1, row=1, col=col)
    named = report.get("stragglers") or []
    title = "Stragglers"
    if named:
        top = named[0]
        title += (f" — top: {esc(rank_label(report, int(top.get('rank', -1))))} "
                  f"({_straggler_what(top)}; costs {fmt_ms(1000 * float(top.get('cost_s') or 0))} per step)")
    evidence = named[0].get("evidence") if named else None
    fig.update_layout(title=dict(text=title, subtitle=dict(text=esc(evidence))) if evidence else title,
                      height=max(320, min(1400, 140 + 16 * len(ranks))), margin=dict(l=150, t=110))
    return fig


def report_figures(report: dict) -> dict[str, go.Figure]:
    """The report's views that apply to its run: no bubble, p2p links or pp_bubble on a run
    without a pipeline, no communication views on a run that did not communicate, no ep panel
    without ep, no stragglers among fewer than two ranks. An empty panel would read as a measured zero."""
    pipeline = _pp_size(report) > 1
    ranks = [r for r in report.get("ranks") or [] if r.get("mean")]
    links = (report.get("p2p") or {}).get("links") or []
    _, dims = _rank_comm(report)
    communicated = bool(dims or _split_rows(report) or pipeline or links)
    figures = {"partition": partition_figure(report)}
    if pipeline:
        figures["bubble"] = bubble_figure(report)
    if communicated:
        figures["comm"] = comm_figure(report)
    if pipeline or links:
        figures["p2p_links"] = p2p_matrix_figure(report)
    if dims or _split_rows(report):
        figures["collectives"] = collectives_figure(report)
    if has_ep(report):
        figures["ep_load"] = ep_load_figure(report)
        if (report.get("ep") or {}).get("pairs"):
            figures["ep_pairs"] = ep_pairs_figure(report)
    if len(ranks) >= 2:
        figures["stragglers"] = straggler_figure(report)
    return {key: cheap_ticks(fig) for key, fig in figures.items()}
