"""Peak memory from the kernel and wall time per stage: the numbers users compare tools by.

Peak RSS is the kernel's own high-water mark (``VmHWM``), not a sampling thread that
misses short peaks, wherever the kernel keeps one. Where it does not (gVisor, as GKE Sandbox and
TPU VM hosts run it: ``/proc/self/status`` there has ``VmRSS`` only), a thread samples ``VmRSS``
every ``PEAK_SAMPLE_SECONDS`` from the first :class:`StageTimer` on; never ``ru_maxrss``, which
Linux and gVisor carry across ``exec`` from a parent. The report names the source it used. Stage times from worker threads add up as busy seconds, so with reads
overlapping writes their sum can exceed the wall time; the report says both.

For the picture (RSS over time, stages as bands) a conversion also samples its RSS a few times a
second and records when each stage was busy (``timeline``): bounded in size, however long the run.
"""

from __future__ import annotations

import resource
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ckptconv.settings import STAGES



HWM = "VmHWM"  # the kernel's high-water mark of this address space
SAMPLED = "sampled VmRSS"  # the most VmRSS seen by the sampling thread (a peak between samples can be missed)
MAXRSS = "ru_maxrss"  # no /proc at all: the only figure left (it may be a parent's)
PEAK_SAMPLE_SECONDS = 0.01


def peak_source(status: str | None) -> str:
    """Where this process's own peak can come from, given the text of its ``/proc/self/status`` (None: unreadable):
    ``VmHWM`` where the kernel keeps it, sampled ``VmRSS`` where it does not (gVisor), ``ru_maxrss`` without /proc.

    >>> peak_source("VmPeak: 9 kB\\nVmHWM: 5 kB\\nVmRSS: 4 kB"), peak_source("VmRSS: 4 kB"), peak_source(None)
    ('VmHWM', 'sampled VmRSS', 'ru_maxrss')
    """
    if status is None:
        return MAXRSS
    return HWM if any(line.startswith("VmHWM:") for line in status.splitlines()) else SAMPLED


def _status() -> str | None:
    try:
        with open("/proc/self/status") as f:
            return f.read()
    except OSError:
        return None


def _status_kib(status: str, field: str) -> int | None:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


class PeakWatch:
    """The most RSS seen, sampled every ``interval`` seconds in a daemon thread (where no ``VmHWM`` is kept)."""

    def __init__(self, interval: float = PEAK_SAMPLE_SECONDS) -> None:
        self.interval, self.peak = interval, current_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptconv-peak", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        rss = current_rss_bytes()
        self.peak = max(self.peak, rss)
        trim_past_the_line(rss)
        return self.peak

    def stop(self) -> None:
        """End the sampling thread: the process's own watch runs as long as the process, a test's must not (at
        a test's 5 ms it took the GIL 200 times a second from every later test in that worker)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


_WATCH: list[PeakWatch] = []  # this process's sampler, started once where no VmHWM is kept


def watch_peak() -> None:
    """Start sampling this process's RSS if the kernel keeps no high-water mark of it (once per process)."""
    if not _WATCH and peak_source(_status()) == SAMPLED:
        _WATCH.append(PeakWatch())


def peak_rss() -> tuple[int, str]:
    """This process's own RSS high-water mark so far, and its source (:func:`peak_source`).

    Not ``ru_maxrss`` where anything else is there: Linux and gVisor carry it across ``exec``, so a child forked from
    a big parent (a Prefect worker, a test process that imported torch) would report the parent's size; ``VmHWM``
    belongs to the address space this program runs in, and so does the sampled ``VmRSS``."""
    status = _status()
    source = peak_source(status)
    if source == HWM:
        return _status_kib(status, "VmHWM"), HWM
    if source == SAMPLED:
        now = current_rss_bytes()
        return (max(_WATCH[0].sample(), now) if _WATCH else now), SAMPLED
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, MAXRSS


def peak_rss_bytes() -> int:
    """This program's RSS high-water mark so far (:func:`peak_rss`)."""
    return peak_rss()[0]


def current_rss_bytes() -> int:
    """Resident set size now, from ``/proc/self/statm`` (else ``VmRSS``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        status = _status()
        return (_status_kib(status, "VmRSS") or 0) if status else 0


def run_figures(timer: "StageTimer", output_bytes: int) -> dict:
    """What every report says of its own run: busy seconds per stage, wall seconds, peak RSS, and
    CPU seconds (all threads, user + system) in total and per GiB written, to size a VM by."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    peak, source = peak_rss()
    figures = {"stage_seconds": timer.as_dict(), "wall_seconds": round(timer.wall(), 3),
               "peak_rss_bytes": peak, "peak_rss_source": source, "cpu_seconds": round(cpu, 3),
               "cpu_seconds_per_gib": round(cpu / (output_bytes / 2**30), 3) if output_bytes else None}
    if timer.sampler is not None:
        figures["timeline"] = timer.timeline()
    return figures


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a daemon thread, in at most ``max_points``.

    When the list is full, neighbouring pairs are merged into one point holding the larger RSS and the
    interval doubles: a 10-hour run keeps as many points as a 10-second one, and no peak between
    samples that were taken is lost to the thinning. (Peaks between samples are what ``VmHWM`` is for.)
    """

    def __init__(self, clock, interval: float = 0.25, max_points: int = 400, rss=None) -> None:
        """``clock`` and ``rss`` (bytes now; default :func:`current_rss_bytes`) are this sampler's own, so a test
        drives one sampler without touching what any other sampler thread in the process reads."""
        self.clock, self.interval, self.max_points = clock, interval, max_points
        self.rss = current_rss_bytes if rss is None else rss
        self.points: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ckptconv-rss", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        with self._lock:
            self.points.append((round(self.clock(), 3), self.rss()))
            if len(self.points) > self.max_points:
                pairs = zip(self.points[0::2], self.points[1::2] + [None])
                self.points = [a if b is None else (a[0], max(a[1], b[1])) for a, b in pairs]
                self.interval *= 2

    def stop(self) -> list[tuple[float, int]]:
        """Stop sampling (after one last sample); returns the points, ``(seconds since start, bytes)``."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.sample()
        with self._lock:
            return list(self.points)

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval):
            self.sample()


class StageTimer:
    """Thread-safe accumulator of seconds per named stage, and of when each stage was busy (spans).

    Spans of one stage closer than ``SPAN_GAP_FRACTION`` of the run so far (at least
    ``MIN_SPAN_GAP`` seconds) merge into one band: a stage busy tile after tile is one band, and a
    long run has at most a few hundred per stage. ``sample_rss`` also samples RSS (``RssSampler``).
    """

    MIN_SPAN_GAP = 0.25
    SPAN_GAP_FRACTION = 0.005

    def __init__(self, sample_rss: bool = False) -> None:
        self.seconds: dict[str, float] = {stage: 0.0 for stage in STAGES}
        self.spans: dict[str, list[list[float]]] = {}
        self._lock = threading.Lock()
        self.started = time.perf_counter()
        self.sampler = RssSampler(self.wall) if sample_rss else None
        watch_peak()  # where the kernel keeps no high-water mark, from the run's start

    def add(self, stage: str, seconds: float, start: float | None = None) -> None:
        """Add busy seconds to ``stage``; ``start`` (seconds since the timer started) places its span,
        by default ending now."""
        start = self.wall() - seconds if start is None else start
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self._add_span(stage, max(start, 0.0), max(start, 0.0) + seconds)

    def _add_span(self, stage: str, start: float, end: float) -> None:
        spans = self.spans.setdefault(stage, [])
        gap = max(self.MIN_SPAN_GAP, self.SPAN_GAP_FRACTION * end)
        if spans and start - spans[-1][1] <= gap:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start, start - self.started)

    def wall(self) -> float:
        return time.perf_counter() - self.started

    def timeline(self) -> dict:
        """RSS samples ``[seconds, bytes]`` and busy spans ``{stage: [[start, end], ...]}`` (seconds since start);
        stops the sampler."""
        rss = self.sampler.stop() if self.sampler is not None else []
        with self._lock:
            spans = {stage: [[round(a, 3), round(b, 3)] for a, b in self.spans[stage]]
                     for stage in STAGES if stage in self.spans}
        return {"rss": [[t, b] for t, b in rss], "spans": spans}

    def close(self) -> None:
        """Stop the RSS sampler, if any (idempotent: after :meth:`timeline` it is already stopped)."""
        if self.sampler is not None:
            self.sampler.stop()

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {name: round(value, 3) for name, value in self.seconds.items()}


def tune_malloc(mmap_threshold: int | None = None, arenas: int = 2) -> None:
    """Make freed tile buffers go back to the OS, so RSS tracks what is alive.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB),
    after which tile-sized buffers come from the heap and stay resident when freed; and each
    tensorstore thread may get its own arena. Fixing the threshold and capping arenas (what
    ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_ARENA_MAX`` do, but settable after start) keeps the
    peak at the live data. A no-op where glibc's ``mallopt`` is missing. ``mmap_threshold`` None: 1 MiB, or
    ``settings.SANDBOX_MMAP_THRESHOLD`` on a kernel without ``VmHWM`` (gVisor), where each page fault of a fresh
    mapping costs several times more (issue 38; the estimate counts what the heap then keeps).

    The arena cap binds only if set before threads have made their arenas: arenas are never freed,
    and once a thread has found more than 8 glibc fixes its limit at 8 per core and never reads
    ``M_ARENA_MAX`` again. So the CLI calls this at its entry, before any thread starts; called
    first after JAX had started, a conversion ran on 16 arenas (2 cores), each holding its own freed
    chunk buffers, and peaked higher the busier the machine (see ``cli.run``).
    """
    import ctypes

    global _LIBC
    if mmap_threshold is None:
        mmap_threshold = default_mmap_threshold(_status())
    try:
        # the process's own symbols, libc's among them: ctypes.util.find_library would run `ldconfig -p` in a
        # child process at every start of the CLI
        libc = ctypes.CDLL(None)
        m_mmap_threshold, m_arena_max = -3, -8
        libc.mallopt(m_mmap_threshold, mmap_threshold)
        libc.mallopt(m_arena_max, arenas)
        _LIBC = libc if hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        pass


def default_mmap_threshold(status: str | None) -> int:
    """glibc's mmap threshold for a process whose ``/proc/self/status`` reads ``status``: 1 MiB (freed tiles leave
    RSS at once), or ``settings.SANDBOX_MMAP_THRESHOLD`` where the kernel keeps no ``VmHWM`` (gVisor's page faults)."""
    from ckptconv import settings

    return settings.SANDBOX_MMAP_THRESHOLD if peak_source(status) == SAMPLED else 1 << 20


_LIBC = None
TRIM_EVERY_BYTES = 64 << 20
_trim_due = [TRIM_EVERY_BYTES]
_trim_line: list[int | None] = [None]


def trim_only_above(rss_bytes: int | None) -> None:
    """From now on :func:`trim` gives pages back only while this process's resident set is above ``rss_bytes``
    (None: always, the default). A conversion on a sandboxed kernel sets its predicted peak less the heap's term
    (``plan.estimate.trim_line``): there the heap's free pages are counted in the prediction, and each page given back
    is faulted in again for the next buffers at a cost far above what it frees (on the 13-core TPU host, Llama-3-8B's
    widths with 8 layers spent 96-116 CPU-s with a trim every 64 MiB and at each commit, 39-49 without, docs/speed.md).
    Past the line the heap is still trimmed, so what a long run's heap gathers stays within the prediction."""
    _trim_line[0] = rss_bytes


# The sampler's trims (trim_past_the_line) come at most this often: where what is live itself stands above the line,
# a trim every sample would give back and fault in the heap's free pages 100 times a second.
SAMPLER_TRIM_SECONDS = 0.05
_sampler_trimmed = [0.0]


def trim_past_the_line(rss_bytes: int) -> None:
    """Trim at once where the resident set ``rss_bytes`` (just sampled) has passed the line :func:`trim_only_above`
    set; nothing where no line is set. :class:`PeakWatch` calls it at each sample (every 10 ms, where the kernel keeps
    no ``VmHWM``, which is where a line is set): the writer's trims come after each 64 MiB written, and between two of
    them 12 workers had freed and taken enough of the heap to pass the line by up to 341 MiB (Llama-3-70B's widths on
    the 13-core TPU host, 16 devices: 1814-2140 MiB against 1986 predicted, the line at 1799; docs/speed.md)."""
    line = _trim_line[0]
    if line is None or rss_bytes <= line or _LIBC is None:
        return
    now = time.monotonic()
    if now - _sampler_trimmed[0] >= SAMPLER_TRIM_SECONDS:
        _sampler_trimmed[0] = now
        _LIBC.malloc_trim(0)


def trim_now_and_then(nbytes: int) -> None:
    """Give free heap pages back to the OS after every ``TRIM_EVERY_BYTES`` written.

    Buffers below the mmap threshold (compressed chunks, zstd state) come from the heap; freed
    in a different order from the one they were allocated in, they leave resident holes that
    add up over a long run. ``malloc_trim`` returns every free page, not only the heap's top.
    """
    _trim_due[0] -= nbytes
    if _trim_due[0] <= 0:
        trim()


def trim() -> None:
    """Give every free heap page back to the OS now, unless the resident set is within the line
    :func:`trim_only_above` set (and restart ``trim_now_and_then``'s count).

    The writer calls it once a data file is committed: the commit frees the transaction's chunks and
    their compressed copies together (twice the data file), and left resident until the next trim
    they stood beside the next transaction's chunks at its commit."""
    _trim_due[0] = TRIM_EVERY_BYTES
    line = _trim_line[0]
    if _LIBC is not None and (line is None or current_rss_bytes() > line):
        _LIBC.malloc_trim(0)
