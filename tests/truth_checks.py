"""Checks shared by the tests that run real pipelines against their own logged truth
(tests/pipelining_run.py and tests/megatron_run.py runs, with pptrace or plain)."""
from __future__ import annotations


def truth_step(truth: dict, step: int) -> dict:
    """One rank's logged truth of ``step``."""
    return next(s for s in truth["steps"] if s["step"] == step)


def sleeps(truth: dict, step: int) -> list:
    """(start, end) epoch ns of every sleep this rank logged in ``step``."""
    return [(z["start_epoch_ns"], z["end_epoch_ns"]) for a in truth_step(truth, step)["actions"] for z in a["sleeps"]]


def covered(spans, lo: int, hi: int) -> int:
    """ns of [lo, hi) covered by the union of ``spans``."""
    total, last = 0, lo
    for a, b in sorted(spans):
        a, b = max(a, last), min(b, hi)
        if b > a:
            total += b - a
            last = b
    return total


def pipeline_window(truths: dict, rank: int, step: int) -> tuple:
    """The pipeline window (DESIGN contract 3) from the truth (rank -> truth), within
    ``rank``'s step: every rank runs its pipeline inside schedule.step(), so the window spans
    the earliest call to the latest return; the part before this rank's step began belongs
    to its previous step."""
    steps = [truth_step(t, step) for t in truths.values()]
    own = truth_step(truths[rank], step)
    return (max(min(s["pipeline_start_epoch_ns"] for s in steps), own["start_epoch_ns"]),
            min(max(s["pipeline_end_epoch_ns"] for s in steps), own["end_epoch_ns"]))


def sends_per_step(truths: dict) -> int:
    """The p2p messages one step moves: each microbatch crosses every stage boundary whose two
    stages sit on different ranks, once forward and once backward."""
    t = next(iter(truths.values()))
    where = t["stage_ranks"]
    boundaries = sum(1 for s in range(len(where) - 1) if where[s] != where[s + 1])
    return 2 * boundaries * t["microbatches"]


def idle_errors_ms(report: dict, truths: dict, steps, busy) -> dict:
    """(rank, step) -> ms of pp_bubble + pp_transfer over the true idle: the truth's pipeline
    window less what ``busy(truth, step)`` (spans, epoch ns) says the rank was doing."""
    parts, out = breakdowns(report), {}
    for rank, truth in truths.items():
        for step in steps:
            lo, hi = pipeline_window(truths, rank, step)
            idle = (hi - lo - covered(busy(truth, step), lo, hi)) / 1e9
            p = parts[rank, step]
            out[rank, step] = round((p["pp_bubble"] + p["pp_transfer"] - idle) * 1e3, 2)
    return out


def compute_errors(report: dict, truths: dict, steps) -> dict:
    """(rank, step) -> the analysis's compute over the rank's logged sleeps, less 1."""
    parts = breakdowns(report)
    return {(rank, step): parts[rank, step]["compute"] / (sum(b - a for a, b in sleeps(truth, step)) / 1e9) - 1
            for rank, truth in truths.items() for step in steps}


def breakdowns(report: dict) -> dict:
    """(rank, step) -> that step's breakdown_s in the analyze --json document."""
    return {(r["rank"], s["step"]): s["breakdown_s"] for r in report["ranks"] for s in r["steps"]}


def check_whatif_replay(run, schedule: str, limit: float = 0.10) -> None:
    """What-if replays the measured schedule within ``limit`` of the measured step."""
    from pptrace.vocab import canonical
    from pptrace.whatif.predict import whatif

    result = whatif(run)
    assert result["measured"]["schedule"] == canonical(schedule)
    error = result["replay"]["error_fraction"]
    assert abs(error) < limit, f"whatif replay error {error:+.3f}"


def check_dashboard(run, report: dict, path) -> None:
    """The dashboard page is written with every figure and its data."""
    from pptrace.export.dashboard import write_page

    html = write_page(run, report, path).read_text()
    for key in ("timeline", "replay", "partition", "bubble", "p2p_links"):
        assert f'id="fig-{key}"' in html, key
    assert html.count('type="application/json"') >= 5  # the figures' data
