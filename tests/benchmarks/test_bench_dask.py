"""benchmarks/bench_dask.py in its --quick mode (8 ranks), so that it cannot rot: it generates
the run, measures analyze in process, cached, with --workers 2 and against a `dask scheduler`
with two `dask worker` processes it starts (and kills), and the start-up alone, and prints its
JSON line. Its numbers are not checked (on a tiny run start-up is all there is); that every
measurement ran, that the cold documents are the in-process one, and that no Dask process
outlives it are."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dask.py"


def dask_processes() -> set:
    """Pids of the Dask processes of a bench_dask cluster (their command lines name its
    directory, bench-dask-*)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dask" in cmd and any(b"bench-dask-" in part for part in cmd):
            found.add(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="needs dask[distributed]")
def test_quick_mode_measures_every_way_to_run(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--data", str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["traces"] == 8 and report["json_mb"] > 0
    for name in ("cold in process", "cached", "cold --workers 2", "cold --scheduler"):
        assert report[name]["wall_s"] > 0, (name, report[name])
        assert report[name]["tree_mb"] >= report[name]["peak_mb"] > 10  # a Python process at least
    assert report["same_document"] is True
    # the Dask runs parsed on Dask, the cached one parsed nothing
    assert any(p.startswith("loading traces on 2 local Dask workers") for p in report["cold --workers 2"]["phases"])
    assert any(p.startswith("loading traces on Dask at tcp://127.0.0.1:") for p in report["cold --scheduler"]["phases"])
    assert "loading traces" not in report["cached"]["phases"]
    for name in ("local cluster", "running cluster"):
        startup = report["startup"][name]
        assert startup["wall_s"] >= startup["import_s"] + startup["ready_s"] + startup["first_task_s"] > 0, startup
    assert report["startup"]["cli cluster start_s"] > 0
    assert (tmp_path / "dask-scale-8x5ops" / "traces").is_dir()
    assert not dask_processes()  # the benchmark's cluster is gone
