"""The range-name grammar (DESIGN.md contract 1): ``<kind>:<op> key=value ...``.

This module is the only place that formats or parses range names. Unknown kinds and
tags are preserved so that users can extend the vocabulary without breaking analysis.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# An op never starts with ':' so that C++ op names like "aten::mm" or "c10d::send" are not
# mistaken for ranges of kind "aten".
_HEAD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):([A-Za-z0-9_][A-Za-z0-9_.\-/]*)$")
_TAG_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class RangeName:
    kind: str
    op: str
    tags: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return format_name(self.kind, self.op, **self.tags)

    @property
    def is_wait(self) -> bool:
        return self.op == "wait"


def _format_value(value) -> str:
    text = str(value)
    if not text or any(c.isspace() for c in text) or "=" in text:
        raise ValueError(f"tag value {value!r} must be non-empty and contain no spaces or '='")
    return text


def format_name(kind: str, op: str, /, **tags) -> str:
    """``format_name("pp", "send_fwd", peer=5, mb=3)`` -> ``"pp:send_fwd peer=5 mb=3"``.

    Tags keep the order they were given in; ``None`` values are dropped so callers can pass
    optional tags (``chunk=None`` when not interleaved) without branching.
    """
    head = f"{kind}:{op}"
    if not _HEAD.match(head):
        raise ValueError(f"bad range name {head!r}: expected '<kind>:<op>' with no spaces")
    parts = [head]
    for key, value in tags.items():
        if value is None:
            continue
        if not _TAG_KEY.match(key):
            raise ValueError(f"bad tag key {key!r} in range {head!r}")
        parts.append(f"{key}={_format_value(value)}")
    return " ".join(parts)


def _parse_value(text: str):
    # Only canonical integers become ints, so that "007" round-trips as written.
    if text.isdigit() or (text[:1] == "-" and text[1:].isdigit()):
        as_int = int(text)
        if str(as_int) == text:
            return as_int
    return text


def parse_name(name: str) -> RangeName | None:
    """Parse a contract-1 range name, or return None for anything else (``aten::mm``,
    ``ProfilerStep#3``, free text)."""
    if not isinstance(name, str) or ":" not in name:
        return None
    head, *rest = name.split(" ")
    match = _HEAD.match(head)
    if match is None:
        return None
    tags = {}
    for item in rest:
        if not item:
            return None
        key, sep, value = item.partition("=")
        if not sep or not value or not _TAG_KEY.match(key):
            return None
        tags[key] = _parse_value(value)
    return RangeName(match.group(1), match.group(2), tags)
