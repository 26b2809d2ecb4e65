"""The ep rank-pair matrix (analyzers/ep_pairs.py) on hand-built all-to-alls whose answers
are known: three ranks of one ep group arrive at 100, 300 and 500 µs at each exchange and
leave together, each with its own per-peer splits; bytes per row 10."""
from __future__ import annotations

import numpy as np
import pytest

import pptrace
from pptrace.analyzers.ep_pairs import ep_pairs, pair_means
from pptrace.topology import Layout
from tracegen import run_from_docs, trace_doc

LAYOUT = Layout(dp=3, ep=3)
#: rank -> rows it sends to ranks 0, 1, 2 (the same in both exchanges of the step)
SEND = {0: [2, 5, 7], 1: [4, 0, 6], 2: [1, 3, 8]}
ARRIVE = {0: 100, 1: 300, 2: 500}  # µs; all leave at 600 (dispatch) and 1600 (combine)


def _recv(rank, send=SEND):
    return [send[src][rank] for src in sorted(send)]


def _docs(send=SEND, recv=None):
    recv = recv or {r: _recv(r, send) for r in send}
    docs = {}
    for rank in send:
        rows, got = sum(send[rank]), recv[rank]
        ranges = [("ProfilerStep#1", 0, 3000)]
        for op, t0 in (("dispatch", 0), ("combine", 1000)):
            name = (f"ep:{op} layer=0 mb=0 bytes={rows * 10} tokens={rows} "
                    f"send={','.join(map(str, send[rank]))} recv={','.join(map(str, got))}")
            ranges.append((name, t0 + ARRIVE[rank], t0 + 600))
        ranges.append((f"compute:expert layer=0 mb=0 tokens={sum(got)} per_expert={sum(got)}", 650, 900))
        docs[rank] = trace_doc(rank, 3, ranges, layout=LAYOUT)
    return docs


def test_sizes_and_waits_are_the_exchanges_and_who_arrived_last(tmp_path):
    run = run_from_docs(tmp_path, _docs(), LAYOUT)
    pairs = ep_pairs(run)
    assert pairs.inconsistent == ()
    table = pairs.table.set_index(["src", "dst"])
    for src, row in SEND.items():
        for dst, n in enumerate(row):
            if src == dst:
                assert (src, dst) not in table.index
                continue
            # two exchanges (dispatch and combine) with the same splits
            assert table.loc[(src, dst), "tokens"] == 2 * n
            assert table.loc[(src, dst), "bytes"] == 2 * n * 10
    # every rank waits for rank 2, the last to arrive, in both exchanges; rank 2 waits for nobody
    assert table.loc[(0, 2), "wait_s"] == pytest.approx(2 * 400e-6, abs=1e-9)
    assert table.loc[(1, 2), "wait_s"] == pytest.approx(2 * 200e-6, abs=1e-9)
    assert table.loc[(0, 1), "wait_s"] == 0 and table.loc[(2, 0), "wait_s"] == 0
    # a rank's pair waits sum to its ep wait (collectives.waits_by_rank)
    waits = pptrace.analyze(run).rank_collectives.query("dim == 'ep'").set_index("rank")["wait_s"]
    per_src = pairs.table.groupby("src")["wait_s"].sum()
    for rank in SEND:
        assert per_src.get(rank, 0.0) == pytest.approx(waits[rank], abs=1e-9)


def test_the_document_has_the_matrix_as_per_step_means_and_no_warning(tmp_path):
    doc = pptrace.analyze(run_from_docs(tmp_path, _docs(), LAYOUT)).to_json()
    pairs = {(p["src"], p["dst"]): p for p in doc["ep"]["pairs"]}
    assert pairs[(0, 2)]["tokens"] == 14 and isinstance(pairs[(0, 2)]["tokens"], int)
    assert doc["ep"]["unmeasured_ranks"] == []
    assert not [w for w in doc["warnings"] if "split sizes" in w]
    # tokens per expert: one local expert per rank, expert id = ep rank
    tokens = {(t["rank"], t["expert"]): t["tokens"] for t in doc["ep"]["expert_tokens"]}
    assert tokens == {(r, r): sum(_recv(r)) for r in SEND}


def test_splits_that_do_not_add_up_are_named_and_left_unmeasured(tmp_path):
    # rank 1 says it got 9 rows from rank 0, who says it sent 5
    recv = {r: _recv(r) for r in SEND}
    recv[1] = [9, *recv[1][1:]]
    analysis = pptrace.analyze(run_from_docs(tmp_path, _docs(recv=recv), LAYOUT))
    pairs = analysis.ep_pairs
    touched = pairs["src"].isin([0, 1]) | pairs["dst"].isin([0, 1])
    assert pairs.loc[touched, "tokens"].isna().all() and pairs.loc[touched, "bytes"].isna().all()
    assert (pairs.loc[touched, "wait_s"] > 0).any()  # waits do not depend on the splits
    doc = analysis.to_json()
    assert doc["ep"]["unmeasured_ranks"] == [0, 1]
    assert [w for w in doc["warnings"] if "split sizes of ranks [0, 1]" in w]


def test_sends_that_do_not_sum_to_the_rows_moved_are_unmeasured(tmp_path):
    docs = _docs()
    for event in docs[2]["traceEvents"]:
        if event["name"].startswith("ep:dispatch"):
            event["name"] = event["name"].replace("tokens=12", "tokens=13")
    pairs = ep_pairs(run_from_docs(tmp_path, docs, LAYOUT))
    assert pairs.inconsistent == (2,)
    assert np.isnan(pairs.table.set_index(["src", "dst"]).loc[(2, 0), "tokens"])


def test_pair_means_divide_by_the_profiled_steps():
    import pandas as pd

    table = pd.DataFrame({"step": [1, 2], "src": [0, 0], "dst": [1, 1], "tokens": [4.0, 6.0],
                          "bytes": [40.0, np.nan], "wait_s": [0.1, 0.3]})
    means = pair_means(table, 2).iloc[0]
    assert means["tokens"] == 5 and means["bytes"] == 20 and means["wait_s"] == pytest.approx(0.2)


def _gpu_traces(in_splits=None):
    """The same exchanges as NCCL all_to_all kernels of a plain GPU trace, with torch's
    record_param_comms fields on the kernel (kineto copies them there): 8 bf16 elements a
    row, so 16 bytes a row; the group is named by its pg_desc, the layout only says dp 3."""
    from tracegen import RankTrace

    docs = {}
    for rank in SEND:
        t = RankTrace(rank, 3, Layout(dp=3), steps=[1])
        t.header["distributedInfo"]["pg_config"].append(
            {"pg_name": "5", "pg_desc": "EXPERT_MODEL_PARALLEL_GROUP", "pg_size": 3, "ranks": [0, 1, 2]})
        t.step(1, 0, 3000)
        for k, t0 in enumerate((0, 1000)):
            send = (in_splits or SEND)[rank]
            t.kernel("ncclDevKernel_SendRecv(ncclDevComm*)", t0 + ARRIVE[rank], 600 - ARRIVE[rank], stream=20,
                     correlation=10 + k, **{"Collective name": "all_to_all", "Process Group Name": "5",
                                            "Process Group Ranks": "[0, 1, 2]", "dtype": "BFloat16",
                                            "In msg nelems": 8 * sum(send), "Out msg nelems": 8 * sum(_recv(rank)),
                                            "In split size": str(send), "Out split size": str(_recv(rank)),
                                            "Group size": 3})
        docs[rank] = t
    return docs


def _gpu_run(tmp_path, traces):
    from tracegen import write_run

    return write_run(tmp_path / "run", list(traces.values()))


def test_nccl_all_to_all_kernels_give_the_matrix_from_their_split_sizes(tmp_path):
    """No pptrace range at all: the kernels' split sizes and arrivals give the same matrix,
    bytes from the elements; the ep group from its description, not the layout's dp."""
    analysis = pptrace.analyze(_gpu_run(tmp_path, _gpu_traces()), use_cache=False, progress=False)
    assert analysis._ep_pairs.inconsistent == ()
    table = analysis.ep_pairs.set_index(["src", "dst"])
    for src, row in SEND.items():
        for dst, n in enumerate(row):
            if src != dst:
                assert table.loc[(src, dst), "tokens"] == 2 * n
                assert table.loc[(src, dst), "bytes"] == 2 * n * 16
    assert table.loc[(0, 2), "wait_s"] == pytest.approx(2 * 400e-6, abs=1e-9)
    waits = analysis.rank_collectives.set_index(["rank", "dim"])["wait_s"]
    assert waits[(0, "ep")] == pytest.approx(2 * 400e-6, abs=1e-9) and (0, "dp") not in waits.index


def test_an_even_split_gives_bytes_but_no_tokens(tmp_path):
    traces = _gpu_traces()
    for t in traces.values():
        for event in t.events:
            if "In split size" in event.get("args", {}):
                event["args"]["In split size"] = event["args"]["Out split size"] = "[]"
    run = pptrace.analyze(_gpu_run(tmp_path, traces), use_cache=False, progress=False).run
    table = ep_pairs(run).table.set_index(["src", "dst"])
    assert table["tokens"].isna().all()
    # 8 x 14 elements of rank 0 in thirds, bf16, two exchanges
    assert table.loc[(0, 1), "bytes"] == pytest.approx(2 * 8 * 14 * 2 / 3)
