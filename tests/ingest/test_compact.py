"""The compact event table (ingest/compact.py): nested plain CPU ops fold into their
top-level op; everything an analysis reads is kept; ``merge`` still shows every op."""
from __future__ import annotations

import gzip

import orjson
from click.testing import CliRunner

from pptrace.cli import cli
from pptrace.ingest.load import load_rank
from pptrace.run.build import load_run
from tracegen import RankTrace


def _rank_with_op_trees(out_dir, rank: int = 0):
    """One step: a forward range holding an aten tree, a collective enqueue holding
    record_param_comms and an aten op, a runtime call inside an aten op, a gloo worker's own
    nested ops, and ops that touch their parent's ends."""
    t = RankTrace(rank, 1)
    t.step(1, 0, 1000)
    t.region("compute:fwd", 10, 500, mb=0)
    t.add("aten::linear", 20, 100, cat="cpu_op")            # top level: kept
    t.add("aten::t", 21, 10, cat="cpu_op")                   # nested: folded
    t.add("aten::transpose", 22, 5, cat="cpu_op")            # nested deeper: folded
    t.add("aten::as_strided", 23, 1, cat="cpu_op")           # folded
    t.add("aten::addmm", 40, 80, cat="cpu_op")               # ends with its parent: folded
    t.add("aten::empty", 120, 0, cat="cpu_op")               # zero-length at the parent's end: folded
    t.add("cudaLaunchKernel", 50, 2, cat="cuda_runtime")     # nested, not a cpu_op: kept
    t.add("c10d::allreduce_", 200, 50, cat="cpu_op")         # significant name: kept
    t.add("record_param_comms", 201, 40, cat="cpu_op",
          args={"Collective name": "allreduce", "Process Group Ranks": "[0]"})  # collective: kept
    t.add("aten::flatten", 205, 3, cat="cpu_op")             # plain, inside c10d: folded
    t.add("aten::relu", 300, 20, cat="cpu_op")               # top level: kept
    t.add("autograd::engine::evaluate_function: MmBackward0", 600, 100, cat="cpu_op")  # kept
    t.add("aten::mm", 610, 50, cat="cpu_op")                 # inside autograd: folded
    t.thread(77, "pt_gloo_runloop")
    t.add("gloo:all_reduce", 210, 30, cat="cpu_op", tid=77)  # another thread, significant: kept
    t.add("aten::add_", 215, 5, cat="cpu_op", tid=77)        # nested on that thread: folded
    t.add("aten::zero_", 260, 5, cat="cpu_op", tid=77)       # top level on that thread: kept
    return t.write(out_dir / "traces" / f"rank{rank}.json.gz")


FOLDED = {"aten::t", "aten::transpose", "aten::as_strided", "aten::addmm", "aten::empty",
          "aten::flatten", "aten::mm", "aten::add_"}


def _names(frame) -> list:
    return sorted(frame["name"].astype(str))


def test_nested_plain_cpu_ops_fold_and_the_rest_is_kept(tmp_path):
    path = _rank_with_op_trees(tmp_path)
    full, meta_full = load_rank(path, compact=False)
    compact, meta = load_rank(path)
    assert meta_full["folded"] == 0
    assert meta["folded"] == len(FOLDED) == len(full) - len(compact)
    assert _names(compact) == sorted(n for n in _names(full) if n not in FOLDED)
    kept = set(_names(compact))
    assert {"aten::linear", "aten::relu", "aten::zero_", "cudaLaunchKernel", "c10d::allreduce_",
            "record_param_comms", "gloo:all_reduce", "autograd::engine::evaluate_function: MmBackward0",
            "ProfilerStep#1"} <= kept
    # every column of the kept rows is as in the full table
    full_kept = full[~full["name"].astype(str).isin(FOLDED)].reset_index(drop=True)
    for column in ("start_ns", "end_ns", "lane", "category", "collective", "step"):
        assert full_kept[column].astype(str).tolist() == compact[column].astype(str).tolist(), column


def test_the_cache_holds_the_compact_table_and_merge_shows_every_op(tmp_path):
    _rank_with_op_trees(tmp_path)
    cold = load_run(tmp_path, progress=False)
    cached = load_run(tmp_path, progress=False)  # from the cache entry written just now
    assert cold.meta[0]["folded"] == cached.meta[0]["folded"] == len(FOLDED)
    assert _names(cold.events) == _names(cached.events)
    assert not FOLDED & set(_names(cached.events))

    out = tmp_path / "merged.json.gz"
    result = CliRunner().invoke(cli, ["merge", str(tmp_path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    merged = orjson.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    shown = {e["name"] for e in merged if e.get("ph") == "X"}
    assert FOLDED <= shown
