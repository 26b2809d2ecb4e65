"""The pipeline figures: the timeline as it ran (each rank's passes, p2p and collectives per
step) and the measured step beside its what-if replay. Pure functions of a
:class:`dashboards.timeline.Timeline` and of the report and what-if result."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go

from .blocks import PLOT_WIDTH_PX, block_traces, fitting_labels, label_font_px
from .style import (
    IDLE_COLOR,
    PHASE_STYLE,
    TOP_LEGEND,
    empty_figure,
    esc,
    fmt_int,
    fmt_ms,
    rank_axis_margin,
)
from .timeline import (
    COMM_ROW,
    COMPUTE_ROW,
    P2P_ROW,
    PASS_PHASES,
    PIPELINE_PHASES,
    Span,
    Timeline,
)


# -- the pipeline timeline ---------------------------------------------------------------------
def _block_hover(blocks, lane_label: dict) -> list[str]:
    """Hover text per block (bytes= and peer= are already in the range name)."""
    out = []
    for r in blocks.itertuples(index=False):
        parts = [f"<b>{esc(r.name)}</b>", esc(lane_label.get(r.rank, f"rank {r.rank}"))]
        mb, chunk, peer = fmt_int(r.mb), fmt_int(r.chunk), fmt_int(r.peer)
        if mb is not None:
            parts[1] += f" · microbatch {mb}" + (f" chunk {chunk}" if chunk is not None else "")
        if peer is not None:
            parts[1] += f" · peer rank {peer}"
        parts.append(f"at {r.start_ms:.3f} ms, {fmt_ms(r.dur_ns / 1e6)} long")
        if r.merged > 1:
            parts.append(f"{r.merged} ops merged at full view (duration = their sum)")
        out.append("<br>".join(parts))
    return out


def downsampled_note(tl: Timeline) -> str:
    """What the page says when decimation merged blocks: the drawing is not every op."""
    said = []
    if tl.merged_blocks:
        drawn = len(tl.blocks)
        said.append(f"{drawn + tl.merged_blocks:,} ranges are drawn as {drawn:,} blocks ({tl.merged_blocks:,} "
                    "merged into a neighbour of the same kind on the same row, closer than a pixel at full "
                    "view; a merged block's hover says how many ops it holds)")
    if tl.merged_idle:
        drawn = len(tl.idle)
        said.append(f"{drawn + tl.merged_idle:,} pp_bubble intervals as {drawn:,} grey blocks (a merged grey "
                    "block spans its intervals and its hover gives the bubble they hold)")
    return ("Down-sampled: " + ", and ".join(said) + ". Zooming does not split them: to see every op, "
            "draw fewer ranks or steps (--ranks, --steps) or open `pptrace merge` in Perfetto.")


def _idle_hover(idle, lane_label: dict) -> list[str]:
    out = []
    for r, a, b, bubble, n in zip(idle["rank"], idle["start_ms"], idle["end_ms"], idle["bubble_ms"], idle["merged"]):
        where = (f"at {a:.3f} ms, {fmt_ms(b - a)} long" if n == 1 else
                 f"{n} intervals merged at full view, {a:.3f} to {b:.3f} ms: {fmt_ms(bubble)} of bubble")
        out.append(f"pp_bubble (step partition)<br>{esc(lane_label.get(r, f'rank {r}'))}<br>{where}")
    return out


def _block_label(phase: str, mb, chunk) -> str:
    mb_s, chunk_s = fmt_int(mb), fmt_int(chunk)
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
        return empty_figure(title, "no profiled step: no ProfilerStep#N range on the ranks' main threads")
    if tl.blocks.empty:
        return empty_figure(title, "no pipeline, communication or compute ranges in the profiled steps")
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
            add(*block_traces(idle["start_ms"].to_numpy(), idle["end_ms"].to_numpy(),
                               idle["rank"].map(y_of).to_numpy(dtype=float), 0.8, _idle_hover(idle, lane_label),
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
    notes = [downsampled_note(tl)] if tl.merged_blocks or tl.merged_idle else []
    fig.update_layout(
        title=f"{title} · down-sampled" if notes else title, meta={"notes": notes},
        height=height, hovermode="closest", dragmode="zoom", plot_bgcolor="white",
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
        return empty_figure(title, f"no what-if replay: {why_none}" if why_none
                      else "the what-if replay was not given to this page (pptrace dashboard computes it)")
    rows = (report.get("pipeline") or {}).get("microbatch_times") or []
    sim = ((whatif_result or {}).get("predicted") or {}).get("timeline") or {}
    if not rows or not sim.get("rows"):
        return empty_figure(title, "no pipeline passes to compare")
    step = min(r["step"] for r in rows)
    first_rank = {}
    for r in rows:
        first_rank.setdefault(r["stage"], r["rank"])
    measured = [r for r in rows if r["step"] == step and r["rank"] == first_rank[r["stage"]]]
    cols = sim["columns"]
    # an input-grad pass (torch's runtime schedules replay "I") is drawn as the backward it is,
    # as the measured lanes draw it (PIPELINE_PHASES)
    simulated = [{**row, "kind": "B" if row["kind"] == "I" else row["kind"]}
                 for row in (dict(zip(cols, r)) for r in sim["rows"])]
    simulated = [row for row in simulated if row["kind"] in PASS_PHASES]
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
        legend=TOP_LEGEND, margin=dict(l=rank_axis_margin(list(labels.values()))),
        meta={"notes": [str(n) for n in whatif_result.get("notes") or []]})
    return fig


def _fmt_s(seconds) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.1f} ms"


