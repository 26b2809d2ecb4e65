"""Blocks on lanes, drawn cheaply: the primitives of the timeline and replay figures.

Blocks are drawn as filled rectangles: one SVG path per trace however many blocks it holds
(a line trace with gaps makes one path per block, and WebGL costs seconds of software
rendering in a headless browser). Rectangles are in data units, so they grow when zoomed.
Hover targets are a separate marker-less trace with points spread inside each block (three,
or one every HOVER_SPACING_PX at full view on a wide block such as a long bubble): no DOM
element per block, and a hover anywhere on a block at full view finds it (Plotly answers
within 20 px of a point).
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

HOVER_POINTS = 3
HOVER_SPACING_PX = 30
MAX_HOVER_POINTS = 48
LABEL_MIN_FONT_PX = 8  # below this a block label is not drawn: unreadable, and costly in SVG
MAX_LABELS_IN_VIEW = 1500  # more would cost seconds of SVG text; zoom in to see them
PLOT_WIDTH_PX = 1180  # the timeline's plot area on the page (1400 px wide, minus margins)


def rect_polygon(x0: np.ndarray, x1: np.ndarray, y: np.ndarray, height: float):
    """Rectangles [x0, x1] x [y - h/2, y + h/2] as ONE polygon for ``fill="toself"``, so that
    Plotly makes one SVG path for the trace (with gaps between blocks it would make an element
    per block). The polygon walks each row along its bottom edge, going up and over every block,
    then back along the same edge; rows are joined along a vertical spine at the left. The
    connecting strokes enclose no area, so what is filled is exactly the rectangles.
    x stays float64 (a kernel deep into a long step keeps its µs); y is float32 (row positions)."""
    x0, x1 = np.asarray(x0, dtype=float), np.asarray(x1, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x0) == 0:
        return np.empty(0), np.empty(0, dtype=np.float32)
    order = np.lexsort((x0, y))
    x0, x1, y = x0[order], x1[order], y[order]
    lo, hi = y - height / 2, y + height / 2
    spine = float(np.min(x0))
    row_starts = np.flatnonzero(np.r_[True, y[1:] != y[:-1]])
    row_ends = np.r_[row_starts[1:], len(y)]
    xs, ys = [], []
    for a, b in zip(row_starts, row_ends):
        n = b - a
        rx = np.empty(4 * n + 2)
        ry = np.empty(4 * n + 2)
        rx[0], ry[0] = spine, lo[a]
        rx[1:-1:4], rx[2:-1:4], rx[3:-1:4], rx[4:-1:4] = x0[a:b], x0[a:b], x1[a:b], x1[a:b]
        ry[1:-1:4], ry[2:-1:4], ry[3:-1:4], ry[4:-1:4] = lo[a:b], hi[a:b], hi[a:b], lo[a:b]
        rx[-1], ry[-1] = spine, lo[a]
        xs.append(rx)
        ys.append(ry)
    return np.concatenate(xs), np.concatenate(ys).astype(np.float32)


def polygon_rects(xs, ys) -> list[tuple[float, float, float]]:
    """The rectangles a :func:`rect_polygon` polygon draws, as (x0, x1, y centre): four points
    (x0, lo), (x0, hi), (x1, hi), (x1, lo) in a row. The joining strokes never match: they
    only move along a bottom edge or down the spine to a lower row."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(xs) < 4:
        return []
    a, b, c, d = (slice(k, len(xs) - 3 + k) for k in range(4))
    hit = ((xs[a] == xs[b]) & (ys[b] > ys[a]) & (ys[c] == ys[b]) & (xs[c] >= xs[b])
           & (xs[d] == xs[c]) & (ys[d] == ys[a]))
    i = np.flatnonzero(hit)
    return list(zip(xs[i], xs[i + 2], (ys[i] + ys[i + 1]) / 2))


def hover_points(x0, x1, y, text: list[str], px_per_unit: float):
    """Hover targets evenly inside each block, each with the block's text: HOVER_POINTS of
    them, more on blocks wider than HOVER_POINTS * HOVER_SPACING_PX at full view
    (``px_per_unit``). Returns x, y, text and the number of points of each block."""
    x0, x1 = np.asarray(x0, dtype=float), np.asarray(x1, dtype=float)
    wide = np.ceil((x1 - x0) * px_per_unit / HOVER_SPACING_PX)
    counts = np.clip(np.nan_to_num(wide), HOVER_POINTS, MAX_HOVER_POINTS).astype(np.int64)
    block = np.repeat(np.arange(len(x0)), counts)
    k = np.arange(len(block)) - np.repeat(np.cumsum(counts) - counts, counts)  # index in block
    xs = x0[block] + (x1 - x0)[block] * (k + 0.5) / counts[block]
    ys = np.asarray(y, dtype=np.float32)[block]
    return xs, ys, [text[i] for i in block], [int(c) for c in counts]


def block_traces(x0, x1, y, height, text, *, name, color, meta, px_per_unit, legend=True,
                  fill=None):
    """A block set as (filled rectangles, hover targets); both in one legend group.
    ``px_per_unit``: pixels per x unit at full view, for the spacing of the hover targets."""
    xs, ys = rect_polygon(np.asarray(x0, dtype=float), np.asarray(x1, dtype=float), y, height)
    hx, hy, htext, counts = hover_points(x0, x1, y, text, px_per_unit)
    group = f"{meta.get('step', '')}:{meta['phase']}"
    blocks = go.Scatter(
        x=xs, y=ys, mode="none", fill="toself", fillcolor=fill or color, name=name,
        legendgroup=group, showlegend=legend, hoverinfo="skip", meta=meta)
    hover = go.Scatter(
        x=hx, y=hy, mode="none", hoveron="points", hovertext=htext, hoverinfo="text",
        marker=dict(color=color), hoverlabel=dict(bgcolor=color), name=name, legendgroup=group,
        showlegend=False, meta={**meta, "phase": meta["phase"] + ":hover", "hover_repeat": counts})
    return blocks, hover


def label_font_px(row_px: float) -> float:
    """The label font for a lane row ``row_px`` pixels tall (the page's zoom handler uses the
    same rule, see dashboards/page.py)."""
    return min(11.0, 0.55 * row_px)


def fitting_labels(x, y, text, width, *, px_per_ms: float, row_px: float,
                   x_range=None, y_range=None) -> list[int]:
    """Indices of the labels to draw at a view: readable font, the label fits inside its block,
    inside the view, and not more than MAX_LABELS_IN_VIEW of them (else none: zoom in)."""
    font = label_font_px(row_px)
    if font < LABEL_MIN_FONT_PX:
        return []
    picked = []
    for i, (xi, yi, t, w) in enumerate(zip(x, y, text, width)):
        if x_range and not (x_range[0] <= xi <= x_range[1]):
            continue
        if y_range and not (y_range[0] <= yi <= y_range[1]):
            continue
        if w * px_per_ms >= 0.62 * font * len(t) + 4:
            picked.append(i)
    return picked if len(picked) <= MAX_LABELS_IN_VIEW else []
