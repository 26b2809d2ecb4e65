"""User-facing errors. The CLI turns a TraceError into a one-line message and exit code 1."""
from __future__ import annotations


class TraceError(Exception):
    """Bad input: the message is one line saying what is wrong, in which file, and what to do."""

    def __init__(self, message: str):
        # One line, always: a message that spans lines reads like a traceback.
        super().__init__(" ".join(str(message).split()))
