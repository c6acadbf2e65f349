"""Peak memory from the kernel and wall time per stage: the numbers users compare tools by.

Peak RSS is the kernel's own high-water mark (``VmHWM``), not a sampling thread that
misses short peaks. Stage times from worker threads add up as busy seconds, so with reads
overlapping writes their sum can exceed the wall time; the report says both.
"""

from __future__ import annotations

import resource
import threading
import time
from contextlib import contextmanager
from typing import Iterator

STAGES = ("plan", "read", "transform", "write", "commit")


def peak_rss_bytes() -> int:
    """This program's RSS high-water mark so far, from the kernel (``VmHWM``).

    Not ``ru_maxrss``: Linux carries it across ``exec``, so a child forked from a big parent
    (a Prefect worker, a test process that imported torch) would report the parent's size.
    ``VmHWM`` belongs to the address space this program runs in. ``ru_maxrss`` is the
    fallback where ``/proc`` is missing.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    """Resident set size now, from ``/proc/self/statm``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def run_figures(timer: "StageTimer", output_bytes: int) -> dict:
    """What every report says of its own run: busy seconds per stage, wall seconds, peak RSS, and
    CPU seconds (all threads, user + system) in total and per GiB written, to size a VM by."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    return {"stage_seconds": timer.as_dict(), "wall_seconds": round(timer.wall(), 3),
            "peak_rss_bytes": peak_rss_bytes(), "cpu_seconds": round(cpu, 3),
            "cpu_seconds_per_gib": round(cpu / (output_bytes / 2**30), 3) if output_bytes else None}


class StageTimer:
    """Thread-safe accumulator of seconds per named stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {stage: 0.0 for stage in STAGES}
        self._lock = threading.Lock()
        self.started = time.perf_counter()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def wall(self) -> float:
        return time.perf_counter() - self.started

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {name: round(value, 3) for name, value in self.seconds.items()}


def tune_malloc(mmap_threshold: int = 1 << 20, arenas: int = 2) -> None:
    """Make freed tile buffers go back to the OS, so RSS tracks what is alive.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB),
    after which tile-sized buffers come from the heap and stay resident when freed; and each
    tensorstore thread may get its own arena. Fixing the threshold and capping arenas (what
    ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_ARENA_MAX`` do, but settable after start) keeps the
    peak at the live data. A no-op where glibc's ``mallopt`` is missing.
    """
    import ctypes
    import ctypes.util

    global _LIBC
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_mmap_threshold, m_arena_max = -3, -8
        libc.mallopt(m_mmap_threshold, mmap_threshold)
        libc.mallopt(m_arena_max, arenas)
        _LIBC = libc if hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        pass


_LIBC = None
TRIM_EVERY_BYTES = 64 << 20
_trim_due = [TRIM_EVERY_BYTES]


def trim_now_and_then(nbytes: int) -> None:
    """Give free heap pages back to the OS after every ``TRIM_EVERY_BYTES`` written.

    Buffers below the mmap threshold (compressed chunks, zstd state) come from the heap; freed
    in a different order from the one they were allocated in, they leave resident holes that
    add up over a long run. ``malloc_trim`` returns every free page, not only the heap's top.
    """
    _trim_due[0] -= nbytes
    if _trim_due[0] <= 0 and _LIBC is not None:
        _trim_due[0] = TRIM_EVERY_BYTES
        _LIBC.malloc_trim(0)
