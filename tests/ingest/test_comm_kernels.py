"""GPU kernels that communicate without NCCL (pptrace/ingest/comm_kernels.py): a hand-built
two-rank MoE trace with DeepEP's kernels (their names as torch.profiler writes them, from
DeepEP's sources) on their own stream under the compute of another, with known answers.

All times in µs of true time (tracegen); both ranks run the same timeline (ep = dp = 2, no
pipeline):

    stream 7  (compute)  gemm [100,400)   get_dispatch_layout [450,500)   gemm [500,800)
    stream 30 (DeepEP)   notify_dispatch [50,100)   dispatch [300,450)   combine [700,900)

The step's GPU window is [50, 900) = 850. DeepEP's layout kernel counts tokens locally: it is
compute. EP time 50 + 150 + 200 = 400, of it hidden under compute [300,400) + [700,800) = 200,
exposed [50,100) + [400,450) + [800,900) = 200; compute 300 + 50 + 300 = 650; nothing else.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest
from click.testing import CliRunner

import pptrace
from pptrace.cli import cli
from pptrace.ingest import comm_kernels
from pptrace.topology import Layout
from tracegen import RankTrace, write_run

US = 1e-6
NOTIFY = "void deep_ep::intranode::notify_dispatch<2>(int const*, int*, int, int const*, int*, int, int, int)"
DISPATCH = "void deep_ep::intranode::dispatch<2, 768, 6144>(int4*, float*, int*, long*, float*, int*, int*)"
COMBINE = "void deep_ep::intranode::combine<__nv_bfloat16, 2, 768, 4096>(__nv_bfloat16*, float*, int*, int)"
LAYOUT_KERNEL = "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def _trace(rank: int, extra=(), pptrace_block: bool = True) -> RankTrace:
    t = RankTrace(rank=rank, layout=Layout(dp=2), steps=[1], pptrace_block=pptrace_block)
    t.step(1, 0, 1000)
    kernels = [(GEMM, 100, 300, 7), (LAYOUT_KERNEL, 450, 50, 7), (GEMM, 500, 300, 7),
               (NOTIFY, 50, 50, 30), (DISPATCH, 300, 150, 30), (COMBINE, 700, 200, 30), *extra]
    for corr, (name, start, dur, stream) in enumerate(kernels, 1):
        t.add("cudaLaunchKernel", 5 + corr, 2, cat="cuda_runtime", args={"correlation": corr})
        t.kernel(name, start, dur, stream=stream, correlation=corr)
    return t


@pytest.fixture(scope="module")
def deepep(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("deepep") / "run", [_trace(0), _trace(1)])


def _us(x) -> int:
    return round(x / US)


def test_deepep_kernels_are_ep_communication_hidden_and_exposed_to_the_us(deepep):
    report = pptrace.analyze(deepep, use_cache=False, progress=False).to_json()
    assert report["run"]["comm_kernels"] == {"DeepEP": {"dim": "ep", "kernels": 6}}  # 3 a rank
    for entry in report["ranks"]:
        (step,) = entry["steps"]
        assert _us(step["time_s"]) == 850
        parts = {k: _us(v) for k, v in step["breakdown_s"].items()}
        assert parts == {"compute": 650, "tp_exposed": 0, "cp_exposed": 0, "dp_exposed": 0, "ep_exposed": 200,
                         "pp_transfer": 0, "pp_bubble": 0, "other": 0}, entry["rank"]
        assert {k: _us(v) for k, v in step["hidden_s"].items()} == {"tp": 0, "cp": 0, "dp": 0, "ep": 200}
        gpu = step["gpu"]
        assert (_us(gpu["compute_s"]), _us(gpu["comm_s"]), _us(gpu["overlap_s"]), _us(gpu["comm_exposed_s"])) == (
            650, 400, 200, 200)
    (ep,) = [c for c in report["collectives"] if c["dim"] == "ep"]
    assert (_us(ep["time_s"]), _us(ep["hidden_s"]), _us(ep["exposed_s"])) == (400, 200, 200)


def test_a_plain_trace_says_its_ep_was_inferred_from_the_kernels(tmp_path):
    """No layout metadata: the world is not presented as a plain dp2 when its communication
    is an all-to-all."""
    run = write_run(tmp_path / "run", [_trace(r, pptrace_block=False) for r in (0, 1)])
    report = pptrace.analyze(run, use_cache=False, progress=False).to_json()
    assert "expert-parallel all-to-all from its kernels (DeepEP)" in report["run"]["inferred"]["ep"]
    assert _us(report["ranks"][0]["steps"][0]["breakdown_s"]["ep_exposed"]) == 200
    text = CliRunner().invoke(cli, ["analyze", str(run)]).stdout
    assert "inferred (the run carries no pptrace metadata): ep: expert-parallel" in " ".join(text.split())


def test_without_the_table_the_same_kernels_would_be_compute():
    """What the table changes (and what pptrace reported before it): DeepEP's kernels are
    plain kernels to torch.profiler."""
    from pptrace.ingest.schema import classify

    for name in (NOTIFY, DISPATCH, COMBINE):
        assert classify(name, "kernel")["category"] == "kernel_compute"
        assert comm_kernels._first_match(pd.Index([name]), comm_kernels.KNOWN)[0] >= 0
    assert comm_kernels._first_match(pd.Index([LAYOUT_KERNEL, GEMM]), comm_kernels.KNOWN).tolist() == [-1, -1]
    # the layout kernel under DeepSeek's namespace counts tokens locally: compute
    dpsk_layout = "void dpsk::ep::cuda::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int)"
    assert comm_kernels._first_match(pd.Index([dpsk_layout]), comm_kernels.KNOWN).tolist() == [-1]


@pytest.mark.parametrize("name, library, dim", [
    ("void deep_ep::internode::dispatch<true, 2, 8, 7168>(int4*, float*)", "DeepEP", "ep"),
    ("void deep_ep::internode_ll::combine<false, 3, 7168>(void*, int*)", "DeepEP", "ep"),
    ("void deep_ep::internode::cached_notify(int, int, int, int, int, int, int*, int*, int*, int*)", "DeepEP", "ep"),
    ("void deep_ep::internode_ll::clean_low_latency_buffer<32>(int*, int, int*, int)", "DeepEP", "ep"),
    ("void nvshmemi_barrier_all_kernel()", "NVSHMEM", "ep"),
    # as DeepSeek's published DualPipe training trace (profile-data train.json) names them
    ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, float*, "
     "dpsk::ep::internode::SourceMeta*, int4 const*)", "DeepEP (dpsk::ep)", "ep"),
    ("void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*, float*, bool const*)",
     "DeepEP (dpsk::ep)", "ep"),
    ("void dpsk::ep::internode::notify_dispatch<false, 8>(int const*, long*, int, int const*)",
     "DeepEP (dpsk::ep)", "ep"),
    ("void dpsk::ep::internode::cached_notify<false>(int, int, int, int, int*, int, int)", "DeepEP (dpsk::ep)", "ep"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, int)",
     "vLLM/SGLang custom all-reduce", "tp"),
    ("void tensorrt_llm::kernels::oneShotAllReduceKernel<__nv_bfloat16, 8>(tensorrt_llm::kernels::AllReduceParams)",
     "TensorRT-LLM all-reduce", "tp"),
])
def test_known_libraries(name, library, dim):
    (k,) = comm_kernels._first_match(pd.Index([name]), comm_kernels.KNOWN)
    assert (comm_kernels.KNOWN[k].library, comm_kernels.KNOWN[k].dim) == (library, dim)


def test_a_user_pattern_takes_effect_in_the_cli_and_the_api(tmp_path):
    """A kernel pptrace does not know is compute until the user names it; then it is
    communication of the dim they say, hidden where compute ran beside it."""
    run = write_run(tmp_path / "run", [_trace(r, extra=[("fancy_alltoallv_kernel<8>", 150, 100, 40)])
                                       for r in (0, 1)])
    runner = CliRunner()

    def ep(*options) -> tuple:
        result = runner.invoke(cli, ["analyze", str(run), "--json", *options])
        assert result.exit_code == 0, result.output
        step = json.loads(result.stdout)["ranks"][0]["steps"][0]
        return _us(step["breakdown_s"]["compute"]), _us(step["hidden_s"]["ep"]), _us(step["hidden_s"]["dp"])

    # the unknown kernel runs inside gemm [100,400): as compute it adds nothing to compute
    assert ep() == (650, 200, 0)
    # as ep: [150,250) is hidden EP time too, compute unchanged (the gemm covers it)
    assert ep("--comm-kernel", "fancy_alltoall=ep") == (650, 300, 0)
    assert ep("--comm-kernel", r"^fancy_\w+kernel=dp") == (650, 200, 100)
    report = pptrace.analyze(run, comm_kernels=["fancy_alltoall=ep"], use_cache=False, progress=False).to_json()
    assert report["run"]["comm_kernels"] == {"user": {"dim": "ep", "kernels": 2}, "DeepEP": {"dim": "ep", "kernels": 6}}
    text = runner.invoke(cli, ["analyze", str(run), "--comm-kernel", "fancy_alltoall=ep"])
    assert "communication kernels known by name: 2 user kernels as ep communication; 6 DeepEP kernels" in " ".join(
        text.stdout.split())


@pytest.mark.parametrize("spec, said", [
    ("fancy(=ep", "is not a regular expression"),
    ("fancy=xp", "dim 'xp' is not one of tp, cp, dp, ep"),
    ("fancy", "expected REGEX=DIM"),
    ("=ep", "expected REGEX=DIM"),
])
def test_a_bad_comm_kernel_is_one_line_and_exit_1(deepep, spec, said):
    for command in (["analyze", str(deepep), "--json"], ["dashboard", str(deepep)], ["whatif", str(deepep)]):
        result = CliRunner().invoke(cli, [*command, "--comm-kernel", spec])
        assert result.exit_code == 1, (command, result.output)
        assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.output
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        pptrace.analyze(deepep, comm_kernels=[spec])


@pytest.mark.parametrize("desc, dim", [
    ("EXPERT_MODEL_PARALLEL_GROUP", "ep"), ("EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "ep"),
    ("EXPERT_DATA_PARALLEL_GROUP", "dp"), ("EXPERT_DATA_PARALLEL_GROUP_AG", "dp"),
    ("EXPERT_TENSOR_PARALLEL_GROUP", "tp"), ("mesh_ep", "ep"), ("TENSOR_MODEL_PARALLEL_GROUP", "tp"),
    ("TENSOR_AND_DATA_PARALLEL_GROUP", None),
])
def test_the_process_group_of_an_nccl_all_to_all_names_its_dim(desc, dim):
    """NCCL all_to_all kernels get their dim from their group's pg_desc (Megatron's expert
    groups, DeviceMesh's mesh_<dim>)."""
    from pptrace.timeline.activity import dim_of_desc

    assert dim_of_desc(desc) == dim


def test_an_nccl_all_to_all_on_the_expert_group_is_ep_under_compute(tmp_path):
    """The NCCL path of the same timeline: the dispatch is an ``all_to_allv`` launched inside
    record_param_comms on a group whose pg_desc is Megatron's expert group; its SendRecv
    kernel is a collective (not pipeline p2p) and ep, hidden [300,400), exposed [400,450)."""
    traces = []
    for rank in (0, 1):
        t = RankTrace(rank=rank, layout=Layout(dp=2), steps=[1])
        t.header["distributedInfo"]["pg_config"].append(
            {"pg_name": "5", "pg_desc": "EXPERT_MODEL_PARALLEL_GROUP", "pg_size": 2, "ranks": [0, 1]})
        t.step(1, 0, 1000)
        for corr, (start, dur) in enumerate([(100, 300), (500, 300)], 1):
            t.add("cudaLaunchKernel", 5 + corr, 2, cat="cuda_runtime", args={"correlation": corr})
            t.kernel(GEMM, start, dur, stream=7, correlation=corr)
        t.add("record_param_comms", 20, 10, cat="cpu_op",
              args={"Collective name": "all_to_allv", "Process Group Ranks": "[0, 1]", "Process Group Name": "5",
                    "In msg nelems": 4096, "Out msg nelems": 4096, "dtype": "BFloat16"})
        t.add("cudaLaunchKernel", 22, 5, cat="cuda_runtime", args={"correlation": 9})
        t.kernel("ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)", 300, 150, stream=20, correlation=9)
        traces.append(t)
    report = pptrace.analyze(write_run(tmp_path / "run", traces), use_cache=False, progress=False).to_json()
    assert report["run"]["comm_kernels"] == {}
    step = report["ranks"][0]["steps"][0]
    assert _us(step["time_s"]) == 700
    assert {k: _us(v) for k, v in step["breakdown_s"].items() if v} == {"compute": 600, "ep_exposed": 50, "other": 50}
    assert _us(step["hidden_s"]["ep"]) == 100
    assert report["p2p"]["pairs"] == 0
