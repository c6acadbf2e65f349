"""Progress of a long command (convert, export, verify): for people, or JSON lines for the Prefect task.

``bar`` is for people: a tqdm bar with ETA when the stream is a terminal, and otherwise (a log
file, a pipe, a container's log) one whole line every ``LINE_SECONDS`` and one at the end, never
a carriage-return update that a log would keep as one endless line. (None at the start: a run
that fails at once still says only its one error line.)
The Prefect task runs the conversion in a child process and parses ``--progress jsonl`` lines
from its stderr. Every mode reports tensors and bytes done and the current RSS.

``CKPTCONV_TEST_HOLD_AT`` is a test hook (see :class:`Hold`): a run stops itself at a named event,
so that a test interrupts it at a known point however fast or slow the machine is.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping, TextIO

from ckptconv.monitor import current_rss_bytes

GIB = 1024**3
MIB = 1024**2
LINE_SECONDS = 10.0  # between two progress lines without a terminal
JSONL_SECONDS = 0.5  # at most one ``progress`` event per this interval (and one when every byte is done)
HOLD_ENV = "CKPTCONV_TEST_HOLD_AT"


@dataclass
class Hold:
    """Where a test wants the run held: ``CKPTCONV_TEST_HOLD_AT=KIND[:SHARE]``, unset (hold nothing) in production.

    Right after printing its first ``KIND`` event (``plan``, ``progress``, ...; ``jsonl`` mode only) the process
    stops itself with SIGSTOP, once; the test that set it sees the line, finds the process stopped, and signals,
    kills or continues it (SIGCONT) at that point. With ``progress:SHARE`` the event is the first at or past that
    share of the bytes, printed when the share is reached rather than at the next interval. A test that only
    reacts to a line races the run: a fast run may have gone past the point, or finished, before the test acts.
    """

    kind: str = ""
    share: float = 0.0
    held: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Hold:
        kind, _, share = env.get(HOLD_ENV, "").partition(":")
        return cls(kind, float(share) if share else 0.0)  # a malformed share fails the test that set it, loudly

    def due(self, kind: str, done: float) -> bool:
        """Whether an event ``kind`` with ``done`` (share of the bytes, 0 to 1) is where the run is to be held."""
        return not self.held and kind == self.kind and done >= self.share

    def stop(self) -> None:
        self.held = True
        os.kill(os.getpid(), signal.SIGSTOP)


class Progress:
    """Counts tensors and bytes written; renders as ``bar``, ``jsonl`` or ``none``.

    ``clock`` is this object's own (``time.monotonic`` unless given): a test drives it without touching
    the process-wide clock that other threads in the same process read. ``hold`` defaults to the
    environment's (:class:`Hold`).
    """

    def __init__(self, total_tensors: int, total_bytes: int, mode: str = "bar", stream: TextIO = sys.stderr,
                 desc: str = "convert", clock: Callable[[], float] = time.monotonic, hold: Hold | None = None) -> None:
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self._hold = Hold.from_env() if hold is None else hold
        self.tensors = self.bytes = 0
        self.mode, self.stream, self.desc = mode, stream, desc
        self._clock = clock
        self._last_emit = self._start = clock()
        self._bar = None
        self._lines = mode == "bar" and not _is_terminal(stream)
        if mode == "bar" and not self._lines:
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=stream,
                             desc=desc, dynamic_ncols=True, mininterval=0.5)

    def advance(self, tensors: int, nbytes: int) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        rss = current_rss_bytes()
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors, rss {rss / GIB:.2f} GiB", refresh=False)
            self._bar.update(nbytes)
        elif self._lines:
            if self._clock() - self._last_emit >= LINE_SECONDS:
                self._line(rss)
        elif self.mode == "jsonl":
            now = self._clock()
            if (now - self._last_emit >= JSONL_SECONDS or self.bytes >= self.total_bytes
                    or self._hold.due("progress", self._share())):
                self._last_emit = now
                self.event("progress", tensors=self.tensors, total_tensors=self.total_tensors,
                           bytes=self.bytes, total_bytes=self.total_bytes, rss_bytes=rss)

    def event(self, kind: str, **fields: object) -> None:
        """One machine-readable line (only in ``jsonl`` mode)."""
        if self.mode == "jsonl":
            self.stream.write("CKPTCONV " + json.dumps({"event": kind, **fields}, allow_nan=False) + "\n")
            self.stream.flush()
            if self._hold.due(kind, self._share()):
                self._hold.stop()

    def _share(self) -> float:
        return self.bytes / self.total_bytes if self.total_bytes else 1.0

    def _line(self, rss: int) -> None:
        """One whole line: share done, bytes, tensors, rate, ETA, RSS."""
        now = self._clock()
        self._last_emit = now
        elapsed = now - self._start
        rate = self.bytes / elapsed if elapsed > 0 else 0.0
        left = max(self.total_bytes - self.bytes, 0)
        eta = _clock(left / rate) if rate > 0 else "?"
        share = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        unit, size = ("GiB", GIB) if self.total_bytes >= GIB else ("MiB", MIB)
        self.stream.write(f"{self.desc}: {share:3.0f}% {self.bytes / size:.2f}/{self.total_bytes / size:.2f} {unit}, "
                          f"{self.tensors}/{self.total_tensors} tensors, {rate / MIB:.1f} MiB/s, "
                          f"elapsed {_clock(elapsed)}, ETA {eta}, rss {rss / GIB:.2f} GiB\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._lines:
            self._line(current_rss_bytes())


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal behind it
        return False


def _clock(seconds: float) -> str:
    """``H:MM:SS``, as tqdm shows times."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
