"""What a trace's pptrace block claims (layout, microbatches, vpp, schedule), checked against
what the traces show: each contradiction is replaced by the evidence, with one warning naming
both. The evidence is infer/'s inference (p2p chain, pg_config, mb and chunk tags, order
of passes), the same that plain traces get."""
from __future__ import annotations

import numpy as np

from . import infer
from ..sweeps import isin
from ..topology import Layout
from ..vocab import DIRECTION_OF, GPIPE, INTERLEAVED, ONE_F_ONE_B, SCHEDULES, canonical


def shape(layout: Layout) -> str:
    return f"tp{layout.tp} cp{layout.cp} pp{layout.pp} dp{layout.dp}"


def is_count(value) -> bool:
    """A positive int (a size, a count) as JSON gives it: bools are not counts."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def cross_check(events, layout, given, claimed, metas, layout_said: str | None):
    """-> (layout, given, warnings): each claim of the pptrace block (layout, and the fields
    of ``given`` named in ``claimed``: microbatches, vpp, schedule) that the traces contradict
    is replaced by what they show, with one warning naming both; an impossible value is
    dropped. The evidence is infer/'s inference (p2p chain, pg_config, mb and chunk tags,
    order of passes). ``layout_said``: how the layout came about ("... {} ..." for its
    shape), None for one the caller gave or that was inferred."""
    warnings: list = []
    given = dict(given)
    if layout_said is not None:
        layout = _check_layout(events, layout, metas, layout_said, warnings)
    if not claimed:
        return layout, given, warnings
    passes = infer.passes_of(events)
    if "microbatches" in claimed:
        _check_microbatches(passes, given, warnings)
    if "vpp" in claimed:
        _check_vpp(passes, given, warnings)
    if "schedule" in claimed:
        _check_schedule(passes, layout, given, sorted(metas), warnings)
    return layout, given, warnings


def _p2p_contradiction(events, layout) -> str | None:
    """The first p2p range whose peer is no pipeline neighbour of its rank in ``layout``, as
    words, or None. Peers of inferred rows are left out (their layout was assumed)."""
    ev = events
    sel = ((ev["category"] == "p2p").to_numpy() & (ev["lane_kind"] == "host").to_numpy()
           & ~ev["gpu_annotation"].to_numpy() & ~ev["inferred"].to_numpy()
           & isin(ev["op"], DIRECTION_OF) & ev["peer"].notna().to_numpy())
    if not sel.any():
        return None
    # selected, then widened: the whole column as int64 first cost 0.3 s at 8 M rows
    rank = ev["rank"].to_numpy()[sel].astype(np.int64)
    peer = ev["peer"].array[sel].to_numpy(np.int64, na_value=-1)
    world, pp = layout.world_size, layout.pp
    stride = layout.rank(pp=1) if pp > 1 else 0
    stage = (rank // max(stride, 1)) % pp
    # neighbours on the ring: interleaved schedules send from the last stage to the first
    nxt = rank + ((stage + 1) % pp - stage) * stride
    prv = rank + ((stage - 1) % pp - stage) * stride
    ok = (rank < world) & (peer >= 0) & (peer < world) & ((peer == nxt) | (peer == prv) | (peer == rank))
    if ok.all():
        return None
    i = int(np.flatnonzero(~ok)[0])
    return f"rank {rank[i]} exchanges p2p with rank {peer[i]}, not a pipeline neighbour in that layout"


def _pg_contradiction(metas, layout) -> str | None:
    """The first process group of distributedInfo.pg_config (pp, tp or cp) that differs from
    the layout's group of that rank, as words, or None."""
    for dim, groups in infer.dim_groups(metas).items():
        for rank, ranks in sorted(groups.items()):
            if rank < layout.world_size and sorted(layout.group_ranks(dim, rank)) != sorted(ranks):
                return (f"distributedInfo.pg_config puts rank {rank} in the {dim} group {sorted(ranks)}, "
                        f"the layout in {sorted(layout.group_ranks(dim, rank))}")
    return None


def _check_layout(events, layout, metas, said, warnings):
    why = _pg_contradiction(metas, layout) or _p2p_contradiction(events, layout)
    if why is None:
        return layout
    claim = said.format(shape(layout))
    shown, how = infer.p2p_chain(events, metas, layout.world_size)
    if shown is None or shown == layout:
        warnings.append(f"{claim}, but {why}; the traces show no other layout, so per-stage results "
                        "follow it and may be wrong")
        return layout
    warnings.append(f"{claim}, but {why}; using {shape(shown)} ({how})")
    return shown


def _check_microbatches(passes, given, warnings):
    claim, seen = given["microbatches"], infer.microbatches_of(passes)
    if claim is None:
        return
    if not is_count(claim):
        given["microbatches"] = seen
        warnings.append(f"the pptrace block says microbatches {claim!r}, not a positive count; "
                        + (f"using {seen} from the mb tags" if seen else "ignored"))
    elif seen is not None and seen != claim:
        given["microbatches"] = seen
        warnings.append(f"the pptrace block says {claim} microbatches, but a rank's step runs forwards of {seen} "
                        f"distinct microbatches (mb tags); using {seen}")


def _check_vpp(passes, given, warnings):
    claim = given["vpp"]
    if claim is None:
        return
    seen = infer.chunks_of(passes)
    tagged = bool(((passes["op"] == "fwd") & (passes["chunk"] >= 0)).any())
    if not is_count(claim):
        given["vpp"] = seen if tagged else None
        warnings.append(f"the pptrace block says vpp {claim!r}, not a positive count; "
                        + (f"using {seen} from the chunk tags" if tagged else "ignored"))
    # without chunk tags the count of forwards per microbatch only refutes a vpp above 1
    # (recomputed forwards could pass for more chunks)
    elif seen is not None and seen != claim and (tagged or claim > 1):
        given["vpp"] = seen
        source = "distinct chunk tags of a rank's forwards" if tagged else "forwards per microbatch in a rank's step"
        warnings.append(f"the pptrace block says vpp {claim}, but the traces show {seen} model chunk"
                        f"{'s' * (seen > 1)} per rank ({source}); using {seen}")


def _check_schedule(passes, layout, given, ranks, warnings):
    """A named schedule with a table whose order the passes do not follow is replaced by the
    one they follow; a name pptrace does not know is kept (its theory replays the measured
    order of passes, right for any schedule) with a warning; a name that is no string goes."""
    claim = given["schedule"]
    if claim is None:
        return
    pp = layout.pp
    stage_of = {r: layout.coords(r).pp for r in ranks if r < layout.world_size}
    if not isinstance(claim, str):
        seen = infer.schedule_fits(passes, pp, stage_of)
        given["schedule"] = None if seen is None else seen[0]
        warnings.append(f"the pptrace block says schedule {claim!r}, not a name; "
                        + ("ignored" if seen is None else f"using {seen[0]} from the order of passes"))
        return
    name = canonical(claim)
    if name not in SCHEDULES and not claim.startswith(infer.TORCH_SCHEDULE_PREFIX):
        seen = infer.schedule_fits(passes, pp, stage_of)
        warnings.append(f"the pptrace block names schedule {claim!r}, which pptrace does not know; its theory is "
                        "the replay of the measured order of passes"
                        + (f" (the order of {seen[0]})" if seen is not None else ""))
        return
    if name not in (GPIPE, ONE_F_ONE_B, INTERLEAVED):
        return  # a schedule without an F/B table (split backwards, torch's own): nothing to check
    v = int(given["vpp"] or 1)
    if infer.schedule_fits(passes, pp, stage_of, [(name, v)]) is not None:
        return
    seen = infer.schedule_fits(passes, pp, stage_of)
    if seen is None:
        return  # an order no table has (noise, a partial step): no evidence against the claim
    given["schedule"], seen_v = seen
    if seen_v != v:
        given["vpp"] = seen_v
    warnings.append(f"the pptrace block says schedule {claim!r}, but every rank's order of forwards and "
                    f"backwards is {seen[0]}'s{f' (vpp {seen_v})' if seen_v > 1 else ''}; using {seen[0]}")
