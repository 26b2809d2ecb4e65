"""The partition's compute split by pass type (analyzers/compute_by_pass.py) on the hand-built
two-stage run of tracegen (times in its units, us): stage 0 computes forwards 10-30 and
40-60, backwards 104-144 and 172-212, the optimizer 232-240; stage 1 forwards 38-58 and 106-126,
backwards 58-98 and 126-166, the optimizer 232-240."""
from __future__ import annotations

import pytest

import pptrace
from pptrace.analyzers.compute_by_pass import compute_by_pass


def test_split_by_pass_sums_to_compute(scenario_run):
    a = pptrace.analyze(scenario_run)
    split = compute_by_pass(a.run, a.partitions).set_index("rank")
    us = 1e-6
    assert split.loc[0, "fwd"] == pytest.approx(40 * us) and split.loc[0, "bwd"] == pytest.approx(80 * us)
    assert split.loc[1, "fwd"] == pytest.approx(40 * us) and split.loc[1, "bwd"] == pytest.approx(80 * us)
    assert split.loc[0, "other"] == pytest.approx(8 * us)  # the optimizer
    assert (split[["bwd_input", "bwd_weight"]] == 0).all().all()
    compute = a.steps.set_index("rank")["compute"]
    total = split[["fwd", "bwd", "bwd_input", "bwd_weight", "other"]].sum(axis=1)
    assert (total - compute).abs().max() < 1e-12
    doc = a.to_json()
    assert doc["ranks"][0]["steps"][0]["compute_s"]["fwd"] == pytest.approx(40 * us)
    assert doc["ranks"][1]["mean"]["compute_s"]["bwd"] == pytest.approx(80 * us)
