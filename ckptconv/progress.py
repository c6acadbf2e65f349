"""Progress of a long command (convert, export, verify): for people, or JSON lines for the Prefect task.

``bar`` is for people: a tqdm bar with ETA when the stream is a terminal, and otherwise (a log
file, a pipe, a container's log) one whole line every ``LINE_SECONDS`` and one at the end, never
a carriage-return update that a log would keep as one endless line. (None at the start: a run
that fails at once still says only its one error line.)
The Prefect task runs the conversion in a child process and parses ``--progress jsonl`` lines
from its stderr. Every mode reports tensors and bytes done and the current RSS.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable, TextIO

from ckptconv.monitor import current_rss_bytes

GIB = 1024**3
MIB = 1024**2
LINE_SECONDS = 10.0  # between two progress lines without a terminal


class Progress:
    """Counts tensors and bytes written; renders as ``bar``, ``jsonl`` or ``none``.

    ``clock`` is this object's own (``time.monotonic`` unless given): a test drives it without touching
    the process-wide clock that other threads in the same process read.
    """

    def __init__(self, total_tensors: int, total_bytes: int, mode: str = "bar", stream: TextIO = sys.stderr,
                 desc: str = "convert", clock: Callable[[], float] = time.monotonic) -> None:
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
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
            if now - self._last_emit >= 0.5 or self.bytes >= self.total_bytes:
                self._last_emit = now
                self.event("progress", tensors=self.tensors, total_tensors=self.total_tensors,
                           bytes=self.bytes, total_bytes=self.total_bytes, rss_bytes=rss)

    def event(self, kind: str, **fields: object) -> None:
        """One machine-readable line (only in ``jsonl`` mode)."""
        if self.mode == "jsonl":
            self.stream.write("CKPTCONV " + json.dumps({"event": kind, **fields}, allow_nan=False) + "\n")
            self.stream.flush()

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
