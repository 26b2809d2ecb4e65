"""tests/box.py, the lock that gives sleep-mode recordings the box alone, between real
processes (what two pytest-xdist workers are): a recording waits for the test the other worker
is in, tests wait for a recording, and a waiting recording is not overtaken by the next test."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
from pathlib import Path
import box
box.use(Path(sys.argv[1]))
with (box.shared() if sys.argv[2] == "shared" else box.alone()):
    print("in", time.monotonic(), flush=True)
    time.sleep(float(sys.argv[3]))
    print("out", time.monotonic(), flush=True)
"""


class Holder:
    """A process that holds the box (``mode``: shared or alone) for ``hold`` seconds."""

    def __init__(self, where: Path, mode: str, hold: float):
        env = {**os.environ, "PYTHONPATH": str(TESTS)}
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(where), mode, str(hold)], env=env,
                                     stdout=subprocess.PIPE, text=True)
        self.times: dict[str, float] = {}

    def wait_in(self) -> float:
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "in", line
        self.times["in"] = float(line[1])
        return self.times["in"]

    def done(self) -> dict:
        out, _ = self.proc.communicate(timeout=60)
        for line in out.split("\n"):
            if line:
                key, value = line.split()
                self.times[key] = float(value)
        assert self.proc.returncode == 0
        return self.times


def test_two_tests_share_the_box(tmp_path):
    a = Holder(tmp_path, "shared", 1.0)
    a.wait_in()
    b = Holder(tmp_path, "shared", 0).done()
    assert b["in"] < a.done()["out"]


def test_a_recording_waits_for_the_test_in_progress_and_the_next_test_for_it(tmp_path):
    a = Holder(tmp_path, "shared", 0.8)
    a.wait_in()
    recording = Holder(tmp_path, "alone", 0.5)
    time.sleep(0.3)  # the recording is waiting on a's test by now
    later = Holder(tmp_path, "shared", 0)
    a, recording, later = a.done(), recording.done(), later.done()
    assert recording["in"] >= a["out"]
    # the door: the test that came while the recording waited did not slip in beside a
    assert later["in"] >= recording["out"]


SELF = """
import sys
from pathlib import Path
import box
box.use(Path(sys.argv[1]))
with box.shared():
    with box.alone():
        with box.alone():  # re-entrant
            print("recorded", flush=True)
    assert box._shared_fd is not None, "the test's share is held again after its recording"
print("done", flush=True)
"""


def test_a_recording_inside_a_test_steps_out_of_its_own_share(tmp_path):
    """The share this worker's test holds is let go for the recording (else the recording
    would wait for itself) and taken again after it."""
    done = subprocess.run([sys.executable, "-c", SELF, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(TESTS)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["recorded", "done"]


LINGER = """
import os, sys, time
from pathlib import Path
import box
box.use(Path(sys.argv[1]))
with box.shared():
    if os.fork() == 0:  # a child that outlives the test, as a forked pool worker may
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)  # (not holding the pipes the test's output is read from)
        time.sleep(3)
        os._exit(0)
print("out", time.monotonic(), flush=True)
"""


def test_a_forked_child_that_outlives_its_test_does_not_hold_the_box(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    test = subprocess.run([sys.executable, "-c", LINGER, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=30)
    assert test.returncode == 0, test.stderr
    left = float(test.stdout.split()[1])
    recording = Holder(tmp_path, "alone", 0).done()
    assert recording["in"] - left < 2.0, "the recording waited for the test's child"
