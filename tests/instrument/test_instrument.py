"""profile() + region() in real gloo processes, and region's behaviour in one process."""
import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pptrace
from pptrace.instrument import parse_steps

WORKER = textwrap.dedent(
    """
    import faulthandler; faulthandler.enable()  # a crash shows where it happened
    import os, sys, torch, torch.distributed as dist
    import pptrace
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    layout = pptrace.Layout(pp=world)
    with pptrace.profile(out, steps="1-2", layout=layout, schedule="1f1b", microbatches=2) as prof:
        for step in range(4):
            x = torch.full((64,), float(rank))
            for mb in range(2):
                with pptrace.region("compute:fwd", mb=mb):
                    torch.mm(torch.ones(32, 32), torch.ones(32, 32))
                peer = 1 - rank
                name = "pp:send_fwd" if rank == 0 else "pp:recv_fwd"
                with pptrace.region(name, peer=peer, mb=mb, bytes=x.numel() * 4):
                    (dist.send if rank == 0 else dist.recv)(x, peer)
            with pptrace.region("dp:all_reduce", what="grad_norm", bytes=4):
                dist.all_reduce(torch.ones(1))
            prof.step()
    # Neither rank tears gloo down while the other is still inside a gloo call: a rank
    # destroying its group while the peer still exported aborted the peer ("terminate called
    # without an active exception"), and after a gloo barrier it still did, rarely (a barrier
    # returns on one rank before the other has finished it). The file store has no sockets.
    dist.barrier()
    done = dist.FileStore(store + ".exit", world)
    done.set(f"done{rank}", "1")
    done.wait([f"done{r}" for r in range(world)])
    dist.destroy_process_group()
    # Everything this test checks is on disk now; C++ teardown at interpreter exit (the
    # same message in pytorch#190489) is not under test.
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


def _run_ranks(tmp_path, world):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    store, out = tmp_path / "store", tmp_path / "run"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(store), str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    return out


@pytest.mark.slow
def test_two_gloo_ranks_write_traces_with_regions_and_metadata(tmp_path):
    out = _run_ranks(tmp_path, world=2)
    files = sorted(p.name for p in (out / "traces").iterdir())
    assert files == ["rank0.json.gz", "rank1.json.gz"]
    for rank in (0, 1):
        trace = json.load(gzip.open(out / "traces" / f"rank{rank}.json.gz"))
        block = trace["pptrace"]
        assert block["rank"] == rank and block["world_size"] == 2
        assert block["layout"] == {"tp": 1, "cp": 1, "pp": 2, "dp": 1, "order": "tp-cp-dp-pp"}
        assert block["coords"] == {"tp": 0, "cp": 0, "pp": rank, "dp": 0}
        assert block["schedule"] == "1f1b" and block["microbatches"] == 2 and block["steps"] == [1, 2]
        start, end = block["clock"]["start"], block["clock"]["end"]
        assert 0 < end["wall_ns"] - start["wall_ns"] < 60e9
        assert trace["distributedInfo"]["rank"] == rank
        names = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
        p2p = "pp:send_fwd" if rank == 0 else "pp:recv_fwd"
        # Two profiled steps x two microbatches, nothing from the unprofiled steps 0 and 3.
        assert names.count("compute:fwd mb=0") == 2 and names.count("compute:fwd mb=1") == 2
        assert names.count(f"{p2p} peer={1 - rank} mb=1 bytes=256") == 2
        assert names.count("dp:all_reduce what=grad_norm bytes=4") == 2
        assert sorted(n for n in names if n.startswith("ProfilerStep")) == ["ProfilerStep#1", "ProfilerStep#2"]


def test_profile_without_distributed_and_unselected_ranks(tmp_path):
    with pptrace.profile(tmp_path / "a", steps=0) as prof:
        with pptrace.region("compute:optimizer"):
            torch.ones(4).sum()
        prof.step()
    trace = json.load(gzip.open(tmp_path / "a" / "traces" / "rank0.json.gz"))
    assert trace["pptrace"]["world_size"] == 1
    assert any(e["name"] == "compute:optimizer" for e in trace["traceEvents"])

    with pptrace.profile(tmp_path / "b", steps=0, ranks=[3]) as prof:
        assert not prof.enabled
        prof.step()
    assert not (tmp_path / "b").exists()


def test_region_as_decorator_and_outside_profiling():
    calls = []

    @pptrace.region("compute:loss", mb=4)
    def loss(x):
        calls.append(x)
        return x * 2

    assert loss(3) == 6 and calls == [3]
    assert loss.__name__ == "loss"
    with pptrace.region("pp:send_fwd", peer=1, mb=0) as r:
        assert r.name == "pp:send_fwd peer=1 mb=0"
    with torch.profiler.profile() as prof:
        loss(1)
    assert "compute:loss mb=4" in {e.name for e in prof.events()}


def test_region_rejects_names_outside_the_grammar():
    with pytest.raises(ValueError, match="is not '<kind>:<op>"):
        pptrace.region("aten::mm")
    with pytest.raises(ValueError, match="is not '<kind>:<op>"):
        pptrace.region("just words")


@pytest.mark.parametrize("steps, expected", [("2-4", (2, 4)), ((1, 1), (1, 1)), (range(3, 6), (3, 5)), (0, (0, 0))])
def test_parse_steps(steps, expected):
    assert parse_steps(steps) == expected


@pytest.mark.parametrize("steps", ["4-2", "x", (-1, 2), None])
def test_parse_steps_rejects(steps):
    with pytest.raises(ValueError, match="steps"):
        parse_steps(steps)


def test_layout_must_match_world(tmp_path):
    with pytest.raises(ValueError, match="world size 2 but the process group has 1"):
        pptrace.profile(tmp_path, layout=pptrace.Layout(tp=2))
