"""When would a step's pipeline have ended with free p2p? A replay of the measured step.

Every rank's main thread is replayed in its measured order: its passes (and any other
top-level range) keep their measured durations, host time between ranges drops to zero,
and a pipeline p2p op completes the moment its matched peer op has been posted (rendezvous
with zero latency: gloo's and NCCL's send waits for the recv to be posted too). Ranges
nested in an open p2p op (ZB-H1's W passes, Megatron's overlap_p2p_comm) run between
posting and waiting, as they did.

The replay keeps what the schedule and the measured pass times decide and drops what
latency and host gaps added, including their knock-on effects: a pass that started before
a late message arrived and then held it up (ZB-H1 places its W passes to fill the bubble of
a latency-free pipeline) starts where it would have without the latency. A critical-path
sum of transfers and gaps misses those.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

_POST, _WAIT, _RUN = 0, 1, 2
_REPLAYED = ("compute", "p2p", "wait", "comm:tp", "comm:cp", "comm:dp", "comm:ep")


def _actions(events: pd.DataFrame, lo: int, hi: int) -> list:
    """One rank's (kind, event index or duration) in the order its main thread did them,
    for the ranges inside the window (a collective that follows the pipeline is not replayed,
    its wait for the last stage is what the window ends on)."""
    ev = events[(events["start_ns"] >= lo).to_numpy() & (events["end_ns"] <= hi).to_numpy()]
    ev = ev.sort_values(["start_ns", "end_ns"], ascending=[True, False])
    timed = []  # (time, class, sequence, kind, payload)
    nested_until = -1  # end of the open top-level range that is not a pipeline p2p op
    for seq, row in enumerate(ev.itertuples()):
        start, end = int(row.start_ns), int(row.end_ns)
        if row.category == "p2p" and row.kind == "pp":
            timed.append((start, 1, seq, _POST, row.Index))
            # at one instant a range that ends there came before one that begins there,
            # except a range's own end, which follows its beginning
            timed.append((end, 0 if end > start else 2, seq, _WAIT, row.Index))
        elif start >= nested_until:  # ranges inside a pass are part of the pass
            timed.append((start, 1, seq, _RUN, end - start))
            nested_until = end
    return [(kind, payload) for *_, kind, payload in sorted(timed)]


def free_p2p_end(view, pairs: pd.DataFrame, step: int, window: tuple[int, int]) -> int | None:
    """The end of ``step``'s pipeline window (ns, on the measured clock, starting at the
    window's start) had p2p been free and host gaps zero; None when the replay cannot follow
    the step (a wait whose matched peer op never gets posted)."""
    lo, hi = window
    ev = view.events
    keep = (ev["step"] == step).to_numpy() & (ev["lane"] == "main").to_numpy() & ev["category"].isin(_REPLAYED).to_numpy()
    work = ev[keep]
    if work.empty:
        return None
    in_step = pairs[pairs["step"] == step]
    partner = dict(zip(in_step["send_index"].astype(np.int64), in_step["recv_index"].astype(np.int64)))
    partner.update(zip(in_step["recv_index"].astype(np.int64), in_step["send_index"].astype(np.int64)))
    programs = [_actions(g, lo, hi) for _, g in work.groupby("rank", observed=True)]
    clock, pos = [lo] * len(programs), [0] * len(programs)
    posted: dict = {}
    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            while pos[r] < len(program):
                kind, payload = program[pos[r]]
                if kind == _POST:
                    posted[payload] = clock[r]
                elif kind == _RUN:
                    clock[r] += payload
                else:
                    peer = partner.get(payload)
                    if peer is not None:  # unmatched ops have nobody to wait for
                        if peer not in posted:
                            break
                        clock[r] = max(clock[r], posted[peer])
                pos[r] += 1
                progress = True
    if any(p < len(program) for p, program in zip(pos, programs)):
        return None
    return max(clock)
