"""A benchmark traced with a bare ``torch.profiler.profile()`` block and no ``prof.step()``,
on real gloo processes: its traces have no ``ProfilerStep#N`` range at all.

Each rank runs, inside the profile block: ``FWD_N`` forward passes (a sleep in a
``compute:fwd`` range), an unannotated sleep (rank 1 sleeps ``LATE_S`` longer, so rank 0
waits for it in the collective), one ``dp:all_reduce`` range around a real all-reduce over
both ranks, then ``BWD_N`` backward passes. Every range is timed with ``time.time_ns`` twice:
just inside it (``inner``) and just outside it (``outer``), so that the range the profiler
recorded lies between the two: inner <= recorded <= outer. The block itself is timed from
just before it is entered to just after it is left (``block``).

    python -m tests.bare_profile_run OUT_DIR
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

FWD_N, FWD_S = 3, 0.012
BWD_N, BWD_S = 2, 0.020
IDLE_S, LATE_S = 0.010, 0.040
NUMEL = 1 << 16


def _timed(log: list, name: str, fn) -> None:
    """fn() inside a record_function range ``name``, logged as (name, outer, inner) spans."""
    from torch.profiler import record_function

    o0 = time.time_ns()
    with record_function(name):
        i0 = time.time_ns()
        fn()
        i1 = time.time_ns()
    o1 = time.time_ns()
    log.append({"name": name, "outer": (o0, o1), "inner": (i0, i1)})


def bench(out_dir: str) -> dict:
    """One rank's benchmark (run under tests/gloo_helpers.run_gloo); -> what it logged."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    rank = dist.get_rank()
    tensor = torch.ones(NUMEL)
    log: list = []
    dist.barrier()  # both ranks start together
    b0 = time.time_ns()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for mb in range(FWD_N):
            _timed(log, f"compute:fwd mb={mb}", lambda: time.sleep(FWD_S))
        time.sleep(IDLE_S + LATE_S * rank)
        _timed(log, f"dp:all_reduce bytes={NUMEL * 4}", lambda: dist.all_reduce(tensor))
        for mb in range(BWD_N):
            _timed(log, f"compute:bwd mb={mb}", lambda: time.sleep(BWD_S))
    b1 = time.time_ns()
    traces = Path(out_dir) / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(traces / f"rank{rank}.json"))
    return {"rank": rank, "block": (b0, b1), "ranges": log}


def record(out_dir: Path, world: int = 2) -> list:
    """The run under ``out_dir`` (traces/rank{r}.json); -> each rank's log."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gloo_helpers import run_gloo

    return run_gloo(world, bench, str(out_dir))


if __name__ == "__main__":  # pragma: no cover - a manual recording
    import json

    print(json.dumps(record(Path(sys.argv[1]))))
