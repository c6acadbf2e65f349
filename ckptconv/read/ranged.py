"""Ranged reads from a remote store, and the retries that make them survive a flaky network.

Reads are ranged GETs streamed straight into a buffer of the requested size: no shard is
downloaded whole and nothing touches the disk, so memory is what the caller asked for.
Transient failures (429, 5xx, dropped connections, short bodies) are retried with
exponential backoff within the run's deadlines, resuming from the last byte received;
anything else fails at once with one line naming the file. The GCS and hub sources
(:mod:`ckptconv.read.gcs`, :mod:`ckptconv.read.hub`) read through :func:`ranged_read`.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable


from ckptconv.errors import CkptConvError, RemoteError, stop_if_terminated
from ckptconv.read.buffers import empty as reusable_empty
from ckptconv.read.waits import DEADLINE_ENV, REQUEST_ENV, Deadlines, announced

log = logging.getLogger("ckptconv")

# Files a conversion reads; provenance pins these (a README edit does not change a GCS fingerprint).
CONFIG_FILE = "config.json"
CHECKPOINT_SUFFIXES = (".safetensors", ".safetensors.index.json")

Sink = Callable[[bytes], None]


def checkpoint_files(names) -> list[str]:
    """The names among ``names`` that a conversion may read: config and safetensors files."""
    return sorted(n for n in names if n == CONFIG_FILE or n.endswith(CHECKPOINT_SUFFIXES))


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: waits ``first_wait * 2**k`` (capped) between attempts."""

    attempts: int = 6
    first_wait: float = 0.5
    max_wait: float = 8.0

    def wait(self, failures: int) -> float:
        return min(self.max_wait, self.first_wait * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)


def ranged_read(where: str, offset: int, length: int, fetch: Callable[[int, int, Sink], None],
                is_transient: Callable[[BaseException], bool], policy: RetryPolicy, deadlines: Deadlines,
                endpoint: str) -> memoryview:
    """``length`` bytes from ``offset``: ``fetch(start, count, sink)`` streams them into ``sink``.

    A failed or short attempt is retried for the bytes still missing, so a dropped
    connection late in a 100 MB range costs only the rest of it. Each attempt is announced
    while it waits; the read gives up after ``policy.attempts`` failures in a row or
    ``deadlines.total_seconds`` without a byte, in one line naming the endpoint.
    """
    view = memoryview(reusable_empty(length))  # not bytearray(length): it zeroes what the read overwrites
    done = 0

    def sink(chunk: bytes) -> None:
        nonlocal done
        end = done + len(chunk)
        if end > length:
            raise RemoteError(f"{where}: server sent more than the {length} bytes asked for at offset {offset}")
        view[done:end] = chunk
        done = end

    retries = Retries(where, endpoint, policy, deadlines)
    while True:
        before = done
        try:
            with announced(f"{where} (bytes {offset + done}-{offset + length - 1} from {endpoint})", deadlines):
                fetch(offset + done, length - done, sink)
            if done == length:
                return view
            error: BaseException = _ShortRead(f"body ended after {done - before} of {length - before} bytes")
        except CkptConvError:
            raise
        except Exception as err:  # classified just below; the non-transient ones fail at once, in one line
            if not is_transient(err):
                raise RemoteError(f"{where}: read failed at byte {offset + done}: {one_line(err)}") from err
            error = err
        retries.failed(error, progressed=done > before, at=f" at byte {offset + done}")


class Retries:
    """The retry budget of one remote operation: attempts in a row, and time without progress."""

    def __init__(self, where: str, endpoint: str, policy: RetryPolicy, deadlines: Deadlines) -> None:
        self.where, self.endpoint, self.policy, self.deadlines = where, endpoint, policy, deadlines
        self.failures = 0
        self.stalled_since = time.monotonic()

    def failed(self, error: BaseException, progressed: bool = False, at: str = "") -> None:
        """Sleep before the next attempt, or raise the one-line error if the budget is spent."""
        now = time.monotonic()
        if progressed:  # bytes arrived: the count and the clock start again
            self.failures, self.stalled_since = 0, now
        self.failures += 1
        wait = self.policy.wait(self.failures)
        stalled = now - self.stalled_since
        if self.failures >= self.policy.attempts or stalled + wait > self.deadlines.total_seconds:
            raise RemoteError(
                f"{self.where}: giving up on {self.endpoint} after {self.failures} failed attempts in {stalled:.0f}s "
                f"({DEADLINE_ENV}={self.deadlines.total_seconds:g}s, {REQUEST_ENV}={self.deadlines.request_seconds:g}s)"
                f"{at}: {one_line(error)}")
        stop_if_terminated()  # a stop signal does not wait out the backoff
        log.warning("%s: transient error%s from %s (%s); retrying in %.1fs (attempt %d of %d, %.0fs left)",
                    self.where, at, self.endpoint, one_line(error), wait, self.failures + 1, self.policy.attempts,
                    self.deadlines.total_seconds - stalled - wait)
        time.sleep(wait)


class _ShortRead(Exception):
    """The server closed a response early without an error; the rest is asked for again."""


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


class SinkFile:
    """The file-like object google-cloud-storage downloads into: forwards every write to a sink."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    def write(self, data: bytes) -> int:
        self._sink(data)
        return len(data)
