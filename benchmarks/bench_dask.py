"""Dask benchmark: what `pptrace analyze --json` costs cold in process (the default), with
`--workers 2` (a local Dask cluster started for the command) and with `--scheduler` (an already
running `dask scheduler` and two `dask worker` processes), and what a cluster's start-up costs.

    python benchmarks/bench_dask.py                       # the 1,024-rank scale run of issue 27
    python benchmarks/bench_dask.py --ranks 256
    python benchmarks/bench_dask.py --run DIR             # an existing run (its cache is removed for cold)
    python benchmarks/bench_dask.py --quick               # a tiny run (for the test): measures nothing

The run is bench_analyze.py's scale run (tests/tracegen.py, GPipe on pp=8, ~3-4 MB of JSON per
rank), generated once into --data. Every measurement is a whole command in a fresh process, as a
user runs it (bench_analyze.measure: wall time, peak RSS, and the command's process tree, which
does not hold the --scheduler cluster's workers): analyze cold in process, cached (what the
machine that writes the report pays whatever parses: assembling the run's table and analysing
it), cold with --workers 2, cold with --scheduler; then the start-up alone, with no work: a
local cluster of 2 workers started and closed, the running cluster connected to, and the time
to each one's first task. The documents of the cold runs must be the in-process one
("same_document"). The last line printed is every number, as JSON.

When a cluster pays (measured on this 2-core machine, shared and loaded: 1,024 ranks, 3.0 GB of
JSON; the README has the numbers): never here. The default already parses on both cores (a
process pool, no cluster to start) and a Dask worker parses a trace no faster than a pool process
does: cold with --workers 2 or --scheduler came out between 0.58x and 1.17x the default's time
over three rounds, as scattered as the default's own tries (151-196 s). What a cluster adds is
its start-up (a local cluster of 2: 1.4-2.7 s until ready, 0.5-0.9 s to close; a running one:
under 0.1 s to connect, then each worker imports pptrace on its first task) and, for an existing
cluster, each rank's table compressed on the worker and sent back. It pays where it brings cores
this machine lacks: with K workers on other machines that see the run at the same path, a cold
analyze takes about cached + parse / K + the transfer, against cached + parse / (this machine's
cores); so from runs whose parse (cold - cached here: ~2 min at 1,024 ranks) is more than a few
seconds, on a cluster with several times this machine's cores. Every later analyze of the run
costs `cached`, with no cluster at all (a cached run never contacts the scheduler).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_analyze as ba  # noqa: E402 - a sibling script, not a package

ROOT = ba.ROOT
RANKS = {False: 1024, True: 8}
WORKERS = 2
#: a cluster's start-up with no work, in a fresh process: ready = started (local) or connected
STARTUP = """import json, sys, time
t0 = time.perf_counter()
from pptrace.ingest import cluster
cluster.require()
t1 = time.perf_counter()
with cluster.client(sys.argv[1], int(sys.argv[2])) as client:
    t2 = time.perf_counter()
    client.submit(sum, [1, 2], pure=False).result()
    t3 = time.perf_counter()
t4 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 3), "ready_s": round(t2 - t1, 3), "first_task_s": round(t3 - t2, 3),
                  "close_s": round(t4 - t3, 3)}))
"""
#: waits for the scheduler at argv[1] to have argv[2] workers -> the epoch second they are there
WAIT = """import sys, time, distributed
with distributed.Client(sys.argv[1], timeout=60, set_as_default=False) as client:
    client.wait_for_workers(int(sys.argv[2]), timeout=300)
print(time.time())
"""


def written_address(scheduler_file: Path) -> str | None:
    """The address in a `dask scheduler --scheduler-file`, once it is all written (Dask writes
    it in place: it may be read half-written)."""
    try:
        return json.loads(scheduler_file.read_text())["address"]
    except (OSError, ValueError, KeyError):
        return None


class CliCluster:
    """A `dask scheduler` and ``workers`` `dask worker`s started as separate processes (as on a
    cluster), on the loopback, one thread each, no dashboards, each in a process group of its own
    (a worker's nanny and its worker in one), all killed on exit; their files and logs go to
    ``home``, and each exits on its own should its starter die without killing it.
    ``worker_prefix`` runs before each worker (tests: in a mount namespace of its own)."""

    def __init__(self, workers: int, home: Path, worker_prefix=()):
        self.workers, self.home, self.worker_prefix, self.procs = workers, Path(home), list(worker_prefix), []

    def _start(self, name: str, *args, prefix=()) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "wb")
        # the scheduler's scratch directory too goes with ours (Dask's default: /tmp, kept)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DASK_TEMPORARY_DIRECTORY": str(self.home)}
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "dask", *map(str, args)], cwd=self.home,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.home / f"{name}.log").read_text(errors="replace")[-2000:]

    def __enter__(self) -> CliCluster:
        try:
            self._start_cluster()
        except BaseException:  # what started is ours to end: __exit__ runs only after __enter__
            self.__exit__()
            raise
        return self

    def _start_cluster(self) -> None:
        scheduler_file = self.home / "scheduler.json"
        t0 = time.time()
        scheduler = self._start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", 0, "--no-dashboard",
                                "--scheduler-file", scheduler_file, "--idle-timeout", 3600)
        while (address := written_address(scheduler_file)) is None:
            if scheduler.poll() is not None or time.time() - t0 > 60:
                raise RuntimeError(f"dask scheduler did not start:\n{self.log('scheduler')}")
            time.sleep(0.05)
        self.address = address
        for i in range(self.workers):
            self._start(f"worker{i}", "worker", address, "--nthreads", 1, "--no-dashboard", "--host", "127.0.0.1",
                        "--name", f"w{i}", "--local-directory", self.home, "--death-timeout", 60,
                        prefix=self.worker_prefix)
        done = subprocess.run([sys.executable, "-c", WAIT, address, str(self.workers)], capture_output=True,
                              text=True, cwd=self.home)
        if done.returncode != 0:
            logs = "\n".join(self.log(f"worker{i}") for i in range(self.workers))
            raise RuntimeError(f"dask workers did not join:\n{done.stderr[-2000:]}\n{logs}")
        self.start_s = round(float(done.stdout.split()[-1]) - t0, 3)

    def __exit__(self, *exc) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self.procs:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            for proc in self.procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass


def measure_analyze(run: Path, options: list, cold: bool) -> dict:
    """`pptrace analyze RUN --json OPTIONS`, its cache removed first when ``cold``."""
    if cold:
        shutil.rmtree(ba.cache_dir(run), ignore_errors=True)
    return ba.measure([sys.executable, "-m", "pptrace", "analyze", str(run), "--json", *options])


def fastest(tries: list) -> dict:
    """The fastest of a measurement's tries, with every try's wall time beside it."""
    ok = [t for t in tries if t.get("wall_s")]
    best = dict(min(ok, key=lambda t: t["wall_s"]) if ok else tries[0])
    best["wall_s_all"] = [t.get("wall_s") for t in tries]
    return best


def measure_startup(scheduler: str, workers: int) -> dict:
    """STARTUP in a fresh process: the whole command's wall time and its parts."""
    res = ba.measure([sys.executable, "-c", STARTUP, scheduler, str(workers)])
    if "error" not in res:
        res.update(json.loads(res.pop("stdout").strip().splitlines()[-1]))
    res.pop("phases", None)
    return res


def loading_s(res: dict):
    """The loading phase's seconds (PPTRACE_PROGRESS=1), where bench_analyze.measure reads them."""
    return next((s for name, s in (res.get("phases") or {}).items()
                 if name.startswith("loading traces") and not name.startswith("loading traces:")), None)


def run_size(run: Path) -> dict:
    files = ba.trace_files(run)
    return {"traces": len(files), "gz_mb": round(sum(f.stat().st_size for f in files) / ba.MB, 1),
            "json_mb": round(sum(ba.uncompressed_bytes(f) for f in files) / ba.MB, 1)}


def report(run: Path, res: dict) -> None:
    print(f"\n== Dask: {run}\n   {res['traces']} traces, {res['gz_mb']:.0f} MB on disk, {res['json_mb']:.0f} MB of "
          f"JSON, {os.cpu_count()} CPUs (numbers from a shared machine: compare within this run)")
    print(f"   {'pptrace analyze --json':<34}{'wall s':>9}{'loading s':>11}{'peak MB':>9}{'tree MB':>9}"
          f"{'x default':>11}")
    base = res["cold in process"].get("wall_s")
    for name in ("cold in process", "cached", f"cold --workers {WORKERS}", "cold --scheduler"):
        r = res[name]
        if not r.get("wall_s"):
            print(f"   {name:<34} failed: {r.get('error')}")
            continue
        load = loading_s(r)
        print(f"   {name:<34}{r['wall_s']:>9.2f}{'-' if load is None else f'{load:.2f}':>11}"
              f"{r['peak_mb']:>9.0f}{r['tree_mb']:>9.0f}{r['wall_s'] / base if base else float('nan'):>11.2f}")
    print(f"\n   start-up, no work ({WORKERS} workers){'command s':>13}{'import s':>10}{'ready s':>9}"
          f"{'1st task s':>12}{'close s':>9}")
    for name in ("local cluster", "running cluster"):
        r = res["startup"][name]
        if "error" in r:
            print(f"   {name:<34} failed: {r['error']}")
            continue
        print(f"   {name:<34}{r['wall_s']:>13.2f}{r['import_s']:>10.2f}{r['ready_s']:>9.2f}{r['first_task_s']:>12.2f}"
              f"{r['close_s']:>9.2f}")
    print(f"   `dask scheduler` + {WORKERS} `dask worker` processes started, workers joined: "
          f"{res['startup']['cli cluster start_s']:.2f} s")
    print(f"   documents of the cold runs equal to the in-process one: {res['same_document']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, help="ranks of the generated scale run (default 1024; quick 8)")
    parser.add_argument("--run", type=Path, help="an existing run instead (its cache is removed for cold)")
    parser.add_argument("--quick", action="store_true", help="a tiny run: checks the benchmark, measures nothing")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of the analyze measurements (each way once a round); the fastest counts")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / ".data",
                        help="where the generated run is kept and reused")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks kill the cluster
    if args.run:
        run = args.run
    else:
        ranks, ops = args.ranks or RANKS[args.quick], ba.SCALE_OPS[args.quick]
        run = ba.ensure(args.data / f"dask-scale-{ranks}x{ops}ops",
                        [sys.executable, str(Path(ba.__file__)), "--generate", "scale", str(ranks), str(ops)])
    res = {"cpus": os.cpu_count(), "quick": args.quick, "run": str(run), **run_size(run)}
    with tempfile.TemporaryDirectory(prefix="bench-dask-") as home, CliCluster(WORKERS, Path(home)) as cluster:
        plan = {"cold in process": ([], True), "cached": ([], False),
                f"cold --workers {WORKERS}": (["--workers", str(WORKERS)], True),
                "cold --scheduler": (["--scheduler", cluster.address], True)}
        tries: dict = {name: [] for name in plan}
        for _ in range(args.repeat):  # rounds, each way once a round: a shared box's load hits all alike
            for name, (options, cold) in plan.items():
                tries[name].append(measure_analyze(run, options, cold))
        res["startup"] = {"local cluster": measure_startup("local", WORKERS),
                          "running cluster": measure_startup(cluster.address, WORKERS),
                          "cli cluster start_s": cluster.start_s}
    for name in plan:
        res[name] = fastest(tries[name])
    expected = res["cold in process"].get("stdout")
    cold = [res[k] for k in (f"cold --workers {WORKERS}", "cold --scheduler")]
    res["same_document"] = expected is not None and all(r.get("stdout") == expected for r in cold)
    for name in plan:
        res[name].pop("stdout", None)
    report(run, res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
