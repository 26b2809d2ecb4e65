"""The diff (``pptrace diff``) on a terminal: the waterfall from BASE's step to NEW's (the run's,
and each stage's change beside it), the bubble against theory per stage, the sentences, and the
verdict as the last line. Formats only: the numbers are the diff document's."""
from __future__ import annotations

from .tables import Col, print_table, printable
from ..diff.noise import NOISE_SPREADS

_NAMES = {"compute_fwd": "compute: forward", "compute_bwd": "compute: backward",
          "compute_bwd_input": "compute: input grad", "compute_bwd_weight": "compute: weight grad",
          "compute_other": "compute: other", "pp_bubble_schedule": "pp bubble: schedule",
          "pp_bubble_latency": "pp bubble: latency"}


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _delta(change: dict) -> str:
    """'+40.02*' (the star: beyond noise)."""
    if change is None or change.get("delta_s") is None:
        return "-"
    return f"{change['delta_s'] * 1e3:+.2f}" + ("*" if change.get("significant") else "")


def _noise(change: dict) -> str:
    noise = change.get("noise_s")
    return "-" if noise is None else f"{NOISE_SPREADS * noise * 1e3:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def waterfall_rows(doc: dict) -> tuple[list[Col], list[list[str]]]:
    """The waterfall as table rows: each item, the unexplained rest (nanoseconds at most)
    and the step; a column per stage with the stage's own change."""
    stages = doc["stages"]
    cols = [Col("item", key=True, justify="left"), Col("base ms", drop_zero=False), Col("new ms", drop_zero=False),
            Col("change ms", drop_zero=False), Col("change %"), Col(f"noise ms ({NOISE_SPREADS:g}x)"),
            *(Col(f"stage {s['stage']}") for s in stages)]
    per_stage = [{i["item"]: i for i in s["waterfall"]["items"]} for s in stages]
    rows = []
    for item in doc["waterfall"]["items"]:
        if not (item["base_s"] or item["new_s"]):
            continue
        rows.append([_NAMES.get(item["item"], item["item"].replace("_", " ")), _ms(item["base_s"]), _ms(item["new_s"]),
                     _delta(item), _pct(item["fraction"]), _noise(item),
                     *(_delta(s.get(item["item"])) for s in per_stage)])
    rest = doc["waterfall"]["unexplained_s"]
    if abs(rest) >= 5e-7:
        rows.append(["unexplained", "-", "-", f"{rest * 1e3:+.3f}", "-", "-", *("-" for _ in stages)])
    step = doc["step"]
    rows.append(["step", _ms(step["base_s"]), _ms(step["new_s"]), _delta(step), _pct(step["fraction"]), _noise(step),
                 *(_delta(s["step"]) for s in stages)])
    return cols, rows


def _bubble_rows(doc: dict) -> list[list[str]]:
    rows = []
    for s in doc["stages"]:
        pipe = s["pipeline"]
        if not pipe:
            continue
        items = {i["item"]: i for i in s["waterfall"]["items"]}
        frac, theory = pipe["bubble_fraction"], pipe["theory_bubble_fraction"]
        rows.append([str(s["stage"]), _delta(s["parts"]["pp_bubble"]), _delta(items.get("pp_bubble_schedule")),
                     _delta(items.get("pp_bubble_latency")),
                     "-" if pipe["theory_bubble_s"]["delta"] is None else f"{pipe['theory_bubble_s']['delta'] * 1e3:+.2f}",
                     pipe["theory"] or "-",
                     "-" if frac["base"] is None else f"{frac['base']:.1%} -> {frac['new']:.1%}",
                     "-" if theory["base"] is None else f"{theory['base']:.1%} -> {theory['new']:.1%}"])
    return rows


def print_diff(doc: dict, console) -> None:
    """The diff's tables and sentences; the verdict is the last line printed."""
    from rich.markup import escape

    b, n = doc["base"], doc["new"]
    console.print(f"[bold]pptrace diff[/] {escape(printable(b['label']))} ({b['layout_text']}, {b['schedule'] or '?'}, "
                  f"m {b['microbatches'] or '?'}) -> {escape(printable(n['label']))} ({n['layout_text']}, "
                  f"{n['schedule'] or '?'}, m {n['microbatches'] or '?'})", highlight=False)
    cols, rows = waterfall_rows(doc)
    print_table(console, "Step time: BASE -> NEW, ms per step (mean over ranks; a stage column: that stage's change)",
                cols, rows, caption=f"* beyond noise: more than {NOISE_SPREADS:g} x the pooled spread of the two "
                                    "runs (the noise column)")
    bubble = _bubble_rows(doc)
    if bubble:
        print_table(console, "Pipeline bubble change per stage vs the schedule's theory (ms)",
                    [Col("stage", key=True), *(Col(h) for h in ("bubble", "schedule", "latency", "theory")),
                     Col("verdict", justify="left", drop_zero=False), Col("fraction", drop_zero=False),
                     Col("theory fraction", drop_zero=False)], bubble)
    for line in doc["explanation"]:
        console.print(escape(printable(line)), highlight=False, soft_wrap=True)
    for warning in doc["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(printable(warning))}", highlight=False, soft_wrap=True)
    console.print(escape(printable(doc["verdict"]["line"])), highlight=False, soft_wrap=True)
