"""A GPipe step whose every block and gap is known, written as trace files, and a
synthetic contract-4 report: the inputs of the dashboard tests (figures, page, browser).

Forward F(s, j) starts at s*(tf+g) + j*tf, backward B(s, j) at T_F + (p-1-s)*(tb+g) + j*tb,
every p2p transfer takes g. So each stage computes m*(tf+tb) and is idle (p-1)*(tf+tb+2g)
inside the pipeline window.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pptrace.topology import Layout
from pptrace.vocab import PARTS
from tracegen import RankTrace

STEP_LEAD_US = 100.0  # the ProfilerStep starts this long before the first forward
HOSTILE_F = "compute:fwd mb=1 note=<img/src=x/onerror=alert(1)>"
HOSTILE_SEND = "pp:send_fwd peer=1 mb=0 bytes=64 x=</script><script>alert(2)</script>"


def gpipe_events(p: int, m: int, tf: float, tb: float, g: float, *, hostile: bool = False):
    """{rank: [(name, start_us, dur_us)]} of one GPipe step on ranks 0..p-1 (one rank per stage)."""
    t_fwd = (p - 1) * (tf + g) + m * tf
    out = {s: [] for s in range(p)}
    for s in range(p):
        for j in range(m):
            f0 = s * (tf + g) + j * tf
            out[s].append((f"compute:fwd mb={j}", f0, tf))
            if s < p - 1:
                out[s].append((f"pp:send_fwd peer={s + 1} mb={j} bytes=64", f0 + tf, g))
                out[s + 1].append((f"pp:recv_fwd peer={s} mb={j} bytes=64", f0 + tf, g))
            b0 = t_fwd + (p - 1 - s) * (tb + g) + j * tb
            out[s].append((f"compute:bwd mb={j}", b0, tb))
            if s > 0:
                out[s].append((f"pp:send_bwd peer={s - 1} mb={j} bytes=64", b0 + tb, g))
                out[s - 1].append((f"pp:recv_bwd peer={s} mb={j} bytes=64", b0 + tb, g))
    end = t_fwd + (p - 1) * (tb + g) + m * tb
    for s in range(p):
        last = max(a + d for _, a, d in out[s])
        out[s].append(("dp:all_reduce what=grad_norm bytes=4", last, end + 50.0 - last))
        out[s].append(("ProfilerStep#1", -STEP_LEAD_US, end + 60.0 + STEP_LEAD_US))
    if hostile:
        out[0] = [(HOSTILE_F if n == "compute:fwd mb=1" else n, a, d) for n, a, d in out[0]]
        out[0] = [(HOSTILE_SEND if n.startswith("pp:send_fwd peer=1 mb=0 ") else n, a, d)
                  for n, a, d in out[0]]
    return out


def write_gpipe_run(root: Path, p=4, m=4, tf=1000.0, tb=2000.0, g=50.0, hostile=False) -> Path:
    """Write the GPipe step as traces/rank{r}.json the way pptrace.profile does."""
    layout = Layout(tp=1, cp=1, pp=p, dp=1)
    for rank, ranges in gpipe_events(p, m, tf, tb, g, hostile=hostile).items():
        trace = RankTrace(rank, p, layout, schedule="gpipe", microbatches=m, vpp=1, steps=[1], distributed=False)
        for name, start, dur in sorted(ranges, key=lambda r: r[1]):
            trace.add(name, start, dur)
        trace.write(root / "traces" / f"rank{rank}.json")
    return root


def synthetic_report(layout: Layout, steps=(1,), time_s=0.02) -> dict:
    """A contract-4 document whose parts sum to time_s, values varying per rank and step."""
    ranks = []
    for r in range(layout.world_size):
        rows = []
        for s in steps:
            parts = {k: 0.0 for k in PARTS}
            parts.update(compute=0.010 + 0.001 * r, pp_transfer=0.0005, dp_exposed=0.0002 * s,
                         other=0.0003)
            parts["pp_bubble"] = time_s - sum(parts.values())
            rows.append({"step": s, "time_s": time_s, "breakdown_s": parts,
                         "hidden_s": {"tp": 0.0, "cp": 0.0, "dp": 0.0001 * (r + 1), "ep": 0.0}})
        mean = {"time_s": time_s,
                "breakdown_s": {k: float(np.mean([row["breakdown_s"][k] for row in rows])) for k in PARTS},
                "hidden_s": {d: float(np.mean([row["hidden_s"][d] for row in rows])) for d in ("tp", "cp", "dp", "ep")}}
        ranks.append({"rank": r, "coords": layout.coords(r)._asdict(), "clock_offset_us": 0.0,
                      "steps": rows, "mean": mean})
    stages = [{"stage": s, "bubble_s": 0.008, "bubble_fraction": 0.4 - 0.01 * s,
               "theory_bubble_fraction": 0.43, "t_fwd_s": 0.001, "t_bwd_s": 0.002}
              for s in range(layout.pp)]
    links = [{"src": s, "dst": s + 1, "count": 4, "bytes": 256 * (s + 1), "wait_s": 0.001 * s,
              "transfer_s": 0.0002} for s in range(layout.pp - 1)]
    return {
        "schema": "pptrace.analysis/1",
        "run": {"world_size": layout.world_size, "layout": layout.to_dict(), "schedule": "gpipe",
                "microbatches": 4, "vpp": 1, "steps": list(steps)},
        "ranks": ranks,
        "pipeline": {"stages": stages, "bubble_fraction": 0.39, "theory_bubble_fraction": 0.43},
        "p2p": {"pairs": 24, "wait_s": 0.003, "transfer_s": 0.001, "links": links},
        "collectives": [{"dim": "dp", "count": 1.0, "exposed_s": 0.0002 * np.mean(steps),
                         "hidden_s": float(np.mean([0.0001 * (r + 1) for r in range(layout.world_size)]))}],
        "stragglers": [{"rank": 2, "metric": "compute", "slowdown": 1.3, "cost_s": 0.004}],
        "warnings": ["rank <b>9</b> missing & more"],
    }
