"""The diff in sentences: the step's change and whether it is noise, what changed in the
set-up, then each significant change the waterfall holds in the order a reader follows the
cause — a stage's compute by pass (per microbatch), the bubble it makes the other stages wait
(with the schedule's theory, so an expected change is not read as a regression), exposed
communication per dimension, p2p transfer and host gaps — and the stragglers and critical
path before and after. Nothing is computed here beyond picking and wording."""
from __future__ import annotations

from .words import change_text, ms, noise_text, signed_ms, stages_text
from .pipeline import fmt_theory

_PASS_WORDS = {"compute_fwd": "forward", "compute_bwd": "backward", "compute_bwd_input": "input-grad",
               "compute_bwd_weight": "weight-grad", "compute_other": "other compute"}
_PER_MB = {"compute_fwd": "t_fwd_s", "compute_bwd": "t_bwd_s", "compute_bwd_input": "t_bwd_s",
           "compute_bwd_weight": "t_wgrad_s"}
_PHASE_WORDS = {"warmup": "warm-up", "steady": "steady state", "cooldown": "cool-down"}
_PART_WORDS = {"pp_transfer": "p2p transfer", "other": "other (host gaps)", "tp_exposed": "tp exposed",
               "cp_exposed": "cp exposed", "dp_exposed": "dp exposed", "ep_exposed": "ep exposed"}
#: sentences of one kind beyond this are summed up in one
MAX_PER_KIND = 6
#: a change smaller than this share of BASE's step is not told, significant or not (the
#: tables show it): sleep-mode compute is so steady that 0.1 ms is beyond its noise
MATERIAL_FRACTION = 0.005
#: changes within this share of their mean read as one (the same change on every stage)
SAME_CHANGE = 0.10
_ITEM_WORDS = {**_PASS_WORDS, **_PART_WORDS, "pp_bubble_schedule": "bubble (schedule part)",
               "pp_bubble_latency": "bubble (latency part)"}


def _told(change: dict, step_s: float) -> bool:
    """Significant, and material: at least MATERIAL_FRACTION of the step."""
    return bool(change["significant"]) and abs(change["delta_s"]) >= MATERIAL_FRACTION * step_s


def _significant(items, step_s: float, parts=None):
    return [i for i in items if _told(i, step_s) and (parts is None or i["part"] in parts)]


def _compute_sentences(scopes: list[tuple[str, dict, dict | None]], step_s: float, m: tuple) -> list[str]:
    """A pass type's compute change per scope; scopes whose change is the same within
    SAME_CHANGE are told in one sentence (every stage's forward +2 ms per microbatch)."""
    found: dict = {}  # item -> [(where, change, per-microbatch change)]
    for where, fall, pipe in scopes:
        for item in _significant(fall["items"], step_s, ("compute",)):
            per_mb = pipe and (pipe["passes_s"].get(_PER_MB.get(item["item"], "")) or {})
            found.setdefault(item["item"], []).append((where, item, per_mb or {}))
    out = []
    for name, rows in found.items():
        deltas = [c["delta_s"] for _, c, _ in rows]
        mean = sum(deltas) / len(deltas)
        groups = [rows] if all(abs(d - mean) <= SAME_CHANGE * abs(mean) for d in deltas) else [[r] for r in rows]
        for group in groups:
            where = group[0][0] if len(group) == 1 else "stages " + ", ".join(w.split()[-1] for w, _, _ in group)
            change = group[0][1] if len(group) == 1 else {"delta_s": mean, "fraction": None}
            text = f"{where}: {_PASS_WORDS.get(name, 'compute')} {change_text(change)} per step" + (
                " each" if len(group) > 1 else "")
            per_mb = [p.get("delta") for _, _, p in group if p.get("delta") is not None]
            if per_mb:
                text += f" ({signed_ms(sum(per_mb) / len(per_mb))} per microbatch"
                base_t = [p["base"] for _, _, p in group if p.get("base")]
                if m[0] != m[1] and base_t and abs(sum(per_mb) / len(per_mb)) < SAME_CHANGE * min(base_t):
                    text += f": from the microbatches, {m[0]} -> {m[1]}"
                text += ")"
            out.append(text)
    return out


def _bubble_sentences(stages: list[dict], grew: set, step_s: float) -> list[str]:
    out = []
    for stage in stages:
        bubble = stage["parts"]["pp_bubble"]
        if not _told(bubble, step_s):
            continue
        text = f"stage {stage['stage']}: pp_bubble {change_text(bubble)}"
        causes = sorted(grew - {stage["stage"]})
        if bubble["delta_s"] > 0 and causes and stage["stage"] not in grew:
            text += f", waiting for {stages_text(causes)}, whose compute grew"
        items = {i["item"]: i for i in stage["waterfall"]["items"]}
        if "pp_bubble_schedule" in items:
            text += (f" (schedule part {signed_ms(items['pp_bubble_schedule']['delta_s'])}, latency "
                     f"{signed_ms(items['pp_bubble_latency']['delta_s'])})")
        phases = stage["pipeline"]["phases_s"]
        top = max(phases, key=lambda ph: abs(phases[ph]["delta"] or 0.0))
        if phases[top]["delta"]:
            text += f", most in the {_PHASE_WORDS[top]}"
        out.append(f"{text}; {fmt_theory(stage['pipeline'])}")
    return out


def _capped(lines: list[str], what: str) -> list[str]:
    if len(lines) <= MAX_PER_KIND:
        return lines
    return [*lines[:MAX_PER_KIND], f"... and {len(lines) - MAX_PER_KIND} more {what} changes (see the tables)"]


def sentences(doc: dict) -> list[str]:
    """The explanation, one sentence a line, most telling first."""
    step, setup = doc["step"], doc["setup"]
    step_s = step["base_s"]
    m = (doc["base"]["microbatches"], doc["new"]["microbatches"])
    out = [f"step {ms(step['base_s'])} -> {ms(step['new_s'])}: {change_text(step)}, {noise_text(step)}"]
    if setup["changes"]:
        out.append("set-up: " + "; ".join(f"{c['what']} {c['base']} -> {c['new']}" for c in setup["changes"]))
    out += [f"not comparable: {why}" for why in setup["not_comparable"]]
    stages = doc["stages"]
    if stages:
        scopes = [(f"stage {s['stage']}", s["waterfall"], s["pipeline"]) for s in stages]
        # the stages the others wait for: those whose compute grew most (half the largest growth, at least)
        growth = {s["stage"]: s["parts"]["compute"]["delta_s"] for s in stages if _told(s["parts"]["compute"], step_s)}
        most = max(growth.values(), default=0.0)
        grew = {stage for stage, d in growth.items() if d > 0 and d >= 0.5 * most}
        out += _capped(_compute_sentences(scopes, step_s, m), "compute")
        out += _capped(_bubble_sentences(stages, grew, step_s), "bubble")
    else:
        out += _compute_sentences([("run", doc["waterfall"], None)], step_s, m)
        bubble = doc["parts"]["pp_bubble"]
        if _told(bubble, step_s) and doc.get("pipeline"):
            out.append(f"pp_bubble {change_text(bubble)} (mean over ranks); {fmt_theory(doc['pipeline'])}")
    pipe = doc.get("pipeline")
    if pipe and {c["what"] for c in setup["changes"]} & {"schedule", "microbatches", "vpp", "layout"}:
        frac, theory = pipe["bubble_fraction"], pipe["theory_bubble_fraction"]
        if frac["base"] is not None and frac["new"] is not None and theory["delta"] is not None:
            out.append(f"pipeline: bubble {frac['base']:.1%} -> {frac['new']:.1%} of the step, theory "
                       f"{theory['base']:.1%} -> {theory['new']:.1%}; bubble {change_text(doc['parts']['pp_bubble'])} "
                       f"per rank, {fmt_theory(pipe)}")
    for dim in doc["dims"]:
        if dim["exposed"] and _told(dim["exposed"], step_s):
            out.append(f"{dim['dim']} exposed {change_text(dim['exposed'])} (collective wait "
                       f"{signed_ms(dim['wait_s']['delta'])}, transfer {signed_ms(dim['transfer_s']['delta'])})")
    for part in ("pp_transfer", "other"):
        if _told(doc["parts"][part], step_s):
            out.append(f"{_PART_WORDS[part]} {change_text(doc['parts'][part])} (mean over ranks)")
    if len(out) == 1 + bool(setup["changes"]) + len(setup["not_comparable"]):
        out.append("no part of the step changed beyond noise")
    s = doc["stragglers"]
    out += [f"straggler appeared: rank {r['rank']} ({r['metric']}, {ms(r['cost_s'])} per step)" for r in s["appeared"]]
    out += [f"straggler gone: rank {r['rank']} ({r['metric']}, was {ms(r['cost_s'])} per step)" for r in s["disappeared"]]
    cp = doc["critical_path"]
    if cp["base"] and cp["new"]:
        bound = (f"bound by {cp['new']['bound']} (was {cp['base']['bound']})" if cp["changed"]
                 else f"bound by {cp['new']['bound']} in both")
        out.append(f"critical path: {bound}, {ms(cp['base']['length_s'])} -> {ms(cp['new']['length_s'])}")
    return out


def summary(doc: dict) -> str:
    """One line: the step's change and its largest significant items."""
    step = doc["step"]
    scopes = [(f"stage {s['stage']} ", s["waterfall"]) for s in doc["stages"]] or [("", doc["waterfall"])]
    found = sorted(((where, i) for where, fall in scopes for i in _significant(fall["items"], step["base_s"])),
                   key=lambda wi: -abs(wi[1]["delta_s"]))
    head = f"step {change_text(step)}, {noise_text(step)}"
    if not found or not step["significant"]:
        return head
    parts = [f"{where}{_ITEM_WORDS.get(i['item'], i['item'])} {signed_ms(i['delta_s'])}"
             for where, i in found[:3]]
    return f"{head}: " + ", ".join(parts)
