"""A toy 2-stage GPipe pipeline on real gloo processes, instrumented like the trainer.

Layout pp=2 x dp=2 (4 ranks, Megatron order tp-cp-dp-pp: stage 0 = ranks 0,1; stage 1 =
ranks 2,3). Compute is a sleep so that the traces have known durations. Every step ends
with the global grad-norm all-reduce over all ranks, as the reference trainer does.

    python -m tests.toy_pipeline OUT_DIR [--world 4] [--microbatches 3] [--steps 3]

The run directory then holds ``OUT_DIR/traces/rank{r}.json.gz`` for profiled steps 1-2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

FWD_S = 0.004
BWD_S = 0.006
ACT_NUMEL = 2048  # float32 -> 8192 bytes per activation message


def _pass(direction: str, mb: int, recv_from, send_to, seconds: float, act) -> None:
    """One microbatch through this stage: receive, compute (a sleep), send on."""
    import torch.distributed as dist

    from pptrace import region

    nbytes = act.numel() * act.element_size()
    if recv_from is not None:
        with region(f"pp:recv_{direction}", peer=recv_from, mb=mb, bytes=nbytes):
            dist.recv(act, src=recv_from)
    with region(f"compute:{direction}", mb=mb):
        time.sleep(seconds)
    if send_to is not None:
        with region(f"pp:send_{direction}", peer=send_to, mb=mb, bytes=nbytes):
            dist.send(act, dst=send_to)


def _worker(rank: int, world: int, out_dir: str, microbatches: int, steps: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    import pptrace
    from pptrace import region

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    layout = pptrace.Layout(pp=2, dp=world // 2)
    dp_group = None
    for ranks in layout.groups("dp"):
        group = dist.new_group(ranks)  # every rank must create every group
        if rank in ranks:
            dp_group = group
    nxt, prv = layout.pipeline_next_rank(rank), layout.pipeline_prev_rank(rank)
    act = torch.ones(ACT_NUMEL)
    grad = torch.ones(4096)

    with pptrace.profile(
        out_dir, steps=f"1-{steps - 1}", layout=layout, schedule="gpipe", microbatches=microbatches
    ) as prof:
        for _ in range(steps):
            # GPipe: all forwards, then the backwards in the same microbatch order
            for mb in range(microbatches):
                _pass("fwd", mb, prv, nxt, FWD_S, act)
            for mb in range(microbatches):
                _pass("bwd", mb, nxt, prv, BWD_S, act)
            with region("dp:all_reduce", bucket=0, bytes=grad.numel() * 4):
                work = dist.all_reduce(grad, group=dp_group, async_op=True)
            with region("dp:wait", op="all_reduce", bucket=0):
                work.wait()
            norm = torch.zeros(1)
            with region("dp:all_reduce", what="grad_norm", bytes=4):
                dist.all_reduce(norm)
            with region("compute:optimizer"):
                time.sleep(0.001)
            prof.step()
    dist.destroy_process_group()


def run(out_dir, world: int = 4, microbatches: int = 3, steps: int = 3) -> Path:
    """Spawn ``world`` gloo ranks and return the run directory."""
    import torch.multiprocessing as mp

    if world % 2:
        raise ValueError(f"world {world} must be even (pp=2)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from instrumented_model.train import start_method

    mp.start_processes(_worker, args=(world, str(out), microbatches, steps), nprocs=world, join=True,
                       start_method=start_method())
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    t0 = time.time()
    run(args.out_dir, args.world, args.microbatches, args.steps)
    print(f"wrote {args.out_dir}/traces in {time.time() - t0:.1f}s", file=sys.stderr)
