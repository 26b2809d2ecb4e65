"""p2p requests whose ranges span post to completion, shared by the integrations.

A library posts its sends/recvs and waits on the returned requests later (or never, when it
only polls them): the range opened at the post is closed by the request's ``wait()``, or by a
later hook that finds the request already completed.
"""
from __future__ import annotations


def nbytes(tensor) -> int | None:
    try:
        return tensor.numel() * tensor.element_size()
    except Exception:  # noqa: BLE001 - whatever the library passes, never break its call
        return None


class Pending:
    """A p2p request as the library sees it: ``wait()`` also closes the request's ranges."""

    __slots__ = ("_work", "_entry")

    def __init__(self, work, entry):
        self._work, self._entry = work, entry

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._entry.done(self._work)

    def __getattr__(self, name):
        return getattr(self._work, name)


class Open:
    """The ranges of one posted batch (or one op of it), closed once all its requests are
    done; it sits in ``pending`` until then."""

    __slots__ = ("regions", "works", "pending")

    def __init__(self, regions, works, pending: set):
        self.regions, self.works, self.pending = regions, list(works), pending
        pending.add(self)

    def done(self, work) -> None:
        self.works = [w for w in self.works if w is not work]
        if not self.works:
            self.close()

    def close(self) -> None:
        for r in reversed(self.regions):
            r.__exit__(None, None, None)
        self.regions = []
        self.pending.discard(self)

    def completed(self) -> bool:
        try:
            return all(w.is_completed() for w in self.works)
        except Exception:  # noqa: BLE001 - a request type without is_completed
            return False
