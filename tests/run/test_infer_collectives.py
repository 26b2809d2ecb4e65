"""gloo collectives of plain traces by their process group (issue 24 item 6b).

A real torch.distributed.pipelining run, DeviceMesh (pp, dp) = (2, 2) on 4 gloo ranks,
plain torch.profiler at its defaults (record_shapes=False): after ``schedule.step()`` each
rank all-reduces its gradients over its dp group (``mesh_dp``: [0, 1] and [2, 3]) and the
step ends with the grad norm's all-reduce over all ranks. gloo writes both as a
``gloo:all_reduce`` on a worker thread, with nothing that names the group; on ranks 0 and 1
the two end half a millisecond apart. Before, both were ``other``.
"""
from __future__ import annotations

import pytest

from pptrace.run.build import load_run
from truth_checks import breakdowns, truth_step

PROFILED = (1, 2)
#: the trace's µs against the truth's ns, and the enqueue before gloo's worker picks it up
SLACK_NS = 300_000


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    from pipelining_run import load_truth, run
    from pptrace.analysis import analyze

    out = run(tmp_path_factory.mktemp("dp2pp2") / "run", "Schedule1F1B", world=4, dp=2, mode="plain-noshapes",
              microbatches=4, steps=3, profile_steps="1-2", fwd_ms=10, bwd_ms=20)
    loaded = load_run(out, use_cache=False)
    return loaded, analyze(loaded).to_json(), load_truth(out)


def _inside(run, rows, lo: int, hi: int) -> bool:
    raw = run.raw_ns(rows)
    return bool(((raw["raw_start_ns"] >= lo - SLACK_NS) & (raw["raw_end_ns"] <= hi + SLACK_NS)).all())


@pytest.mark.slow
def test_each_all_reduce_gets_its_groups_dimension(dp_run):
    """Per rank and step: the dp all-reduce is dp, inside the call the harness timed, on
    its own worker thread; the world's is the step-end one (what=grad_norm), inside its call.
    Every gloo collective is placed."""
    run, _, truth = dp_run
    assert (run.layout.pp, run.layout.dp) == (2, 2)
    assert "collectives" in run.inferred
    ev = run.events
    gloo = ev[(ev["name"] == "gloo:all_reduce") & ev["step"].isin(PROFILED)]
    inferred = ev[(ev["category"] == "comm:dp") & ev["inferred"] & ev["step"].isin(PROFILED)]
    assert len(inferred) == len(gloo) == 2 * 4 * len(PROFILED)
    for rank, t in truth.items():
        for step in PROFILED:
            s = truth_step(t, step)
            mine = inferred[(inferred["rank"] == rank) & (inferred["step"] == step)]
            final = mine["tags"].astype(str).str.contains("grad_norm").to_numpy()
            assert final.sum() == 1 and (~final).sum() == 1, (rank, step)
            assert _inside(run, mine[~final], s["dp_reduce_start_epoch_ns"], s["dp_reduce_end_epoch_ns"]), (rank, step)
            assert _inside(run, mine[final], s["reduce_start_epoch_ns"], s["reduce_end_epoch_ns"]), (rank, step)
            assert (mine["lane"] != "main").all()


@pytest.mark.slow
def test_the_dp_all_reduce_is_dp_time_not_other(dp_run):
    """Its whole worker range is dp, exposed or hidden (dp outranks the bubble in the
    partition): at least that range's time per rank-step, the rest of the step unchanged in
    kind (the pipeline still found, its waits bubble)."""
    from pptrace.timeline.intervals import union

    run, report, _ = dp_run
    ev = run.events
    parts = breakdowns(report)
    hidden = {(r["rank"], s["step"]): s["hidden_s"] for r in report["ranks"] for s in r["steps"]}
    dp = ev[(ev["category"] == "comm:dp") & ev["inferred"] & ~ev["tags"].astype(str).str.contains("grad_norm")]
    for (rank, step), p in parts.items():
        mine = dp[(dp["rank"] == rank) & (dp["step"] == step)]
        ran = union(mine["start_ns"].to_numpy(), mine["end_ns"].to_numpy()).total / 1e9
        assert ran > 0
        assert p["dp_exposed"] + hidden[rank, step]["dp"] >= ran - 1e-6, (rank, step, p, ran)
        assert p["pp_transfer"] < p["pp_bubble"]
