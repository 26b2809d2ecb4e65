"""benchmarks/bench_diff.py in its --quick mode (8 ranks), so that it cannot rot: it generates
two runs and their analysis.json, diffs them in process and as a command and prints its JSON
line. Its numbers are not checked (the target is for 64 ranks)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_diff.py"


@pytest.mark.slow
def test_quick_mode_diffs_two_analyses(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeat", "2", "--data", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 8 and len(report["diff_s_all"]) == 2 and report["command_s"] > report["diff_s"] > 0
    assert report["target"]["pass"] in (True, False)
    # NEW's forward is 10% longer: the diff says so
    assert report["verdict"].startswith("FAIL: step +"), report["verdict"]
    assert (tmp_path / "diff-base-8" / "analysis.json").exists()
