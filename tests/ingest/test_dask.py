"""Loading on Dask (pptrace/ingest/cluster.py, `--workers N` / `--scheduler ADDRESS`): the same
--json document as in process, on a trainer run and on GPU traces; a worker that dies is
retried, or the command fails in one line with no report: never a report without a rank.

The clusters are real (LocalCluster on the loopback, worker processes). A job that kills its
worker is this module's stand-in for load._parse_job, patched in where load_ranks looks it
up; the workers import this module (tests/ is on their sys.path, passed on by spawn).

As on a cluster, ``cli_cluster`` is a `dask scheduler` and two `dask worker` processes started
from the command line (benchmarks/bench_dask.py's CliCluster: each in a process group of its
own, killed whatever the tests do), the workers in a directory of their own; ``pptrace`` runs
against it as a separate process too."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pptrace.cli import cli
from pptrace.errors import TraceError
from pptrace.ingest import cluster, files, load, store
from pptrace.run.build import load_run
from tracegen import pipeline_run, pipeline_traces, write_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_dask import CliCluster  # noqa: E402 - the benchmark's cluster, started as on a cluster

needs_dask = pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                                reason="needs dask[distributed] (pip install 'pptrace[distributed]')")
DIED_MARKER = "died-once"  # beside the traces: the first job of a run to find it absent dies


def _dies_once(path, *rest):
    """load._parse_job, but the first call for a run kills the worker process running it."""
    marker = Path(path).parent / DIED_MARKER
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        from pptrace.ingest.load import _parse_job

        return _parse_job(path, *rest)
    os._exit(70)


def _always_dies(path, *rest):
    os._exit(70)


def _cannot_read(path, *rest):
    """What _parse_job says on a worker that does not see the run where the client does."""
    return None, None, f"cannot read {path}: No such file or directory; check that the file exists and is readable"


def _local_cluster(n_workers: int):
    import distributed

    return distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                    dashboard_address="127.0.0.1:0", silence_logs=logging.CRITICAL)


@pytest.fixture(scope="module")
def scheduler():
    """The address of a running 2-worker cluster, as `dask scheduler` + `dask worker` give."""
    with _local_cluster(2) as running:
        yield running.scheduler_address


def invoke(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args], env={"PPTRACE_PROGRESS": "1"})
    assert "Traceback" not in result.output
    return result


def document(*args) -> dict:
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def cold(run: Path) -> None:
    """No cache entry left: the next load parses every trace."""
    for trace in files.find_trace_files(run):
        shutil.rmtree(store.cache_path(trace).parent, ignore_errors=True)


def entries(run: Path) -> list:
    return [store.cache_path(t) for t in files.find_trace_files(run) if store.cache_path(t).exists()]


@pytest.fixture(scope="module")
def trainer_copy(trainer_run, tmp_path_factory):
    """A private copy of the trainer run (its cache comes and goes here)."""
    run = tmp_path_factory.mktemp("dask") / "run"
    shutil.copytree(trainer_run / "traces", run / "traces", ignore=shutil.ignore_patterns(".pptrace-cache"))
    return run


@pytest.fixture
def tiny_run(tmp_path):
    return pipeline_run(tmp_path / "run", pp=2, dp=2)[0]


@pytest.mark.slow
@needs_dask
@pytest.mark.parametrize("command", ["analyze", "whatif"])
@pytest.mark.parametrize("where", ["scheduler", "workers"])
def test_trainer_run_on_dask_gives_the_in_process_document(trainer_copy, scheduler, command, where):
    cold(trainer_copy)
    expected = document(command, trainer_copy, "--json")
    cold(trainer_copy)
    options = ("--scheduler", scheduler) if where == "scheduler" else ("--workers", 2)
    result = invoke(command, trainer_copy, "--json", *options)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == expected
    said = f"on Dask at {scheduler}" if where == "scheduler" else "on 2 local Dask workers"
    assert f"loading traces {said} 4/4" in result.stderr  # parsed there, not read from the cache
    assert len(entries(trainer_copy)) == 4  # the workers filled the cache beside the traces


@pytest.mark.slow
@needs_dask
def test_gpu_traces_on_dask_give_the_in_process_document(hta_fixtures, scheduler, tmp_path):
    for name in ("sendrecv_world128_rank0.json.gz", "sendrecv_world128_rank1.json.gz"):
        shutil.copy(hta_fixtures / name, tmp_path / name)
    expected = document("analyze", tmp_path, "--json")
    assert expected["run"]["ranks"] == [0, 1]
    cold(tmp_path)
    result = invoke("analyze", tmp_path, "--json", "--scheduler", scheduler)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == expected
    assert f"on Dask at {scheduler} 2/2" in result.stderr


@pytest.mark.slow
@needs_dask
def test_a_worker_killed_once_is_retried(trainer_copy, scheduler, monkeypatch):
    cold(trainer_copy)
    expected = document("analyze", trainer_copy, "--json")
    cold(trainer_copy)
    monkeypatch.setattr(load, "_parse_job", _dies_once)
    got = document("analyze", trainer_copy, "--json", "--scheduler", scheduler)
    assert (trainer_copy / "traces" / DIED_MARKER).exists()  # a worker did die
    assert got == expected


@pytest.mark.slow
@needs_dask
def test_a_job_that_always_kills_its_worker_fails_in_one_line(tiny_run, monkeypatch):
    """--workers: Dask runs it again once (allowed-failures 1 here; 3 by default), then the
    command stops with one line and no report on stdout."""
    import dask

    monkeypatch.setattr(load, "_parse_job", _always_dies)
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        result = invoke("analyze", tiny_run, "--json", "--workers", 2)
    assert result.exit_code == 1
    assert result.stdout == ""
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: rank ") and "the Dask worker running it died 2 times" in error
    assert error.endswith("no report written")


@pytest.mark.slow
@needs_dask
def test_a_worker_that_cannot_read_the_run_is_an_error_not_a_missing_rank(tiny_run, scheduler, monkeypatch):
    monkeypatch.setattr(load, "_parse_job", _cannot_read)
    with pytest.raises(TraceError, match="every worker must see the run's traces at the same path"):
        load_run(tiny_run, progress=False, scheduler=scheduler)


@pytest.mark.slow
@needs_dask
def test_an_unreachable_scheduler_is_named_in_one_line(tiny_run, monkeypatch):
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    result = invoke("analyze", tiny_run, "--scheduler", address)
    assert result.exit_code == 1 and result.stdout == ""
    assert f"cannot reach the Dask scheduler at {address}" in result.stderr
    result = invoke("analyze", tiny_run, "--scheduler", "no-port")
    assert result.exit_code == 1 and "cannot reach the Dask scheduler at no-port" in result.stderr


@pytest.mark.slow
@needs_dask
def test_a_scheduler_without_workers_is_an_error(tiny_run, monkeypatch):
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 1)
    with _local_cluster(0) as empty:
        result = invoke("analyze", tiny_run, "--scheduler", empty.scheduler_address)
    assert result.exit_code == 1 and result.stdout == ""
    assert f"the Dask scheduler at {empty.scheduler_address} has no worker" in result.stderr


def test_without_dask_the_options_say_how_to_install_it(tiny_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # what an install without it gives
    for options in (("--workers", 2), ("--scheduler", "tcp://127.0.0.1:8786")):
        result = invoke("analyze", tiny_run, *options)
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr.strip() == f"Error: {cluster.INSTALL_HINT}"
    cold(tiny_run)
    with pytest.raises(TraceError, match=r"pip install 'pptrace\[distributed\]'"):
        load_run(tiny_run, progress=False, scheduler=cluster.LOCAL, workers=2)


def test_workers_and_scheduler_together_are_refused(tiny_run):
    result = invoke("analyze", tiny_run, "--workers", 2, "--scheduler", "tcp://127.0.0.1:8786")
    assert result.exit_code == 2
    assert "give one of them" in result.stderr


# -- a cluster started as on a cluster: `dask scheduler` and `dask worker` processes ------------
#: pptrace as a user runs it, with the connect timeout shrunk so that a failure costs seconds
PPTRACE = "import sys; from pptrace.ingest import cluster; cluster.CONNECT_TIMEOUT_S = 1; " \
          "from pptrace.cli import cli; sys.argv[0] = 'pptrace'; cli()"


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """The address of a `dask scheduler` with two `dask worker`s, all separate processes."""
    with CliCluster(2, tmp_path_factory.mktemp("cli-cluster")) as running:
        yield running.address


def pptrace_command(*args, cwd: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """``pptrace ARGS`` in a fresh process (cluster.CONNECT_TIMEOUT_S = 1) -> (result, seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PPTRACE_PROGRESS": "1"}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PPTRACE, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done, time.perf_counter() - t


@pytest.fixture
def warned_run(tmp_path):
    """A pp=2 x dp=2 run one of whose traces holds an event twice: its document carries a
    warning that names the trace's path."""
    traces, _ = pipeline_traces(pp=2, dp=2)
    twice = next(e for e in traces[1].events if e.get("dur", 0) > 0)
    traces[1].events.append(dict(twice))
    return write_run(tmp_path / "run", traces)


@pytest.mark.slow
@needs_dask
def test_a_dask_cli_cluster_gives_the_in_process_document(cli_cluster, warned_run, monkeypatch):
    """RUN as a user on the cluster's login node types it, relative to where they stand; the
    workers stand elsewhere: the document is the in-process one, the warning naming the trace
    as the user named it."""
    monkeypatch.chdir(warned_run.parent)
    expected = document("analyze", "run", "--json")
    assert any(w.startswith("run/traces/rank1.json.gz: 1 event recorded twice") for w in expected["warnings"])
    cold(warned_run)
    done, _ = pptrace_command("analyze", "run", "--json", "--scheduler", cli_cluster, cwd=warned_run.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == expected
    assert f"loading traces on Dask at {cli_cluster} 4/4" in done.stderr  # parsed there, not read from the cache
    assert len(entries(warned_run)) == 4  # the workers filled the cache beside the traces


def _silent_listener(server: socket.socket) -> None:
    """Accepts and never answers (the kernel queues the connections)."""
    server.listen()


def _http_listener(server: socket.socket) -> None:
    """Answers anything as an HTTP server does (the dashboard's port), then hangs up."""
    server.listen()

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()


@pytest.mark.slow
@needs_dask
@pytest.mark.parametrize("peer, why", [
    (None, "Timed out trying to connect"),  # nothing listens
    (_silent_listener, "no answer within 2 s"),  # Dask's own Client waits for ever on it
    (_http_listener, "it answered, but not as a Dask scheduler"),  # Dask's: a MemoryError of exabytes
    ("worker", "it answered as a Dask Worker, not a scheduler"),
])
def test_a_scheduler_not_reachable_is_one_line_within_the_timeout(cli_cluster, tiny_run, peer, why):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        if peer == "worker":
            import distributed

            with distributed.Client(cli_cluster, timeout=10, set_as_default=False) as client:
                address = next(iter(client.scheduler_info()["workers"]))
        elif peer is not None:
            peer(server)
        if peer is None:
            server.close()  # the port stays free: connections to it are refused
        done, seconds = pptrace_command("analyze", tiny_run, "--json", "--scheduler", address, cwd=tiny_run)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"Error: cannot reach the Dask scheduler at {address} ("), lines
    assert why in lines[-1] and lines[-1].endswith("and that the scheduler runs")
    assert all(line.startswith("pptrace: ") for line in lines[:-1]), lines  # progress, then that line only
    assert seconds < 2 + 8, seconds  # the timeout, plus a fresh process's imports on a loaded box


def _hides(directory: Path) -> list | None:
    """A command prefix that runs what follows in a mount namespace of its own where
    ``directory`` is an empty tmpfs (a machine that does not see the run there), or None where
    this system allows no such namespace (unprivileged user namespaces off, as some CI
    runners have them)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
              'mount -t tmpfs tmpfs "$0" && exec "$@"', str(directory)]
    probe = subprocess.run([*prefix, "test", "!", "-e", str(directory / "run")], capture_output=True)
    return prefix if probe.returncode == 0 else None


@pytest.mark.slow
@needs_dask
def test_a_worker_that_does_not_see_the_run_names_the_path(tmp_path_factory, tmp_path):
    """A real `dask worker` to which the run's directory is an empty one (its own mount
    namespace): the command stops in one line naming the path and what to do, no report."""
    shared = tmp_path / "shared"
    run = pipeline_run(shared / "run", pp=2, dp=1)[0]
    prefix = _hides(shared)
    if prefix is None:
        pytest.skip("no unprivileged mount namespaces here (unshare --user --mount refused)")
    with CliCluster(1, tmp_path_factory.mktemp("blind-cluster"), worker_prefix=prefix) as blind:
        address = blind.address
        done, _ = pptrace_command("analyze", run, "--json", "--scheduler", address, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    error = done.stderr.strip().splitlines()[-1]
    assert re.match(rf"Error: cannot read {re.escape(str(run / 'traces'))}/rank[01]\.json\.gz: No such file or "
                    "directory", error), error
    assert f"on a Dask worker of {address}, while this machine reads it" in error
    assert f"every worker must see the run's traces at the same path ({run / 'traces'}:" in error
    assert error.endswith("no report written")
