"""What every figure shares: the parts' order and colours, the pass phases' style, escaping of
trace text (see figures.py), number formats, the rank labels and the legend and axis
conventions."""
from __future__ import annotations

import math

import plotly.graph_objects as go

from pptrace import vocab
from pptrace.topology import Layout

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


def fmt_int(v) -> str | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v))


def fmt_ms(ms) -> str:
    """A duration in ms, the one unit of every figure: µs resolution, and kernels shorter
    than a µs keep their digits."""
    ms = float(ms)
    return f"{ms:.3f} ms" if abs(ms) >= 0.01 or ms == 0 else f"{ms:.3g} ms"


def layout_of(report: dict) -> Layout | None:
    try:
        return Layout.from_dict(report["run"]["layout"])
    except (KeyError, TypeError, ValueError):
        return None


def rank_label(report: dict, rank: int) -> str:
    layout = layout_of(report)
    try:
        return layout.label(rank) if layout else f"rank {rank}"
    except ValueError:
        return f"rank {rank}"


# Legends sit above the plot, inside the top margin. A legend at the right (Plotly's default)
# widens the right margin after the first layout, and Plotly then lays the figure out again.
TOP_LEGEND = dict(orientation="h", y=1.02, yanchor="bottom", x=0)


def cheap_ticks(fig: go.Figure) -> go.Figure:
    """Tick labels are not measured one by one to hide those past the figure's edge (the SVG
    clips them anyway): on axes with dozens of rank labels that measuring is most of a plot."""
    fig.update_xaxes(ticklabeloverflow="allow")
    fig.update_yaxes(ticklabeloverflow="allow")
    return fig


def rank_axis_margin(labels: list[str]) -> int:
    """Room for rank labels written along an axis (about 6.5 px a character at Plotly's 12 px)."""
    return int(30 + 6.5 * max((len(t) for t in labels), default=0))


def empty_figure(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=esc(why), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, height=220, xaxis_visible=False, yaxis_visible=False)
    return fig


