"""What every hostile-input test asserts, written once (issue 15): the real ``pptrace``
command in a subprocess (so stderr, exit codes, signals and file descriptors are real),
one line on stderr and no traceback, and trace files left byte for byte as they were.

    before = checksums(run_dir)
    r = pptrace("analyze", run_dir, "--json")
    one_line_error(r, "rank2.json")          # exit 1, one stderr line naming what is wrong
    assert checksums(run_dir) == before
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path


def pptrace(*args, timeout: float = 120, env: dict | None = None, stdin=None, **kwargs) -> subprocess.CompletedProcess:
    """``python -m pptrace ARGS`` with text output; no colours, a fixed width unless ``env``
    says otherwise."""
    full_env = {**os.environ, "PYTHONWARNINGS": "default", "NO_COLOR": "1", "COLUMNS": "120",
                "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("PPTRACE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "pptrace", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                          **kwargs)


def no_traceback(result: subprocess.CompletedProcess) -> None:
    for stream in (result.stdout, result.stderr):
        assert "Traceback" not in stream and "internal error" not in stream, stream[-2000:]


def stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def one_line_error(result: subprocess.CompletedProcess, *must_contain: str, code: int = 1) -> str:
    """The command failed with ``code`` and said why in exactly one stderr line that holds
    every ``must_contain``; returns that line."""
    no_traceback(result)
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    lines = stderr_lines(result)
    assert len(lines) == 1, lines
    for part in must_contain:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def checksums(root) -> dict:
    """relative path -> sha256 of every regular file under ``root`` except pptrace's cache
    (the trace files a command must never modify)."""
    root = Path(root)
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and ".pptrace-cache" not in path.parts:
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
