"""The GPU path on real NCCL traces (fixtures/hta-gpu, read-only: loaded without cache)."""
from __future__ import annotations

import shutil

import pytest

from pptrace.analyzers.partition import partition_run
from pptrace.vocab import PARTS
from pptrace.analyzers.gpu_timeline import gpu_timeline
from pptrace.timeline.windows import gpu_step_windows
from pptrace.export.report import build_report
from pptrace.run.build import load_run


def _run(hta_fixtures, *names, tmp=None):
    if len(names) == 1:
        return load_run(hta_fixtures / names[0], use_cache=False, progress=False)
    for name in names:
        shutil.copy(hta_fixtures / name, tmp / name)
    return load_run(tmp, use_cache=False, progress=False)


@pytest.fixture(scope="module")
def world8(hta_fixtures):
    return _run(hta_fixtures, "sendrecv_allreduce_world8_rank3.json.gz")


def test_every_nccl_kernel_knows_its_collective(world8):
    """Old traces carry the collective only on the host: ingest/nccl.py finds it for every kernel,
    and the SendRecv kernels turn out to be all_to_all, not pipeline p2p."""
    k = world8.events[world8.events["category"] == "kernel_comm"]
    assert len(k) == 60 and k["collective"].notna().all()
    sendrecv = k[k["name"].astype(str).str.contains("SendRecv")]
    assert set(sendrecv["collective"].astype(str)) == {"all_to_all"}
    act = world8.activities[3]
    assert act.p2p.total == 0
    assert act.comm["ep"].total > 0 and act.comm["dp"].total > 0
    assert act.unknown_groups == 60  # no pg_config, no group ranks: guessed, and said so
    report = build_report(world8)
    assert any("60 NCCL collective kernels" in w for w in report["warnings"])


def test_partition_uses_gpu_step_windows_and_sums(world8):
    run = world8
    windows = gpu_step_windows(world8.events)
    parts = partition_run(run)
    assert [p.step for p in parts] == [1009, 1010, 1011, 1012, 1013, 1014]
    for p in parts:
        assert (p.start_ns, p.end_ns) == windows[(3, p.step)]
        assert sum(p.parts[name].total for name in PARTS) == p.wall_ns
        # the GPU work of a step starts after its CPU ProfilerStep begins
        cpu = world8.events[(world8.events["category"] == "step") & (world8.events["step"] == p.step)]
        assert p.start_ns > int(cpu["start_ns"].iloc[0])
    # steps never overlap on the GPU
    ordered = sorted(windows.values())
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))


def test_gpu_timeline_is_consistent(world8):
    table = gpu_timeline(world8.events)
    assert len(table) == 6
    for row in table.itertuples():
        assert row.compute_s + row.comm_exposed_s + row.memcpy_exposed_s + row.idle_s == pytest.approx(row.time_s, abs=1e-9)
        assert 0 <= row.overlap_pct <= 100
        assert row.launch_bound_s <= row.idle_s + 1e-12
        assert row.host_launching_s <= row.launch_bound_s + 1e-12


def test_world2_allreduce_is_dp_from_group_ranks(hta_fixtures):
    run = _run(hta_fixtures, "nccl_allreduce_world2_rank0.json.gz")
    act = run.activities[0]
    assert act.unknown_groups == 0 and act.comm["dp"].total > 0 and act.p2p.total == 0
    steps = build_report(run)["ranks"][0]["steps"]
    assert [s["step"] for s in steps] == [4, 5, 6]
    assert all(s["gpu"]["memcpy_s"] > 0 for s in steps)


def test_world128_two_ranks(hta_fixtures, tmp_path):
    run = _run(hta_fixtures, "sendrecv_world128_rank0.json.gz", "sendrecv_world128_rank1.json.gz", tmp=tmp_path)
    report = build_report(run)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    k = run.events[run.events["category"] == "kernel_comm"]
    # SendRecv kernels here come from all_reduce, all_to_all and _allgather_base
    assert k["collective"].notna().all() and not k["collective"].astype(str).isin(["send", "recv"]).any()
    assert any("without pptrace ranges" in w and "pipeline bubble" in w for w in report["warnings"])
