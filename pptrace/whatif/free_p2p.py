"""When would a step's pipeline have ended with free p2p? A replay of the measured step.

Every rank's main thread is replayed in its measured order: its passes (and any other
top-level range) keep their measured durations, host time between ranges drops to zero,
a pipeline recv completes the moment its matched send has been posted, and a send never
holds its sender: free p2p is the schedule's pure data dependencies (the closed forms'
model). gloo's and NCCL's sends do wait for their recv to be posted, and a trainer that waits
on its sends (Megatron's combined ops) or whose integration closes a send's range only when
it next looks (torch's runtime schedules wait on sends at the end of the step) shows that
wait; it is owed to the transport's rendezvous, not to the order of the passes. Ranges
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
_SENDS = ("send_fwd", "send_bwd")
_REPLAYED = ("compute", "p2p", "wait", "comm:tp", "comm:cp", "comm:dp", "comm:ep")


def _actions(events: pd.DataFrame, lo: int, hi: int) -> list:
    """One rank's (kind, event index or duration) in the order its main thread did them,
    for the ranges inside the window (a collective that follows the pipeline is not replayed,
    its wait for the last stage is what the window ends on)."""
    ev = events[(events["start_ns"] >= lo).to_numpy() & (events["end_ns"] <= hi).to_numpy()]
    ev = ev.sort_values(["start_ns", "end_ns"], ascending=[True, False])
    is_pp = ((ev["category"] == "p2p") & (ev["kind"] == "pp")).to_numpy()
    is_send = ev["op"].isin(_SENDS).to_numpy()
    timed = []  # (time, class, sequence, kind, payload)
    nested_until = -1  # end of the open top-level range that is not a pipeline p2p op
    rows = zip(ev["start_ns"].to_numpy().tolist(), ev["end_ns"].to_numpy().tolist(), is_pp.tolist(),
               is_send.tolist(), ev.index.tolist())
    for seq, (start, end, pp, send, index) in enumerate(rows):
        if pp:
            timed.append((start, 1, seq, _POST, index))
            if not send:  # free p2p: a send never holds its sender (see the module docstring)
                # at one instant a range that ends there came before one that begins there,
                # except a range's own end, which follows its beginning
                timed.append((end, 0 if end > start else 2, seq, _WAIT, index))
        elif start >= nested_until:  # ranges inside a pass are part of the pass
            timed.append((start, 1, seq, _RUN, end - start))
            nested_until = end
    return [(kind, payload) for *_, kind, payload in sorted(timed)]


def free_p2p_ends(view, pairs: pd.DataFrame, windows: dict) -> dict:
    """step -> the end of that step's pipeline window (ns, measured clock, starting at the
    window's start; ``windows``: step -> (start, end)) had p2p been free and host gaps zero.
    Steps the replay cannot follow (a wait whose matched peer op never gets posted) are
    left out."""
    ev = view.events
    keep = ((ev["lane"] == "main").to_numpy() & ev["category"].isin(_REPLAYED).to_numpy()
            & ev["step"].isin(list(windows)).to_numpy())
    pairs = pairs[pairs["step"].isin(list(windows)).to_numpy()]
    partner = dict(zip(pairs["send_index"].astype(np.int64), pairs["recv_index"].astype(np.int64)))
    partner.update(zip(pairs["recv_index"].astype(np.int64), pairs["send_index"].astype(np.int64)))
    out = {}
    for step, work in ev[keep].groupby("step", observed=True):
        lo, hi = windows[int(step)]
        programs = [_actions(g, lo, hi) for _, g in work.groupby("rank", observed=True)]
        end = _replay(programs, partner, lo)
        if end is not None:
            out[int(step)] = end
    return out


def _replay(programs: list, partner: dict, start: int) -> int | None:
    clock, pos = [start] * len(programs), [0] * len(programs)
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
