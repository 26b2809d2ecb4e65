"""What the expert-parallel analysis costs: on a synthetic 64-rank MoE run (dp 64, ep 8: eight
ep groups, 4 MoE layers, 8 microbatches, 2 profiled steps, ep rank 3's experts at 2x the mean
tokens), the time of the ep analyses (analyzers/ep_pairs.py: the rank-pair matrix;
analyzers/experts.py: tokens per expert and the expert load) against `pptrace analyze RUN --json`
as a user runs it (a fresh process, cache kept: the smaller time, so the stricter ratio).

    python benchmarks/bench_ep.py                 # 64 ranks
    python benchmarks/bench_ep.py --ranks 16      # fewer
    python benchmarks/bench_ep.py --quick         # tiny run: checks the benchmark, measures nothing

Target (printed PASS/MISS, never asserted): the ep analyses under 10% of the analyze time. The
last line printed is every number, as JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_analyze import cache_dir, measure  # noqa: E402

EP, LAYERS, M, STEPS, HOT = 8, 4, 8, (1, 2), 3
TOKENS, TOPK, ROW_BYTES, LOCAL = 1024, 2, 512, 4  # per microbatch on a rank; 4 experts per ep rank
US_PER_TOKEN = 0.5  # expert time (twice in backward)


def _splits(copies: int) -> list[int]:
    """Rows to each ep rank: the hot one at 2x the mean, the rest even."""
    heavy = 2 * copies // EP
    rest = [(copies - heavy) // (EP - 1)] * (EP - 1)
    rest[-1] += copies - heavy - sum(rest)
    return [*rest[:HOT], heavy, *rest[HOT:]]


def generate(out: Path, ranks: int, ops: int) -> Path:
    """The run: every rank of an ep group arrives at each exchange together (+ a few µs of
    jitter) and leaves after the last; experts run US_PER_TOKEN per token received."""
    from pptrace.topology import Layout
    from tracegen import RankTrace, write_run

    layout = Layout(dp=ranks, ep=EP)
    traces = {r: RankTrace(r, ranks, layout, schedule=None, microbatches=M, steps=list(STEPS)) for r in range(ranks)}
    send = _splits(TOKENS * TOPK)
    got = {e: [send[e]] * EP for e in range(EP)}  # every source routes alike
    ep_rank = {r: layout.expert_coords(r)[0] for r in range(ranks)}
    t = 0.0
    for step in (0, *STEPS):
        start = t
        for mb in range(M):
            for phase in ("fwd", "bwd"):
                t0 = t
                for r, tr in traces.items():  # the dense part of the pass, with its aten ops
                    tr.region(f"compute:{phase}", t0, 400, mb=mb)
                    for k in range(ops):
                        tr.add("aten::mm", t0 + k * 400 / max(ops, 1), 400 / max(ops, 1) * 0.8, cat="cpu_op")
                t = t0 + 400
                for layer in range(LAYERS):
                    direction = "bwd" if phase == "bwd" else None
                    scale = 2.0 if phase == "bwd" else 1.0
                    arrive = {r: t + (r * 7) % 11 for r in traces}
                    leave = max(arrive.values()) + 60
                    for r, tr in traces.items():
                        tr.region("ep:dispatch", arrive[r], leave - arrive[r], layer=layer, mb=mb, dir=direction,
                                  bytes=sum(send) * ROW_BYTES, tokens=sum(send), send=",".join(map(str, send)),
                                  recv=",".join(map(str, got[ep_rank[r]])))
                    expert = {r: sum(got[ep_rank[r]]) * US_PER_TOKEN * scale for r in traces}
                    for r, tr in traces.items():
                        n = sum(got[ep_rank[r]])
                        tr.region("compute:expert", leave, expert[r], layer=layer, mb=mb, dir=direction, tokens=n,
                                  per_expert=",".join([str(n // LOCAL)] * LOCAL))
                    back = {r: leave + expert[r] for r in traces}
                    done = max(back.values()) + 60
                    for r, tr in traces.items():
                        n = sum(got[ep_rank[r]])
                        tr.region("ep:combine", back[r], done - back[r], layer=layer, mb=mb, dir=direction,
                                  bytes=n * ROW_BYTES, tokens=n, send=",".join(map(str, got[ep_rank[r]])),
                                  recv=",".join(map(str, send)))
                    t = done + 20
        for r, tr in traces.items():
            tr.region("dp:all_reduce", t, 500, what="grads")
            tr.step(step, start, t + 500 - start)
        t += 600
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_run(tmp, list(traces.values()))
    tmp.rename(out)
    return out


def time_ep(run_dir: Path) -> dict:
    """Seconds of the ep analyses on the loaded run (cache kept), best of three."""
    import pptrace
    from pptrace.analyzers.collectives import waits_by_rank
    from pptrace.analyzers.ep_pairs import ep_pairs
    from pptrace.analyzers.experts import expert_load, expert_tokens

    run = pptrace.analyze(run_dir, progress=False).run
    best = {}
    for _ in range(3):
        timings = {}
        t = time.perf_counter()
        pairs = ep_pairs(run)
        timings["ep_pairs_s"] = time.perf_counter() - t
        t = time.perf_counter()
        tokens = expert_tokens(run)
        timings["expert_tokens_s"] = time.perf_counter() - t
        t = time.perf_counter()
        load = expert_load(run, waits_by_rank(run))
        timings["expert_load_s"] = time.perf_counter() - t
        for key, value in timings.items():
            best[key] = min(best.get(key, value), value)
    best["pairs_rows"], best["expert_rows"], best["load_rows"] = len(pairs.table), len(tokens), len(load)
    best["ep_s"] = best["ep_pairs_s"] + best["expert_tokens_s"] + best["expert_load_s"]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 ranks, no aten ops: checks the benchmark")
    parser.add_argument("--data", type=Path, help="where the run is written (default: a temporary directory, removed)")
    args = parser.parse_args()
    ranks = 16 if args.quick else args.ranks
    if ranks % EP:
        raise SystemExit(f"--ranks {ranks} must be a multiple of ep={EP}")
    root = Path(tempfile.mkdtemp(prefix="pptrace-bench-ep-")) if args.data is None else args.data
    try:
        run = root / f"ep-{ranks}"
        if not run.exists():
            root.mkdir(parents=True, exist_ok=True)
            generate(run, ranks, 0 if args.quick else 40)
        shutil.rmtree(cache_dir(run), ignore_errors=True)
        cmd = [sys.executable, "-m", "pptrace", "analyze", str(run), "--json"]
        cold, cached = ({k: v for k, v in measure(cmd).items() if k != "stdout"} for _ in range(2))
        ep = time_ep(run)
        share = ep["ep_s"] / cached["wall_s"]
        verdict = {"label": "ep analyses / cached analyze", "value": share, "target": 0.10, "pass": share < 0.10}
        print(f"{ranks} ranks (dp {ranks}, ep {EP}): analyze cold {cold['wall_s']:.2f} s, cached {cached['wall_s']:.2f} s; "
              f"ep analyses {ep['ep_s'] * 1e3:.1f} ms (pairs {ep['ep_pairs_s'] * 1e3:.1f}, tokens per expert "
              f"{ep['expert_tokens_s'] * 1e3:.1f}, load {ep['expert_load_s'] * 1e3:.1f})")
        print(f"  {'PASS' if verdict['pass'] else 'MISS'} ep analyses = {share:.1%} of the cached analyze (target < 10%)")
        print(json.dumps({"ranks": ranks, "cold": cold, "cached": cached, "ep": ep, "target": verdict}))
    finally:
        if args.data is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
