"""Load-speed and memory benchmark: json vs orjson vs pptrace (cold, cached) vs HTA.

    python benchmarks/bench_load.py                 # 8 ranks x ~40 MB (generated once)
    python benchmarks/bench_load.py --ranks 2 --mb 5   # quick

Each measurement runs in a fresh subprocess so that its peak RSS (getrusage) is its own.
Targets: pptrace cold within 1.5x of plain orjson.loads, cached >= 10x faster than cold,
cold at least 2x faster than HTA's TraceAnalysis load, peak memory (the whole process
tree: the loading process plus every worker it may start) below the total trace size.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_EVENT_BYTES = 420  # one Kineto-formatted aten event with args, measured


def generate(out: Path, ranks: int, mb: float) -> Path:
    """A pipeline run whose per-rank traces are ~``mb`` MB of Kineto-formatted events."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tracegen import pipeline_run

    pp = 2 if ranks % 2 == 0 and ranks > 1 else 1
    microbatches, steps = 8, (1, 2)
    ranges = 2 * microbatches * len(steps)
    per_range = max(1, int(mb * 1e6 / _EVENT_BYTES / ranges))
    pipeline_run(out, pp=pp, dp=ranks // pp, microbatches=microbatches, steps=steps,
                 cpu_ops_per_mb=per_range, gz=False, fwd_us=20_000, bwd_us=40_000)
    return out


def child(mode: str, run_dir: str) -> None:
    """One measurement; imports happen before the clock starts."""
    files = sorted(str(p) for p in (Path(run_dir) / "traces").glob("*.json"))
    if mode.startswith("pptrace") or mode == "baseline":
        sys.path.insert(0, str(ROOT))
        from pptrace.run.build import load_run
    elif mode == "hta":
        from hta.trace_analysis import TraceAnalysis
    import orjson

    t0 = time.perf_counter()
    n = 0
    if mode == "baseline":  # imports only: the RSS every pptrace process starts with
        pass
    elif mode == "json":
        for f in files:
            with open(f, "rb") as fh:
                n += len(json.load(fh)["traceEvents"])
    elif mode == "orjson":
        for f in files:
            with open(f, "rb") as fh:
                n += len(orjson.loads(fh.read())["traceEvents"])
    elif mode in ("pptrace", "pptrace-nocache"):
        run = load_run(run_dir, use_cache=(mode == "pptrace"), progress=False)
        n = len(run.events)
    elif mode == "hta":
        analysis = TraceAnalysis(trace_dir=str(Path(run_dir) / "traces"))
        n = sum(len(df) for df in analysis.t.traces.values())
    wall = time.perf_counter() - t0
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({"mode": mode, "wall_s": wall, "events": n, "peak_self": own, "peak_child": kids}))


def measure(mode: str, run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(run_dir)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        return {"mode": mode, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--mb", type=float, default=40.0, help="approximate MB per rank trace")
    parser.add_argument("--dir", type=Path, default=None, help="where the generated run lives (reused)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per loader; the fastest counts")
    parser.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    run_dir = args.dir or Path(f"/tmp/pptrace-bench-{args.ranks}x{args.mb:g}")
    if args.generate:
        return generate(run_dir, args.ranks, args.mb)
    if not (run_dir / "traces").is_dir():
        # In a subprocess: peak RSS survives exec, so this process must stay small.
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--generate", "--ranks", str(args.ranks), "--mb",
                        str(args.mb), "--dir", str(run_dir)], check=True, cwd=ROOT)
        print(f"generated {run_dir} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    files = sorted((run_dir / "traces").glob("*.json"))
    total = sum(f.stat().st_size for f in files)
    print(f"{len(files)} traces, {total / 1e6:.0f} MB total, {os.cpu_count()} CPUs")
    shutil.rmtree(run_dir / "traces" / ".pptrace-cache", ignore_errors=True)
    results = {}
    for key, mode in (("json", "json"), ("orjson", "orjson"), ("pptrace-nocache", "pptrace-nocache"),
                      ("pptrace-cold", "pptrace"), ("pptrace-cached", "pptrace")):
        runs = []
        for _ in range(args.repeat):
            if key == "pptrace-cold":
                shutil.rmtree(run_dir / "traces" / ".pptrace-cache", ignore_errors=True)
            runs.append(measure(mode, run_dir))
        ok = [r for r in runs if "wall_s" in r]
        results[key] = min(ok, key=lambda r: r["wall_s"]) if ok else runs[0]
    results["baseline"] = measure("baseline", run_dir)
    try:
        import hta  # noqa: F401
        results["hta"] = measure("hta", run_dir)
    except ImportError:
        results["hta"] = {"mode": "hta", "error": "not installed (pip install traceinsight)"}
    print(f"{'loader':<16}{'wall s':>9}{'events':>10}{'peak MB (self)':>16}{'peak MB (worker)':>18}")
    for key, r in results.items():
        if "error" in r:
            print(f"{key:<16} skipped: {r['error']}")
            continue
        print(f"{key:<16}{r['wall_s']:>9.2f}{r['events']:>10}{r['peak_self'] / 1e6:>16.0f}{r['peak_child'] / 1e6:>18.0f}")
    base, cold, cached = (results.get(k, {}) for k in ("orjson", "pptrace-cold", "pptrace-cached"))
    if all("wall_s" in r for r in (base, cold, cached)):
        workers = min(len(files), os.cpu_count() or 1)
        # Forked workers share the parent's imported pages: count what each adds above the
        # import baseline (pandas, pyarrow, and torch through pptrace/__init__).
        floor = results["baseline"].get("peak_self", 0)
        added = max(cold["peak_child"] - floor, 0)
        peak = cold["peak_self"] + workers * added
        print(f"cold / orjson   = {cold['wall_s'] / base['wall_s']:.2f}  (target <= 1.5)")
        print(f"cold / cached   = {cold['wall_s'] / cached['wall_s']:.1f}  (target >= 10)")
        hta = results.get("hta", {})
        if "wall_s" in hta:
            print(f"hta / cold      = {hta['wall_s'] / cold['wall_s']:.2f}  (target >= 2)")
        print(f"peak memory     = {peak / 1e6:.0f} MB = parent {cold['peak_self'] / 1e6:.0f} + {workers} workers x "
              f"{added / 1e6:.0f} above the {floor / 1e6:.0f} MB import baseline, vs {total / 1e6:.0f} MB of "
              "traces (target: below)")


if __name__ == "__main__":
    main()
