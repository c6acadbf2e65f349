"""Where a ckptconv command's wall time goes, thread by thread (issue 38; py-spy is not on the TPU host).

``python bench/threadprof.py OUT.json ARGS...`` runs ``ckptconv ARGS...`` in this process with a sampler thread
that every ``INTERVAL`` seconds records each Python thread's innermost frame (what it is doing or waiting in), each
pending asyncio task's innermost coroutine frame and what it awaits, and
every ``CPU_INTERVAL`` seconds each thread's CPU seconds from ``/proc/self/task/*/stat`` (user and system apart;
threads no Python code names keep their kernel name: tensorstore's pools, XLA's). At exit it writes ``OUT.json``:
per thread group CPU seconds, the most seen frames of each Python thread, and a timeline of CPU by group.
The sampler is a thread of its own: it costs a few ms of CPU a second; it tunes malloc as the CLI does before it
starts (so the arena cap binds as in a plain run), but its own samples allocate, so peaks measured under it are near
but not the figures to quote; walls and CPU are.

Each sample also splits the process's resident memory (issue 38: where a gVisor host's extra memory goes):
``VmRSS`` against glibc's ``mallinfo2`` (every arena): bytes malloc has handed out and not had back (``in_use``), free
bytes in its heaps (``heap_free``: glibc still counts a free block whose pages ``malloc_trim`` gave back, so at most
what is resident of them), large blocks it mapped on their own (``mapped``: in use), and the rest (``other``: the
libraries, Python's object arenas, thread stacks, what a library maps itself; at least this much, for that reason).
``memory.at_peak`` is the split of the sample with the highest ``VmRSS``.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import json
import os
import re
import runpy
import sys
import threading
import time

from ckptconv import monitor

INTERVAL = 0.05
CPU_INTERVAL = 0.5
TICK = os.sysconf("SC_CLK_TCK")


def _tasks() -> dict[int, tuple[str, float, float]]:
    """tid -> (kernel name, user s, system s) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[int(tid)] = (comm, int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo():
    """glibc's ``mallinfo2`` (2.33 and later), or None where it is missing."""
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def memory_split(rss: int, info) -> dict[str, int]:
    """Resident bytes split by who holds them (module docstring); ``info``: a ``mallinfo2`` result or None.

    >>> class Info: arena, hblkhd, uordblks, fordblks = 300, 50, 200, 100
    >>> memory_split(1000, Info())
    {'rss': 1000, 'in_use': 200, 'heap_free': 100, 'mapped': 50, 'other': 650}
    """
    if info is None:
        return {"rss": rss}
    return {"rss": rss, "in_use": info.uordblks, "heap_free": info.fordblks, "mapped": info.hblkhd,
            "other": rss - info.arena - info.hblkhd}


def _group(name: str) -> str:
    """A thread's group: its name without the numbers that tell pool threads apart."""
    return re.sub(r"[_\-]?\d+(_\d+)?$", "", name) or name


PARTS = ("memory", "frames", "tasks", "cpu")


class Sampler:
    """``parts``: what each sample records, of ``PARTS``. The frames and tasks of every thread hold the stream's frames
    (and what they refer to) while they are read, and slow it: Mistral-7B's widths on 16 devices converted in 14.5 s
    with a 0.58 GiB peak under them, against 7 s and 0.19 GiB alone (2 cores). ``THREADPROF_PARTS=memory,cpu`` leaves
    them out for a run whose memory is the question."""

    def __init__(self, parts: tuple[str, ...] = PARTS) -> None:
        self.parts = [getattr(self, f"_sample_{part}") for part in parts]
        self.frames: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.awaits: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.names: dict[int, str] = {}  # native tid -> Python thread name
        self.last: dict[int, tuple[str, float, float]] = {}
        self.timeline: list[dict] = []
        self.errors: collections.Counter = collections.Counter()  # a failed sample's message -> how often
        self.start = time.perf_counter()
        self._next_cpu = 0.0  # seconds since start of the next CPU sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="threadprof", daemon=True)
        self._mallinfo = _mallinfo()
        self.memory: list[dict] = []  # each sample's split, with its time
        self.peak: dict = {}  # the split of the sample with the highest VmRSS

    def _run(self) -> None:
        """Sample until stopped; a part of a sample that raises is counted in ``errors`` (by its message) and the rest
        go on: a sampler thread that died on its first error left a profile that looked merely quiet."""
        while not self._stop.wait(INTERVAL):
            for part in self.parts:
                try:  # one failing spares the rest
                    part()
                except Exception as err:  # noqa: BLE001 - reported in the result, sampling goes on
                    self.errors[f"{part.__name__}: {type(err).__name__}: {err}"[:300]] += 1

    def _sample_memory(self) -> None:
        """The resident set (``monitor.current_rss_bytes``: VmRSS) and what glibc's heaps hold (first, so the sample's
        own allocations come after it)."""
        split = memory_split(monitor.current_rss_bytes(), self._mallinfo() if self._mallinfo else None)
        split["t"] = round(time.perf_counter() - self.start, 2)
        self.memory.append(split)
        if split["rss"] > self.peak.get("rss", -1):
            self.peak = split

    def _sample_frames(self) -> None:
        """Each Python thread's innermost frame (and its caller), and its innermost ckptconv frame."""
        frames = sys._current_frames()  # noqa: SLF001 - the profiler's one source
        for thread in threading.enumerate():
            if thread is self._thread or thread.native_id is None:
                continue
            self.names[thread.native_id] = thread.name
            frame = frames.get(thread.ident)
            if frame is not None:
                code = frame.f_code
                where = f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
                caller = frame.f_back
                if caller is not None:
                    where += f" <- {os.path.basename(caller.f_code.co_filename)}:{caller.f_code.co_name}"
                self.frames[_group(thread.name)][where] += 1
                ours = frame
                while ours is not None and f"{os.sep}ckptconv{os.sep}" not in ours.f_code.co_filename:
                    ours = ours.f_back
                if ours is not None and ours is not frame:
                    self.ours[_group(thread.name)][
                        f"{os.path.basename(ours.f_code.co_filename)}:{ours.f_code.co_name}:{ours.f_lineno}"] += 1

    def _sample_cpu(self) -> None:
        """Every CPU_INTERVAL: each thread's CPU seconds so far, into the timeline by group."""
        now = time.perf_counter() - self.start
        if now >= self._next_cpu:
            self._next_cpu = now + CPU_INTERVAL
            self.last.update(_tasks())
            self.timeline.append({"t": round(now, 2), "cpu": self._by_group()})

    def _sample_tasks(self) -> None:
        """Each pending asyncio task (any loop: the writer's runs in Orbax's thread), by its outermost coroutine: the
        innermost coroutine frame it is suspended in and what that awaits (a loop idle in ``select`` is waiting on
        one of these)."""
        import asyncio

        registry = getattr(asyncio.tasks, "_all_tasks", None)  # Python 3.11; 3.12 keeps them as _scheduled_tasks
        if registry is None:
            registry = getattr(asyncio.tasks, "_scheduled_tasks", ())
        try:
            tasks = list(registry)  # noqa: SLF001 - every loop's tasks
        except RuntimeError:  # changed while copied: skip this sample
            return
        for task in tasks:
            if task.done():
                continue
            coro = task.get_coro()
            outer = getattr(coro, "__qualname__", type(coro).__name__)
            chain, awaited = [], None
            while coro is not None:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    chain.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}")
                awaited = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                if awaited is None or not (hasattr(awaited, "cr_frame") or hasattr(awaited, "gi_frame")):
                    break
                coro = awaited
            self.awaits[outer][" > ".join(chain[-3:]) + f" awaits {type(awaited).__name__}"] += 1

    def _by_group(self) -> dict[str, list[float]]:
        groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for tid, (comm, user, system) in self.last.items():
            entry = groups[_group(self.names.get(tid, comm))]
            entry[0] += user
            entry[1] += system
            entry[2] += 1
        return {k: [round(v[0], 2), round(v[1], 2), v[2]] for k, v in groups.items()}

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.last.update(_tasks())

    def result(self) -> dict:
        wall = time.perf_counter() - self.start
        return {"wall_seconds": round(wall, 2), "cpu_by_group_user_sys_threads": self._by_group(),
                "frames": {group: counter.most_common(12) for group, counter in self.frames.items()},
                "ckptconv_frames": {group: counter.most_common(12) for group, counter in self.ours.items()},
                "task_awaits": {outer: counter.most_common(12) for outer, counter in self.awaits.items()},
                "samples_per_second": 1 / INTERVAL, "sampler_errors": self.errors.most_common(12),
                "timeline": self.timeline,
                "memory": {"at_peak": self.peak, "every_half_second": self.memory[::int(CPU_INTERVAL / INTERVAL)]}}


def _patch(spec: str) -> None:
    """``THREADPROF_PATCH="module:attr=literal;..."``: set module attributes before the run (an experiment's knob,
    e.g. ``ckptconv.settings:COMMIT_LANES=8``); ``THREADPROF_MMAP_THRESHOLD`` the CLI's malloc threshold."""
    import ast
    import importlib

    for item in filter(None, spec.split(";")):
        target, _, literal = item.partition("=")
        module, _, attr = target.partition(":")
        setattr(importlib.import_module(module), attr, ast.literal_eval(literal))
    threshold = os.environ.get("THREADPROF_MMAP_THRESHOLD")
    if threshold:
        monitor.tune_malloc.__defaults__ = (int(threshold),) + monitor.tune_malloc.__defaults__[1:]


def main(out: str, args: list[str]) -> int:
    """Run ``ckptconv ARGS`` under the sampler; write what it saw to ``out`` (the CLI's own failure exits skip it)."""
    _patch(os.environ.get("THREADPROF_PATCH", ""))
    monitor.tune_malloc()  # as the CLI's entry does, before this sampler's thread can make an arena of its own
    sampler = Sampler(tuple(os.environ.get("THREADPROF_PARTS", ",".join(PARTS)).split(",")))
    code = 0
    sys.argv = ["ckptconv", *args]
    try:
        with sampler:
            runpy.run_module("ckptconv", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code or 0
    finally:
        with open(out, "w") as f:
            json.dump(sampler.result(), f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
