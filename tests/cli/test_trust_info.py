"""Issue 25 item 14: ``info`` makes analyze's checks, one set of them (run.build.run_headers),
so that it never describes a directory analyze reads otherwise: symlink loops, a rank no run
has, unreadable files, all said in the same lines."""
from __future__ import annotations

import json

from hostile import checksums, no_traceback, pptrace
from pptrace.run.build import MAX_RANKS
from tracegen import RankTrace, pipeline_run


def test_info_says_what_analyze_says_of_every_file(tmp_path):
    run_dir, _ = pipeline_run(tmp_path / "run", pp=2)
    traces = run_dir / "traces"
    (traces / "loop1.json").symlink_to(traces / "loop2.json")
    (traces / "loop2.json").symlink_to(traces / "loop1.json")
    # a trace whose every source names a rank beyond any run (info listed it as rank 1048576)
    odd = RankTrace(rank=MAX_RANKS * 4, world_size=2)
    odd.step(1, 0, 1000)
    odd.write(traces / "extra.json.gz")
    (traces / "rank7.json").write_text('{"traceEvents": [')  # cut before any event
    before = checksums(run_dir)
    r = pptrace("analyze", run_dir, "--json")
    no_traceback(r)
    assert r.returncode == 0, r.stderr[-2000:]
    said = json.loads(r.stdout)["warnings"]
    assert [w for w in said if "loop1.json" in w] and [w for w in said if "extra.json.gz" in w and "beyond any run" in w]
    r = pptrace("info", run_dir)
    no_traceback(r)
    assert r.returncode == 0 and "ranks: 2 (0, 1)" in r.stdout, r.stdout
    shown = [line.removeprefix("warning: ") for line in r.stdout.splitlines() if line.startswith("warning: ")]
    files = ("loop1.json", "loop2.json", "extra.json.gz", "rank7.json")
    assert sorted(f for f in files for line in shown if f in line) == sorted(files)
    # the same lines (info reads headers only: what analyze learns from the events is its own)
    assert all(line in said for line in shown), (shown, said)
    assert checksums(run_dir) == before
