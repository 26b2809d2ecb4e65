"""The reference trainer's sleep-mode runs the suite shares (test_train, test_analyze_trainer,
test_whatif_trainer), each made once a session, on first use (conftest's ``sleep_run``), and
one after another so that none perturbs another's timing.

All of them: p=4 stages, m=8 microbatches, forward 10 ms, backward 10 ms of input grad and
10 ms of weight grad per microbatch per stage (1F1B and interleaved run the two back to back,
one 20 ms backward; ZB-H1 defers W), 10 steps of which 2-9 are profiled; the sleep mode's
truth (truth/rank{r}.json) beside the traces.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

P, M = 4, 8
T_F, T_B, T_W = 0.010, 0.010, 0.010  # forward, input grad, weight grad (s per microbatch per stage)
PROFILED = list(range(2, 10))
STEPS = 10
COMMON = ["--pp", str(P), "--microbatches", str(M), "--layers", "8", "--compute", "sleep",
          "--fwd-ms", "10", "--bwd-ms", "10", "--wgrad-ms", "10", "--steps", str(STEPS), "--profile-steps", "2-9"]
DELAYED_RANK, DELAY_S = 2, 0.005
RUNS = {
    "1f1b": ["--schedule", "1f1b"],
    # Megatron's default for interleaved: overlap_p2p_comm
    "interleaved": ["--schedule", "interleaved", "--vpp", "2"],
    # Megatron's blocking four-way exchanges (--no-overlap-p2p-communication)
    "interleaved-no-overlap": ["--schedule", "interleaved", "--vpp", "2", "--no-overlap-p2p-comm"],
    "zb-h1": ["--schedule", "zb-h1"],
    "m16": ["--schedule", "1f1b", "--microbatches", str(2 * M)],
    # rank 2 (stage 2) sleeps 5 ms more in every forward
    "delay": ["--schedule", "1f1b", "--delay", f"{DELAYED_RANK}:fwd:{int(DELAY_S * 1e3)}"],
}


def make(out: Path, name: str) -> Path:
    """Run the trainer as ``RUNS[name]`` into ``out``; returns ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-m", "instrumented_model.train", *COMMON, *RUNS[name], "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"trainer {name} failed: {done.stderr[-2000:]}"
    return out
