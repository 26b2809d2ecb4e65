"""One 2-core box, two pytest-xdist workers: a sleep-mode recording runs with the box to itself.

The suite's timing checks hold a run's analysis to its truth, and what-ifs and diffs to other
runs and to theory. A recording made while the other worker analyses or renders a page pays
that load in its sleeps and gloo hops (tens of ms per step, and not the same in two runs),
and the checks against theory or against another run then fail one CI run in two. So every
test holds the box *shared* from its setup to its teardown (``shared``, conftest's hook), and
a recording holds it *alone* (``alone``): it waits for the test the other worker is in to
finish, and the other worker's next test waits for the recording.

A reader-writer lock from two ``flock``s on files the workers share: the door (held briefly by
readers, for the whole recording by the writer, so a waiting recording is not starved by a
stream of tests) and the box (shared by tests, exclusive to recordings). Without xdist there
is no other worker and the locks are never contended.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

_where: Path | None = None
_shared_fd: int | None = None  # this worker's shared hold on the box, while a test runs
_alone_fds: list = []  # the door and the box, while this worker records alone
_alone_depth = 0


def _forget_in_child() -> None:
    """A forked child (the trainer's ranks, a loader's pool) shares its parent's open lock
    files, and a lock lives until every descriptor of it is closed: a child that outlived its
    test would hold the box after the test let go. Children never take the box."""
    global _where, _shared_fd, _alone_fds, _alone_depth
    for fd in ([_shared_fd] if _shared_fd is not None else []) + _alone_fds:
        os.close(fd)
    _where, _shared_fd, _alone_fds, _alone_depth = None, None, [], 0


os.register_at_fork(after_in_child=_forget_in_child)


def use(directory: Path) -> None:
    """Keep the lock files in ``directory`` (one every worker of the session sees)."""
    global _where
    _where = directory
    directory.mkdir(parents=True, exist_ok=True)


def ready() -> bool:
    """Whether :func:`use` was called in this process."""
    return _where is not None


def _open(name: str) -> int:
    return os.open(_where / name, os.O_RDWR | os.O_CREAT, 0o644)


def _take_share() -> None:
    global _shared_fd
    door, box = _open("door"), _open("box")
    try:
        fcntl.flock(door, fcntl.LOCK_EX)
        fcntl.flock(box, fcntl.LOCK_SH)
    finally:
        os.close(door)  # closing the door's only descriptor releases it
    _shared_fd = box


def _drop_share() -> None:
    global _shared_fd
    if _shared_fd is not None:
        os.close(_shared_fd)
        _shared_fd = None


@contextmanager
def shared():
    """Hold the box with the other worker's tests, not with its recordings."""
    if _where is None:
        yield
        return
    _take_share()
    try:
        yield
    finally:
        _drop_share()


@contextmanager
def stepped_aside():
    """Let go of this test's share while it waits on the other worker (a shared run that
    worker is making alone would otherwise wait for this test, and this test for it)."""
    held = _shared_fd is not None
    _drop_share()
    try:
        yield
    finally:
        if held:
            _take_share()


@contextmanager
def _exclusive():
    _alone_fds[:] = [_open("door"), _open("box")]
    try:
        for fd in _alone_fds:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in _alone_fds:
            os.close(fd)
        _alone_fds.clear()


@contextmanager
def alone():
    """Have the box to this recording alone (re-entrant; a no-op outside a pytest session)."""
    global _alone_depth
    with ExitStack() as stack:
        if _where is not None and not _alone_depth:  # the outermost recording takes the box
            stack.enter_context(stepped_aside())
            stack.enter_context(_exclusive())
        _alone_depth += 1
        try:
            yield
        finally:
            _alone_depth -= 1
