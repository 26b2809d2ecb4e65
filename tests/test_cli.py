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
