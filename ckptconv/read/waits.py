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


@dataclass(eq=False)
class _Wait:
    """One outstanding wait: announced every ``every`` seconds since ``since`` (its start, or its
    last progress); given up after ``give_up_after`` seconds without progress, if it has a ``give_up``."""

    what: str
    every: float
    since: float
    unit: str = "so far"  # how the announced seconds read: since the start, or without progress
    give_up_after: float = math.inf
    give_up: Callable[[str], None] | None = None
    announced: int = 0

    def progressed(self) -> None:
        self.since, self.announced = time.monotonic(), 0


class _Board:
    """Outstanding waits, announced (and given up) by one daemon thread, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: set[_Wait] = set()
        self._thread: threading.Thread | None = None

    def add(self, wait: _Wait) -> _Wait:
        with self._lock:
            self._waits.add(wait)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptconv-waits", daemon=True)
                self._thread.start()
        return wait

    def remove(self, wait: _Wait) -> None:
        with self._lock:
            self._waits.discard(wait)

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                waits = list(self._waits)
            for wait in waits:
                idle = time.monotonic() - wait.since
                if wait.give_up is not None and idle >= wait.give_up_after:
                    self.remove(wait)
                    wait.give_up(f"giving up on {wait.what}: no progress for {idle:.0f}s ({DEADLINE_ENV}="
                                 f"{wait.give_up_after:g}); the destination is incomplete and a rerun resumes or "
                                 "redoes it")
                elif int(idle // wait.every) > wait.announced:
                    wait.announced = int(idle // wait.every)
                    log.warning("ckptconv: still waiting for %s (%.0fs %s)", wait.what, idle, wait.unit)


_BOARD = _Board()


@contextlib.contextmanager
def announced(what: str, deadlines: Deadlines) -> Iterator[None]:
    """While the block runs, say every ``announce_seconds`` that we still wait for ``what``."""
    wait = _BOARD.add(_Wait(what, deadlines.announce_seconds, time.monotonic()))
    try:
        yield
    finally:
        _BOARD.remove(wait)


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
    wait = _BOARD.add(_Wait(what, deadlines.announce_seconds, time.monotonic(), "without progress",
                            deadlines.total_seconds, give_up))
    try:
        yield wait.progressed
    finally:
        _BOARD.remove(wait)


@contextlib.contextmanager
def watched_writes(target: str, endpoint: str) -> Iterator[Callable[[], None]]:
    """On gs://, a client library (tensorstore, gcsfs) retries a failing or mute endpoint by itself,
    silently: say while no write settles that we wait for them, and give up in one line after the
    remote deadline. Elsewhere the yielded ``tick`` does nothing."""
    if not target.startswith("gs://"):
        yield lambda: None
        return
    with watched(f"writes to {target} at {endpoint}", Deadlines.from_env()) as tick:
        yield tick
