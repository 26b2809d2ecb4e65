"""Loading a run's ranks on Dask: ``--workers N`` (a local cluster of N processes, started for
the load and closed after it) or ``--scheduler ADDRESS`` (an existing cluster whose workers
see the run at the same path as this machine). Needs ``pip install 'pptrace[distributed]'``.

Map: each trace file not in the cache is one task, the job that parses it in process
(load._parse_job), run by a worker; what comes back per rank is small: its events table
compressed (or the path of the cache entry the worker wrote, on a local cluster) and its
meta. A worker is given each trace's absolute path (it runs in a directory of its own), and
what it says of the trace names it as the user did. Exchange and reduce (matching the ranks'
p2p and collectives, aligning their clocks, the report) happen here, on the assembled run,
exactly as without Dask: the document is the same. A task whose worker dies is run again by
Dask (``distributed.scheduler.allowed-failures`` times); one that keeps killing its workers
ends the load with a TraceError, never a report without that rank.
"""
from __future__ import annotations

import logging
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..errors import TraceError
from .columnar import StoredTable

#: load_ranks' ``scheduler`` for a cluster of ``workers`` processes on this machine.
LOCAL = "local"
INSTALL_HINT = "--workers/--scheduler need Dask: pip install 'pptrace[distributed]'"
#: How long to wait for a scheduler to answer, and for it to have a worker.
CONNECT_TIMEOUT_S = 10


def require():
    """The ``distributed`` module, or a TraceError saying how to install it."""
    try:
        import distributed
    except ImportError:
        raise TraceError(INSTALL_HINT) from None
    return distributed


def describe(scheduler: str, workers: int | None = None) -> str:
    if scheduler != LOCAL:
        return f"Dask at {scheduler}"
    return f"{workers} local Dask workers" if workers else "local Dask workers"


@contextmanager
def _quiet_logs():
    """Dask logs a worker's death, each retry and a lost connection at WARNING/ERROR, some
    with tracebacks; pptrace reports the outcome in one line instead (PPTRACE_DEBUG=1 keeps
    Dask's own lines). Its loggers (distributed.client has a level of its own) all reach the
    handlers of the ``distributed`` logger: those are raised for the load."""
    level = logging.WARNING if os.environ.get("PPTRACE_DEBUG") else logging.CRITICAL
    handlers = [(h, h.level) for h in logging.getLogger("distributed").handlers]
    for handler, old in handlers:
        handler.setLevel(max(level, old))
    try:
        yield level
    finally:
        for handler, old in handlers:
            handler.setLevel(old)


@contextmanager
def client(scheduler: str, workers: int | None = None):
    """A ``distributed.Client``: of a new local cluster of ``workers`` processes (one thread
    each, on the loopback) when ``scheduler`` is LOCAL, else of the scheduler
    at that address. Closed, with its cluster, on exit."""
    distributed = require()
    with _quiet_logs() as level:
        if scheduler == LOCAL:
            n = max(1, int(workers or os.cpu_count() or 1))
            import dask

            # Dask's MALLOC_TRIM_THRESHOLD_ for workers hands freed memory back at once, which
            # costs parsing ~25% more CPU (r8's 8 ranks: 5.2 s of task CPU, 4.1 s without):
            # these workers live for one load. The scheduler serves HTTP whatever its
            # dashboard: on a free port, not on a 8787 another cluster may hold.
            environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
            environ.pop("MALLOC_TRIM_THRESHOLD_", None)
            with dask.config.set({"distributed.nanny.pre-spawn-environ": environ}):
                cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                                   host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                                   silence_logs=level)
            try:
                with distributed.Client(cluster, set_as_default=False) as dask_client:
                    yield dask_client
            finally:
                cluster.close()
            return
        try:
            # a malformed address first: a Client made of one fails and then hangs at exit
            distributed.comm.resolve_address(scheduler)
            _ask_scheduler(scheduler)
            dask_client = distributed.Client(scheduler, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        except (OSError, TimeoutError, ValueError, TypeError) as exc:
            raise TraceError(f"cannot reach the Dask scheduler at {scheduler} ({_one_line(exc)}); check the "
                             "address (tcp://HOST:8786, the scheduler's port, not its dashboard's) and that the "
                             "scheduler runs") from None
        with dask_client:
            try:
                dask_client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                raise TraceError(f"the Dask scheduler at {scheduler} has no worker (none joined within "
                                 f"{CONNECT_TIMEOUT_S} s); start some with `dask worker {scheduler}`") from None
            yield dask_client


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def _identity(address: str, connection_args: dict):
    from distributed.comm import connect

    comm = await connect(address, timeout=CONNECT_TIMEOUT_S, **connection_args)
    try:
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def _ask_scheduler(address: str) -> None:
    """Raise OSError unless a Dask scheduler answers at ``address`` within CONNECT_TIMEOUT_S
    (+1 s for its answer). distributed.Client cannot be trusted with that: its connect retries
    for its timeout but then awaits the peer's handshake with none, so a port that accepts and
    never answers hangs it for good, and one that answers something else (an HTTP server: the
    dashboard's port) fails with whatever those bytes decode to (a MemoryError of exabytes).
    Asked on a thread of its own: the caller's thread may already run an event loop (a notebook)."""
    import asyncio
    import threading

    from distributed.security import Security

    connection_args = Security().get_connection_args("client")
    # a second beyond connect's own timeout: a port that refuses for that long is said as such
    deadline = CONNECT_TIMEOUT_S + 1
    box: dict = {}

    def ask():
        try:
            box["reply"] = asyncio.run(asyncio.wait_for(_identity(address, connection_args), deadline))
        except (TimeoutError, asyncio.TimeoutError):  # before OSError: TimeoutError is one
            box["error"] = f"no answer within {deadline} s"
        except OSError as exc:
            box["error"] = _one_line(exc)
        except Exception:  # noqa: BLE001 - the peer's bytes decoded as Dask's protocol: anything
            box["error"] = "it answered, but not as a Dask scheduler"

    thread = threading.Thread(target=ask, name="pptrace-dask-probe", daemon=True)
    thread.start()
    thread.join(deadline + 5)
    if thread.is_alive():
        raise OSError(f"no answer within {deadline} s")
    if "error" in box:
        raise OSError(box["error"])
    reply = box["reply"]
    kind = reply.get("type") if isinstance(reply, dict) else None
    if kind != "Scheduler":
        raise OSError(f"it answered as a Dask {kind}, not a scheduler" if isinstance(kind, str)
                      else "it answered, but not as a Dask scheduler")


def _on_worker(job, args: tuple, pack: bool):
    """``job(*args)`` on a worker; with ``pack``, a table the worker put in its cache comes
    back as the entry's bytes (an Arrow IPC file like StoredTable.pack's): that path may not
    exist, or be another file, on the machine that assembles the run."""
    stored, meta, error = job(*args)
    if pack and stored is not None and stored.path is not None:
        stored = StoredTable(stored.num_rows, ipc=Path(stored.path).read_bytes())
    return stored, meta, error


def map_jobs(scheduler: str, workers: int | None, job, calls: dict, on_done) -> None:
    """Run ``job(*args)`` (the loader's parse of one trace, load._parse_job) for each
    ``index -> args`` of ``calls`` on Dask (see :func:`client`), calling ``on_done(index,
    outcome)`` in this process as each finishes. Raises TraceError if a job cannot be run (its
    workers died, the scheduler went away, the worker lacks pptrace or cannot read the trace):
    a report then would miss that rank."""
    distributed = require()
    pack = scheduler != LOCAL  # a remote worker's cache entry is not this machine's file
    token = uuid.uuid4().hex[:8]
    with client(scheduler, workers) as dask_client:
        # a worker runs in a directory of its own: a relative RUN means nothing there
        absolute = {i: os.path.abspath(args[0]) for i, args in calls.items()}
        futures = {
            dask_client.submit(_on_worker, job, (absolute[i], *args[1:]), pack, pure=False,
                               key=f"pptrace-load-rank{args[1]}-{token}-{i}"): i
            for i, args in calls.items()
        }
        try:
            for future in distributed.as_completed(futures, loop=dask_client.loop):
                index = futures[future]
                try:
                    outcome = future.result()
                except Exception as exc:
                    raise _job_failed(calls[index], exc, scheduler) from None
                future.release()
                outcome = _as_given(outcome, absolute[index], calls[index][0])
                on_done(index, _checked(outcome, calls[index], scheduler))
        except BaseException:
            dask_client.cancel(list(futures))  # a remote cluster's other tasks: no one awaits them
            raise


def _job_failed(args: tuple, exc: Exception, scheduler: str) -> TraceError:
    from concurrent.futures import CancelledError

    from distributed.scheduler import KilledWorker

    path, rank = args[0], args[1]
    if isinstance(exc, KilledWorker):
        deaths = getattr(exc, "allowed_failures", None)
        times = f" {deaths + 1} times" if isinstance(deaths, int) else ""
        return TraceError(f"rank {rank} ({path}): the Dask worker running it died{times} (out of memory? "
                          "killed?); no report written")
    if isinstance(exc, (OSError, CancelledError)):  # the scheduler went away (CommClosedError, ...)
        return TraceError(f"rank {rank} ({path}): lost the Dask scheduler at {scheduler} "
                          f"({type(exc).__name__}: {_one_line(exc)}); no report written")
    return TraceError(f"rank {rank} ({path}): its Dask task failed ({type(exc).__name__}: "
                      f"{_one_line(exc)}); every worker needs pptrace installed, and the run at "
                      "the same path; no report written")


def _as_given(outcome, absolute: str, given: str):
    """The worker's outcome for ``absolute``, naming the trace as the user gave it (the
    report names it as it does without Dask)."""
    stored, meta, error = outcome
    if absolute == given:
        return outcome
    if meta is not None:
        meta = {**meta, "path": given,
                "warnings": [w.replace(absolute, given) for w in meta.get("warnings") or ()]}
    return stored, meta, error.replace(absolute, given) if error is not None else None


def _checked(outcome, args: tuple, scheduler: str):
    """A worker that cannot read a trace this machine can read does not see the run where
    this machine does: an error of the cluster's setup, not a rank to skip."""
    path = args[0]
    error = outcome[2]
    if error is not None and error.startswith(f"cannot read {path}") and os.access(path, os.R_OK):
        where = "" if scheduler == LOCAL else f" of {scheduler}"
        run = os.path.dirname(os.path.abspath(path))
        raise TraceError(f"{error} (on a Dask worker{where}, while this machine reads it); every worker must "
                         f"see the run's traces at the same path ({run}: a shared file system mounted there, or "
                         "a copy); no report written")
    return outcome
