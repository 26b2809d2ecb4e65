"""What each pipeline schedule of the reference trainer saves against 1F1B on this machine.

    python benchmarks/bench_schedules.py [--repeat 3]

Sleep mode, p=4, m=8, forward 10 ms, backward 20 ms (ZB-H1: 10 ms input grad + 10 ms weight
grad), each schedule run ``--repeat`` times in turn. Prints per schedule the median step, the
step its sleeps alone allow (the closed forms of DESIGN contract 3), what it paid beyond them
(p2p latency and wake-ups on the critical path) and its saving against 1F1B measured beside
the saving theory promises. A speed measurement, not a correctness check: on a quiet 2-core
box interleaved with overlap_p2p_comm saves 40-150% of its 45 ms and ZB-H1 of its 60 ms; on a
slow or busy one the doubled exchanges of interleaved eat most of its gain (a busy core once
gave interleaved 441 ms against its 285 while the 1F1B run beside it paid 40 ms over its 330).
The tests check only what holds on any machine (tests/trainer/test_train.py: no schedule beats its
sleeps).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).parents[1]
COMMON = ["--pp", "4", "--microbatches", "8", "--layers", "8", "--compute", "sleep", "--fwd-ms", "10", "--steps", "6",
          "--profile-steps", "5"]
RUNS = {
    "1f1b": ["--bwd-ms", "20"],
    "interleaved": ["--bwd-ms", "20", "--schedule", "interleaved", "--vpp", "2", "--no-overlap-p2p-comm"],
    "interleaved-overlap": ["--bwd-ms", "20", "--schedule", "interleaved", "--vpp", "2"],
    "zb-h1": ["--bwd-ms", "10", "--wgrad-ms", "10", "--schedule", "zb-h1"],
}
#: the sleeps alone (tests/trainer/test_train.py derives the same numbers)
THEORY_S = {"1f1b": 0.330, "interleaved": 0.285, "interleaved-overlap": 0.285, "zb-h1": 0.270}


def median_step_s(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(row["step_time_s"] for row in rows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    steps: dict[str, list[float]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory(prefix="bench-schedules-") as scratch:
        for i in range(args.repeat):
            for name, extra in RUNS.items():
                out = Path(scratch) / f"{name}-{i}"
                subprocess.run([sys.executable, "-m", "instrumented_model.train", *COMMON, *extra, "--out", str(out)],
                               cwd=REPO, env=env, check=True, capture_output=True)
                steps[name].append(median_step_s(out))
    base = statistics.median(steps["1f1b"])
    print(f"{'schedule':<22}{'step ms':>9}{'sleeps ms':>11}{'beyond ms':>11}{'saving ms':>11}{'theory ms':>11}")
    for name, values in steps.items():
        step = statistics.median(values)
        print(f"{name:<22}{step * 1e3:>9.1f}{THEORY_S[name] * 1e3:>11.1f}{(step - THEORY_S[name]) * 1e3:>11.1f}"
              f"{(base - step) * 1e3:>11.1f}{(THEORY_S['1f1b'] - THEORY_S[name]) * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
