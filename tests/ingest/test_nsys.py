"""Nsight Systems SQLite input (ingest/nsys.py) on a real export: hpcgroup/pipit's MPI + CUDA
saxpy on an A100 (nsys 2022.2), 5 kernels, 15 memcpy, 24 NVTX rows (MPI's among them)."""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pptrace.cli import cli as main
from pptrace.errors import TraceError
from pptrace.ingest.files import find_trace_files
from pptrace.ingest.load import load_rank

FIXTURE = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "nsys" / "saxpy-mpi-cuda-rank0.sqlite"
if not FIXTURE.exists():
    FIXTURE = Path("/work/shared/fixtures/nsys/saxpy-mpi-cuda-rank0.sqlite")
pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason="the nsys fixture is not here")


def _union_s(rows) -> float:
    """Seconds covered by the [start, end) rows, merged by a plain sort (the test's own
    reference, not pptrace's intervals)."""
    total, reach_start, reach_end = 0, None, None
    for start, end in sorted(rows):
        if reach_end is None or start > reach_end:
            if reach_end is not None:
                total += reach_end - reach_start
            reach_start, reach_end = start, end
        else:
            reach_end = max(reach_end, end)
    if reach_end is not None:
        total += reach_end - reach_start
    return total / 1e9


def _sql(path, query):
    with sqlite3.connect(path) as db:
        return db.execute(query).fetchall()


def _with_step(tmp_path) -> Path:
    """The fixture, copied, with one NVTX range ProfilerStep#1 around all of its GPU work and
    the runtime calls that launched it, on its main thread: a step for the analysis to
    partition (the export has no step marks; GPU work belongs to its launching call's step)."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / FIXTURE.name
    shutil.copy(FIXTURE, path)
    path.chmod(0o644)
    with sqlite3.connect(path) as db:
        lo, hi = db.execute("SELECT MIN(start), MAX(end) FROM (SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL "
                            "UNION ALL SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                            "UNION ALL SELECT start, end FROM CUPTI_ACTIVITY_KIND_RUNTIME)").fetchone()
        tid = db.execute("SELECT globalTid FROM NVTX_EVENTS WHERE globalTid IS NOT NULL LIMIT 1").fetchone()[0]
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?, ?, 59, ?, ?)",
                   (lo - 1000, hi + 1000, "ProfilerStep#1", tid))
    return path


def test_the_export_loads_every_kernel_memcpy_and_nvtx_range():
    frame, meta = load_rank(FIXTURE)
    cats = frame["cat"].astype(str).value_counts().to_dict()
    assert cats["kernel"] == 5 and cats["gpu_memcpy"] == 15
    n_ranges = _sql(FIXTURE, "SELECT COUNT(*) FROM NVTX_EVENTS WHERE end IS NOT NULL")[0][0]
    assert cats["user_annotation"] == n_ranges == 22
    assert cats["cuda_runtime"] == _sql(FIXTURE, "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME")[0][0]
    names = set(frame["name"].astype(str))
    assert {"saxpy", "MPI_Init", "MPI_Finalize"} <= names, names
    assert any(n.startswith("saxpy") for n in frame.loc[frame["cat"] == "kernel", "name"].astype(str))
    # rank and world size from the recorded environment (PMI_RANK=0, PMI_SIZE=2), the clock
    # from the capture's UTC start
    assert meta["rank"] == 0 and meta["world_size"] == 2 and meta["hostname"] == "nid001608"
    utc = _sql(FIXTURE, "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")[0][0]
    first = _sql(FIXTURE, "SELECT MIN(start) FROM CUPTI_ACTIVITY_KIND_KERNEL")[0][0]
    assert frame.loc[frame["cat"] == "kernel", "start_ns"].min() == utc + first
    # kernels and their runtime calls share correlation ids; host rows on the main lane
    kernels = frame[frame["cat"] == "kernel"]
    runtime = frame[frame["cat"] == "cuda_runtime"]
    assert set(kernels["correlation"]) <= set(runtime["correlation"])
    assert set(kernels["lane"].astype(str)) == {f"stream {s}" for s in kernels["stream"]}
    assert set(frame.loc[frame["cat"] == "user_annotation", "lane"].astype(str)) == {"main"}


def test_gpu_compute_memcpy_and_busy_equal_the_exports_own_unions(tmp_path):
    """The analysis' GPU times of the one step equal the interval unions of the export's rows
    (within 1%): compute = kernels, memcpy = memcpy rows, busy = both."""
    path = _with_step(tmp_path)
    kernels = _sql(path, "SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL")
    copies = _sql(path, "SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY")
    result = CliRunner().invoke(main, ["analyze", str(path.parent), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    gpu = doc["ranks"][0]["steps"][0]["gpu"]
    for got, want in ((gpu["compute_s"], _union_s(kernels)), (gpu["memcpy_s"], _union_s(copies)),
                      (gpu["busy_s"], _union_s(kernels + copies))):
        assert want > 0 and got == pytest.approx(want, rel=0.01), (gpu, want)


def _fails_in_one_line(run, *parts):
    result = CliRunner().invoke(main, ["analyze", str(run), "--json"])
    assert result.exit_code != 0 and not isinstance(result.exception, (AssertionError, KeyError, TypeError)) \
        and "Traceback" not in result.output, result.output
    text = result.output.strip().splitlines()
    assert len(text) == 1, text
    for part in parts:
        assert part in text[0], text
    return text[0]


def test_sqlite_that_is_not_an_export(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with sqlite3.connect(run / "rank0.sqlite") as db:
        db.execute("CREATE TABLE t (x INTEGER)")
    _fails_in_one_line(run, "not an Nsight Systems export")


def test_truncated_export(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.sqlite").write_bytes(FIXTURE.read_bytes()[: 200_000])
    _fails_in_one_line(run, "rank0.sqlite")


def test_export_without_kernels_is_a_host_only_analysis(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "rank0.sqlite"
    shutil.copy(FIXTURE, path)
    path.chmod(0o644)
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
    result = CliRunner().invoke(main, ["analyze", str(run), "--json"])
    assert result.exit_code == 0, result.output
    warnings = json.loads(result.stdout)["warnings"]
    assert any("no CUDA kernels" in w and "host-only" in w for w in warnings), warnings
    frame, _ = load_rank(path)
    assert (frame["cat"] == "kernel").sum() == 0 and (frame["cat"] == "user_annotation").sum() == 22


def test_sqlite_and_json_ranks_mixed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE, run / "rank0.sqlite")
    (run / "rank1.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="mixed"):
        find_trace_files(run)
    _fails_in_one_line(run, "mixed")


def test_nsys_rep_without_nsys_says_the_export_command(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.nsys-rep").write_bytes(b"\0" * 64)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nsys
    _fails_in_one_line(run, "nsys export --type sqlite")


HTA = Path("/work/shared/fixtures/hta-gpu")


@pytest.mark.parametrize("name, rank, world", [("nccl_allreduce_world2_rank0", 0, 2),
                                               ("sendrecv_allreduce_world8_rank3", 3, 8)])
def test_a_gpu_trace_written_as_an_nsys_export_analyses_as_its_json(tmp_path, name, rank, world):
    """The same rank both ways: an HTA GPU trace (torch.profiler, NCCL) and that trace's
    kernels, memcpy, runtime calls and annotations written in nsys's schema (tests/nsys_export,
    the real export's CREATE TABLE statements; the rank only in the recorded environment):
    every step's time, partition and GPU times agree within 1%."""
    from nsys_export import write_export

    json_run, nsys_run = tmp_path / "json", tmp_path / "nsys"
    json_run.mkdir(), nsys_run.mkdir()
    trace = shutil.copy(HTA / f"{name}.json.gz", json_run)
    frame, meta = load_rank(trace, compact=False)
    write_export(nsys_run / "export.sqlite", frame, base_ns=meta["base_ns"], env={"RANK": rank, "WORLD_SIZE": world})
    docs = []
    for run in (json_run, nsys_run):
        result = CliRunner().invoke(main, ["analyze", str(run), "--json"])
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout))
    want, got = (d["ranks"][0] for d in docs)
    assert got["rank"] == want["rank"] == rank and docs[1]["run"]["world_size"] == world
    assert [s["step"] for s in got["steps"]] == [s["step"] for s in want["steps"]] and want["steps"]
    for a, b in zip(got["steps"], want["steps"]):
        assert a["time_s"] == pytest.approx(b["time_s"], rel=0.01)
        for part in ("breakdown_s", "gpu"):
            for key, value in b[part].items():
                if isinstance(value, float):
                    assert a[part][key] == pytest.approx(value, rel=0.01, abs=1e-6), (part, key)


def test_the_typed_header_of_either_reader():
    from pptrace.ingest.header import RankHeader

    _, meta = load_rank(FIXTURE)
    head = RankHeader.of(meta)
    assert (head.reader, head.rank, head.world_size, head.hostname, head.pptrace) == ("nsys", 0, 2, "nid001608", None)
    assert head.base_ns == _sql(FIXTURE, "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")[0][0]
    _, meta = load_rank(HTA / "nccl_allreduce_world2_rank0.json.gz")
    head = RankHeader.of(meta)
    assert head.reader == "kineto" and head.rank == 0 and head.pg_config == meta["distributed"]["pg_config"]
    with pytest.raises(ValueError, match="rank"):
        RankHeader.of({**meta, "rank": -1})


def test_the_sleep_mode_trainer_recorded_as_nsys_exports_analyses_as_its_traces(sleep_run, tmp_path):
    """The reference trainer's 1F1B sleep run (p=4, m=8), each rank's trace written as an nsys
    export (its pptrace ranges as NVTX, the rank in the recorded environment): every step's
    time and compute agree within 1%, and every part of the partition within 1% of the step's
    time (the export, as nsys would, has none of the gloo host ops whose spans refine the p2p
    transfer/bubble split, ~0.5 ms of a 360 ms step on the corpus run), as does the pipeline's
    bubble fraction."""
    from nsys_export import write_export

    run = sleep_run("1f1b")
    nsys_run = tmp_path / "nsys"
    nsys_run.mkdir()
    for trace in sorted((run / "traces").glob("rank*.json*")):
        frame, meta = load_rank(trace, compact=False)
        write_export(nsys_run / f"rank{meta['rank']}.sqlite", frame, base_ns=meta["base_ns"],
                     env={"RANK": meta["rank"], "WORLD_SIZE": meta["world_size"]})
    docs = []
    for path in (run, nsys_run):
        result = CliRunner().invoke(main, ["analyze", str(path), "--json"])
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout))
    got, want = docs
    assert got["run"]["layout"] == want["run"]["layout"]
    assert got["pipeline"]["bubble_fraction"] == pytest.approx(want["pipeline"]["bubble_fraction"], abs=0.01)
    assert [r["rank"] for r in got["ranks"]] == [r["rank"] for r in want["ranks"]] == [0, 1, 2, 3]
    for ra, rb in zip(got["ranks"], want["ranks"]):
        assert len(ra["steps"]) == len(rb["steps"]) > 0
        for a, b in zip(ra["steps"], rb["steps"]):
            assert a["time_s"] == pytest.approx(b["time_s"], rel=0.01)
            assert a["breakdown_s"]["compute"] == pytest.approx(b["breakdown_s"]["compute"], rel=0.01)
            for part, value in b["breakdown_s"].items():
                assert abs(a["breakdown_s"][part] - value) <= 0.01 * b["time_s"], (ra["rank"], a["step"], part)


def test_rows_read_a_chunk_at_a_time_give_the_table_read_at_once(tmp_path, monkeypatch):
    """Export.rows fetches FETCH_ROWS rows at a time (no list of every row's tuple is held: a
    574 k-kernel export peaked at 889 MB read whole, 388 MB so) and codes each text column
    over the chunks: 3-row chunks, which split every table and put a string's rows in several
    chunks, give the same table, names and their categories, as one chunk does."""
    import pptrace.ingest.nsys as nsys

    whole, _ = load_rank(FIXTURE, compact=False)
    monkeypatch.setattr(nsys, "FETCH_ROWS", 3)
    chunked, _ = load_rank(FIXTURE, compact=False)
    assert chunked.equals(whole) and len(whole) > 3 * 20
    for column in ("name", "cat"):
        assert list(chunked[column].cat.categories) == list(whole[column].cat.categories)
    assert chunked["name"].astype(str).tolist() == whole["name"].astype(str).tolist()
