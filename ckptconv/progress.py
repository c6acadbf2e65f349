"""Progress of a conversion: a tqdm bar for people, or JSON lines for the Prefect task.

The Prefect task runs the conversion in a child process and parses ``--progress jsonl``
lines from its stderr; both modes report tensors and bytes done and the current RSS.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TextIO

from ckptconv.monitor import current_rss_bytes

GIB = 1024**3


class Progress:
    """Counts tensors and bytes written; renders as ``bar``, ``jsonl`` or ``none``."""

    def __init__(self, total_tensors: int, total_bytes: int, mode: str = "bar", stream: TextIO = sys.stderr,
                 desc: str = "convert") -> None:
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self.tensors = self.bytes = 0
        self.mode, self.stream = mode, stream
        self._last_emit = 0.0
        self._bar = None
        if mode == "bar":
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
        elif self.mode == "jsonl":
            now = time.monotonic()
            if now - self._last_emit >= 0.5 or self.bytes >= self.total_bytes:
                self._last_emit = now
                self.event("progress", tensors=self.tensors, total_tensors=self.total_tensors,
                           bytes=self.bytes, total_bytes=self.total_bytes, rss_bytes=rss)

    def event(self, kind: str, **fields: object) -> None:
        """One machine-readable line (only in ``jsonl`` mode)."""
        if self.mode == "jsonl":
            self.stream.write("CKPTCONV " + json.dumps({"event": kind, **fields}, allow_nan=False) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
