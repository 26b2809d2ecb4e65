"""Diff speed: `pptrace diff BASE.json NEW.json` of two 64-rank analyses from their analysis.json.

    python benchmarks/bench_diff.py                 # 64 ranks (pp 8 x dp 8), target < 1 s
    python benchmarks/bench_diff.py --ranks 256
    python benchmarks/bench_diff.py --quick         # 8 ranks (for the test)

Two synthetic GPipe runs (tests/tracegen.py pipeline_run: pp 8, 8 microbatches, 2 steps; NEW's
forward 10% longer) are generated and analysed once into benchmarks/.data/ (`pptrace analyze
--json`, the analysis.json a CI job keeps as its baseline). Measured: the library call
``pptrace.diff(base_json, new_json)`` in this process (the fastest of --repeat, imports done)
and the whole command `python -m pptrace diff BASE NEW --json` in a fresh process, as CI runs
it (interpreter and imports included). The target, < 1 s for the library call, is printed
PASS/MISS, never asserted; the last line printed is every number, as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0


def generate(out: Path, ranks: int, fwd_us: float) -> Path:
    """A run and its analysis.json, once (kept under ``out``)."""
    doc = out / "analysis.json"
    if doc.exists():
        return doc
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from tracegen import pipeline_run

    pp = min(8, ranks)
    if ranks % pp:
        raise SystemExit(f"--ranks: {ranks} is no multiple of pp={pp}")
    pipeline_run(out, pp=pp, dp=ranks // pp, microbatches=8, steps=(1, 2), fwd_us=fwd_us, bwd_us=40_000, gz=True)
    done = subprocess.run([sys.executable, "-m", "pptrace", "analyze", str(out), "--json"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PPTRACE_PROGRESS": "0"})
    if done.returncode != 0:
        raise SystemExit(f"analyze {out} failed: {done.stderr[-2000:]}")
    tmp = doc.with_suffix(".tmp")
    tmp.write_text(done.stdout)
    tmp.rename(doc)
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, help="ranks of each run (default 64; quick 8)")
    parser.add_argument("--repeat", type=int, default=5, help="library calls; the fastest counts")
    parser.add_argument("--quick", action="store_true", help="8 ranks: checks the benchmark, measures nothing")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / ".data", help="where the runs are kept")
    args = parser.parse_args()
    ranks = args.ranks or (8 if args.quick else 64)
    args.data.mkdir(parents=True, exist_ok=True)
    (args.data / ".gitignore").write_text("*\n")
    t = time.perf_counter()
    base = generate(args.data / f"diff-base-{ranks}", ranks, 20_000)
    new = generate(args.data / f"diff-new-{ranks}", ranks, 22_000)
    print(f"runs and analyses ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)

    sys.path.insert(0, str(ROOT))
    import pptrace

    pptrace.diff(base, new)  # imports and first-call costs out of the timing
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        doc = pptrace.diff(base, new, gates=["step>+3%"])
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    cmd = subprocess.run([sys.executable, "-m", "pptrace", "diff", str(base), str(new), "--json"], cwd=ROOT,
                         capture_output=True, text=True)
    command_s = time.perf_counter() - t
    if cmd.returncode != 0:
        raise SystemExit(f"pptrace diff failed: {cmd.stderr[-2000:]}")
    best = min(times)
    result = {"ranks": ranks, "base_json_mb": round(base.stat().st_size / 1e6, 2),
              "new_json_mb": round(new.stat().st_size / 1e6, 2), "diff_s": round(best, 4),
              "diff_s_all": [round(x, 4) for x in times], "command_s": round(command_s, 3),
              "target": {"diff_s": TARGET_S, "pass": best < TARGET_S}, "summary": doc["summary"],
              "verdict": doc["verdict"]["line"]}
    print(f"pptrace diff of two {ranks}-rank analyses ({result['base_json_mb']} + {result['new_json_mb']} MB of "
          f"JSON): library {best:.3f} s (best of {args.repeat}), command {command_s:.2f} s; "
          f"target < {TARGET_S:g} s: {'PASS' if best < TARGET_S else 'MISS'}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
