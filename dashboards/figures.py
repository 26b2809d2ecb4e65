"""Plotly figure builders: pure functions of the analysis report (contract 4) and of a
:class:`dashboards.timeline.Timeline`. They only display what the analyzers computed.

Every string that can come from a trace (range names, kernel names, warnings) goes through
:func:`esc`: Plotly renders hover text, tick labels and legend names as a small HTML subset, so a
range called ``<img src=x onerror=...>`` must reach it as entities to show up as text.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pptrace.topology import Layout
from pptrace import vocab

from .blocks import PLOT_WIDTH_PX, block_traces, fitting_labels, label_font_px
from .timeline import COMM_ROW, COMPUTE_ROW, P2P_ROW, PASS_PHASES, PIPELINE_PHASES, Span, Timeline

# Stacked bars read best with the pipeline's own parts next to compute.
_LEADING = ("compute", "pp_bubble", "pp_transfer")
PARTS = (*_LEADING, *(p for p in vocab.PARTS if p not in _LEADING))
PART_COLORS = {
    "compute": "#4C78A8", "pp_bubble": "#BDBDBD", "pp_transfer": "#E45756",
    "tp_exposed": "#EECA3B", "cp_exposed": "#FF9DA6", "dp_exposed": "#9D755D",
    "ep_exposed": "#72B7B2", "other": "#54545C",
}
PHASE_STYLE = {  # phase -> (legend name, colour); F/B/W as in the Megatron and Zero Bubble diagrams
    "F": ("forward (F)", "#4C78A8"), "B": ("backward (B)", "#54A24B"),
    "W": ("weight grad (W)", "#B279A2"), "compute": ("other compute", "#8C8C8C"),
    "recv": ("p2p recv", "#F58518"), "send": ("p2p send", "#E45756"), "p2p": ("p2p", "#E45756"),
    "tp": ("tp comm", "#EECA3B"), "cp": ("cp comm", "#FF9DA6"), "dp": ("dp comm", "#9D755D"),
    "ep": ("ep comm", "#72B7B2"), "wait": ("wait", "#79706E"),
    "kernel": ("compute kernels", "#4C78A8"), "nccl": ("NCCL kernels", "#E45756"),
}
IDLE_COLOR = "rgba(120,120,120,0.30)"


def esc(text) -> str:
    """Make untrusted text inert for Plotly's HTML-ish labels (it decodes these entities)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fmt_int(v) -> str | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v))


def fmt_ms(ms) -> str:
    """A duration in ms, the one unit of every figure: µs resolution, and kernels shorter
    than a µs keep their digits."""
    ms = float(ms)
    return f"{ms:.3f} ms" if abs(ms) >= 0.01 or ms == 0 else f"{ms:.3g} ms"


def _layout_of(report: dict) -> Layout | None:
    try:
        return Layout.from_dict(report["run"]["layout"])
    except (KeyError, TypeError, ValueError):
        return None


def rank_label(report: dict, rank: int) -> str:
    layout = _layout_of(report)
    try:
        return f"rank {rank} · {layout.describe(rank)}" if layout else f"rank {rank}"
    except ValueError:
        return f"rank {rank}"


# Legends sit above the plot, inside the top margin. A legend at the right (Plotly's default)
# widens the right margin after the first layout, and Plotly then lays the figure out again.
TOP_LEGEND = dict(orientation="h", y=1.02, yanchor="bottom", x=0)


def _cheap_ticks(fig: go.Figure) -> go.Figure:
    """Tick labels are not measured one by one to hide those past the figure's edge (the SVG
    clips them anyway): on axes with dozens of rank labels that measuring is most of a plot."""
    fig.update_xaxes(ticklabeloverflow="allow")
    fig.update_yaxes(ticklabeloverflow="allow")
    return fig


def _rank_axis_margin(labels: list[str]) -> int:
    """Room for rank labels written along an axis (about 6.5 px a character at Plotly's 12 px)."""
    return int(30 + 6.5 * max((len(t) for t in labels), default=0))


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=esc(why), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, height=220, xaxis_visible=False, yaxis_visible=False)
    return fig


# -- the pipeline timeline ---------------------------------------------------------------------
def _block_hover(blocks, lane_label: dict) -> list[str]:
    """Hover text per block (bytes= and peer= are already in the range name)."""
    out = []
    for r in blocks.itertuples(index=False):
        parts = [f"<b>{esc(r.name)}</b>", esc(lane_label.get(r.rank, f"rank {r.rank}"))]
        mb, chunk, peer = _fmt_int(r.mb), _fmt_int(r.chunk), _fmt_int(r.peer)
        if mb is not None:
            parts[1] += f" · microbatch {mb}" + (f" chunk {chunk}" if chunk is not None else "")
        if peer is not None:
            parts[1] += f" · peer rank {peer}"
        parts.append(f"at {r.start_ms:.3f} ms, {fmt_ms(r.dur_ns / 1e6)} long")
        if r.merged > 1:
            parts.append(f"{r.merged} ops merged at full view (duration = their sum)")
        out.append("<br>".join(parts))
    return out


def _block_label(phase: str, mb, chunk) -> str:
    mb_s, chunk_s = _fmt_int(mb), _fmt_int(chunk)
    if mb_s is None:
        return ""
    return f"{phase}{mb_s}" + (f".{chunk_s}" if chunk_s is not None else "")


def _label_trace(labelled, y_of: dict, step: int, px_row: float, span_ms: float):
    """Block labels (F3, B3.1, ...). The trace holds the labels readable at full view; all of
    the step's labels ride along in ``meta.labels`` for the page's zoom handler."""
    x = [round(float(v), 6) for v in (labelled["start_ms"] + labelled["end_ms"]) / 2]
    y = [float(y_of[r]) for r in labelled["rank"]]
    text = [_block_label(p, m, c) for p, m, c in
            zip(labelled["phase"], labelled["mb"], labelled["chunk"])]
    width = [round(float(v), 6) for v in labelled["end_ms"] - labelled["start_ms"]]
    shown = fitting_labels(x, y, text, width, px_per_ms=PLOT_WIDTH_PX / max(span_ms, 1e-9),
                           row_px=px_row)
    return go.Scatter(
        x=[x[i] for i in shown], y=[y[i] for i in shown], text=[text[i] for i in shown],
        mode="text", textfont=dict(color="white", size=label_font_px(px_row)),
        hoverinfo="skip", showlegend=False,
        meta={"step": step, "phase": "labels", "labels": {"x": x, "y": y, "text": text, "w": width}})


def timeline_figure(tl: Timeline, *, title: str = "Pipeline timeline") -> go.Figure:
    """One lane group per rank (stages top to bottom): compute row with F/B/W blocks, p2p row
    (recv above, send below), comm row; grey = the step partition's pp_bubble of that rank,
    dotted lines = the pipeline window the analysis used."""
    if not tl.steps:
        return _empty(title, "no profiled step: no ProfilerStep#N range on the ranks' main threads")
    if tl.blocks.empty:
        return _empty(title, "no pipeline, communication or compute ranges in the profiled steps")
    y_of = {lane.rank: lane.y for lane in tl.lanes}
    lane_label = {lane.rank: lane.label for lane in tl.lanes}
    n_rows = max(lane.y for lane in tl.lanes) + 3
    px_row = max(7.0, min(22.0, 1500.0 / n_rows))
    row_offset = {COMPUTE_ROW: (0.0, 0.8), P2P_ROW: (1.0, 0.32), COMM_ROW: (2.0, 0.6)}  # (y offset, height)
    y_range = [max(lane.y for lane in tl.lanes) + 2.5, -0.5]
    fig = go.Figure()
    step_of_trace = []

    def add(*traces, step):
        for trace in traces:
            fig.add_trace(trace)
            step_of_trace.append(step)

    for step in tl.steps:
        idle = tl.idle[tl.idle["step"] == step]
        blocks = tl.blocks[tl.blocks["step"] == step]
        span = (float(blocks["end_ms"].max() - min(0.0, float(blocks["start_ms"].min())))
                if len(blocks) else tl.step_spans_ms[step].end_ms)
        px_per_ms = PLOT_WIDTH_PX / max(span, 1e-9)
        if step in tl.pipeline_ms:
            lo, hi = tl.pipeline_ms[step]
            add(go.Scatter(x=[lo, lo, None, hi, hi], y=[y_range[0], y_range[1], None, y_range[0], y_range[1]],
                           mode="lines", line=dict(color="#555", width=1, dash="dot"),
                           name="pipeline window", hoverinfo="skip",
                           meta={"step": step, "phase": "pipeline_window"}),
                step=step)
        if not idle.empty:
            text = [f"pp_bubble (step partition)<br>{esc(lane_label.get(r, f'rank {r}'))}<br>"
                    f"at {a:.3f} ms, {fmt_ms(b - a)} long"
                    for r, a, b in zip(idle["rank"], idle["start_ms"], idle["end_ms"])]
            add(*block_traces(idle["start_ms"].to_numpy(), idle["end_ms"].to_numpy(),
                               idle["rank"].map(y_of).to_numpy(dtype=float), 0.8, text,
                               name="idle: pp_bubble", color="#9E9E9E", fill=IDLE_COLOR,
                               meta={"step": step, "phase": "idle"}, px_per_unit=px_per_ms),
                step=step)
        # legend entries in PHASE_STYLE's order, not the order the phases first occur in
        # this run's events (which would shuffle the legend from one run to the next)
        order = {phase: i for i, phase in enumerate(PHASE_STYLE)}
        for phase in sorted(blocks["phase"].unique(), key=lambda ph: (order.get(ph, len(order)), ph)):
            pb = blocks[blocks["phase"] == phase]
            name, color = PHASE_STYLE.get(phase, (phase, "#888888"))
            row = pb["row"].iloc[0]
            offset, height = row_offset[row]
            y = pb["rank"].map(y_of).to_numpy(dtype=float) + offset
            if row == P2P_ROW:  # recv and send of one batched exchange overlap: split the row
                y = y + (-0.18 if phase == "recv" else 0.18)
            add(*block_traces(pb["start_ms"].to_numpy(), pb["end_ms"].to_numpy(), y, height,
                               _block_hover(pb, lane_label), name=esc(name), color=color,
                               meta={"step": step, "phase": phase}, px_per_unit=px_per_ms),
                step=step)
        labelled = blocks[blocks["phase"].isin(list(PASS_PHASES)) & (blocks["merged"] == 1)]
        if not labelled.empty:
            add(_label_trace(labelled, y_of, step, px_row, span), step=step)
        # autorange stops on the last block's edge, which then reads as cut off: an invisible
        # point 2% past the step's end keeps it inside the plot (and follows the step buttons)
        end = max(float(blocks["end_ms"].max()) if len(blocks) else tl.step_spans_ms[step].end_ms,
                  tl.pipeline_ms.get(step, Span(0.0, 0.0)).end_ms)
        add(go.Scatter(x=[1.02 * end], y=[y_range[1]], mode="markers", marker=dict(opacity=0, size=1),
                       hoverinfo="skip", showlegend=False, meta={"step": step, "phase": "extent"}),
            step=step)

    first = tl.steps[0]
    for trace, step in zip(fig.data, step_of_trace):
        trace.visible = step == first
    # Row names only where they stay cheap: every tick label is measured in the DOM at load.
    sub_rows = ((1, P2P_ROW), (2, COMM_ROW)) if len(tl.lanes) <= 16 else ()
    ticks = [(lane.y + off, text) for lane in tl.lanes
             for off, text in ((0, esc(lane.label)), *sub_rows)]
    shapes = [dict(type="line", xref="paper", x0=0, x1=1, y0=b.y - 0.8, y1=b.y - 0.8,
                   line=dict(color="#555", width=1))
              for a, b in zip(tl.lanes, tl.lanes[1:]) if a.stage != b.stage]
    plot_px = n_rows * px_row
    height = int(plot_px + 170)
    fig.update_layout(
        title=title, height=height, hovermode="closest", dragmode="zoom", plot_bgcolor="white",
        # fixed margins, with the legend and the step buttons placed inside them: a legend or
        # menu that pushes a margin makes Plotly lay the whole figure out a second time
        legend=dict(orientation="h", y=1.0, yanchor="bottom", x=0),
        margin=dict(l=150, r=20, t=110, b=50, autoexpand=False), shapes=shapes,
        xaxis=dict(title="time since the step's start (ms, aligned clocks)", showgrid=True,
                   gridcolor="#eee", zeroline=False, rangemode="tozero"),
        # an explicit y range: autorange would pad it by 5% of the lanes (hover targets count
        # as points), and the reversed range puts stage 0 on top
        yaxis=dict(tickvals=[y for y, _ in ticks], ticktext=[text for _, text in ticks],
                   range=y_range, showgrid=False, zeroline=False, tickfont=dict(size=10),
                   ticklabeloverflow="allow"),
    )
    if len(tl.steps) > 1:
        buttons = [dict(label=f"step {s}", method="update",
                        args=[{"visible": [t == s for t in step_of_trace]},
                              {"xaxis.autorange": True, "yaxis.range": y_range}])
                   for s in tl.steps]
        many = len(buttons) > 4  # a row of buttons would run into the legend
        fig.update_layout(updatemenus=[dict(type="dropdown" if many else "buttons",
                                            direction="down" if many else "right",
                                            buttons=buttons, x=1, xanchor="right",
                                            y=1 + 40 / plot_px, yanchor="bottom")])
    return fig


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
        return _empty("Step partition per rank", "the report has no per-rank steps")
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
        fig.update_layout(height=420 + _rank_axis_margin(labels),
                          margin=dict(b=_rank_axis_margin(labels) + 20))
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
        return _empty("Pipeline bubble per stage", "the report has no pipeline stages")
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
    layout = _layout_of(report)
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
        return _empty("Communication exposed vs hidden", "the report has no communication")
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
        return _empty("p2p links", "no matched pipeline send/recv pairs in the report")
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
        return _empty(title, "the report has no tp/cp/dp/ep communication")
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
        height += _rank_axis_margin(labels)
        fig.update_xaxes(tickangle=-90, row=1, col=1)
        fig.update_layout(margin=dict(b=_rank_axis_margin(labels) + 20))
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
        return _empty("Stragglers", "the report has no per-rank steps")
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


# -- measured vs replayed (what-if) -------------------------------------------------------------
class _Pass(NamedTuple):
    """A block of the replay figure: on the lane of (source, stage), times in s."""

    source: str  # "measured" or "replayed"
    stage: int
    phase: str
    mb: int
    start_s: float
    end_s: float


def replay_figure(report: dict, whatif_result: dict | None, *, why_none: str | None = None) -> go.Figure:
    """Each stage's F/B/W passes as measured (first profiled step, first rank of the stage)
    above the same schedule replayed by the what-if simulator from the run's measured times:
    where they differ, something the simulator does not model (contention, a slow link) cost
    time. Both lanes start at 0 = the step's pipeline window start. Without a result, the
    figure says why (``why_none``)."""
    title = "Measured vs replayed schedule"
    if whatif_result is None:
        return _empty(title, f"no what-if replay: {why_none}" if why_none
                      else "the what-if replay was not given to this page (pptrace dashboard computes it)")
    rows = (report.get("pipeline") or {}).get("microbatch_times") or []
    sim = ((whatif_result or {}).get("predicted") or {}).get("timeline") or {}
    if not rows or not sim.get("rows"):
        return _empty(title, "no pipeline passes to compare")
    step = min(r["step"] for r in rows)
    first_rank = {}
    for r in rows:
        first_rank.setdefault(r["stage"], r["rank"])
    measured = [r for r in rows if r["step"] == step and r["rank"] == first_rank[r["stage"]]]
    cols = sim["columns"]
    simulated = [row for row in (dict(zip(cols, r)) for r in sim["rows"]) if row["kind"] in PASS_PHASES]
    # The replay has every stage; the measurement only those whose ranks were loaded (a rank
    # missing, filtered out, unreadable): each stage keeps both lanes, an untraced one empty.
    stages = sorted(set(first_rank) | {int(r["stage"]) for r in simulated})
    lane = {}  # (source, stage) -> y; measured lane above its replay
    for i, stage in enumerate(stages):
        lane[("measured", stage)], lane[("replayed", stage)] = 2 * i, 2 * i + 1
    blocks = [_Pass("measured", r["stage"], PIPELINE_PHASES.get(r["op"], "compute"), r["mb"],
                    r["start_s"], r["start_s"] + r["dur_s"]) for r in measured]
    blocks += [_Pass("replayed", r["stage"], r["kind"], r["mb"], r["start_s"], r["end_s"]) for r in simulated]
    fig = go.Figure()
    span_ms = 1e3 * max([b.end_s for b in blocks] or [1.0])
    for phase in (*PASS_PHASES, "compute"):
        mine = [b for b in blocks if b.phase == phase]
        if not mine:
            continue
        x0 = np.array([b.start_s for b in mine]) * 1e3
        x1 = np.array([b.end_s for b in mine]) * 1e3
        text = [f"{b.source} stage {b.stage}<br>{phase} mb {b.mb}<br>{fmt_ms(1e3 * (b.end_s - b.start_s))}"
                for b in mine]
        name, color = PHASE_STYLE[phase]
        fig.add_traces(block_traces(x0, x1, np.array([lane[(b.source, b.stage)] for b in mine], dtype=float),
                                     0.6, text, name=name, color=color, meta={"phase": phase},
                                     px_per_unit=PLOT_WIDTH_PX / span_ms))
    measured_s = (whatif_result.get("measured") or {}).get("step_time_s")
    replayed_s = whatif_result["predicted"].get("step_time_s")
    labels = {y: f"{source} · stage {stage}" + (" (not traced)" if source == "measured"
                                                 and stage not in first_rank else "")
              for (source, stage), y in lane.items()}
    fig.update_layout(
        title=f"{title}: step {_fmt_s(measured_s)} measured, {_fmt_s(replayed_s)} replayed",
        xaxis_ticklabeloverflow="allow",
        height=max(260, 36 * len(lane) + 120), xaxis_title="ms from the pipeline window start",
        # autorange ends the axis on the last block's edge, which then reads as cut off
        xaxis_range=[min(0.0, 1e3 * min((b.start_s for b in blocks), default=0.0)), 1.02 * span_ms],
        yaxis={"tickvals": list(labels), "ticktext": list(labels.values()),
               "range": [len(lane) - 0.5, -0.5], "ticklabeloverflow": "allow"},
        legend=TOP_LEGEND, margin=dict(l=_rank_axis_margin(list(labels.values()))),
        meta={"notes": [str(n) for n in whatif_result.get("notes") or []]})
    return fig


def _fmt_s(seconds) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.1f} ms"


def report_figures(report: dict) -> dict[str, go.Figure]:
    """The report's views that apply to its run: no bubble, p2p links or pp_bubble on a run
    without a pipeline, no communication views on a run that did not communicate, no
    stragglers among fewer than two ranks. An empty panel would read as a measured zero."""
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
    if len(ranks) >= 2:
        figures["stragglers"] = straggler_figure(report)
    return {key: _cheap_ticks(fig) for key, fig in figures.items()}
