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
        for name in ("pptrace cold", "pptrace cached"):  # pptrace's phases, the analysis among them
            assert 0 < res[name]["phases"]["analysing"] < res[name]["wall_s"], res[name]
        assert "loading traces" in res["pptrace cold"]["phases"]  # cold parses; cached does not
        assert "loading traces" not in res["pptrace cached"]["phases"]
    targets = [*report["trainer"]["targets"].values(), *report["scale"]["targets"].values()]
    if "hta" in report["gpu"]:  # HTA installed
        targets += report["gpu"]["targets"].values()
    assert all(t["pass"] in (True, False) for t in targets), targets
    # cached/orjson at 2 and 4 ranks; cold, cached and each one's analysis phase per event from
    # 2 to 4 ranks; the peak
    assert len(report["scale"]["targets"]) == 7, sorted(report["scale"]["targets"])
    assert report["scale"]["per_ranks"]["4"]["events"] > report["scale"]["per_ranks"]["2"]["events"]

    # The cold runs wrote pptrace's cache; the GPU copies carry ranks 0 and 1.
    gpu_run = next(tmp_path.glob("gpu-*"))
    assert len(list((gpu_run / "traces" / ".pptrace-cache").glob("*.arrow"))) == 2
    for r in (0, 1):
        head = gzip.open(gpu_run / "traces" / f"rank{r}.json.gz").read(8192)
        assert int(re.search(rb'"rank":\s*(\d+)', head).group(1)) == r


@pytest.mark.slow
def test_quick_realistic_mode_measures_and_removes_its_runs(tmp_path):
    """The realistic mode at its --quick size: two sizes generated into --tmp, measured (analyze
    cold and cached, the page, merge on the larger), then removed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--mode", "realistic", "--tmp", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])["realistic"]
    small, big = report["per_ranks"]["8"], report["per_ranks"]["16"]
    assert (small["traces"], big["traces"]) == (8, 16)
    # each rank's JSON, as measured from the files, is the size asked for (the generator sizes its
    # ops from GPU_OP_BYTES: a change to the event layout it writes shows here)
    for res in (small, big):
        assert 0.8 * report["rank_mb"] <= res["json_mb"] / res["traces"] <= 1.25 * report["rank_mb"], res
    # the per-byte growth verdict is the reported times over the reported sizes
    grow = big["json_mb"] / small["json_mb"]
    for name in ("cold", "cached"):
        want = big[f"pptrace {name}"]["wall_s"] / small[f"pptrace {name}"]["wall_s"] / grow
        assert report["targets"][f"{name} 16/8 ranks per byte"]["value"] == pytest.approx(want, abs=1e-3)
    assert big["events"] > 50 * big["traces"]  # dense: thousands of events per rank
    for name in ("pptrace cold", "pptrace cached", "pptrace --html", "pptrace merge"):
        assert big[name]["wall_s"] > 0 and big[name]["tree_mb"] > 10, (name, big[name])
    assert big["pptrace merge"]["out_mb"] > 0 and big["pptrace --html"]["html_mb"] > 1
    assert set(report["targets"]) >= {"cold/orjson 16", "cached 16/8 ranks per byte", "pptrace merge peak GB"}
    if "error" not in big.get("browser", {"error": ""}):  # playwright and chromium here
        assert big["browser"]["render_s"] > 0 and 0 < big["browser"]["blocks"] <= 60000
    assert list(tmp_path.iterdir()) == []  # the generated runs are gone


@pytest.mark.slow
def test_realistic_mode_removes_its_runs_when_killed(tmp_path):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(BENCH), "--quick", "--mode", "realistic", "--tmp", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/moe-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert list(tmp_path.glob("*/moe-*")), "no run was generated"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert list(tmp_path.iterdir()) == []
