"""Giving freed memory back to the operating system, so that a run's peak RSS is its live
data and not what the allocators kept from parsing earlier ranks.

Two allocators keep freed memory by design. Arrow's default pool (mimalloc) caches it for
reuse: under `pptrace analyze` on an 8-rank trainer run (benchmarks/bench_analyze.py) it
held 40-55 MB more at the peak than the system allocator, at no gain in speed, so the CLI
selects the system pool (:func:`prefer_system_arrow_pool`, before pyarrow is imported: a
pool chosen later leaves mimalloc's arenas initialised). glibc's malloc keeps the freed
heap a rank's parse used (~20 MB per 65 MB trace) until ``malloc_trim`` is called, which
:func:`release` does after each rank and after the run's table is assembled. Both are
what Dask's workers do for the same reason (``distributed.worker_memory``). The CLI also
keeps numpy's arrays on small pages (:func:`prefer_small_pages`) and large blocks on the heap
(:func:`prefer_heap_for_large_blocks`).
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys


def prefer_system_arrow_pool() -> None:
    """Make the system allocator Arrow's default pool in this process (and the processes it
    starts), unless the user chose one (ARROW_DEFAULT_MEMORY_POOL) or pyarrow is loaded."""
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


def prefer_small_pages() -> None:
    """Keep numpy from asking for transparent huge pages for its arrays in this process (and
    the processes it starts), unless the user said (NUMPY_MADVISE_HUGEPAGE) or numpy is
    loaded. Where the kernel defragments on fault for regions that ask (THP ``defrag``
    ``madvise``, a common default), a first touch of a fresh huge page can wait on compaction:
    on a 2-core machine of the benchmark's kind, cached ``pptrace analyze`` of the 1,024-rank
    run took 7.0-7.7 s without against 8.1-8.9 s with (6 runs each, interleaved), same peak;
    most of a run's arrays are written once, so fewer TLB misses later do not pay it back."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")


#: glibc's mallopt parameter, and the size up to which blocks come from the heap under the CLI
M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO = -3, 1 << 30


_heap_wanted = False


def prefer_heap_for_large_blocks() -> None:
    """Have :func:`large_blocks_on_heap` let glibc's malloc serve blocks up to
    HEAP_BLOCKS_UP_TO from its heap in this process, unless the user chose
    (MALLOC_MMAP_THRESHOLD_). By default a block over 32 MB (a column of a few million rows) is
    a fresh mmap, faulted in page by page when written and unmapped when freed, and the
    analysis makes many: on the benchmark's 2-core machine, cached ``pptrace analyze`` of the
    128 x 150 MB MoE-sized run took 33 s against 41-44 s (its analysis 12.8 against 22-23 s),
    of the 1,024-rank run 5.5-6.2 s against 6.9-7.3 s, for ~7% more peak (heap pages stay with
    the process until :func:`release` trims them)."""
    global _heap_wanted
    _heap_wanted = "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform.startswith("linux")


def large_blocks_on_heap() -> None:
    """What :func:`prefer_heap_for_large_blocks` chose, from now on in this process: the
    loader calls it once its parse workers are done, so that they (forked: they would inherit
    it) keep malloc's default, under which the trainer run's parse peaked 7 MB lower."""
    if _heap_wanted:
        try:
            ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO)
        except (OSError, AttributeError):  # not glibc
            pass


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        # the C library this process already has (dlopen(NULL)): find_library would run
        # ldconfig in a subprocess, in every worker that trims
        return ctypes.CDLL(None).malloc_trim  # glibc only; musl has none
    except (OSError, AttributeError):
        return None


def release() -> None:
    """Return the heap's free pages and Arrow's cached blocks to the OS (a few ms)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    if "pyarrow" in sys.modules:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
