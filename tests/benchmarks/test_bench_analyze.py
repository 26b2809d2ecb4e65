"""benchmarks/bench_analyze.py in its --quick mode, on tiny runs, so that it cannot rot: it
generates each mode's run, measures every command and prints its final JSON line. Its numbers
are not checked (targets are for the full sizes; on tiny runs start-up time dominates)."""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_analyze.py"


@pytest.mark.slow
def test_quick_mode_measures_every_mode(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--data", str(tmp_path), "--ranks", "2,4"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    runs = [report["trainer"], report["gpu"], *report["scale"]["per_ranks"].values()]
    assert [res["traces"] for res in runs] == [2, 2, 2, 4]
    for res in runs:
        assert res["events"] > 0 and res["json_mb"] > 0
        for name in ("orjson", "pptrace cold", "pptrace cached"):
            assert res[name]["wall_s"] > 0, (name, res[name])
            assert res[name]["tree_mb"] >= res[name]["peak_mb"] > 10  # a Python process at least
    targets = [*report["trainer"]["targets"].values(), *report["scale"]["targets"].values()]
    if "hta" in report["gpu"]:  # HTA installed
        targets += report["gpu"]["targets"].values()
    assert all(t["pass"] in (True, False) for t in targets), targets
    assert len(report["scale"]["targets"]) == 3  # cold and cached time from 2 to 4 ranks, peak

    # The cold runs wrote pptrace's cache; the GPU copies carry ranks 0 and 1.
    gpu_run = next(tmp_path.glob("gpu-*"))
    assert len(list((gpu_run / "traces" / ".pptrace-cache").glob("*.arrow"))) == 2
    for r in (0, 1):
        head = gzip.open(gpu_run / "traces" / f"rank{r}.json.gz").read(8192)
        assert int(re.search(rb'"rank":\s*(\d+)', head).group(1)) == r
