"""Run a function on N real gloo processes (file:// rendezvous, loopback, one thread each).

``run_gloo(world_size, fn, *args)`` spawns the ranks, initialises ``torch.distributed`` in
each, calls ``fn(*args)`` there (``fn`` reads ``dist.get_rank()``), and returns the results
in rank order. ``fn`` and its results must be picklable; ``fn`` must live at module level.
A failure on any rank raises with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback


def _worker(rank, world_size, store_dir, fn, args, results):
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_dir}/store",
            rank=rank,
            world_size=world_size,
        )
        try:
            # Plain pickle: tensors travel by value, not through shared-memory handles that
            # die with this process.
            results.put((rank, True, pickle.dumps(fn(*args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent needs every failure
        results.put((rank, False, traceback.format_exc()))


def run_gloo(world_size: int, fn, *args, timeout: float = 120):
    """``[fn(*args) on rank 0, ..., on rank world_size-1]``."""
    from instrumented_model.train import start_method

    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gloo-") as store_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_dir, fn, args, results), daemon=True)
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        out, errors = {}, []
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"run_gloo({world_size}, {fn.__name__}): ranks {sorted(set(range(world_size)) - set(out))} "
                        f"did not finish within {timeout} s"
                    )
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    if errors or any(p.exitcode not in (None, 0) for p in procs):
                        if not errors:
                            errors.append((-1, "a rank died without reporting"))
                        break
                    continue
                if ok:
                    out[rank] = pickle.loads(payload)
                else:
                    errors.append((rank, payload))
                    break  # the other ranks are probably stuck in a collective now
        finally:
            for proc in procs:
                proc.join(timeout=5 if not errors else 0.1)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if errors:
            rank, text = errors[0]
            raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{text}")
    return [out[r] for r in range(world_size)]


def cases_by_world(cases: dict) -> dict:
    """{case name: fn's kwargs with its "world"} -> world size -> {case name: kwargs}."""
    worlds: dict = {}
    for name, case in cases.items():
        worlds.setdefault(case["world"], {})[name] = {k: v for k, v in case.items() if k != "world"}
    return worlds


def _each_case(fn, cases: list[dict]) -> list:
    return [fn(case) for case in cases]


def run_case_worlds(fn, worlds: dict, trace_root, timeout: float = 240) -> dict:
    """``worlds``: world size -> {case name: kwargs}; each world's cases run one after
    another in one set of gloo ranks (one start-up per world, not per case), ``fn(case)`` on
    every rank (a module-level function: the ranks import it), a case's ``profile`` naming
    its trace directory under ``trace_root``. -> case name -> [result of each rank], and
    "trace_root"."""
    out = {}
    for world, cases in worlds.items():
        todo = []
        for case in cases.values():
            case = dict(case)
            if case.get("profile"):
                case["profile_dir"] = str(trace_root / case.pop("profile"))
            todo.append(case)
        per_rank = run_gloo(world, _each_case, fn, todo, timeout=timeout)
        for i, name in enumerate(cases):
            out[name] = [per_rank[r][i] for r in range(world)]
    out["trace_root"] = trace_root
    return out
