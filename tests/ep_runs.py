"""The reference trainer's sleep-mode MoE runs the suite shares (tests/trainer/test_ep_sleep.py,
tests/whatif/test_balanced_experts.py), each made once a session on first use (conftest's
``ep_run``): dp 4 / ep 4, 8 experts top-2, 2 MoE layers, 4 microbatches, forward 4 ms and
backward 8 ms per microbatch, experts 200 µs per token (twice that in backward), steps 1-2
profiled; ``-hot``: ep rank 2's experts get 2x the mean tokens. ``ep-dp4-light``: the same
with 8 microbatches at 50 µs per token. ``ep-pp2``: the same inside a
dp 2 / ep 2 / pp 2 1F1B pipeline (``-hot``: ep rank 1 at 1.5x). The truth
(truth/rank{r}.json) beside the traces."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HOT, FACTOR, M = 2, 2.0, 4
COMMON = ["--dp", "4", "--ep", "4", "--experts", "8", "--topk", "2", "--layers", "2", "--compute", "sleep",
          "--fwd-ms", "4", "--bwd-ms", "8", "--microbatches", str(M), "--expert-us-per-token", "200",
          "--steps", "3", "--profile-steps", "1-2"]
#: the issue-42 config: cheap expert calls (50 µs/token, ~10 ms a call), 8 microbatches, so the
#: all-to-alls after the experts are a larger share of the step
LIGHT = [*COMMON[:COMMON.index("--microbatches")], "--microbatches", "8", "--expert-us-per-token", "50",
         "--steps", "3", "--profile-steps", "1-2"]
PIPELINE = ["--pp", "2", "--dp", "2", "--ep", "2", "--layers", "4", "--schedule", "1f1b"]
RUNS = {
    "ep-dp4": COMMON, "ep-dp4-hot": [*COMMON, "--moe-imbalance", f"{HOT}:{FACTOR:g}"],
    "ep-pp2": [*COMMON, *PIPELINE], "ep-pp2-hot": [*COMMON, *PIPELINE, "--moe-imbalance", "1:1.5"],
    "ep-dp4-light": LIGHT, "ep-dp4-light-hot": [*LIGHT, "--moe-imbalance", f"{HOT}:{FACTOR:g}"],
}


def train(out: Path, args) -> Path:
    """The trainer with ``args`` into ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-m", "instrumented_model.train", *args, "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return out
