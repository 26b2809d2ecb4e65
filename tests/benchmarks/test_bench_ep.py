"""benchmarks/bench_ep.py in its --quick mode (16 ranks), so that it cannot rot: it generates
the MoE run, measures analyze and the ep analyses and prints its final JSON line. The ratio is
not checked here (the target is for 64 ranks on a quiet machine); the run's ep tables are."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ep.py"


@pytest.mark.slow
def test_quick_mode_measures_the_ep_analyses(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--data", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 16 and report["cold"]["wall_s"] > 0 and report["cached"]["wall_s"] > 0
    ep = report["ep"]
    # 2 ep groups of 8: every ordered pair of a group, and 4 experts on each of the 16 ranks
    assert ep["pairs_rows"] == 3 * 2 * 8 * 7 and ep["load_rows"] == 16 and ep["expert_rows"] == 3 * 16 * 4
    assert ep["ep_s"] > 0 and report["target"]["pass"] in (True, False)
