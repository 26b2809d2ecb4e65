"""Issue 15, outputs: what pptrace writes is whole or absent, a write that cannot happen is one
line naming the path, absurd requests are refused at once, and the profiler keeps kineto's
markers off the user's stderr. Every check runs the real command (tests/hostile.py) unless it
measures the library itself (the merge's memory)."""
from __future__ import annotations

import gzip
import json
import os
import resource
import stat
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from hostile import checksums, no_traceback, one_line_error, pptrace, stderr_lines
from tracegen import pipeline_run

PREVIOUS = b"<html>the report of yesterday</html>\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-stage GPipe run with known timing (a few thousand events)."""
    out, _ = pipeline_run(tmp_path_factory.mktemp("trust-outputs") / "run", pp=2, microbatches=4,
                          steps=(1, 2), cpu_ops_per_mb=20)
    assert pptrace("analyze", out, "--json").returncode == 0  # fills the cache: later loads write nothing
    return out


def _limit_file_size(limit: int):
    """preexec_fn: a process that may write no file beyond ``limit`` bytes (EFBIG, the full
    disk every user can simulate; Python ignores SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _mounted_full_tmpfs(where: Path) -> bool:
    """A small tmpfs at ``where`` (root only), to be filled by the caller."""
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _fill(directory: Path) -> None:
    with open(directory / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:  # full
            pass


# ---------------------------------------------------------------------------------------------
# 1. a full disk leaves the previous outputs as they were
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("disk", ["file-size-limit", "full-tmpfs"])
def test_full_disk_keeps_the_previous_outputs(run, tmp_path, disk):
    out_dir = tmp_path / "out"
    preexec = None
    if disk == "full-tmpfs":
        if not _mounted_full_tmpfs(out_dir):
            pytest.skip("cannot mount a tmpfs here (needs root)")
    else:
        out_dir.mkdir()
        preexec = _limit_file_size(2048)
    try:
        outputs = {"report.html": PREVIOUS, "merged.json": b'{"traceEvents": []}', "sim.json": b"{}"}
        for name, content in outputs.items():
            (out_dir / name).write_bytes(content)
        if disk == "full-tmpfs":
            _fill(out_dir)
        before = checksums(run)
        commands = [
            ("dashboard", run, "-o", out_dir / "report.html"),
            ("merge", run, "-o", out_dir / "merged.json"),
            ("whatif", run, "--microbatches", "8", "--trace", out_dir / "sim.json"),
        ]
        for args, name in zip(commands, outputs):
            line = one_line_error(pptrace(*args, preexec_fn=preexec), f"cannot write {out_dir / name}",
                                  "free some space")
            assert ("No space left" if disk == "full-tmpfs" else "File too large") in line
        for name, content in outputs.items():
            assert (out_dir / name).read_bytes() == content, name  # intact, not truncated
        assert sorted(p.name for p in out_dir.iterdir()) == sorted([*outputs, *(["filler"] if disk == "full-tmpfs" else [])])
        assert checksums(run) == before
    finally:
        if disk == "full-tmpfs":
            subprocess.run(["umount", str(out_dir)], capture_output=True, timeout=30)


# ---------------------------------------------------------------------------------------------
# 7. absurd --ranks / --steps lists are refused before anything is materialised
# ---------------------------------------------------------------------------------------------
def test_absurd_rank_and_step_lists_are_refused_at_once(run):
    cases = [
        (("--ranks", "0-1000000000"), ("--ranks", "1000000001 ranks", "pptrace info")),
        (("--steps", "0-100000000"), ("--steps", "100000001 steps")),
        (("--steps", "3-1"), ("runs backwards", "1-3")),
        (("--ranks", "0-99999999999"), ("larger than any rank",)),
        # issue 25 item 14: a range whose end was lost is refused, not read as its start
        (("--ranks", "0-"), ("--ranks '0-'", "has no end", "0-N")),
    ]
    for option, words in cases:
        started = time.monotonic()
        result = pptrace("analyze", run, "--json", *option)
        # the old parser built the list first: minutes and tens of GB for these
        assert time.monotonic() - started < 60
        one_line_error(result, *words, code=2)
    kept = pptrace("analyze", run, "--json", "--ranks", "0-1", "--steps", "2")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["run"]["steps"] == [2]


# ---------------------------------------------------------------------------------------------
# 8. an output that cannot be written: "cannot write PATH: reason", never "internal error"
# ---------------------------------------------------------------------------------------------
def _stdout_to(fd: int, *args) -> subprocess.CompletedProcess:
    """``pptrace ARGS`` with its stdout on ``fd`` (hostile.pptrace captures stdout)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    env.pop("PPTRACE_DEBUG", None)
    done = subprocess.run([sys.executable, "-m", "pptrace", *map(str, args)], stdout=fd, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, timeout=120, env=env)
    done.stdout = ""  # it went to fd
    return done


def test_unwritable_outputs_say_which_path_and_why(run, tmp_path):
    before = checksums(run)
    line = one_line_error(pptrace("merge", run, "-o", "/dev/full"), "cannot write /dev/full", "No space left")
    assert "internal error" not in line
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # written in place, never replaced by a file
    assert pptrace("merge", run, "-o", "/dev/null").returncode == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    piped = pptrace("merge", run, "-o", "/dev/stdout")  # the trace on stdout, the status line off it
    assert piped.returncode == 0 and json.loads(piped.stdout)["traceEvents"], piped.stderr
    assert stderr_lines(piped) == ["merged 2 ranks into /dev/stdout"]

    one_line_error(pptrace("dashboard", run, "-o", tmp_path), f"cannot write {tmp_path}", "directory")
    one_line_error(pptrace("merge", run, "-o", run / "traces" / "rank0.json.gz"), "one of the run's trace files")
    (tmp_path / "file").write_text("")  # a file where the output's folder should be
    one_line_error(pptrace("merge", run, "-o", tmp_path / "file" / "x.json"), "cannot write", "Not a directory")

    # a read-only run directory: the dashboard's default place, RUN/report.html
    readonly = tmp_path / "ro"
    if os.geteuid() != 0:
        readonly.mkdir()
        (readonly / "traces").mkdir()
        for trace in (run / "traces").glob("rank*.json.gz"):
            (readonly / "traces" / trace.name).write_bytes(trace.read_bytes())
        readonly.chmod(0o555)
        ok = True
    else:
        readonly.mkdir()
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(readonly)],
                            capture_output=True).returncode == 0
        if ok:
            (readonly / "traces").mkdir()
            for trace in (run / "traces").glob("rank*.json.gz"):
                (readonly / "traces" / trace.name).write_bytes(trace.read_bytes())
            ok = subprocess.run(["mount", "-o", "remount,ro", str(readonly)], capture_output=True).returncode == 0
    try:
        if ok:
            line = one_line_error(pptrace("dashboard", readonly), f"cannot write {readonly / 'report.html'}",
                                  "writable output path")
            assert "Read-only" in line or "Permission denied" in line
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(readonly)], capture_output=True)
        else:
            readonly.chmod(0o755)

    # standard output on a full disk, then on a pipe nobody reads any more
    with open("/dev/full", "w") as full:
        one_line_error(_stdout_to(full.fileno(), "analyze", run, "--json"),
                       "cannot write standard output", "No space left")
        one_line_error(_stdout_to(full.fileno(), "analyze", run), "cannot write standard output")
    for args in (("analyze", run, "--json"), ("analyze", run)):
        read, write = os.pipe()
        os.close(read)
        try:
            result = _stdout_to(write, *args)
        finally:
            os.close(write)
        no_traceback(result)
        assert result.returncode == 1 and stderr_lines(result) == [], result.stderr  # quiet, like | head
    assert checksums(run) == before


# ---------------------------------------------------------------------------------------------
# 9. --microbatches 100000 is refused in a second, with the cap and why; long steps get fewer
#    replays, and say so
# ---------------------------------------------------------------------------------------------
def test_whatif_caps_the_replay_size(run):
    from pptrace.whatif.predict import MIN_REPLICATIONS, SIMULATION_BUDGET

    started = time.monotonic()
    most = SIMULATION_BUDGET // MIN_REPLICATIONS // 2  # 2 stages
    one_line_error(pptrace("whatif", run, "--microbatches", "100000"), "--microbatches 100000",
                   "200000 passes", "seconds, not minutes", f"--microbatches {most} or fewer")
    assert time.monotonic() - started < 60  # it ran for twenty minutes
    result = pptrace("whatif", run, "--json", "--microbatches", "2100")  # 4200 passes
    assert result.returncode == 0, result.stderr
    notes = json.loads(result.stdout)["notes"]
    assert any("4200 passes per step: the median of 31 replays" in note for note in notes), notes
    assert time.monotonic() - started < 120


# ---------------------------------------------------------------------------------------------
# 19. pptrace.profile: kineto's USDT markers stay off stderr, the user's own lines do not
# ---------------------------------------------------------------------------------------------
def test_profile_keeps_kineto_markers_off_stderr(tmp_path):
    script = textwrap.dedent("""
        import sys, torch, pptrace
        with pptrace.profile(sys.argv[1], steps="1-2") as prof:
            for i in range(4):
                with pptrace.region("compute:fwd", mb=0):
                    torch.ones(8).sum()
                print(f"user line {i}", file=sys.stderr)
                prof.step()
        print("user line after", file=sys.stderr)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr, done.stderr
    assert stderr_lines(done) == [*(f"user line {i}" for i in range(4)), "user line after"]
    traces = list((tmp_path / "run" / "traces").iterdir())
    assert [p.name for p in traces] == ["rank0.json.gz"]  # and no temporary file left beside it
    assert json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]


# ---------------------------------------------------------------------------------------------
# 21. merge streams: the same trace as one dict per event made, in memory that does not grow
#     with the run
# ---------------------------------------------------------------------------------------------
def _expected_events(run) -> list[dict]:
    """The merged trace as the old writer built it, one dict per event (the reference)."""
    ev = run.events
    origin = int(ev["start_ns"].min())
    out, tids = [], {}
    lanes_of = ev.groupby("rank", observed=True)["lane"].agg(lambda s: sorted(set(s.astype(str))))
    for rank in sorted(lanes_of.index):
        from pptrace.export.perfetto import _lane_sort

        out += [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": run.describe(rank)}},
                {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
        for i, lane in enumerate(sorted(lanes_of[rank], key=_lane_sort), start=1):
            tids[(rank, lane)] = i
            out += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": lane}},
                    {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": i, "args": {"sort_index": i}}]
    for r, lane, name, cat, category, step, start, dur in zip(
            ev["rank"], ev["lane"].astype(str), ev["name"].astype(str), ev["cat"].astype(object),
            ev["category"].astype(str), ev["step"], ev["start_ns"], ev["dur_ns"]):
        out.append({"ph": "X", "name": name, "cat": cat if isinstance(cat, str) else "other", "pid": int(r),
                    "tid": tids[(int(r), lane)], "ts": round((int(start) - origin) / 1000.0, 3),
                    "dur": round(int(dur) / 1000.0, 3), "args": {"category": category, "step": int(step)}})
    for fid, (kind, direction, mb, src, dst, si, ri, s0, r1) in enumerate(zip(
            run.pairs["kind"], run.pairs["direction"], run.pairs["mb"], run.pairs["src"], run.pairs["dst"],
            run.pairs["send_index"], run.pairs["recv_index"], run.pairs["send_start_ns"], run.pairs["recv_end_ns"]),
            start=1):
        name = f"{kind}:{direction} mb={mb}"
        start = round((int(s0) - origin) / 1000.0 + 0.001, 3)
        end = round(max((int(r1) - origin) / 1000.0 - 0.001, start), 3)
        out.append({"ph": "s", "id": fid, "name": name, "cat": "p2p", "pid": int(src),
                    "tid": tids[(int(src), str(ev.at[si, "lane"]))], "ts": start})
        out.append({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": "p2p", "pid": int(dst),
                    "tid": tids[(int(dst), str(ev.at[ri, "lane"]))], "ts": end})
    return out


def test_merge_streams_the_same_trace_in_bounded_memory(tmp_path, monkeypatch):
    from pptrace.export import perfetto
    from pptrace.run.build import load_run

    run_dir, truth = pipeline_run(tmp_path / "run", pp=4, dp=2, microbatches=8, steps=(1, 2), cpu_ops_per_mb=60)
    run = load_run(run_dir)
    assert len(run.pairs) == len(truth["pairs"]) > 0
    expected = _expected_events(run)

    monkeypatch.setattr(perfetto, "CHUNK_ROWS", 1000)  # a rank's ~2000 events span several slices
    tracemalloc.start()
    try:
        out = perfetto.merge_run(run, tmp_path / "merged.json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    doc = json.loads(out.read_bytes())
    assert doc["traceEvents"] == expected  # every event and flow, in the same order
    assert doc["otherData"]["pptrace"]["clock"] == "aligned to the reference rank"
    per_rank = out.stat().st_size / len(run.ranks)
    # one dict per event took ~6x the whole text (12 MB here); the stream stays below the text
    # of one rank of eight
    assert peak < per_rank, (peak, per_rank)

    gz = perfetto.merge_run(run, tmp_path / "merged.json.gz")
    assert json.loads(gzip.decompress(gz.read_bytes())) == doc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.json", "merged.json.gz", "run"]
