"""What changed in the set-up between the two runs (layout, world size, schedule, microbatches,
vpp, library versions, hosts) and so which comparisons are possible: ranks correspond only
under the same layout; stages under the same number of stages; a parallel dimension only where
both runs have it. Two runs with no parallel dimension in common are refused."""
from __future__ import annotations

from ..errors import TraceError

DIMS = ("tp", "cp", "pp", "dp", "ep")


def sizes(doc: dict) -> dict:
    layout = doc["run"].get("layout") or {}
    return {d: int(layout.get(d) or 1) for d in DIMS}


def layout_text(doc: dict) -> str:
    s = sizes(doc)
    return " ".join(f"{d}{n}" for d, n in s.items() if n > 1) or "1 rank"


def _environment(doc: dict) -> dict:
    return doc["run"].get("environment") or {}


def _changed(what: str, base, new, note: str | None = None) -> dict | None:
    if base == new:
        return None
    return {"what": what, "base": base, "new": new, **({"note": note} if note else {})}


def setup(base: dict, new: dict, labels: tuple[str, str]) -> dict:
    """{changes: [{what, base, new, note?}], comparable: {ranks, stages, dims}, not_comparable:
    [why...]}; a TraceError when the runs share no parallel dimension."""
    rb, rn = base["run"], new["run"]
    sb, sn = sizes(base), sizes(new)
    with_b, with_n = {d for d, n in sb.items() if n > 1}, {d for d, n in sn.items() if n > 1}
    if (with_b or with_n) and not (with_b & with_n):
        raise TraceError(f"{labels[0]} ({layout_text(base)}) and {labels[1]} ({layout_text(new)}) have no parallel "
                         "dimension in common: neither stages nor communication can be compared; diff runs of one "
                         "model whose layouts share a dimension")
    same_order = (rb.get("layout") or {}).get("order") == (rn.get("layout") or {}).get("order")
    same_layout = sb == sn and same_order and rb.get("world_size") == rn.get("world_size")
    pipeline = sb["pp"] > 1 or sn["pp"] > 1
    found = [
        _changed("layout", layout_text(base), layout_text(new)),
        _changed("rank order", (rb.get("layout") or {}).get("order"), (rn.get("layout") or {}).get("order")),
        _changed("world size", rb.get("world_size"), rn.get("world_size")),
    ]
    if pipeline:
        found += [_changed("schedule", rb.get("schedule"), rn.get("schedule")),
                  _changed("microbatches", rb.get("microbatches"), rn.get("microbatches")),
                  _changed("vpp", rb.get("vpp") or 1, rn.get("vpp") or 1)]
    vb, vn = _environment(base).get("versions") or {}, _environment(new).get("versions") or {}
    found += [_changed(name, vb.get(name), vn.get(name)) for name in sorted(set(vb) | set(vn))]
    hb, hn = _environment(base).get("hosts") or {}, _environment(new).get("hosts") or {}
    if hb and hn:
        found.append(_changed("hosts", sorted(hb), sorted(hn)))
    not_comparable = []
    if not same_layout:
        not_comparable.append(f"ranks: the layouts differ ({layout_text(base)} vs {layout_text(new)}), so rank r is "
                              "not the same work in both; compared per stage and per dimension instead")
    if sb["pp"] != sn["pp"]:
        not_comparable.append(f"stages: pp {sb['pp']} -> {sn['pp']}, a stage holds other layers; compared for the "
                              "run as a whole")
    elif pipeline and (rb.get("vpp") or 1) != (rn.get("vpp") or 1):
        not_comparable.append(f"stage contents: vpp {rb.get('vpp') or 1} -> {rn.get('vpp') or 1} gives each stage "
                              "other layers in other chunks; its totals still compare")
    for d in sorted(with_b ^ with_n, key=DIMS.index):
        only = labels[0] if d in with_b else labels[1]
        not_comparable.append(f"{d}: only {only} has it ({d}{max(sb[d], sn[d])}); its communication is new or gone, "
                              "not a change")
    return {"changes": [c for c in found if c is not None],
            "comparable": {"ranks": same_layout, "stages": sb["pp"] == sn["pp"],
                           "dims": [d for d in DIMS if d in with_b & with_n]},
            "not_comparable": not_comparable}
