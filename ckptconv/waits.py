"""Bounded, announced waits on remote endpoints (the hub, GCS).

Every remote operation runs under :class:`Deadlines`: each request has a timeout (connecting,
or silence between bytes), and one operation with all its retries has a total deadline, after
which it fails in one line naming the endpoint. While a request is outstanding, :func:`announced`
says so on the ``ckptconv`` logger every ``ANNOUNCE_SECONDS`` ("still waiting for ..."), so a
stalled endpoint is never a silent run. Both figures come from the environment, so a Prefect
deployment or a test can set them without new flags.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from ckptconv.errors import BadInputError

log = logging.getLogger("ckptconv")

REQUEST_ENV = "CKPTCONV_REMOTE_TIMEOUT"  # seconds one request may connect or go silent
DEADLINE_ENV = "CKPTCONV_REMOTE_DEADLINE"  # seconds one operation may take with all its retries
ANNOUNCE_ENV = "CKPTCONV_REMOTE_ANNOUNCE"  # seconds between "still waiting" lines


@dataclass(frozen=True)
class Deadlines:
    """How long one remote request, and one remote operation with its retries, may take."""

    request_seconds: float = 60.0
    total_seconds: float = 900.0
    announce_seconds: float = 15.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Deadlines:
        default = cls()
        return cls(_seconds(env, REQUEST_ENV, default.request_seconds),
                   _seconds(env, DEADLINE_ENV, default.total_seconds),
                   _seconds(env, ANNOUNCE_ENV, default.announce_seconds))


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise BadInputError(f"{name}={text!r}: expected a positive number of seconds")
    return value


class _Board:
    """Outstanding waits, announced by one daemon thread (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[str, float, float]] = {}  # id -> (what, started, every)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, what: str, every: float) -> int:
        with self._lock:
            key = next(self._ids)
            self._waits[key] = (what, time.monotonic(), every)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptconv-waits", daemon=True)
                self._thread.start()
            return key

    def remove(self, key: int) -> None:
        with self._lock:
            self._waits.pop(key, None)

    def _run(self) -> None:
        announced: dict[int, int] = {}  # id -> announcements made
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                waits = dict(self._waits)
            for key in list(announced):
                if key not in waits:
                    del announced[key]
            for key, (what, started, every) in waits.items():
                due = int((now - started) // every)
                if due > announced.get(key, 0):
                    announced[key] = due
                    log.warning("ckptconv: still waiting for %s (%.0fs so far)", what, now - started)


_BOARD = _Board()


@contextlib.contextmanager
def announced(what: str, deadlines: Deadlines) -> Iterator[None]:
    """While the block runs, say every ``announce_seconds`` that we still wait for ``what``."""
    key = _BOARD.add(what, deadlines.announce_seconds)
    try:
        yield
    finally:
        _BOARD.remove(key)


def abandon(message: str) -> None:
    """End the process at once with one error line (exit 1).

    For waits inside tensorstore/Orbax (gs:// destination writes): their own retries cannot be
    interrupted from Python, so a stall past its deadline ends the process. Nothing is lost by
    leaving this way: the destination's report still says "writing", so nothing reads as complete,
    and a rerun resumes or redoes the step.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.write(f"ckptconv: error: {message}\n")
    sys.stderr.flush()
    os._exit(1)


@contextlib.contextmanager
def watched(what: str, deadlines: Deadlines, give_up=abandon) -> Iterator[Callable[[], None]]:
    """Watch an operation that reports progress by calling the yielded ``tick()``.

    While it has not ticked for ``announce_seconds`` it says "still waiting for <what>"; after
    ``total_seconds`` without a tick it calls ``give_up`` with a line naming ``what``.
    """
    last = [time.monotonic()]
    done = threading.Event()

    def tick() -> None:
        last[0] = time.monotonic()

    def watch() -> None:
        every = deadlines.announce_seconds
        next_line = every
        while not done.wait(0.2):
            idle = time.monotonic() - last[0]
            if idle >= deadlines.total_seconds:
                give_up(f"giving up on {what}: no progress for {idle:.0f}s ({DEADLINE_ENV}="
                        f"{deadlines.total_seconds:g}); the destination is incomplete and a rerun resumes or redoes it")
                return
            if idle < next_line - every:  # it progressed since the last line
                next_line = every
            if idle >= next_line:
                next_line += every
                log.warning("ckptconv: still waiting for %s (%.0fs without progress)", what, idle)

    thread = threading.Thread(target=watch, name="ckptconv-watch", daemon=True)
    thread.start()
    try:
        yield tick
    finally:
        done.set()
        thread.join()
