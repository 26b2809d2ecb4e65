"""Dashboard size and render time on a large synthetic run (default: 64 ranks, 3 steps).

    python benchmarks/bench_dashboard.py                 # pp=8 x dp=8, 16 microbatches, 3 steps
    python benchmarks/bench_dashboard.py --pp 4 --dp 1 --microbatches 8   # quick

Targets (issue 6): HTML under 25 MB, rendered in under 5 s in headless Chromium. The render time
of an empty page that only loads plotly.js is printed too: on a busy 2-core box most of the
render time is parsing plotly.js, and the difference is what the run's figures cost.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # tracegen, and this checkout's pptrace

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
FIRST_SCREEN = ("() => window.Plotly !== undefined && [...document.querySelectorAll('.pptrace-fig')]"
                ".filter(d => d.getBoundingClientRect().top < innerHeight).every(g => g._fullLayout)")
READY = ("() => { const d = [...document.querySelectorAll('.js-plotly-plot')];"
         " return window.Plotly !== undefined && d.length === document.querySelectorAll('.pptrace-fig').length"
         " && d.every(g => g._fullLayout); }")


def _tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process's descendants (the Playwright driver and
    Chromium's processes): unlike wall time it does not grow when other jobs share the cores."""
    parent, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    me, total = os.getpid(), 0.0
    for pid in cpu:
        p = pid
        while p in parent and p != me and p > 1:
            p = parent[p]
        if p == me and pid != me:
            total += cpu[pid]
    return total


def _render_seconds(browser, html: Path, repeats: int) -> tuple[list[float], dict]:
    times, info = [], {}
    for _ in range(repeats):
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                   else route.abort())
        c0, t0 = _tree_cpu_seconds(), time.perf_counter()
        page.goto(html.resolve().as_uri())
        page.wait_for_function(FIRST_SCREEN, timeout=120000)
        # two frames: what newPlot laid out is painted on the next animation frame
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        info.setdefault("first_screen_s", []).append(round(time.perf_counter() - t0, 2))
        # then scroll through the page: the other figures are drawn as they come into view
        page.evaluate("() => document.querySelectorAll('.pptrace-fig').forEach(d => d.scrollIntoView())")
        for div in page.locator(".pptrace-fig").all():
            div.scroll_into_view_if_needed()
        page.wait_for_function(READY, timeout=120000)
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        times.append(time.perf_counter() - t0)
        info.setdefault("cpu_s", []).append(round(_tree_cpu_seconds() - c0, 2))
        info |= page.evaluate(
            "() => { const gd = document.getElementById('fig-timeline');"
            " return gd ? {traces: gd._fullData.length,"
            " points: gd._fullData.reduce((n, t) => n + (t.x ? t.x.length : 0), 0)} : {}; }")
        if info.get("traces"):
            t1 = time.perf_counter()  # zoom into 2% of the x range and back: redraws
            page.evaluate("() => { const gd = document.getElementById('fig-timeline');"
                          " const r = gd._fullLayout.xaxis.range;"
                          " return Plotly.relayout(gd, {'xaxis.range': [r[0], r[0] + (r[1] - r[0]) / 50]})"
                          "   .then(() => Plotly.relayout(gd, {'xaxis.autorange': true})); }")
            info["zoom_and_back_s"] = round(time.perf_counter() - t1, 3)
        page.close()
    return times, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="keep the run and page here")
    args = ap.parse_args(argv)

    from tracegen import pipeline_run

    from dashboards.page import build_figures, render_html
    from pptrace.analysis import analyze
    from pptrace.run.build import load_run

    root = args.out or Path(tempfile.mkdtemp(prefix="bench_dashboard_"))
    t = time.perf_counter()
    run_dir, _ = pipeline_run(root / "run", pp=args.pp, dp=args.dp, microbatches=args.microbatches,
                              steps=tuple(range(1, args.steps + 1)))
    t_gen = time.perf_counter() - t
    t = time.perf_counter()
    run = load_run(run_dir, use_cache=False)
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    analysis = analyze(run)
    report = analysis.to_json()
    t_report = time.perf_counter() - t
    # what `pptrace dashboard` gathers before drawing (the page itself analyses nothing): the
    # partitions the report was built from, kept by the analysis, and the replay
    t = time.perf_counter()
    partitions = analysis.partitions
    t_part = time.perf_counter() - t
    t = time.perf_counter()
    result, _ = analysis.replay
    t_whatif = time.perf_counter() - t
    t = time.perf_counter()
    figures = build_figures(run, report, partitions=partitions, whatif_result=result)
    t_fig = time.perf_counter() - t
    t = time.perf_counter()
    html = root / "report.html"
    html.write_text(render_html(run, report, figures), encoding="utf-8")
    t_html = time.perf_counter() - t
    empty = root / "empty.html"
    empty.write_text(render_html(run, report, {}), encoding="utf-8")

    blocks = len(run.events[run.events["category"].isin(["compute", "p2p", "comm:dp"])])
    print(f"run: {run.layout.world_size} ranks (pp={args.pp} dp={args.dp}), m={args.microbatches}, "
          f"{args.steps} steps, {blocks} timeline ranges; generate {t_gen:.2f} s, "
          f"load {t_load:.2f} s, report {t_report:.2f} s, partitions {t_part:.2f} s, "
          f"what-if {t_whatif:.2f} s (the caller's)")
    size_mb = html.stat().st_size / 1e6
    print(f"figures {t_fig:.2f} s, html {t_html:.2f} s; HTML {size_mb:.2f} MB "
          f"(empty page with plotly.js: {empty.stat().st_size / 1e6:.2f} MB) -> target < 25 MB: "
          f"{'OK' if size_mb < 25 else 'OVER'}")

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("playwright not installed: render time not measured")
        return 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        base, base_info = _render_seconds(browser, empty, args.repeats)
        full, info = _render_seconds(browser, html, args.repeats)
        browser.close()
    best = min(full)
    print(f"first screen (load -> the figures in the 1400x900 viewport plotted): "
          f"{info.pop('first_screen_s')} s")
    print(f"render (load -> every figure plotted, scrolling through the page, {args.repeats} tries): "
          f"{', '.join(f'{x:.2f}' for x in full)} s; best {best:.2f} s -> target < 5 s: "
          f"{'OK' if best < 5 else 'OVER'}")
    print(f"empty page (plotly.js only): best {min(base):.2f} s; figures add {best - min(base):.2f} s")
    print(f"CPU seconds of the browser processes per load: page {info.pop('cpu_s')}, "
          f"empty page {base_info.get('cpu_s')}; load average now {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"timeline: {info}")
    print(f"page kept at {html}" if args.out else f"(run and page in {root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
