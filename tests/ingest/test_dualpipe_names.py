"""DualPipe phase annotations (ingest/dualpipe_names.py), with the names of DeepSeek's
published EP64 training trace (deepseek-ai/profile-data train.json), and a hand-built GPU
rank of that shape: phases on the host, compute kernels on stream 7, DeepEP's dispatch and
combine (dpsk::ep namespace) on stream 23 under the compute."""
from __future__ import annotations

import pytest

import pptrace
from pptrace.ingest.dualpipe_names import parse_dualpipe_name
from pptrace.ingest.schema import classify
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

US = 1e-6
GEMM = "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(dpsk::Params)"
DISPATCH = "void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*)"
COMBINE = "void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*, float*)"


@pytest.mark.parametrize("name, kind, op, tags", [
    ("attn(F)", "compute", "fwd", {"dualpipe": "attn"}),
    ("mlp(B)", "compute", "bwd", {"dualpipe": "mlp"}),
    ("mlp(W)", "compute", "bwd_weight", {"dualpipe": "mlp"}),
    ("attn(W)", "compute", "bwd_weight", {"dualpipe": "attn"}),
    ("dispatch(F)", "phase", "dispatch", {"dualpipe": "dispatch", "dir": "fwd"}),
    ("combine(B)", "phase", "combine", {"dualpipe": "combine", "dir": "bwd"}),
])
def test_the_phases_of_the_published_trace(name, kind, op, tags):
    parsed = parse_dualpipe_name(name)
    assert (parsed.kind, parsed.op, parsed.tags) == (kind, op, tags)
    category = classify(name, "user_annotation")["category"]
    assert category == ("compute" if kind == "compute" else "other")


@pytest.mark.parametrize("name", ["dispatch(W)", "attn(X)", "attn (F)", "1F1B", "mlp(F) extra", "dispatch"])
def test_other_names_are_not_phases(name):
    assert parse_dualpipe_name(name) is None


def test_a_dualpipe_rank_gets_its_ep_from_the_kernels_not_the_host_phases(tmp_path):
    """Host: dispatch(F) [0, 400) (the CPU waiting for token counts), attn(F) [400, 450).
    GPU: gemm [100, 500) and [600, 900) on stream 7; dispatch [300, 550) and combine
    [850, 950) on stream 23. ep = 350 µs: hidden 200 + 50 under the gemms, exposed 50 + 50;
    the 400 µs host range adds nothing."""
    t = RankTrace(rank=0, layout=Layout(dp=1), steps=[1], pptrace_block=False)
    t.step(1, 0, 1000)
    t.add("dispatch(F)", 0, 400)
    t.add("attn(F)", 400, 50)
    for corr, (name, start, dur, stream) in enumerate(
            [(GEMM, 100, 400, 7), (DISPATCH, 300, 250, 23), (GEMM, 600, 300, 7), (COMBINE, 850, 100, 23)], 1):
        t.add("cudaLaunchKernel", 5 + corr, 2, cat="cuda_runtime", args={"correlation": corr})
        t.kernel(name, start, dur, stream=stream, correlation=corr)
    report = pptrace.analyze(write_run(tmp_path / "run", [t]), use_cache=False, progress=False).to_json()
    (step,) = report["ranks"][0]["steps"]
    assert round(step["hidden_s"]["ep"] / US) == 250
    assert round(step["breakdown_s"]["ep_exposed"] / US) == 100
    assert round(step["breakdown_s"]["compute"] / US) == 700
    assert report["run"]["comm_kernels"] == {"DeepEP (dpsk::ep)": {"dim": "ep", "kernels": 2}}
