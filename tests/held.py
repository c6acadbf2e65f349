"""Interrupting a running conversion at a known point, whatever the machine's speed.

A test that reads a child's event line and only then signals it races the child: a fast run (or a
slow test process) may be past the point, or done, before the signal lands. With
``CKPTCONV_TEST_HOLD_AT`` (``ckptconv.progress.Hold``) the child stops itself (SIGSTOP) right after
printing that event; the test waits here until it is stopped, then kills, signals or continues it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ckptconv.progress import HOLD_ENV

__all__ = ["HOLD_ENV", "hold_at", "held_at_event", "wait_held"]


def hold_at(kind: str, share: float | None = None) -> dict[str, str]:
    """The environment that holds a child at its first ``kind`` event (``progress``: at or past ``share``)."""
    return {HOLD_ENV: kind if share is None else f"{kind}:{share}"}


def held_at_event(proc: subprocess.Popen, kind: str) -> None:
    """Read ``proc``'s ``--progress jsonl`` lines (its stderr, text) up to its first ``kind`` event, then wait until
    it has stopped itself there (``hold_at(kind)`` in its environment); fail if it ends without that event."""
    for line in proc.stderr:
        if line.startswith(f'CKPTCONV {{"event": "{kind}"'):
            wait_held(proc.pid)
            return
    raise AssertionError(f"the conversion ended (exit {proc.wait()}) without a {kind} event")


def wait_held(pid: int, timeout: float = 300) -> None:
    """Return once process ``pid`` is stopped; fail naming the reason if it ends first or never stops.

    ``timeout`` only bounds a busy machine: a held child stops microseconds after its line.
    """
    deadline = time.monotonic() + timeout
    while True:
        state = _state(pid)
        if state in ("T", "t"):
            return
        assert state not in (None, "Z", "X"), f"pid {pid} ended before it reached its hold point ({HOLD_ENV})"
        assert time.monotonic() < deadline, f"pid {pid} not held after {timeout} s (state {state})"
        time.sleep(0.01)


def _state(pid: int) -> str | None:
    """The one-letter state of ``/proc/PID/stat`` (R, S, D, T, t, Z, ...), None once the pid is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
