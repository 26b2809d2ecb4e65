"""The diff document (schema ``pptrace.diff/1``): two analysis documents in, every comparison
of this package out, in one dict — what ``pptrace diff --json`` prints, the terminal tables and
the page draw, and ``pptrace.diff(base, new)`` returns."""
from __future__ import annotations

from ..analysis import strict_json
from ..errors import TraceError
from ..vocab import PARTS
from . import compare
from .cells import HIDDEN, cells, items_of
from .decompose import by_quantity, changes, waterfall
from .explain import sentences, summary
from .gate import Gate, evaluate, parse_gate, verdict
from .noise import RULE, RESOLUTION_S
from .pipeline import run_pipeline, stages_pipeline
from .setup import layout_text, setup, sizes
from .sides import Side, load_side

SCHEMA = "pptrace.diff/1"


def _side(side: Side, table) -> dict:
    run = side.document["run"]
    return {"label": side.label, "world_size": run.get("world_size"), "layout": run.get("layout"),
            "layout_text": layout_text(side.document), "schedule": run.get("schedule"),
            "microbatches": run.get("microbatches"), "vpp": run.get("vpp"), "steps": run.get("steps"),
            "ranks": int(table["rank"].nunique()), "typical_step": compare.typical_step(table),
            "environment": run.get("environment"), "warnings": len(side.document.get("warnings") or [])}


def _rank_rows(cb, cn, quantities) -> list[dict]:
    per = by_quantity(changes(cb, cn, "rank", quantities))
    stage = dict(zip(cn["rank"], cn["stage"]))
    return [{"rank": int(r), "stage": int(stage[r]), "step": v["time_s"], "parts": {p: v[p] for p in PARTS}}
            for r, v in per.items()]


def _warnings(doc: dict, sides: tuple[Side, Side]) -> list[str]:
    out = []
    if doc["step"]["significant"] is None:
        out.append("neither run has two profiled steps or three ranks in a stage: no noise to judge a change "
                   "against, so every change is shown and gates judge the threshold alone")
    if abs(doc["waterfall"]["unexplained_s"]) > RESOLUTION_S:
        out.append(f"the parts of a step do not add up to its time in one of the documents "
                   f"({doc['waterfall']['unexplained_s'] * 1e6:+.1f} us unexplained); was it edited?")
    if not any(i["item"].startswith("compute_") for i in doc["waterfall"]["items"]):
        out.append("compute is not split by pass type: an analysis without ranks[].steps[].compute_s "
                   "(written by an older pptrace); analyze the run again for the split")
    for side in sides:
        if side.document.get("warnings"):
            out.append(f"{side.label}: its analysis has {len(side.document['warnings'])} warning(s); "
                       "pptrace analyze shows them")
    return out


def diff_documents(base: Side, new: Side, gates=()) -> dict:
    """The diff of two loaded sides (see :func:`diff`)."""
    gates = [g if isinstance(g, Gate) else parse_gate(g) for g in gates]
    db, dn = base.document, new.document
    set_up = setup(db, dn, (base.label, new.label))
    cb, cn = cells(db), cells(dn)
    for side, table in ((base, cb), (new, cn)):
        if table.empty:
            raise TraceError(f"{side.label}: no rank has an analysed step (no ProfilerStep#N on any main thread); "
                             "nothing to compare")
    items = items_of(cb, cn)
    quantities = list(dict.fromkeys(["time_s", *PARTS, *(i for i, _ in items), *HIDDEN]))
    columns = list(dict.fromkeys([*cb.columns, *cn.columns]))
    cb, cn = cb.reindex(columns=columns, fill_value=0.0), cn.reindex(columns=columns, fill_value=0.0)
    run = by_quantity(changes(cb, cn, None, quantities))[0]
    per_stage = by_quantity(changes(cb, cn, "stage", quantities)) if set_up["comparable"]["stages"] else {}
    step = run["time_s"]
    pipelined = sizes(db)["pp"] > 1 or sizes(dn)["pp"] > 1
    pipes = {p["stage"]: p for p in stages_pipeline(db, dn, per_stage)} if pipelined else {}
    ranks_b = cb.groupby("stage")["rank"].unique()
    ranks_n = cn.groupby("stage")["rank"].unique()
    doc = {
        "schema": SCHEMA,
        "base": _side(base, cb), "new": _side(new, cn),
        "setup": set_up,
        "noise": {"rule": RULE},
        "step": step,
        "waterfall": waterfall(step, run, items),
        "parts": {p: run[p] for p in PARTS},
        "hidden": {h.removeprefix("hidden_"): run[h] for h in HIDDEN},
        "pipeline": (run_pipeline(db, dn, run["pp_bubble"], run.get("pp_bubble_schedule")) if pipelined else None),
        "stages": [{"stage": int(s), "ranks": {"base": sorted(int(r) for r in ranks_b[s]),
                                               "new": sorted(int(r) for r in ranks_n[s])},
                    "step": v["time_s"], "parts": {p: v[p] for p in PARTS}, "waterfall": waterfall(v["time_s"], v, items),
                    "pipeline": pipes.get(s)} for s, v in per_stage.items()] if pipelined else [],
        "dims": compare.dims(db, dn, run, (sizes(db), sizes(dn))),
        "links": compare.links(db, dn) if set_up["comparable"]["stages"] else [],
        "ranks": _rank_rows(cb, cn, quantities) if set_up["comparable"]["ranks"] else [],
        "stragglers": compare.stragglers(db, dn, set_up["comparable"]["ranks"], set_up["comparable"]["stages"]),
        "critical_path": compare.critical_path(db, dn),
        "timelines": {"base": compare.timeline(db, compare.typical_step(cb)),
                      "new": compare.timeline(dn, compare.typical_step(cn))},
    }
    doc["explanation"] = sentences(doc)
    doc["summary"] = summary(doc)
    doc["verdict"] = verdict(step, [evaluate(g, run, per_stage) for g in gates])
    doc["warnings"] = _warnings(doc, (base, new))
    return strict_json(doc)


def diff(base, new, *, gates=(), labels=(None, None), **load_options) -> dict:
    """What changed between two runs, and why: the ``pptrace.diff/1`` document.

    ``base`` and ``new``: run directories or trace files (analysed here, ``load_options``
    going to ``pptrace.analyze``), ``analysis.json`` files that ``pptrace analyze --json``
    wrote, :class:`~pptrace.analysis.Analysis` objects or their ``to_json()`` dicts.
    ``gates``: specs such as ``'step>+3%'`` (see ``pptrace.diff.gate``); the verdict says
    whether NEW failed one. Bad input raises a one-line TraceError or ValueError."""
    gates = [parse_gate(g) if not isinstance(g, Gate) else g for g in gates]  # before anything loads
    return diff_documents(load_side(base, labels[0], **load_options), load_side(new, labels[1], **load_options),
                          gates)
