"""The `pptrace` command's choices of memory (pptrace/ingest/memory.py): Arrow's pool and
numpy's pages, in fresh interpreters (both are fixed when the library is first imported)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

POOL = ("import pptrace.cli, pyarrow, pandas; "
        "from pptrace.ingest import memory; memory.release(); print(pyarrow.default_memory_pool().backend_name)")


def _fresh(code: str, variable: str, value: str | None) -> str:
    """What ``code`` prints in a fresh interpreter with ``variable`` set to ``value`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _pool(env_pool: str | None, code: str = POOL) -> str:
    return _fresh(code, "ARROW_DEFAULT_MEMORY_POOL", env_pool)


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


HUGE = "import numpy; print(numpy._core.multiarray._get_madvise_hugepage())"


def _hugepages(code: str, env_value: str | None = None) -> str:
    return _fresh(code, "NUMPY_MADVISE_HUGEPAGE", env_value)


def test_the_cli_keeps_numpy_off_huge_pages_unless_the_user_chose():
    """(prefer_small_pages: faults on fresh huge pages cost the cached 1,024-rank analysis
    ~15% on the benchmark's machine.) Numpy alone asks for them on Linux; the CLI does not,
    a user's NUMPY_MADVISE_HUGEPAGE stands, and the library alone changes nothing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("numpy asks for huge pages on Linux only")
    assert _hugepages(HUGE) == "True"
    assert _hugepages("import pptrace.cli; " + HUGE) == "False"
    assert _hugepages("import pptrace.cli; " + HUGE, "1") == "True"
    assert _hugepages("import pptrace.run; " + HUGE) == "True"


# bytes in mmapped blocks after a 64 MB array is made: glibc's mallinfo2().hblkhd
MMAPPED = """import ctypes, numpy
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
block = numpy.ones(64 << 20, numpy.uint8)
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
print(mallinfo2().hblkhd >= 64 << 20)"""


def test_the_cli_takes_large_blocks_from_the_heap_unless_the_user_chose():
    """(prefer_heap_for_large_blocks: a fresh mmap per large column, faulted in page by page,
    cost the 128 x 150 MB analysis a third of its time.) glibc alone maps a 64 MB block; under
    the CLI it comes from the heap once the loader assembles (not before: its forked parse
    workers keep the default); a user's MALLOC_MMAP_THRESHOLD_ stands; the library alone
    changes nothing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc")
    try:
        import ctypes

        ctypes.CDLL(None).mallinfo2
    except AttributeError:
        pytest.skip("no glibc >= 2.33 (mallinfo2)")
    assembled = "from pptrace.ingest import memory; memory.large_blocks_on_heap()\n"  # as the loader does
    assert _fresh(MMAPPED, "MALLOC_MMAP_THRESHOLD_", None) == "True"
    assert _fresh("import pptrace.cli\n" + MMAPPED, "MALLOC_MMAP_THRESHOLD_", None) == "True"  # not before the parse
    assert _fresh("import pptrace.cli\n" + assembled + MMAPPED, "MALLOC_MMAP_THRESHOLD_", None) == "False"
    assert _fresh("import pptrace.cli\n" + assembled + MMAPPED, "MALLOC_MMAP_THRESHOLD_", str(1 << 20)) == "True"
    assert _fresh(assembled + MMAPPED, "MALLOC_MMAP_THRESHOLD_", None) == "True"
