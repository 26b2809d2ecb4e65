"""Issue 25, items 7 and 8: ``pptrace.profile`` refuses what it cannot do at ``__enter__``, in
one line, before the first training step (a second profile, a directory it cannot write, steps
or a layout it would misread), and says nothing on stderr that the user cannot act on.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pptrace
from hostile import stderr_lines
from pptrace.errors import TraceError

ROOT = Path(__file__).parents[2]


def _python(script: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _train(prof, steps: int = 3) -> None:
    for _ in range(steps):
        with pptrace.region("compute:fwd", mb=0):
            torch.ones(8).sum()
        prof.step()


def _trace(run_dir) -> dict:
    return json.loads(gzip.decompress((Path(run_dir) / "traces" / "rank0.json.gz").read_bytes()))


# ---------------------------------------------------------------------------------------------
# 7. a nested pptrace.profile is one error, never a crashed process
# ---------------------------------------------------------------------------------------------
def test_nested_profile_is_refused_in_a_real_process(tmp_path):
    # Both profiles warm up at once: before the fix this process died of SIGSEGV.
    done = _python("""
        import sys, torch, pptrace
        with pptrace.profile(sys.argv[1] + "/outer", steps="1-2") as outer:
            with pptrace.profile(sys.argv[1] + "/inner", steps="1-2") as inner:
                for step in range(4):
                    torch.ones(8).sum()
                    inner.step()
                    outer.step()
    """, tmp_path)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    last = stderr_lines(done)[-1]
    assert last == (f"RuntimeError: pptrace.profile is already active in this process (started for "
                    f"{tmp_path}/outer); nest pptrace.region inside it instead of a second pptrace.profile"), last
    assert not (tmp_path / "inner").exists()


def test_training_goes_on_under_the_outer_profile_after_a_refused_one(tmp_path):
    # In a child process too: were the refusal to regress, the crash would take pytest with it.
    done = _python("""
        import sys, torch, pptrace
        out = sys.argv[1]
        def train(prof, steps):
            for _ in range(steps):
                with pptrace.region("compute:fwd", mb=0):
                    torch.ones(8).sum()
                prof.step()
        with pptrace.profile(out + "/outer", steps="1-2") as outer:
            try:
                with pptrace.profile(out + "/inner", steps=0):
                    raise SystemExit("the second profile was entered")
            except RuntimeError as exc:
                print(exc)
            train(outer, 4)
        with pptrace.profile(out + "/later", steps=0) as prof:  # the outer one let go of the process
            train(prof, 1)
    """, tmp_path)
    assert done.returncode == 0 and stderr_lines(done) == [], (done.returncode, done.stderr[-2000:])
    assert "already active in this process" in done.stdout, done.stdout
    assert any(e["name"] == "compute:fwd mb=0" for e in _trace(tmp_path / "outer")["traceEvents"])
    assert _trace(tmp_path / "later")["pptrace"]["steps"] == [0]
    assert not (tmp_path / "inner").exists()


def test_nesting_is_refused_on_ranks_that_record_nothing_too(tmp_path):
    # Refused everywhere alike: a rank that went on would wait forever for the ones that stopped.
    with pptrace.profile(tmp_path / "outer", steps=0, ranks=[3]) as outer:
        assert not outer.enabled
        with pytest.raises(RuntimeError, match=re.escape(f"started for {tmp_path / 'outer'}")):
            with pptrace.profile(tmp_path / "inner", steps=0, ranks=[3]):
                pass


def test_profile_inside_a_recording_torch_profiler_is_refused(tmp_path):
    with torch.profiler.profile():
        with pytest.raises(RuntimeError, match="a torch.profiler is already recording in this process"):
            with pptrace.profile(tmp_path / "run", steps=0):
                pass
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# 8. an unwritable directory, bad steps, a dict layout, torch's warmup warning, the name error
# ---------------------------------------------------------------------------------------------
def test_uncreatable_directory_fails_at_enter_before_any_step(tmp_path):
    (tmp_path / "afile").write_text("a file, so nothing can be created under it")
    out = tmp_path / "afile" / "out"
    ran = []
    with pytest.raises(TraceError) as info:
        with pptrace.profile(out, steps="1-2") as prof:
            ran.append("training")
            _train(prof)
    assert ran == []
    message = str(info.value)
    assert message == f"cannot write {out / 'traces'}: Not a directory; choose another output path", message
    # the refused profile holds nothing: the next one starts
    with pptrace.profile(tmp_path / "ok", steps=0) as prof:
        _train(prof, steps=1)
    assert _trace(tmp_path / "ok")["pptrace"]["rank"] == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode 0o500 directory")
def test_read_only_directory_fails_at_enter(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(TraceError, match=re.escape(f"cannot write {locked / 'run' / 'traces'}: Permission denied")):
            with pptrace.profile(locked / "run", steps=0):
                pass
    finally:
        locked.chmod(0o700)


def test_ranks_that_record_nothing_never_touch_the_directory(tmp_path):
    (tmp_path / "afile").write_text("")
    with pptrace.profile(tmp_path / "afile" / "out", steps=0, ranks=[3]) as prof:
        _train(prof, steps=1)


@pytest.mark.parametrize("steps", [True, False, (1.7, 2.9), (True, 2), 2.0, "1.5-2", range(0, 6, 2), (1, 2, 3)])
def test_steps_that_are_not_whole_step_numbers_are_refused(tmp_path, steps):
    with pytest.raises(ValueError, match=re.escape(f"steps {steps!r} must look like")):
        pptrace.profile(tmp_path, steps=steps)


@pytest.mark.parametrize("steps, expected", [([2, 3], (2, 3)), (range(2, 4), (2, 3)), (4, (4, 4)), ("2-3", (2, 3))])
def test_steps_the_docstring_promises_still_work(tmp_path, steps, expected):
    prof = pptrace.profile(tmp_path, steps=steps)
    assert (prof.first_step, prof.last_step) == expected


def test_layout_as_a_mapping_is_the_layout_it_names(tmp_path):
    with pptrace.profile(tmp_path / "run", steps=0, layout={"dp": 1, "order": "tp-cp-dp-pp"}) as prof:
        assert prof.layout == pptrace.Layout()
        _train(prof, steps=1)
    assert _trace(tmp_path / "run")["pptrace"]["layout"] == pptrace.Layout().to_dict()
    with pytest.raises(ValueError, match="layout .* has world size 2 but the process group has 1"):
        pptrace.profile(tmp_path, layout={"tp": 2})


@pytest.mark.parametrize("layout, message", [
    ({"pipeline": 2}, "layout {'pipeline': 2}: unknown key pipeline; expected some of tp, cp, pp, dp"),
    ("tp2", "layout 'tp2' must be a pptrace.Layout or a mapping like {'tp': 2, 'pp': 4}"),
    ({"tp": "2"}, "Layout.tp must be a positive integer, got '2'"),
])
def test_layout_that_is_not_one_says_what_is_expected(tmp_path, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pptrace.profile(tmp_path, layout=layout)


def test_no_warmup_warning_reaches_stderr(tmp_path):
    # steps from 0 leave torch no step to warm up in; steps from 1 have one
    done = _python("""
        import sys, torch, pptrace
        for name, steps in (("zero", 0), ("one", "1-2")):
            with pptrace.profile(sys.argv[1] + "/" + name, steps=steps) as prof:
                for step in range(3):
                    torch.ones(8).sum()
                    prof.step()
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warmup" not in done.stderr.lower() and stderr_lines(done) == [], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "zero"]


def test_region_name_error_states_the_grammar_inline():
    with pytest.raises(ValueError) as info:
        pptrace.region("just words")
    message = str(info.value)
    assert message == ("region name 'just words' is not '<kind>:<op> [key=value ...]', e.g. "
                       "'pp:send_fwd peer=1 mb=0' (kinds: compute, tp, cp, pp, dp, ep)"), message
    assert "DESIGN" not in message and "contract" not in message.lower()
