"""The click CLI, through CliRunner: output, one-line errors, exit codes, no tracebacks."""
import gzip

import pytest
import torch
from click.testing import CliRunner

import pptrace
from pptrace.cli import cli


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    with pptrace.profile(out, steps="1-2", schedule="1f1b", microbatches=4) as prof:
        for _ in range(3):
            with pptrace.region("compute:fwd", mb=0):
                torch.ones(8).sum()
            prof.step()
    return out


def invoke(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def test_version_and_help_list_commands():
    assert invoke("--version").output.strip() == f"pptrace, version {pptrace.__version__}"
    result = invoke("--help")
    assert result.exit_code == 0 and "info" in result.output


def test_info_on_a_run(run_dir):
    result = invoke("info", run_dir)
    assert result.exit_code == 0, result.output
    assert "rank0.json.gz" in result.output
    assert "1-2" in result.output and "1f1b" in result.output
    assert "ranks: 1 (0)" in result.output
    assert '"pp": 1' in result.output  # the layout line


def test_info_on_empty_dir(tmp_path):
    result = invoke("info", tmp_path)
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("Error:")
    assert "no trace files" in result.output


def test_info_on_missing_path(tmp_path):
    result = invoke("info", tmp_path / "nope")
    assert result.exit_code == 1 and "no such file or directory" in result.output


def test_info_on_garbage_files(tmp_path):
    (tmp_path / "rank0.json").write_text("this is not json")
    (tmp_path / "rank1.json.gz").write_bytes(b"\x1f\x8b not really gzip")
    (tmp_path / "rank2.json").write_text('[1, 2, 3]')
    result = invoke("info", tmp_path)
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and result.output.startswith("Error:")
    assert "could be read" in result.output


def test_info_warns_about_a_bad_file_next_to_good_ones(run_dir, tmp_path):
    good = (run_dir / "traces" / "rank0.json.gz").read_bytes()
    (tmp_path / "rank0.json.gz").write_bytes(good)
    (tmp_path / "rank1.json").write_text("garbage")
    result = invoke("info", tmp_path)
    assert result.exit_code == 0
    assert "warning:" in result.output and "rank1.json" in result.output
    assert gzip.decompress((tmp_path / "rank0.json.gz").read_bytes())  # user files untouched


# -- commands over a loaded run (synthetic GPipe run with known timing; real GPU traces) ----


@pytest.fixture(scope="module")
def gpipe_run(tmp_path_factory):
    from tracegen import pipeline_run

    run_dir, _ = pipeline_run(tmp_path_factory.mktemp("gpipe") / "run", pp=2, microbatches=4)
    return run_dir


def test_analyze_prints_tables_and_json(gpipe_run):
    import json

    result = invoke("analyze", gpipe_run)
    assert result.exit_code == 0, result.output
    # step parts are headed in words ("pp bubble"), so that headers wrap instead of widening columns
    assert "Pipeline bubble per stage" in result.output and "pp bubble" in result.output
    result = invoke("analyze", gpipe_run, "--json", "--steps", "1", "--ranks", "0")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == "pptrace.analysis/1"
    assert doc["run"]["steps"] == [1] and [r["rank"] for r in doc["ranks"]] == [0]


def _main(tmp_path, *args, before: str = "") -> "subprocess.CompletedProcess":
    """``pptrace ARGS`` through cli.main in a fresh interpreter, ``before`` run first, with an
    exit handler that leaves a file behind (the quick exit must still run them)."""
    import subprocess
    import sys

    code = (f"import atexit, pathlib, sys\n{before}\n"
            f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'atexit-ran')!r}).write_text('ran'))\n"
            f"sys.argv = ['pptrace', *{[str(a) for a in args]!r}]\n"
            "from pptrace.cli import main\nmain()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)


def test_the_command_exits_quickly_with_its_status_its_output_and_its_exit_handlers(gpipe_run, tmp_path):
    """cli.main skips the interpreter's teardown: the whole --json document still reaches the
    pipe, a refused input still exits 1 with its one line, the exit handlers still run; and
    while another thread runs, the process waits for it as a plain exit does."""
    import json

    done = _main(tmp_path, "analyze", gpipe_run, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["schema"] == "pptrace.analysis/1"
    assert (tmp_path / "atexit-ran").read_text() == "ran"
    (tmp_path / "atexit-ran").unlink()
    refused = _main(tmp_path, "analyze", tmp_path / "nowhere", "--json")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("Error: ") and len(refused.stderr.strip().splitlines()) == 1
    assert (tmp_path / "atexit-ran").exists()
    late = tmp_path / "thread-finished"
    busy = _main(tmp_path, "--version", before=(
        "import threading, time, pathlib\n"
        f"threading.Thread(target=lambda: (time.sleep(0.5), pathlib.Path({str(late)!r}).write_text('x'))).start()"))
    assert busy.returncode == 0 and busy.stdout.startswith("pptrace, version")
    assert late.exists(), "the quick exit cut a running thread short"


def test_analyze_rejects_a_bad_list(gpipe_run):
    result = invoke("analyze", gpipe_run, "--ranks", "zero")
    assert result.exit_code == 2 and "is not a list like" in result.output


@pytest.mark.parametrize("trace", ["nccl_allreduce_world2_rank0.json.gz", "no_distributed_info.json.gz",
                                   "gloo_cpu_only_world300_rank34.json.gz"])
def test_analyze_real_gpu_traces_exits_0_with_warnings(tmp_path, trace):
    from conftest import FIXTURES

    (tmp_path / trace).write_bytes((FIXTURES / trace).read_bytes())
    result = invoke("analyze", tmp_path / trace)
    assert result.exit_code == 0, result.output
    assert "warning" in result.output.lower()


def test_merge_dashboard_and_whatif(gpipe_run, tmp_path):
    import gzip
    import json

    result = invoke("merge", gpipe_run, "-o", tmp_path / "merged.json.gz")
    assert result.exit_code == 0, result.output
    merged = json.loads(gzip.decompress((tmp_path / "merged.json.gz").read_bytes()))
    assert {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"} >= {"rank 0 · pp0", "rank 1 · pp1"}

    result = invoke("dashboard", gpipe_run, "-o", tmp_path / "report.html")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.html").read_text().count("<html") == 1

    result = invoke("whatif", gpipe_run, "--schedule", "1f1b", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["predicted"]["step_time_s"] > 0 and len(doc["predicted"]["stages"]) == 2
    result = invoke("whatif", gpipe_run, "--schedule", "1f1b", "--vpp", "2")
    assert result.exit_code == 1 and result.output.startswith("Error:")
    # --vpp alone switches the schedule, and says so (issue 25 item 14)
    result = invoke("whatif", gpipe_run, "--vpp", "2", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["predicted"]["schedule"] == "interleaved"
    assert any(n.startswith("--vpp 2 chunks per stage need the interleaved schedule") for n in doc["notes"]), doc["notes"]
    assert "need the interleaved schedule" in " ".join(invoke("whatif", gpipe_run, "--vpp", "2").output.split())
