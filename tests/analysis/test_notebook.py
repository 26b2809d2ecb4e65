"""examples/analysis.ipynb, executed top to bottom in a real Jupyter kernel (nbclient): every
cell runs without an error, and each shows what its markdown promises (the documented
columns of each table, the JSON document's keys, a Plotly figure, the what-if's prediction).
The notebook makes its own run with the reference trainer (sleep compute, two ranks), so
this is a slow test: about 20 s on two cores.
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from pptrace.vocab import COMM_DIMS, PARTS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "analysis.ipynb"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def test_the_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # the kernel's environment: the run under pytest's tmp (not the user's /tmp), and Plotly's
    # own default renderer for a Jupyter kernel whatever the caller's shell sets
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("notebook")), "PLOTLY_RENDERER": "plotly_mimetype"}
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    return {cell.id: cell for cell in nb.cells}


def _result(cell) -> dict:
    """The data of the cell's displayed value (execute_result or display_data)."""
    shown = [o for o in cell.outputs if o.output_type in ("execute_result", "display_data")]
    assert len(shown) == 1, cell.outputs
    return shown[0]["data"]


def _literal(cell):
    return ast.literal_eval(_result(cell)["text/plain"])


def _html_table(cell) -> tuple[list[str], int]:
    """(the column headers, number of body rows) of a DataFrame's HTML output."""
    html = _result(cell)["text/html"]
    head = re.search(r"<thead>(.*?)</thead>", html, re.S).group(1)
    first = re.search(r"<tr.*?>(.*?)</tr>", head, re.S).group(1)
    headers = [re.sub(r"<.*?>", "", h).strip() for h in re.findall(r"<th.*?>.*?</th>", first, re.S)]
    body = re.search(r"<tbody>(.*?)</tbody>", html, re.S).group(1)
    return headers[1:], len(re.findall(r"<tr", body))  # the first header is the index's


@pytest.mark.slow
def test_every_cell_ran_without_an_error(executed):
    for cell in executed.values():
        if cell.cell_type == "code":
            assert cell.execution_count is not None, cell.id
            assert not [o for o in cell.outputs if o.output_type == "error"], cell.id
            # nothing went to stderr either (a warning would mean the run or analysis is off)
            assert not [o for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"], cell.id


@pytest.mark.slow
def test_the_run_and_the_analysis(executed):
    assert _literal(executed["make-run"]) == ["rank0.json.gz", "rank1.json.gz"]
    assert _result(executed["analyze"])["text/plain"] == "<Analysis: 2 ranks (pp2), schedule 1f1b, steps [1, 2]>"


@pytest.mark.slow
def test_the_step_tables_have_the_documented_columns(executed):
    columns, rows = _html_table(executed["steps"])
    assert columns == ["rank", "step", "time_s", *PARTS, *(f"hidden_{d}" for d in COMM_DIMS)]
    assert rows == 4  # 2 ranks x 2 profiled steps
    columns, rows = _html_table(executed["steps-by-rank"])
    assert columns == ["time_s", "compute", "pp_bubble", "pp_transfer", "dp_exposed", "other"] and rows == 2


@pytest.mark.slow
def test_stages_links_and_critical_path(executed):
    columns, rows = _html_table(executed["stages"])
    assert columns == ["stage", "bubble_s", "bubble_schedule_s", "bubble_latency_s", "theory_bubble_s",
                       "t_fwd_s", "t_bwd_s"]
    assert rows == 2
    columns, rows = _html_table(executed["links"])
    assert {"src", "dst", "count", "bytes", "wait_s", "transfer_s"} <= set(columns) and rows == 2  # 0->1, 1->0
    columns, rows = _html_table(executed["critical-path"])
    assert columns == ["step", "length_s", "compute_s", "p2p_s", "comm_s", "summary"] and rows == 2
    assert "bound by" in _result(executed["critical-path"])["text/html"]


@pytest.mark.slow
def test_the_json_document(executed):
    assert {"schema", "run", "ranks", "pipeline", "p2p", "collectives", "stragglers", "critical_path",
            "warnings"} <= set(_literal(executed["json-keys"]))
    pipe = _literal(executed["json-pipeline"])
    assert pipe["schedule"] == "1f1b" and pipe["microbatches"] == 4
    assert 0 < pipe["theory_bubble_fraction"] < 1 and 0 < pipe["bubble_fraction"] < 1


@pytest.mark.slow
def test_the_figures_display_as_plotly(executed):
    assert {"timeline", "replay", "partition", "bubble", "p2p_links"} <= set(_literal(executed["figures"]))
    data = _result(executed["timeline"])
    assert PLOTLY_MIME in data
    figure = data[PLOTLY_MIME]
    assert figure["data"] and "layout" in figure


@pytest.mark.slow
def test_the_whatif_predicts_the_interleaved_schedule(executed):
    w = _literal(executed["whatif"])
    assert w["schedule"] == "interleaved" and w["vpp"] == 2
    assert w["measured_s"] > 0 and w["predicted_s"] > 0
    # a step-time comparison: the speedup is measured over predicted
    assert w["speedup"] == pytest.approx(w["measured_s"] / w["predicted_s"], rel=1e-9)
