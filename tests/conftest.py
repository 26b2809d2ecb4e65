"""Fixtures the suite shares: recorded runs (each made once a session on first use), hand-built
runs, and a real headless Chromium for the pages."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import box
from pptrace.topology import Layout
from tracegen import STAGE0, STAGE1, run_from_docs, trace_doc

CHROMIUM = "/usr/bin/chromium"
#: no network, no background services: a page that needed one would fail to render
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]

#: Real GPU traces recorded elsewhere (HTA's test data, MIT; see the README there), copied
#: from ../shared/fixtures/hta-gpu so the suite does not depend on files beside the checkout.
FIXTURES = Path(__file__).parent / "data" / "hta-gpu"


@pytest.fixture(scope="session")
def hta_fixtures() -> Path:
    return FIXTURES


def _workers_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/, above each worker's popen-gwK/
    return root


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, its fixtures' setup and teardown included, holds the box shared with the
    other worker's tests; a sleep-mode recording takes it alone (tests/box.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not box.ready():
        # pytest's own tmp_path_factory fixture is this object; a hook cannot request fixtures
        box.use(_workers_root(item.config._tmp_path_factory) / "box")
    with box.shared():
        yield


def shared_run(tmp_path_factory, name: str, make) -> Path:
    """``make(out)`` once per test session, whatever the number of pytest-xdist workers: in
    the directory the workers share, under a file lock, marked done only once it returned
    (a worker that died half-way leaves it to be made again), with the box to itself
    (box.alone: the shared runs are the suite's timing ground truth). -> ``out``."""
    from filelock import FileLock

    home = _workers_root(tmp_path_factory) / "shared" / name
    home.parent.mkdir(parents=True, exist_ok=True)
    with box.stepped_aside(), FileLock(str(home) + ".lock"):
        done = home.parent / f"{name}.done"
        if not done.exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            with box.alone():
                make(home / "run")
            done.touch()
    return home / "run"


@pytest.fixture(scope="session")
def sleep_run(tmp_path_factory):
    """name -> the directory of that shared sleep-mode trainer run (sleep_runs.RUNS), made
    once a session, on first use."""
    import sleep_runs

    return lambda name: shared_run(tmp_path_factory, f"sleep-{name}", lambda out: sleep_runs.make(out, name))


@pytest.fixture(scope="session")
def ep_run(tmp_path_factory):
    """name -> the directory of that shared MoE sleep-mode trainer run (ep_runs.RUNS), made
    once a session, on first use."""
    import ep_runs

    return lambda name: shared_run(tmp_path_factory, name, lambda out: ep_runs.train(out, ep_runs.RUNS[name]))


@pytest.fixture(scope="session")
def gloo_run(tmp_path_factory) -> Path:
    """A real 4-rank gloo run of the toy pipeline (pp=2 x dp=2, 4 microbatches, steps 1-8).
    Eight profiled steps give alignment enough collectives to be tight on a busy host."""
    from toy_pipeline import run

    return shared_run(tmp_path_factory, "gloo", lambda out: run(out, world=4, microbatches=4, steps=9))


@pytest.fixture
def gloo_copy(gloo_run, tmp_path) -> Path:
    """A private copy of the gloo run's traces (tests may rewrite or add files)."""
    dst = tmp_path / "run"
    shutil.copytree(gloo_run / "traces", dst / "traces", ignore=shutil.ignore_patterns(".pptrace-cache"))
    return dst


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory) -> Path:
    """A real run of the reference trainer: pp=2 x dp=2, 1F1B, sleep compute, steps 1-2."""
    import sys

    def make(out: Path) -> None:
        cmd = [sys.executable, "-m", "instrumented_model.train", "--pp", "2", "--dp", "2", "--microbatches", "4",
               "--compute", "sleep", "--fwd-ms", "5", "--bwd-ms", "10", "--steps", "3", "--profile-steps", "1-2",
               "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        done = subprocess.run(cmd, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    return shared_run(tmp_path_factory, "trainer", make)


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
def scenario_run(tmp_path):
    """The hand-built 2-stage pipeline of tracegen.STAGE0/STAGE1 (every number known)."""
    layout = Layout(pp=2)
    return run_from_docs(tmp_path, {0: trace_doc(0, 2, STAGE0, layout=layout), 1: trace_doc(1, 2, STAGE1, layout=layout)},
                         layout, schedule="1f1b", microbatches=2)


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, headless, driven by Playwright (skipped with the reason where either
    is missing)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - depends on the machine
        pytest.skip("python playwright is not installed (pip install playwright)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} missing (apt-get install -y chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()
