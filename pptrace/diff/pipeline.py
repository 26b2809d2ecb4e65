"""The pipeline side of a diff: per stage and for the run, the bubble against the schedule's
theory before and after, so that a bubble change the set-up explains ("+12 ms, as expected from
m 8 -> 4: theory +11 ms") is told apart from one it does not; the bubble by phase; and the
per-microbatch pass times (t_fwd, t_bwd, t_w) before and after."""
from __future__ import annotations

import math

from .noise import NOISE_SPREADS

#: a measured bubble change within this share of the theory's change (or within noise) is expected
THEORY_TOLERANCE = 0.10
PHASES = ("warmup", "steady", "cooldown")
PASS_TIMES = ("t_fwd_s", "t_bwd_s", "t_wgrad_s")


def _pair(b, n) -> dict:
    b = None if b is None else float(b)
    n = None if n is None else float(n)
    delta = None if b is None or n is None else n - b
    return {"base": b, "new": n, "delta": delta, "fraction": delta / b if delta is not None and b else None}


def verdict_on_theory(measured: float | None, theory: float | None, noise: float | None) -> str | None:
    """'as expected', 'above theory' or 'below theory': the measured change of the bubble the
    schedule causes against the change the theory predicts from the measured pass times."""
    if measured is None or theory is None:
        return None
    slack = max(THEORY_TOLERANCE * abs(theory), NOISE_SPREADS * (noise or 0.0), 1e-6)
    if abs(measured - theory) <= slack:
        return "as expected"
    return "above theory" if measured > theory else "below theory"


def stage_pipeline(sb: dict, sn: dict, bubble: dict, schedule_part: dict | None) -> dict:
    """One stage's pipeline comparison from its ``pipeline.stages[]`` entries on each side;
    ``bubble`` / ``schedule_part``: the stage's changes of pp_bubble and of its schedule part
    (None when not split)."""
    theory = _pair(sb.get("theory_bubble_s"), sn.get("theory_bubble_s"))
    measured = schedule_part or bubble
    return {
        "theory_bubble_s": theory,
        "bubble_fraction": _pair(sb.get("bubble_fraction"), sn.get("bubble_fraction")),
        "theory_bubble_fraction": _pair(sb.get("theory_bubble_fraction"), sn.get("theory_bubble_fraction")),
        "phases_s": {ph: _pair(sb.get(f"{ph}_bubble_s"), sn.get(f"{ph}_bubble_s")) for ph in PHASES},
        "passes_s": {t: _pair(sb.get(t), sn.get(t)) for t in PASS_TIMES},
        "compared": "schedule part" if schedule_part else "bubble",
        "beyond_theory_s": (None if theory["delta"] is None else measured["delta_s"] - theory["delta"]),
        "theory": verdict_on_theory(measured["delta_s"], theory["delta"], measured.get("noise_s")),
    }


def stages_pipeline(base: dict, new: dict, stage_changes: dict) -> list[dict]:
    """Per stage both runs have: ``stage_pipeline``. ``stage_changes``: stage -> {quantity: change}."""
    by_b = {s["stage"]: s for s in base["pipeline"].get("stages") or []}
    by_n = {s["stage"]: s for s in new["pipeline"].get("stages") or []}
    out = []
    for stage in sorted(set(by_b) & set(by_n) & set(stage_changes)):
        values = stage_changes[stage]
        out.append({"stage": stage, **stage_pipeline(by_b[stage], by_n[stage], values["pp_bubble"],
                                                     values.get("pp_bubble_schedule"))})
    return out


def run_pipeline(base: dict, new: dict, bubble: dict, schedule_part: dict | None) -> dict:
    """The run's: measured bubble (mean over ranks) and fraction against theory, before and after."""
    pb, pn = base["pipeline"], new["pipeline"]
    out = stage_pipeline(pb, pn, bubble, schedule_part)
    for key in ("phases_s", "passes_s"):
        out.pop(key)
    out["theory_source"] = {"base": pb.get("theory_source"), "new": pn.get("theory_source")}
    return out


def fmt_theory(entry: dict) -> str:
    """'theory +11.0 ms, as expected' for a sentence."""
    delta = entry["theory_bubble_s"]["delta"]
    if delta is None or entry.get("theory") is None:
        return "no theory on both sides"
    text = f"theory {delta * 1e3:+.1f} ms"
    beyond = entry.get("beyond_theory_s")
    if entry["theory"] != "as expected" and beyond is not None and math.isfinite(beyond):
        return f"{text}, {abs(beyond) * 1e3:.1f} ms {entry['theory']}"
    return f"{text}, as expected"
