"""Fixtures for the ingestion tests (load, align, match, merge, bad input)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pptrace.topology import Layout
from tracegen import STAGE0, STAGE1, run_from_docs, trace_doc

#: Real GPU traces recorded elsewhere (HTA's test data, MIT; see the README there), copied
#: from ../shared/fixtures/hta-gpu so the suite does not depend on files beside the checkout.
FIXTURES = Path(__file__).parent / "data" / "hta-gpu"


@pytest.fixture(scope="session")
def hta_fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def sleep_run(tmp_path_factory):
    """name -> the directory of that shared sleep-mode trainer run (sleep_runs.RUNS), made
    once a session, on first use."""
    import sleep_runs

    made: dict = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = sleep_runs.make(tmp_path_factory.mktemp(name) / "run", name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def gloo_run(tmp_path_factory) -> Path:
    """A real 4-rank gloo run of the toy pipeline (pp=2 x dp=2, 4 microbatches, steps 1-8).
    Eight profiled steps give alignment enough collectives to be tight on a busy host."""
    from toy_pipeline import run

    out = tmp_path_factory.mktemp("gloo") / "run"
    run(out, world=4, microbatches=4, steps=9)
    return out


@pytest.fixture
def gloo_copy(gloo_run, tmp_path) -> Path:
    """A private copy of the gloo run's traces (tests may rewrite or add files)."""
    dst = tmp_path / "run"
    shutil.copytree(gloo_run / "traces", dst / "traces", ignore=shutil.ignore_patterns(".pptrace-cache"))
    return dst


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory) -> Path:
    """A real run of the reference trainer: pp=2 x dp=2, 1F1B, sleep compute, steps 1-2."""
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("trainer") / "run"
    cmd = [sys.executable, "-m", "instrumented_model.train", "--pp", "2", "--dp", "2", "--microbatches", "4",
           "--compute", "sleep", "--fwd-ms", "5", "--bwd-ms", "10", "--steps", "3", "--profile-steps", "1-2",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(cmd, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def recorder(tmp_path_factory) -> Path:
    """The NVTX injection library (tests/nvtx/nvtx_recorder.c) built with gcc: loaded through
    NVTX_INJECTION64_PATH, it logs every NVTX range a process emits."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NVTX injection library")
    lib = tmp_path_factory.mktemp("nvtx") / "libnvtx_recorder.so"
    source = Path(__file__).parent / "nvtx" / "nvtx_recorder.c"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(lib), str(source), "-lpthread"],
                   check=True)
    return lib


@pytest.fixture
def pipeline_view(tmp_path):
    """The hand-built 2-stage pipeline of tracegen.STAGE0/STAGE1 (every number known)."""
    layout = Layout(pp=2)
    return run_from_docs(tmp_path, {0: trace_doc(0, 2, STAGE0, layout=layout), 1: trace_doc(1, 2, STAGE1, layout=layout)},
                         layout, schedule="1f1b", microbatches=2)
