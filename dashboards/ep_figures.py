"""The expert-parallel panel: pure functions of the report's ``ep``, ``experts`` and ranks'
means (contract 4), drawn only for a run with ep traffic or tagged experts.

- load: tokens per expert per step (a row per expert and the rank it lives on: every
  expert-data-parallel replica is a row of its own), beside each rank's ep time per step,
  exposed vs hidden under compute and, for its collectives, waiting for the slowest peer vs
  transfer;
- pairs: the ep rank-pair matrix (tokens sent, and wait: the sender waiting for the peer), as
  the p2p links panel is for the pipeline.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import PART_COLORS, TOP_LEGEND, empty_figure, esc, rank_label


def has_ep(report: dict) -> bool:
    ep = report.get("ep") or {}
    return bool(ep.get("pairs") or ep.get("expert_tokens"))


def _rank_ep(report: dict) -> tuple[list[int], dict]:
    """The ranks with ep time and their ms per step: exposed, hidden, wait, transfer."""
    out = {"exposed": [], "hidden": [], "wait": [], "transfer": []}
    ranks = []
    for entry in sorted(report.get("ranks") or [], key=lambda r: r.get("rank", 0)):
        mean = entry.get("mean") or {}
        coll = (mean.get("collectives") or {}).get("ep") or {}
        values = (float((mean.get("breakdown_s") or {}).get("ep_exposed") or 0),
                  float((mean.get("hidden_s") or {}).get("ep") or 0),
                  float(coll.get("wait_s") or 0), float(coll.get("transfer_s") or 0))
        if not any(values):
            continue
        ranks.append(int(entry["rank"]))
        for key, value in zip(out, values):
            out[key].append(1000 * value)
    return ranks, out


def ep_load_figure(report: dict) -> go.Figure:
    """Tokens per expert per step (heatmap) and each rank's ep ms per step (bars)."""
    title = "Expert load and ep communication"
    tokens = (report.get("ep") or {}).get("expert_tokens") or []
    ranks, per_rank = _rank_ep(report)
    if not tokens and not ranks:
        return empty_figure(title, "the report has no tagged experts and no ep communication")
    cols = (1 if tokens else 0) + (1 if ranks else 0)
    fig = make_subplots(rows=1, cols=cols, horizontal_spacing=0.12, column_widths=[0.45, 0.55] if cols == 2 else None,
                        subplot_titles=[t for t, on in (("tokens per expert per step", tokens),
                                                        ("ep per rank, ms per step", ranks)) if on])
    n_rows = 0
    if tokens:
        rows = sorted({(int(t["expert"]), int(t["rank"])) for t in tokens})
        steps = sorted({int(t["step"]) for t in tokens})
        at = {key: i for i, key in enumerate(rows)}
        z = np.full((len(rows), len(steps)), np.nan)
        for t in tokens:
            z[at[(int(t["expert"]), int(t["rank"]))], steps.index(int(t["step"]))] = float(t["tokens"])
        labels = [f"expert {e} · {esc(rank_label(report, r))}" for e, r in rows]
        fig.add_trace(go.Heatmap(
            z=z, x=[f"step {s}" for s in steps], y=labels, colorscale="YlOrRd", showscale=False,
            hoverongaps=False, texttemplate="%{z:,.0f}" if z.size <= 400 else None, textfont=dict(size=10),
            hovertemplate="%{y}<br>%{x}: %{z:,.0f} tokens<extra></extra>"), row=1, col=1)
        fig.update_yaxes(autorange="reversed", row=1, col=1)
        n_rows = len(rows)
    if ranks:
        col = cols
        x = [esc(rank_label(report, r)) for r in ranks]
        color = PART_COLORS["ep_exposed"]
        fig.add_trace(go.Bar(x=x, y=per_rank["exposed"], name="ep exposed", marker_color=color, offsetgroup="time",
                             hovertemplate="ep exposed %{y:.3f} ms<extra>%{x}</extra>"), row=1, col=col)
        fig.add_trace(go.Bar(x=x, y=per_rank["hidden"], base=per_rank["exposed"], name="ep hidden under compute",
                             marker=dict(color=color, opacity=0.45, pattern_shape="/"), offsetgroup="time",
                             hovertemplate="ep hidden %{y:.3f} ms<extra>%{x}</extra>"), row=1, col=col)
        fig.add_trace(go.Bar(x=x, y=per_rank["wait"], name="collective wait (slowest peer)", marker_color="#BDBDBD",
                             offsetgroup="split", hovertemplate="wait %{y:.3f} ms<extra>%{x}</extra>"), row=1, col=col)
        fig.add_trace(go.Bar(x=x, y=per_rank["transfer"], base=per_rank["wait"], name="collective transfer",
                             marker_color="#E45756", offsetgroup="split",
                             hovertemplate="transfer %{y:.3f} ms<extra>%{x}</extra>"), row=1, col=col)
        if len(x) > 8:
            fig.update_xaxes(tickangle=-90, row=1, col=col)
    # the legend above the subplot titles, not on them
    fig.update_layout(barmode="group", title=title, legend={**TOP_LEGEND, "y": 1.12}, legend_traceorder="normal",
                      height=max(400, min(1400, 180 + 16 * n_rows)), margin=dict(l=170, t=130))
    return fig


def ep_pairs_figure(report: dict) -> go.Figure:
    """src x dst heatmaps of the ep all-to-alls: tokens sent, and the sender's wait for the peer."""
    ep = report.get("ep") or {}
    pairs = ep.get("pairs") or []
    if not pairs:
        return empty_figure("ep rank pairs", "the report has no ep all-to-all with per-peer split sizes")
    world = int((report.get("run") or {}).get("world_size") or 0)
    n = max([world, *[int(p["src"]) + 1 for p in pairs], *[int(p["dst"]) + 1 for p in pairs]])
    metrics = (("tokens", "tokens sent per step", "%{z:,.0f} tokens", 1.0, "%{z:.3~s}"),
               ("wait_s", "sender waiting for the peer (ms per step)", "%{z:.3f} ms", 1000.0, "%{z:.3~f}"))
    fig = make_subplots(rows=1, cols=2, subplot_titles=[m[1] for m in metrics], horizontal_spacing=0.1)
    for col, (key, _, hover, scale, text) in enumerate(metrics, start=1):
        z = np.full((n, n), np.nan)
        for p in pairs:
            value = p.get(key)
            if value is not None:
                z[int(p["src"]), int(p["dst"])] = float(value) * scale
        fig.add_trace(go.Heatmap(
            z=z, x=list(range(n)), y=list(range(n)), colorscale="Viridis", showscale=False, hoverongaps=False,
            texttemplate=text if n <= 16 else None, textfont=dict(size=10),
            hovertemplate=f"src rank %{{y}} → dst rank %{{x}}<br>{hover}<extra></extra>"), row=1, col=col)
        ticks = dict(tickmode="linear", dtick=1 if n <= 16 else max(1, n // 16))
        fig.update_xaxes(title_text="dst rank", row=1, col=col, **ticks)
        fig.update_yaxes(title_text="src rank" if col == 1 else None, autorange="reversed", row=1, col=col, **ticks)
    unmeasured = ep.get("unmeasured_ranks") or []
    subtitle = (f"sizes unmeasured for ranks {unmeasured[:8]}: their split sizes do not add up"
                if unmeasured else None)
    fig.update_layout(title=dict(text="ep rank pairs (sender row, peer column)",
                                 subtitle=dict(text=esc(subtitle))) if subtitle else
                      "ep rank pairs (sender row, peer column)",
                      height=max(360, min(760, 260 + 8 * n)))
    return fig
