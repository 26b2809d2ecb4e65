"""`pptrace diff` refuses what it cannot compare in one line on stderr, exit code 1, no
traceback: a file that is no analysis, an analysis from a future schema, runs with no
parallel dimension in common, a bad gate; and exits 3 only for a failed gate."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from diff_docs import cell, document
from pptrace.cli import GATE_FAILED, cli
from pptrace.topology import Layout


def _write(path, doc):
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def _run(*args):
    result = CliRunner().invoke(cli, ["diff", *args])
    return result, result.stderr.strip()


@pytest.fixture
def good(tmp_path):
    return _write(tmp_path / "base.json", document(lambda r, s, step: cell()))


@pytest.mark.parametrize("other, says", [
    ({"measured": {}, "predicted": {}}, "not a pptrace analysis"),           # a whatif --json
    ({"schema": "pptrace.diff/1"}, "a pptrace.diff/1 document, not an analysis"),
    ([1, 2, 3], "a JSON list, not a pptrace analysis"),
    ("this is { not json", "not JSON"),
    ({"schema": "pptrace.analysis/1", "run": {}}, "without its 'ranks' section"),
])
def test_unrelated_documents(tmp_path, good, other, says):
    result, err = _run(good, _write(tmp_path / "other.json", other))
    assert result.exit_code == 1 and says in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output


def test_future_schema(tmp_path, good):
    future = _write(tmp_path / "future.json", document(lambda r, s, step: cell(), schema="pptrace.analysis/2"))
    result, err = _run(future, good)
    assert result.exit_code == 1 and len(err.splitlines()) == 1
    assert "newer than the pptrace.analysis/1 this pptrace reads" in err and "upgrade pptrace" in err


def test_no_common_dims(tmp_path, good):
    dp = _write(tmp_path / "dp.json", document(lambda r, s, step: cell(schedule=0, latency=0), layout=Layout(dp=2)))
    result, err = _run(good, dp)
    assert result.exit_code == 1 and "no parallel dimension in common" in err and len(err.splitlines()) == 1


def test_missing_path_and_bad_gate(tmp_path, good):
    result, err = _run(good, str(tmp_path / "nowhere"))
    assert result.exit_code == 1 and "no such file or directory" in err
    result, err = _run(good, good, "--gate", "step>3")
    assert result.exit_code == 1 and "is not a gate" in err and len(err.splitlines()) == 1


def test_gate_exit_codes(tmp_path, good):
    slower = _write(tmp_path / "slow.json", document(lambda r, s, step: cell(fwd=0.013)))
    ok, _ = _run(good, good, "--gate", "step>+3%")
    assert ok.exit_code == 0 and ok.stdout.strip().splitlines()[-1].startswith("PASS:")
    failed, _ = _run(good, slower, "--gate", "step>+3%")
    assert failed.exit_code == GATE_FAILED == 3 and failed.stdout.strip().splitlines()[-1].startswith("FAIL: step +")
    within, _ = _run(good, slower, "--gate", "step>+20%", "--gate", "pp_bubble>+1ms")
    assert within.exit_code == 0
    as_json, _ = _run(good, slower, "--gate", "step>+3%", "--json")
    assert as_json.exit_code == GATE_FAILED and json.loads(as_json.stdout)["verdict"]["status"] == "fail"
