"""The `pptrace` command's choice of Arrow memory pool (pptrace/ingest/memory.py), in fresh
interpreters: the pool is fixed when pyarrow is first imported."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

POOL = ("import pptrace.cli, pyarrow, pandas; "
        "from pptrace.ingest import memory; memory.release(); print(pyarrow.default_memory_pool().backend_name)")


def _pool(env_pool: str | None, code: str = POOL) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if env_pool is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = env_pool
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_cli_uses_the_system_allocator():
    assert _pool(None) == "system"


def test_a_pool_the_user_chose_stands():
    import pyarrow as pa

    if "jemalloc" not in pa.supported_memory_backends():
        pytest.skip("this pyarrow has no jemalloc")
    assert _pool("jemalloc") == "jemalloc"


def test_the_library_alone_leaves_the_pool_alone():
    """Importing the loader (not the CLI) must not change a user's process."""
    code = "import pptrace.run, pyarrow; print(pyarrow.default_memory_pool().backend_name)"
    default = _pool(None, "import pyarrow; print(pyarrow.default_memory_pool().backend_name)")
    assert _pool(None, code) == default
