"""Whether an inferred pipeline holds together: the microbatches its p2p carries against its
passes, the passes' share of the step, a named schedule against the order its passes ran.

Inference from plain traces can misread a trace it has no names for (a loss that calls
backward() per chunk read as passes of their own); the structure the schedule leaves in the
trace (one forward message per microbatch across each stage boundary) is then the better
count, and what disagrees is said, in one line, rather than printed as a result."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...vocab import BWD_OPS, FWD, GPIPE, ONE_F_ONE_B, canonical
from .result import Inference
from .schedule import order_schedule

#: The passes of a rank's step together take at least this share of it in any pipeline
#: that computes (a bubble of 95% would take pp ~ 20 m); below it they are misread.
TINY_SHARE = 0.05


def check_structure(passes: pd.DataFrame, ops: pd.DataFrame, steps: pd.DataFrame, stage_of, pp, named: bool,
                    out: Inference) -> None:
    """Fill ``out``'s microbatches from the p2p where the passes disagree with it, and warn,
    in one line, of each way the inferred structure is implausible. ``named``: the
    schedule came from the trace's names, not from the passes' order."""
    if passes.empty or not pp or pp < 2:
        return
    v = int(out.vpp or 1)
    said = []
    m = _messages(ops, v)
    if m is not None and out.microbatches is not None and m != out.microbatches:
        said.append(f"the p2p carries {m} microbatches a step (forward messages across a stage boundary) but the "
                    f"passes hold {out.microbatches}; using {m}")
        out.microbatches = m
        out.inferred["microbatches"] = (f"{m}: forward p2p messages a rank sends or receives in a step"
                                        + (f", over {v} model chunks" if v > 1 else "") + " (the passes disagree)")
    m = out.microbatches
    op = passes["op"].astype(str)
    n_f = passes.assign(f=(op == FWD).to_numpy()).groupby(["rank", "step"])["f"].sum()
    # a backward split in two (I, W) is one microbatch's backward: count what they cover
    bwd = passes[op.isin(list(BWD_OPS)).to_numpy()]
    n_b = bwd.groupby(["rank", "step"])[["mb", "chunk"]].value_counts().groupby(level=[0, 1]).size()
    n_b = n_b.reindex(n_f.index, fill_value=0)
    if m:
        off = (n_f != m * v) | (n_b != m * v)
        if off.any():
            (rank, step), f, b = off.idxmax(), int(n_f[off].iloc[0]), int(n_b[off].iloc[0])
            said.append(f"rank {rank} step {step} runs {f} forwards and {b} backwards, not {m * v} "
                        f"({m} microbatches{f' x {v} chunks' if v > 1 else ''}): its passes may be misread")
    tiny = _tiny(passes, steps, (m or int(n_f.max())) * v)
    if tiny:
        said.append(tiny)
    contradicted = _contradicted(passes, stage_of, pp, out.schedule) if named else None
    if contradicted:
        said.append(contradicted)
    if said:
        out.warnings.append("the inferred pipeline looks implausible: " + "; ".join(said))


def _messages(ops: pd.DataFrame, v: int) -> int | None:
    """Microbatches a step from the p2p: the most forward messages one rank sends (or
    receives) in a step, over its model chunks; None without directed ops."""
    if ops is None or ops.empty:
        return None
    fwd = ops[(ops["dir"] == "fwd").to_numpy() & (ops["step"] >= 0).to_numpy()]
    if fwd.empty:
        return None
    most = int(fwd.groupby(["rank", "step", "is_send"]).size().max())
    return most // v if most % v == 0 else None


def _tiny(passes: pd.DataFrame, steps: pd.DataFrame, per_step: int) -> str | None:
    """A rank whose median pass, times the passes a step holds (forwards and backwards),
    is under TINY_SHARE of its median step: the passes found are not the passes."""
    if steps is None or steps.empty or not per_step:
        return None
    dur = pd.Series((passes["end_ns"] - passes["start_ns"]).to_numpy(np.int64), index=passes["rank"].to_numpy())
    pass_ns = dur.groupby(level=0).median()
    step_ns = pd.Series((steps["end_ns"] - steps["start_ns"]).to_numpy(np.int64),
                        index=steps["rank"].to_numpy()).groupby(level=0).median()
    share = (pass_ns * 2 * per_step / step_ns.reindex(pass_ns.index)).dropna()
    low = share[share < TINY_SHARE]
    if low.empty:
        return None
    rank = int(low.idxmin())
    return (f"rank {rank}'s median pass is {pass_ns[rank] / 1e6:.2f} ms, {2 * per_step} of them "
            f"{100 * low[rank]:.1f}% of its {step_ns[rank] / 1e6:.1f} ms step")


def _contradicted(passes: pd.DataFrame, stage_of, pp, schedule) -> str | None:
    """The schedule the names gave, where pptrace has its table, against the order of the
    passes (torch's own orders for other schedules are their own: nothing to hold them to)."""
    name = canonical(schedule) if isinstance(schedule, str) else None
    if name not in (GPIPE, ONE_F_ONE_B) or stage_of is None:
        return None
    plain = passes[passes["rank"].isin(list(stage_of)).to_numpy()]
    if plain.empty or not plain["op"].isin(["fwd", "bwd"]).all():
        return None
    if order_schedule(plain, pp, stage_of, [(name, 1)]) is not None:
        return None
    return f"the passes do not run in {schedule}'s order, which the trace's names give"
