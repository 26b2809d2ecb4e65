"""Analyze-speed and memory benchmark: `pptrace analyze --json` cold and cached, vs orjson and HTA.

    python benchmarks/bench_analyze.py                               # trainer, gpu and scale modes
    python benchmarks/bench_analyze.py --mode trainer --run /tmp/bench/r8
    python benchmarks/bench_analyze.py --mode scale --ranks 64,256,1024
    python benchmarks/bench_analyze.py --mode realistic              # 32 and 128 ranks x 150 MB (long)
    python benchmarks/bench_analyze.py --quick                       # tiny sizes (for the test)

Modes, each on the same files for all of its measurements:
  trainer    the 8-rank tp2 cp2 pp2 + SP trainer run with 12 profiled steps (instrumented_model.train),
             generated once into benchmarks/.data/ unless --run names an existing one;
  gpu        8 copies of the HTA fixture sendrecv_allreduce_world8_rank3, each given its rank;
  scale      synthetic GPipe runs (tests/tracegen.py, pp=8, ~3 MB of JSON per rank) on --ranks ranks
             (default 64,256,1024), written a rank at a time and kept in --data;
  realistic  MoE-sized GPU traces: --realistic-ranks (default 32,128) ranks x --rank-mb (150) MB of
             JSON, the size a MoE run writes per rank today (tests/tracegen.py write_dense: a GPipe
             pp=8 skeleton, 48 microbatches, and in every pass thousands of small ops, each a CPU op,
             a nested allocation, its cudaLaunchKernel, the ac2g flow and its kernel), generated into
             a temporary directory (--tmp) and removed after, on failure and Ctrl-C too. Beside analyze
             cold and cached it runs, on the largest, `pptrace analyze RUN --html`, opens that page in
             headless Chromium (benchmarks/bench_dashboard.py's measurement) and `pptrace merge`. Not in
             "all": it takes half an hour on 2 cores.

Every measurement is a whole command in a fresh process, as a user runs it (pptrace byte-compiled
first, as an installed pptrace is): the orjson baseline
(gzip decompress + orjson.loads of each file, as a user's own script would), `python -m pptrace
analyze DIR --json` with its cache removed (cold) and then kept (cached), and HTA's TraceAnalysis
load (+ get_temporal_breakdown and get_comm_comp_overlap on GPU traces). pptrace runs with
PPTRACE_PROGRESS=1, and the time of each of its phases is kept ("phases"; "analysing" is the
analysis phase alone). Peak memory: "peak" is the peak RSS of the largest single process of the
command's tree (getrusage of the reaped child); "tree" the largest sum of PSS over the whole tree
sampled every 50 ms (pptrace and HTA may start worker processes), never below "peak". A command
whose tree passes --cap-gb is killed (the machine is shared) and reported as such. Targets are
printed PASS/MISS, never asserted: cold <= 1.0x and cached <= 0.2x the orjson parse and tree peak
<= 0.5x the uncompressed traces (trainer); HTA / cold >= 8 (gpu); cached <= 0.2x the orjson parse
from 256 ranks (CACHED_TARGET_RANKS), time per event from the next-largest to the largest N growing
at most 1.125x (1,024 / 256 ranks within 4.5x) and the tree peak at the largest N < 4 GB (scale); time per byte from the smaller to the larger run growing at
most 1.2x, tree peaks < 4 GB, the page drawn within PAGE_BOUND_S and the timeline's blocks within
the dashboard's bound, with its down-sampling note when it merged blocks (realistic). The last
line printed is every number, as JSON.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
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
SCALE_OPS = {False: 250, True: 5}  # aten ops per compute range: 250 is ~3 MB of JSON per rank
SCALE_RANKS = {False: "64,256,1024", True: "2,4"}
REALISTIC_RANKS = {False: "32,128", True: "8,16"}
#: the scale mode's cached/orjson target holds from this many ranks (issue 27: 256 and 1,024)
CACHED_TARGET_RANKS = {False: 256, True: 0}
REALISTIC_MB = {False: 150.0, True: 1.0}
# the realistic skeleton: GPipe on pp=8 with MoE-like microbatch counts (the timeline of 128 ranks
# then holds more blocks than the dashboard draws), and each op's JSON (write_dense, gpu=True)
REALISTIC_PP, REALISTIC_MICROBATCHES, REALISTIC_STEPS = 8, 48, (1, 2)
REALISTIC_FWD_US, REALISTIC_BWD_US = 8_000, 16_000
GPU_OP_BYTES = 1925
PAGE_BOUND_S = 20.0  # every figure of the page drawn (2 cores, shared): past it a user gives up
ZOOM_BOUND_S = 5.0  # zoom into the timeline and back: a page that freezes fails this

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
# the page in headless Chromium, measured as bench_dashboard.py measures it, then what it says
BROWSER = """import json, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from playwright.sync_api import sync_playwright
from bench_dashboard import CHROMIUM, LAUNCH_ARGS, _render_seconds
html = Path(sys.argv[1])
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
    times, info = _render_seconds(browser, html, 1)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://") else r.abort())
    page.goto(html.resolve().as_uri())
    # figures are drawn as they scroll into view: at 128 ranks what precedes the timeline
    # can push it below the first screen, where it would never be drawn
    page.evaluate("() => { const gd = document.getElementById('fig-timeline'); if (gd) gd.scrollIntoView(); }")
    page.wait_for_function("() => { const gd = document.getElementById('fig-timeline'); return !gd || gd._fullLayout; }",
                           timeout=120000)
    notes = page.locator("#timeline .fig-notes li")
    info["note"] = notes.first.inner_text() if notes.count() else None
    info["note_visible"] = bool(notes.count()) and notes.first.is_visible()
    info["title"] = page.evaluate("() => { const t = document.querySelector('#fig-timeline .gtitle');"
                                  " return t ? t.textContent : null; }")
    # blocks drawn (every step): one hover text per block on the page, idle excluded
    info["blocks"] = page.evaluate(
        "() => JSON.parse(document.getElementById('data-fig-timeline').textContent).data"
        ".filter(t => t.meta && t.meta.hover_repeat && t.meta.phase !== 'idle:hover')"
        ".reduce((n, t) => n + t.meta.hover_repeat.length, 0)")
    browser.close()
print(json.dumps({"render_s": round(times[0], 2), **info}))
"""
# "pptrace: loading traces 8/8 (2 workers: ...) (7.17 s)": the phase, its count, what it said, its time
PHASE = re.compile(r"^pptrace: (.+?)(?: \d+/\d+(?: \((.*)\))?)? \(([\d.]+) s\)$")


# -- generating the runs (in subprocesses: this process stays small, see measure) -------------
def generate_gpu(out: Path, fixture: str, ranks: int) -> None:
    """``ranks`` copies of one GPU trace. pptrace takes the rank from distributedInfo.rank and
    HTA from the first '"rank": N' of the file, which is the same field: rewrite that one."""
    raw = gzip.decompress((FIXTURES / fixture).read_bytes())
    (out / "traces").mkdir(parents=True)
    for r in range(ranks):
        doc = re.sub(rb'"rank":\s*\d+', b'"rank": %d' % r, raw, count=1)
        (out / "traces" / f"rank{r}.json.gz").write_bytes(gzip.compress(doc, compresslevel=6))


def _write_rank(job) -> None:
    from tracegen import write_dense

    trace, path, ops, gpu = job
    write_dense(trace, path, ops, gpu=gpu)


def generate_dense(out: Path, ranks: int, *, gpu: bool, ops: int | None = None, rank_mb: float | None = None) -> None:
    """A GPipe run on pp=8 (fewer when ranks < 8) x dp=ranks/pp ranks, from tests/tracegen.py's
    skeleton, each rank's ops written straight to .json.gz by a pool of processes, one rank at a
    time each (a whole 1,024-rank run built in memory first would take ~10 GB). ``gpu``: the
    realistic MoE-sized traces, ``rank_mb`` MB of JSON per rank; else the scale mode's CPU ops."""
    from multiprocessing import Pool

    from tracegen import pipeline_traces

    pp = min(REALISTIC_PP, ranks)
    if ranks % pp:
        raise SystemExit(f"--ranks: {ranks} is no multiple of pp={pp}")
    shape = (dict(microbatches=REALISTIC_MICROBATCHES, steps=REALISTIC_STEPS, fwd_us=REALISTIC_FWD_US,
                  bwd_us=REALISTIC_BWD_US) if gpu else dict(microbatches=8, steps=(1, 2), fwd_us=20_000, bwd_us=40_000))
    traces, _ = pipeline_traces(pp=pp, dp=ranks // pp, **shape)
    if gpu:  # ops per compute range for rank_mb MB beside the skeleton's own; every rank has as many ranges
        ranges = sum(e["name"].startswith("compute:") for e in traces[0].events)
        room = rank_mb * MB - len(traces[0].dumps())
        ops = max(1, round(room / GPU_OP_BYTES / ranges))
    jobs = [(t, out / "traces" / f"rank{t.rank}.json.gz", ops, gpu) for t in traces]
    with Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        for _ in pool.imap_unordered(_write_rank, jobs):
            pass


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
    # its own process group: the generator's pool workers end with it, not after our cleanup
    proc = subprocess.Popen(cmd + [str(tmp)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        end_group(proc.pid)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"generating {out} failed:\n{stdout[-2000:]}{stderr[-2000:]}")
    tmp.rename(out)
    seconds = time.perf_counter() - t
    print(f"generated {out} in {seconds:.0f} s", file=sys.stderr)
    (out / "generated_s").write_text(f"{seconds:.1f}\n")
    return out


def end_group(pgid: int, wait_s: float = 10.0) -> None:
    """SIGKILL process group ``pgid`` and return once none of it runs any more. A kill is
    delivered asynchronously: a pool worker of a killed generator could otherwise still
    re-create the directory (its writer's mkdir) just after the caller removed it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # state, pgrp; zombies run nothing
                alive = True
                break
        if not alive:
            return
        time.sleep(0.01)


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


def phases(stderr: str) -> tuple[dict, dict]:
    """pptrace's PPTRACE_PROGRESS=1 lines -> ({phase: seconds} (a phase met twice: summed),
    {phase: what its line said beside its count}, e.g. how many workers loaded the traces)."""
    seconds: dict = {}
    said: dict = {}
    for line in stderr.splitlines():
        m = PHASE.match(line.strip())
        if m:
            label, note, t = m.groups()
            seconds[label] = round(seconds.get(label, 0.0) + float(t), 3)
            if note:
                said[label] = note
    return seconds, said


def measure(cmd: list[str], cap_mb: float | None = None) -> dict:
    """Wall time and peak memory of ``cmd`` in a fresh process (its own process group, killed
    whole when its tree passes ``cap_mb`` or this benchmark is interrupted). This process imports
    nothing big: Linux carries the peak RSS of a process across exec, so a child would inherit ours."""
    env = {**os.environ, "PPTRACE_PROGRESS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)
        state = {"tree": 0, "killed": False, "done": threading.Event()}

        def sample():
            while not state["done"].wait(0.05):
                state["tree"] = max(state["tree"], tree_pss(proc.pid))
                if cap_mb and state["tree"] > cap_mb * MB and not state["killed"]:
                    state["killed"] = True
                    os.killpg(proc.pid, signal.SIGKILL)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # usage: this child and its reaped descendants
        except BaseException:  # Ctrl-C: the command's group is ours to end, before the caller cleans up
            end_group(proc.pid)
            raise
        finally:
            state["done"].set()
            sampler.join()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if state["killed"]:
        return {"error": f"killed at {state['tree'] / 1e9:.1f} GB (--cap-gb {cap_mb / 1e3:g})",
                "wall_s": None, "tree_mb": round(state["tree"] / MB, 1)}
    if proc.returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if line.strip() and not PHASE.match(line.strip())]
        return {"error": (lines or [f"exit {proc.returncode}"])[-1][-200:]}
    peak = usage.ru_maxrss * 1024
    seconds, said = phases(stderr)
    return {"wall_s": round(wall, 3), "peak_mb": round(peak / MB, 1), "tree_mb": round(max(peak, state["tree"]) / MB, 1),
            "phases": seconds, **({"said": said} if said else {}), "stdout": stdout}


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
    generated = run / "generated_s"
    if generated.exists():
        res["generated_s"] = float(generated.read_text())
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
            tries.append(measure(cmd, args.cap_gb * 1e3))
        ok = [t for t in tries if t.get("wall_s")]
        res[name] = min(ok, key=lambda t: t["wall_s"]) if ok else tries[0]
        tell(run, name, res[name])
        if name == "orjson" and ok:
            res["events"] = int(res[name]["stdout"].split()[-1])
        res[name].pop("stdout", None)
        if not name.startswith("pptrace"):
            res[name].pop("phases", None), res[name].pop("said", None)
    return res


# -- reporting -------------------------------------------------------------------------------
def tell(run: Path, name: str, r: dict) -> None:
    """Each measurement on stderr as it ends: a long run interrupted still leaves its numbers."""
    shown = {k: v for k, v in r.items() if k != "stdout"}
    print(f"   {run.name}: {name}: {json.dumps(shown)}", file=sys.stderr, flush=True)


def verdict(label: str, value, op: str, target: float) -> dict:
    if value is None:
        print(f"  {label:<40} n/a (a measurement failed)")
        return {"value": None, "target": f"{op} {target}", "pass": None}
    ok = value <= target if op == "<=" else value >= target if op == ">=" else value < target
    print(f"  {label:<40} {value:8.2f}  {'PASS' if ok else 'MISS'} (target {op} {target:g})")
    return {"value": round(value, 3), "target": f"{op} {target:g}", "pass": ok}


def ratio(res: dict, a: str, b: str, key: str = "wall_s"):
    x, y = res.get(a, {}).get(key), res.get(b, {}).get(key)
    return x / y if x is not None and y else None


def analysing(res: dict, name: str):
    """The analysis phase's seconds of one pptrace measurement (None: not printed or failed)."""
    return res.get(name, {}).get("phases", {}).get("analysing")


def print_run(title: str, run: Path, res: dict) -> None:
    made = f", generated in {res['generated_s']:.0f} s" if "generated_s" in res else ""
    print(f"\n== {title}: {run}\n   {res['traces']} traces, {res['gz_mb']:.0f} MB on disk, {res['json_mb']:.0f} MB "
          f"of JSON, {res.get('events', '?')} events, {os.cpu_count()} CPUs{made}")
    print(f"   {'':<16}{'wall s':>9}{'analysing s':>13}{'peak MB':>10}{'tree MB':>10}")
    for name in ("orjson", "pptrace cold", "pptrace cached", "hta", "hta load", "pptrace --html", "pptrace merge"):
        r = res.get(name)
        if r is None:
            continue
        if "error" in r:
            print(f"   {name:<16} failed: {r['error']}")
        else:
            a = analysing(res, name)
            said = "; ".join(f"{k}: {v}" for k, v in r.get("said", {}).items())
            print(f"   {name:<16}{r['wall_s']:>9.2f}{'' if a is None else f'{a:.2f}':>13}"
                  f"{r['peak_mb']:>10.0f}{r['tree_mb']:>10.0f}{f'   ({said})' if said else ''}")


def mode_trainer(args) -> dict:
    if args.run:
        run = args.run
    else:
        targs, name = TRAINER_ARGS[args.quick]
        run = ensure(args.data / name, [sys.executable, "-m", "instrumented_model.train", *targs, "--out"])
    res = bench_run(run, args, "cpu")
    print_run("trainer run", run, res)
    peak = max((res[k].get("tree_mb") or 0 for k in ("pptrace cold", "pptrace cached")), default=0)
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


def growth(per_n: dict, size: str, slack: float, names=("pptrace cold", "pptrace cached"), unit="ranks") -> dict:
    """Time from the next-largest to the largest run over their ``size`` ("events" or "json_mb")
    ratio, for each of ``names`` and for the analysis phase alone: <= ``slack`` is linear."""
    (n0, r0), (n1, r1) = list(per_n.items())[-2:]
    grow = r1[size] / r0[size] if r0.get(size) and r1.get(size) else None
    out = {}
    for name in names:
        for label, t0, t1 in ((name.split()[1], r0[name].get("wall_s"), r1[name].get("wall_s")),
                              (f"{name.split()[1]} analysing", analysing(r0, name), analysing(r1, name))):
            value = t1 / t0 / grow if t0 and t1 and grow else None
            out[f"{label} {n1}/{n0} {unit} per {'event' if size == 'events' else 'byte'}"] = verdict(
                f"{label} time {n1}/{n0} {unit} / {'events' if size == 'events' else 'bytes'}", value, "<=", slack)
    return out


def mode_scale(args) -> dict:
    ops = SCALE_OPS[args.quick]
    per_n = {}
    for n in args.ranks:
        run = ensure(args.data / f"scale-{n}x{ops}ops-dense",
                     [sys.executable, __file__, "--generate", "scale", str(n), str(ops)])
        per_n[n] = bench_run(run, args, None)
        print(f"   scale {n}: done", file=sys.stderr)
    print(f"\n== scale: tests/tracegen.py pipeline_traces + write_dense, pp={min(8, max(args.ranks))}, "
          f"{ops} ops per range")
    print(f"   {'ranks':>6}{'JSON MB':>9}{'events':>10}{'gen s':>7}{'orjson s':>10}{'cold s':>9}{'cached s':>10}"
          f"{'analysing s':>13}{'cold tree MB':>14}{'cached tree MB':>16}")
    for n, res in per_n.items():
        cells = [(res["orjson"].get("wall_s"), 10, 2), (res["pptrace cold"].get("wall_s"), 9, 2),
                 (res["pptrace cached"].get("wall_s"), 10, 2), (analysing(res, "pptrace cached"), 13, 2),
                 (res["pptrace cold"].get("tree_mb"), 14, 0), (res["pptrace cached"].get("tree_mb"), 16, 0)]
        text = "".join(f"{c:>{w}.{d}f}" if c is not None else f"{'failed':>{w}}" for c, w, d in cells)
        print(f"   {n:>6}{res['json_mb']:>9.0f}{res.get('events', 0):>10}{res.get('generated_s', 0):>7.0f}{text}")
    out = {"per_ranks": {str(n): r for n, r in per_n.items()}, "targets": {}}
    for n, res in per_n.items():
        # the target holds from CACHED_TARGET_RANKS (issue 27's sizes); below, the fresh
        # interpreter's imports (~0.35 s) are most of a cached run, so the ratio is shown only
        cached = ratio(res, "pptrace cached", "orjson")
        if n >= CACHED_TARGET_RANKS[args.quick]:
            out["targets"][f"cached/orjson {n}"] = verdict(f"cached / orjson at {n} ranks", cached, "<=", 0.2)
        elif cached is not None:
            print(f"  {f'cached / orjson at {n} ranks':<40} {cached:8.2f}  (no target below "
                  f"{CACHED_TARGET_RANKS[args.quick]} ranks)")
    if len(per_n) >= 2:
        out["targets"] |= growth(per_n, "events", 1.125)  # 4.5x for 256 -> 1,024 ranks
    biggest = per_n[max(per_n)]
    peak = max((biggest[k].get("tree_mb") or 0 for k in ("pptrace cold", "pptrace cached")), default=0)
    out["targets"]["peak GB"] = verdict(f"tree peak GB at {max(per_n)} ranks", peak / 1e3 if peak else None, "<", 4.0)
    return out


def page_check(run: Path, work: Path, args) -> dict:
    """`pptrace analyze RUN --html` (cached), then the page in headless Chromium."""
    page = work / "page.html"
    res = measure([sys.executable, "-m", "pptrace", "analyze", str(run), "--html", str(page)], args.cap_gb * 1e3)
    res.pop("stdout", None)
    if "error" in res or not page.exists():
        return {"pptrace --html": res}
    res["html_mb"] = round(page.stat().st_size / MB, 1)
    if importlib.util.find_spec("playwright") is None:
        return {"pptrace --html": res, "browser": {"error": "playwright not installed"}}
    try:
        done = subprocess.run([sys.executable, "-c", BROWSER, str(page), str(ROOT / "benchmarks")], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        browser = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                   else {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][-200:]})
    except subprocess.TimeoutExpired:
        browser = {"error": "no page drawn within 300 s"}
    return {"pptrace --html": res, "browser": browser}


def mode_realistic(args) -> dict:
    mb = args.rank_mb or REALISTIC_MB[args.quick]
    sizes = [int(n) for n in (args.realistic_ranks or REALISTIC_RANKS[args.quick]).split(",")]
    work = Path(tempfile.mkdtemp(prefix="pptrace-realistic-", dir=args.tmp))
    per_n: dict = {}
    try:
        for n in sizes:
            run = ensure(work / f"moe-{n}x{mb:g}MB",
                         [sys.executable, __file__, "--generate", "realistic", str(n), str(mb)])
            per_n[n] = res = bench_run(run, args, None)
            if n == max(sizes):
                res |= page_check(run, work, args)
                tell(run, "page", {k: res[k] for k in ("pptrace --html", "browser") if k in res})
                merged = work / "merged.json.gz"
                res["pptrace merge"] = measure([sys.executable, "-m", "pptrace", "merge", str(run), "-o", str(merged)],
                                               args.cap_gb * 1e3)
                res["pptrace merge"].pop("stdout", None)
                if merged.exists():
                    res["pptrace merge"]["out_mb"] = round(merged.stat().st_size / MB, 1)
                tell(run, "pptrace merge", res["pptrace merge"])
            print_run(f"realistic: {n} ranks x {mb:g} MB", run, res)
            shutil.rmtree(run, ignore_errors=True)  # the next size needs the disk
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"rank_mb": mb, "per_ranks": {str(n): r for n, r in per_n.items()}, "targets": {}}
    for n, res in per_n.items():
        out["targets"][f"cold/orjson {n}"] = verdict(f"cold / orjson at {n} ranks",
                                                     ratio(res, "pptrace cold", "orjson"), "<=", 1.0)
        out["targets"][f"cached/orjson {n}"] = verdict(f"cached / orjson at {n} ranks",
                                                       ratio(res, "pptrace cached", "orjson"), "<=", 0.2)
    if len(per_n) >= 2:
        out["targets"] |= growth(per_n, "json_mb", 1.2)
    n, big = max(per_n), per_n[max(per_n)]
    for name in ("pptrace cold", "pptrace cached", "pptrace --html", "pptrace merge"):
        if name in big:
            peak = big[name].get("tree_mb")
            out["targets"][f"{name} peak GB"] = verdict(f"{name} tree peak GB at {n} ranks",
                                                        peak / 1e3 if peak else None, "<", 4.0)
    page = big.get("browser", {})
    if "browser" in big:
        out["targets"]["page drawn s"] = verdict("page: every figure drawn, s", page.get("render_s"), "<=", PAGE_BOUND_S)
        out["targets"]["zoom s"] = verdict("page: timeline zoom in and back, s", page.get("zoom_and_back_s"),
                                           "<=", ZOOM_BOUND_S)
        blocks = page.get("blocks")
        out["targets"]["blocks"] = verdict("page: timeline blocks drawn", blocks, "<=", 60000)
        # the title and the note above the figure say it together, or neither does
        titled, noted = "down-sampled" in (page.get("title") or ""), bool(page.get("note_visible"))
        says = None if not (titled or noted) else titled and noted
        out["targets"]["note"] = {"value": page.get("note"), "pass": says}
        print(f"  {'page: down-sampling note':<40} "
              f"{'none (nothing merged)' if says is None else 'shown' if says else 'MISSING from title or page'}")
    return out


def compile_package() -> None:
    """Byte-compile pptrace as ``pip install`` leaves it. Where PYTHONDONTWRITEBYTECODE is set
    (it is on this benchmark's machines) a checkout's modules would otherwise be compiled from
    source in every measured process: 0.07 s of each, which no installed pptrace pays."""
    import compileall

    for package in ("pptrace", "dashboards"):
        compileall.compile_dir(ROOT / package, quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("trainer", "gpu", "scale", "realistic", "all"), default="all",
                        help="all: trainer, gpu and scale (realistic only when named)")
    parser.add_argument("--run", type=Path, help="trainer mode: an existing run (its cache is removed for cold)")
    parser.add_argument("--ranks", help=f"scale mode: comma-separated rank counts (default {SCALE_RANKS[False]}; "
                                        f"quick {SCALE_RANKS[True]})")
    parser.add_argument("--realistic-ranks", help=f"realistic mode: rank counts (default {REALISTIC_RANKS[False]})")
    parser.add_argument("--rank-mb", type=float, help=f"realistic mode: MB of JSON per rank (default {REALISTIC_MB[False]:g})")
    parser.add_argument("--quick", action="store_true", help="tiny runs: checks the benchmark, measures nothing")
    parser.add_argument("--workers", type=int, help="passed to pptrace analyze --workers")
    parser.add_argument("--repeat", type=int, default=1, help="tries per measurement; the fastest counts")
    parser.add_argument("--no-hta", action="store_true", help="skip HTA even when installed")
    parser.add_argument("--cap-gb", type=float, default=12.0,
                        help="kill a measured command whose process tree passes this (default 12)")
    parser.add_argument("--data", type=Path, default=ROOT / "benchmarks" / ".data",
                        help="where generated runs are kept and reused")
    parser.add_argument("--tmp", type=Path, help="realistic mode: where its runs are written (default: $TMPDIR)")
    parser.add_argument("--generate", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
        kind, *rest = args.generate
        if kind == "gpu":
            return generate_gpu(Path(rest[2]), rest[0], int(rest[1]))
        if kind == "realistic":
            return generate_dense(Path(rest[2]), int(rest[0]), gpu=True, rank_mb=float(rest[1]))
        return generate_dense(Path(rest[2]), int(rest[0]), gpu=False, ops=int(rest[1]))
    # a kill (not only Ctrl-C) still runs the finally blocks that remove generated runs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.ranks = [int(n) for n in (args.ranks or SCALE_RANKS[args.quick]).split(",")]
    if importlib.util.find_spec("hta") is None:  # not imported: this process must stay small
        print("HTA not installed (pip install 'pptrace[hta]'): skipped", file=sys.stderr)
        args.no_hta = True
    results = {"cpus": os.cpu_count(), "quick": args.quick, "workers": args.workers}
    compile_package()
    modes = (("trainer", mode_trainer), ("gpu", mode_gpu), ("scale", mode_scale), ("realistic", mode_realistic))
    for mode, fn in modes:
        if args.mode == mode or (args.mode == "all" and mode != "realistic"):
            results[mode] = fn(args)
    print(json.dumps(results))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the finally blocks have removed what this run generated
        sys.exit("bench_analyze: interrupted")
