"""Analyze-speed and memory benchmark: `pptrace analyze --json` cold and cached, vs orjson and HTA.

    python benchmarks/bench_analyze.py                               # every mode
    python benchmarks/bench_analyze.py --mode trainer --run /tmp/bench/r8
    python benchmarks/bench_analyze.py --mode scale --ranks 8,64,256
    python benchmarks/bench_analyze.py --quick                       # tiny sizes (for the test)

Modes, each on the same files for all of its measurements:
  trainer  the 8-rank tp2 cp2 pp2 + SP trainer run with 12 profiled steps (instrumented_model.train),
           generated once into benchmarks/.data/ unless --run names an existing one;
  gpu      8 copies of the HTA fixture sendrecv_allreduce_world8_rank3, each given its rank;
  scale    synthetic GPipe runs (tests/tracegen.py, pp=8, ~4 MB of JSON per rank) on --ranks ranks.

Every measurement is a whole command in a fresh process, as a user runs it: the orjson baseline
(gzip decompress + orjson.loads of each file, as a user's own script would), `python -m pptrace
analyze DIR --json` with its cache removed (cold) and then kept (cached), and HTA's TraceAnalysis
load (+ get_temporal_breakdown and get_comm_comp_overlap on GPU traces). Peak memory: "peak" is
the peak RSS of the largest single process of the command's tree (getrusage of the reaped child);
"tree" the largest sum of PSS over the whole tree sampled every 50 ms (pptrace and HTA may start
worker processes), never below "peak". Targets are printed PASS/MISS, never asserted: cold <= 1.0x and cached <=
0.2x the orjson parse and tree peak <= 0.5x the uncompressed traces (trainer); HTA / cold >= 8
(gpu); time from the next-largest to the largest N growing at most 1.125x linearly and the
tree peak at the largest N < 4 GB (scale). The last line printed is every number, as JSON.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data" / "hta-gpu"
MB = 1e6
TRAINER_ARGS = {  # (arguments, name of the cached run)
    False: (["--tp", "2", "--cp", "2", "--pp", "2", "--sp", "--steps", "14", "--profile-steps", "2-13",
             "--microbatches", "8", "--layers", "4"], "trainer-tp2cp2pp2-sp"),
    True: (["--pp", "2", "--steps", "3", "--profile-steps", "2-2", "--microbatches", "2", "--layers", "2"],
           "trainer-quick"),
}
GPU_FIXTURE = {False: ("sendrecv_allreduce_world8_rank3.json.gz", 8), True: ("nccl_allreduce_world2_rank0.json.gz", 2)}
SCALE_OPS = {False: 250, True: 5}  # aten ops per compute range: 250 is ~4 MB of JSON per rank

ORJSON = """import gzip, sys, orjson
n = 0
for f in sys.argv[1:]:
    with open(f, "rb") as fh:
        raw = fh.read()
    n += len(orjson.loads(gzip.decompress(raw) if f.endswith(".gz") else raw)["traceEvents"])
print(n)
"""
HTA = """import sys
from hta.trace_analysis import TraceAnalysis
analysis = TraceAnalysis(trace_dir=sys.argv[1])
if sys.argv[2] == "gpu":  # both raise on CPU-only traces: no kernels to break down
    analysis.get_temporal_breakdown(visualize=False)
    analysis.get_comm_comp_overlap(visualize=False)
"""


# -- generating the runs (in subprocesses: this process stays small, see measure) -------------
def generate_gpu(out: Path, fixture: str, ranks: int) -> None:
    """``ranks`` copies of one GPU trace. pptrace takes the rank from distributedInfo.rank and
    HTA from the first '"rank": N' of the file, which is the same field: rewrite that one."""
    raw = gzip.decompress((FIXTURES / fixture).read_bytes())
    (out / "traces").mkdir(parents=True)
    for r in range(ranks):
        doc = re.sub(rb'"rank":\s*\d+', b'"rank": %d' % r, raw, count=1)
        (out / "traces" / f"rank{r}.json.gz").write_bytes(gzip.compress(doc, compresslevel=6))


def generate_scale(out: Path, ranks: int, ops: int) -> None:
    """A GPipe run on pp=8 (fewer when ranks < 8) x dp=ranks/pp ranks, from tests/tracegen.py."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from tracegen import pipeline_run

    pp = min(8, ranks)
    if ranks % pp:
        raise SystemExit(f"--ranks: {ranks} is no multiple of pp={pp}")
    pipeline_run(out, pp=pp, dp=ranks // pp, microbatches=8, steps=(1, 2), cpu_ops_per_mb=ops,
                 gz=True, fwd_us=20_000, bwd_us=40_000)


def ensure(out: Path, cmd: list[str]) -> Path:
    """Run ``cmd`` (which writes the run into its last argument) unless ``out`` holds a run.
    Written under a temporary name and renamed, so an interrupted generation is never reused."""
    if (out / "traces").is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.parent.name == ".data":  # generated data stays out of git
        (out.parent / ".gitignore").write_text("*\n")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.perf_counter()
    done = subprocess.run(cmd + [str(tmp)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"generating {out} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    tmp.rename(out)
    print(f"generated {out} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


# -- measuring -------------------------------------------------------------------------------
def tree_pss(pid: int) -> int:
    """Bytes resident in ``pid`` and all its descendants now (0 once it is gone), as PSS: pages
    that forked workers share with their parent count once, not once per process."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("Pss:")) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (OSError, ValueError, StopIteration):
            continue
    return total


def measure(cmd: list[str]) -> dict:
    """Wall time and peak memory of ``cmd`` in a fresh process. This process imports nothing
    big: Linux carries the peak RSS of a process across exec, so a child would inherit ours."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        state = {"tree": 0, "done": threading.Event()}

        def sample():
            while not state["done"].wait(0.05):
                state["tree"] = max(state["tree"], tree_pss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # usage: this child and its reaped descendants
        wall = time.perf_counter() - t0
        state["done"].set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if line.strip()] or [f"exit {proc.returncode}"]
        return {"error": lines[-1][-200:]}
    peak = usage.ru_maxrss * 1024
    return {"wall_s": round(wall, 3), "peak_mb": round(peak / MB, 1),
            "tree_mb": round(max(peak, state["tree"]) / MB, 1), "stdout": stdout}


def trace_files(run: Path) -> list[Path]:
    return sorted(p for p in (run / "traces").iterdir() if p.name.endswith((".json", ".json.gz")))


def uncompressed_bytes(path: Path) -> int:
    """A gzip file's last 4 bytes hold its data's size (mod 4 GiB: a trace is smaller)."""
    if not path.name.endswith(".gz"):
        return path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(-4, os.SEEK_END)
        return int.from_bytes(fh.read(4), "little")


def cache_dir(run: Path) -> Path:
    """Where pptrace caches this run's tables (asked of pptrace: it depends on permissions)."""
    code = "import sys; from pptrace.ingest.store import cache_path; print(cache_path(sys.argv[1]).parent)"
    return Path(subprocess.run([sys.executable, "-c", code, str(trace_files(run)[0])], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip())


def bench_run(run: Path, args, hta: str | None) -> dict:
    """orjson, pptrace cold, pptrace cached (and HTA in ``hta`` mode: 'cpu' or 'gpu') on one run;
    the fastest of --repeat tries of each counts."""
    files = [str(f) for f in trace_files(run)]
    analyze = [sys.executable, "-m", "pptrace", "analyze", str(run), "--json"]
    if args.workers is not None:  # only when given: older pptrace has no --workers
        analyze += ["--workers", str(args.workers)]
    cache = cache_dir(run)
    res = {"traces": len(files), "gz_mb": round(sum(os.path.getsize(f) for f in files) / MB, 1),
           "json_mb": round(sum(uncompressed_bytes(Path(f)) for f in files) / MB, 1)}
    plan = [("orjson", [sys.executable, "-c", ORJSON, *files], False), ("pptrace cold", analyze, True),
            ("pptrace cached", analyze, False)]
    if hta and not args.no_hta:
        plan.append(("hta" if hta == "gpu" else "hta load",
                     [sys.executable, "-c", HTA, str(run / "traces"), hta], False))
    for name, cmd, cold in plan:
        tries = []
        for _ in range(args.repeat):
            if cold:
                shutil.rmtree(cache, ignore_errors=True)
            tries.append(measure(cmd))
        ok = [t for t in tries if "wall_s" in t]
        res[name] = min(ok, key=lambda t: t["wall_s"]) if ok else tries[0]
        if name == "orjson" and ok:
            res["events"] = int(res[name]["stdout"].split()[-1])
        res[name].pop("stdout", None)
    return res


# -- reporting -------------------------------------------------------------------------------
def verdict(label: str, value, op: str, target: float) -> dict:
    if value is None:
        print(f"  {label:<34} n/a (a measurement failed)")
        return {"value": None, "target": f"{op} {target}", "pass": None}
    ok = value <= target if op == "<=" else value >= target if op == ">=" else value < target
    print(f"  {label:<34} {value:8.2f}  {'PASS' if ok else 'MISS'} (target {op} {target:g})")
    return {"value": round(value, 3), "target": f"{op} {target:g}", "pass": ok}


def ratio(res: dict, a: str, b: str, key: str = "wall_s"):
    return res[a][key] / res[b][key] if key in res.get(a, {}) and key in res.get(b, {}) and res[b][key] else None


def print_run(title: str, run: Path, res: dict) -> None:
    print(f"\n== {title}: {run}\n   {res['traces']} traces, {res['gz_mb']:.0f} MB on disk, {res['json_mb']:.0f} MB "
          f"of JSON, {res.get('events', '?')} events, {os.cpu_count()} CPUs")
    print(f"   {'':<16}{'wall s':>9}{'peak MB':>10}{'tree MB':>10}")
    for name in ("orjson", "pptrace cold", "pptrace cached", "hta", "hta load"):
        r = res.get(name)
        if r is None:
            continue
        if "error" in r:
            print(f"   {name:<16} failed: {r['error']}")
        else:
            print(f"   {name:<16}{r['wall_s']:>9.2f}{r['peak_mb']:>10.0f}{r['tree_mb']:>10.0f}")


def mode_trainer(args) -> dict:
    if args.run:
        run = args.run
    else:
        targs, name = TRAINER_ARGS[args.quick]
        run = ensure(args.data / name, [sys.executable, "-m", "instrumented_model.train", *targs, "--out"])
    res = bench_run(run, args, "cpu")
    print_run("trainer run", run, res)
    peak = max((res[k].get("tree_mb", 0) for k in ("pptrace cold", "pptrace cached")), default=0)
    res["targets"] = {
        "cold/orjson": verdict("cold / orjson", ratio(res, "pptrace cold", "orjson"), "<=", 1.0),
        "cached/orjson": verdict("cached / orjson", ratio(res, "pptrace cached", "orjson"), "<=", 0.2),
        "peak/json": verdict("pptrace tree peak / JSON size", peak / res["json_mb"] if peak else None, "<=", 0.5),
    }
    return res


def mode_gpu(args) -> dict:
    fixture, ranks = GPU_FIXTURE[args.quick]
    run = ensure(args.data / f"gpu-{fixture.split('.')[0]}-x{ranks}",
                 [sys.executable, __file__, "--generate", "gpu", fixture, str(ranks)])
    res = bench_run(run, args, "gpu")
    print_run(f"gpu: {ranks} copies of {fixture}", run, res)
    res["targets"] = {"hta/cold": verdict("HTA / pptrace cold", ratio(res, "hta", "pptrace cold"), ">=", 8.0)}
    return res


def mode_scale(args) -> dict:
    ops = SCALE_OPS[args.quick]
    per_n = {}
    for n in args.ranks:
        run = ensure(args.data / f"scale-{n}x{ops}ops",
                     [sys.executable, __file__, "--generate", "scale", str(n), str(ops)])
        per_n[n] = bench_run(run, args, None)
        print(f"   scale {n}: done", file=sys.stderr)
    print(f"\n== scale: tests/tracegen.py pipeline_run, pp={min(8, max(args.ranks))}, {ops} ops per range")
    cols = [("orjson", "wall_s"), ("pptrace cold", "wall_s"), ("pptrace cached", "wall_s"),
            ("pptrace cold", "tree_mb"), ("pptrace cached", "tree_mb")]
    print(f"   {'ranks':>6}{'JSON MB':>9}{'events':>10}{'orjson s':>10}{'cold s':>9}{'cached s':>10}"
          f"{'cold tree MB':>14}{'cached tree MB':>16}")
    for n, res in per_n.items():
        cells = [res[k].get(f) for k, f in cols]
        text = "".join(f"{c:>{w}.{2 if f == 'wall_s' else 0}f}" if c is not None else f"{'failed':>{w}}"
                       for c, (_, f), w in zip(cells, cols, (10, 9, 10, 14, 16)))
        print(f"   {n:>6}{res['json_mb']:>9.0f}{res.get('events', 0):>10}{text}")
    out = {"per_ranks": {str(n): r for n, r in per_n.items()}, "targets": {}}
    if len(per_n) >= 2:
        (n0, r0), (n1, r1) = list(per_n.items())[-2:]
        bound = 1.125 * n1 / n0  # 4.5x for 64 -> 256
        for name in ("pptrace cold", "pptrace cached"):
            t0, t1 = r0[name].get("wall_s"), r1[name].get("wall_s")
            out["targets"][f"{name} {n1}/{n0}"] = verdict(
                f"{name.split()[1]} time {n1} / {n0} ranks", t1 / t0 if t0 and t1 else None, "<=", round(bound, 3))
    biggest = per_n[max(per_n)]
    peak = max((biggest[k].get("tree_mb", 0) for k in ("pptrace cold", "pptrace cached")), default=0)
    out["targets"]["peak GB"] = verdict(f"tree peak GB at {max(per_n)} ranks", peak / 1e3 if peak else None, "<", 4.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("trainer", "gpu", "scale", "all"), default="all")
    parser.add_argument("--run", type=Path, help="trainer mode: an existing run (its cache is removed for cold)")
    parser.add_argument("--ranks", help="scale mode: comma-separated rank counts (default 8,64,256; quick 2,4)")
    parser.add_argument("--quick", action="store_true", help="tiny runs: checks the benchmark, measures nothing")
    parser.add_argument("--workers", type=int, help="passed to pptrace analyze --workers")
    parser.add_argument("--repeat", type=int, default=1, help="tries per measurement; the fastest counts")
    parser.add_argument("--no-hta", action="store_true", help="skip HTA even when installed")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / ".data",
                        help="where generated runs are kept and reused")
    parser.add_argument("--generate", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        kind, *rest = args.generate
        if kind == "gpu":
            return generate_gpu(Path(rest[2]), rest[0], int(rest[1]))
        return generate_scale(Path(rest[2]), int(rest[0]), int(rest[1]))
    args.ranks = [int(n) for n in (args.ranks or ("2,4" if args.quick else "8,64,256")).split(",")]
    if importlib.util.find_spec("hta") is None:  # not imported: this process must stay small
        print("HTA not installed (pip install 'pptrace[hta]'): skipped", file=sys.stderr)
        args.no_hta = True
    results = {"cpus": os.cpu_count(), "quick": args.quick, "workers": args.workers}
    for mode, fn in (("trainer", mode_trainer), ("gpu", mode_gpu), ("scale", mode_scale)):
        if args.mode in (mode, "all"):
            results[mode] = fn(args)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
