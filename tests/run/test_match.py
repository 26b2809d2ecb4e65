"""Cross-rank matching on synthetic ground truth and on real gloo traces."""
from __future__ import annotations

import pytest

from pptrace.run.match import PAIR_COLUMNS, group_of, match_p2p
from pptrace.run.build import load_run
from pptrace.topology import Layout
from tracegen import RankTrace, pipeline_run, write_run


def test_pairs_equal_ground_truth(tmp_path):
    run_dir, truth = pipeline_run(tmp_path / "run", pp=3, dp=2, microbatches=3, steps=(1, 2),
                                  skew_ns={2: 2_000_000})
    run = load_run(run_dir, use_cache=False)
    got = sorted(
        (int(p.src), int(p.dst), p.direction, int(p.mb), int(p.step)) for p in run.pairs.itertuples()
    )
    assert got == sorted((s, d, dr, mb, st) for s, d, dr, mb, st, _, _ in truth["pairs"])
    origin = run.events["start_ns"].min() - 10_000  # the synthetic run starts at true 10 µs
    by_key = {(s, d, dr, mb, st): (ss, re) for s, d, dr, mb, st, ss, re in truth["pairs"]}
    for p in run.pairs.itertuples():
        send_us, recv_end_us = by_key[(p.src, p.dst, p.direction, p.mb, p.step)]
        # aligned times agree with the truth within the alignment bound (50 µs latency)
        assert abs((p.send_start_ns - origin) - send_us * 1000) < 150_000
        assert abs((p.recv_end_ns - origin) - recv_end_us * 1000) < 150_000
        assert p.wait_ns >= 0 and p.transfer_ns >= 0
    assert not [w for w in run.warnings if "no matching" in w]


def test_loader_pairs_time_on_the_aligned_clocks(tmp_path):
    """The loader pairs before aligning and times the pairs after (wait, transfer, exchanges:
    pptrace.timeline.exchanges); the same as pairing the aligned events afresh."""
    run_dir, _ = pipeline_run(tmp_path / "run", pp=3, microbatches=3, skew_ns={1: 3_000_000, 2: -2_000_000})
    run = load_run(run_dir, use_cache=False)
    again, _ = match_p2p(run.events)
    assert list(run.pairs.columns) == list(again.columns) == list(PAIR_COLUMNS)
    for column in PAIR_COLUMNS:
        assert (run.pairs[column].to_numpy() == again[column].to_numpy()).all(), column
    # GPipe: every recv is its own exchange, waiting until the send plus 50 µs latency
    assert (run.pairs["recv_exchange"].nunique() == len(run.pairs)) and (run.pairs["transfer_ns"] > 0).all()


def test_unmatched_ops_are_warnings(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, microbatches=2)
    run = load_run(run_dir, use_cache=False)
    events = run.events
    drop = events.index[(events["op"] == "recv_fwd").to_numpy()][:1]
    pairs, warnings = match_p2p(events.drop(index=drop))
    assert len(pairs) == len(run.pairs) - 1
    assert len(warnings) == 1 and "1 p2p sends have no matching recv" in warnings[0]


def test_chunk_tag_mismatch_falls_back_to_order(tmp_path):
    a, b = RankTrace(0, layout=Layout(pp=2)), RankTrace(1, layout=Layout(pp=2))
    for t in (a, b):
        t.step(1, 0, 1000)
    a.region("pp:send_fwd", 10, 5, peer=1, mb=0, chunk=1)
    b.region("pp:recv_fwd", 5, 20, peer=0, mb=0, chunk=0)  # a trainer tagging its own chunk
    run = load_run(write_run(tmp_path / "run", [a, b]), use_cache=False)
    assert len(run.pairs) == 1 and not [w for w in run.warnings if "no matching" in w]


def test_collective_groups_follow_the_layout():
    layout = Layout(tp=2, cp=2, pp=2, dp=2)
    assert group_of("tp", None, 5, layout) == tuple(layout.group_ranks("tp", 5))
    dp_cp = {r for c in layout.group_ranks("cp", 5) for r in layout.group_ranks("dp", c)}
    assert group_of("dp", None, 5, layout) == tuple(sorted(dp_cp)) and len(dp_cp) == 4
    assert group_of("dp", '{"what":"grad_norm"}', 5, layout) == tuple(range(16))


def test_collective_instances_from_ranges(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2, dp=2, microbatches=2, steps=(1, 2, 3))
    run = load_run(run_dir, use_cache=False)
    inst = run.collectives
    assert inst["instance"].nunique() == 3  # one grad-norm all-reduce per step
    assert inst["complete"].all() and (inst.groupby("instance")["rank"].nunique() == 4).all()


def test_nccl_kernels_form_instances(hta_fixtures):
    run = load_run(hta_fixtures / "nccl_allreduce_world2_rank0.json.gz", use_cache=False)
    nccl = run.collectives[run.collectives["source"] == "nccl_kernel"]
    assert len(nccl) > 0 and set(nccl["group"]) == {"0,1"}
    # only rank 0 of 2 is here: instances are incomplete but nothing is reported missing
    # that was not loaded
    assert not nccl["complete"].any()
    assert not [w for w in run.warnings if "lack ranks" in w]


@pytest.mark.slow
def test_real_gloo_matching_is_complete(gloo_run):
    run = load_run(gloo_run, use_cache=False)
    ev = run.events
    p2p = ev[(ev["category"] == "p2p").to_numpy()]
    sends = p2p[p2p["op"].astype(str).str.startswith("send")]
    recvs = p2p[p2p["op"].astype(str).str.startswith("recv")]
    assert len(sends) == len(recvs) == len(run.pairs) > 0
    assert run.pairs["send_index"].is_unique and run.pairs["recv_index"].is_unique
    assert set(run.pairs["send_index"]) == set(sends.index)
    assert set(run.pairs["recv_index"]) == set(recvs.index)
    assert (run.pairs["src"] // 2 + 1 == run.pairs["dst"] // 2).sum() == (run.pairs["direction"] == "fwd").sum()
    inst = run.collectives
    assert len(inst) and inst["complete"].all()
    sizes = inst.groupby("instance").agg(n=("rank", "nunique"), size=("group_size", "first"))
    assert (sizes["n"] == sizes["size"]).all()
    assert set(sizes["size"]) == {2, 4}  # dp buckets over [0,1]/[2,3], grad norm over all
    assert not [w for w in run.warnings if "no matching" in w or "lack ranks" in w]
    steps = run.steps
    assert steps == tuple(range(1, 9)) and set(run.pairs["step"]) == set(steps)


@pytest.mark.slow
def test_real_trainer_run_loads_matches_and_aligns(trainer_run, tmp_path):
    from pptrace.export.perfetto import merge_run

    run = load_run(trainer_run, use_cache=False)
    assert run.layout == Layout(pp=2, dp=2) and run.ranks == (0, 1, 2, 3)
    assert run.steps == (1, 2) and run.schedule == "1f1b" and run.microbatches == 4
    ev = run.events
    p2p = ev[(ev["category"] == "p2p").to_numpy()]
    assert len(p2p) == 2 * len(run.pairs) > 0
    # 4 microbatches x fwd+bwd x 2 pipelines x 2 steps, each sent once and received once
    assert len(run.pairs) == 4 * 2 * 2 * 2
    assert set(run.pairs["send_index"]) | set(run.pairs["recv_index"]) == set(p2p.index)
    inst = run.collectives
    assert len(inst) and inst["complete"].all()
    norms = inst[inst["name"].str.contains("grad_norm")]
    assert norms["instance"].nunique() == 2 and (norms.groupby("instance")["rank"].nunique() == 4).all()
    assert not [w for w in run.warnings if "no matching" in w or "lack ranks" in w]
    # one host: every offset is within its own bound of the true value, 0
    off = run.offsets.set_index("rank")
    assert (off["offset_ns"].abs() <= off["uncertainty_ns"].fillna(0) + 1).all()
    assert (run.pairs["recv_end_ns"] >= run.pairs["send_start_ns"]).all()
    assert merge_run(run, tmp_path / "merged.json.gz").stat().st_size > 0


def test_cp_ring_pairs(tmp_path):
    """A 3-rank CP ring: at ring step s every rank sends KV to the next and receives from the previous."""
    layout = Layout(cp=3)
    traces = [RankTrace(r, layout=layout) for r in range(3)]
    for r, t in enumerate(traces):
        t.step(1, 0, 10_000)
        for s in range(2):
            base = 100 + 1000 * s
            t.region("cp:send_kv", base, 50, peer=(r + 1) % 3, step=s, layer=0, bytes=128)
            t.region("cp:recv_kv", base + 60, 200, peer=(r - 1) % 3, step=s, layer=0, bytes=128)
    run = load_run(write_run(tmp_path / "run", traces), use_cache=False)
    assert len(run.pairs) == 6 and set(run.pairs["kind"]) == {"cp"} and set(run.pairs["direction"]) == {"kv"}
    assert sorted(zip(run.pairs["src"], run.pairs["dst"], run.pairs["ring_step"])) == sorted(
        (r, (r + 1) % 3, s) for r in range(3) for s in range(2))
    assert not [w for w in run.warnings if "no matching" in w]
