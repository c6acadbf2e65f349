"""Run ``python -m ckptconv ...`` in a fresh process: its own JAX, its own device count.

Two memory figures come back. The child's own high-water mark (``VmHWM`` of its address space,
read from ``/proc/PID/status`` while it runs; the conversion also reports it itself) is the
headline: it is what the conversion used. ``os.wait4``'s ``ru_maxrss`` is kept for reference
only: Linux carries ``ru_maxrss`` across ``exec``, so for a child forked from a large worker
it is at least the worker's own RSS at fork time, whatever the child did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ckptconv.plan.devices import device_env
from tasks.failures import BadInput, ChildFailed, failure

CLI = [sys.executable, "-m", "ckptconv"]
TAIL_LINES = 40


def child_env(devices: int) -> dict[str, str]:
    """This environment plus the child's device count, glibc arena cap and unbuffered output."""
    return {**device_env(devices), "MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "1"}


@dataclass
class ChildResult:
    """How a child ended: exit code (negative: killed by that signal), memory figures, last lines.

    ``own_peak_rss_bytes``: the child's VmHWM as last read while it ran (its own address space);
    ``wait4_maxrss_bytes``: the kernel's ru_maxrss, which includes the parent at fork (see above).
    """

    returncode: int
    own_peak_rss_bytes: int
    wait4_maxrss_bytes: int
    seconds: float
    tail: list[str] = field(default_factory=list)
    timed_out: bool = False

    def check(self, what: str, timeout: float | None = None) -> None:
        """Raise the failure class that matches a non-zero exit (see ``tasks.failures``)."""
        if self.returncode != 0 or self.timed_out:
            raise failure(what, self.returncode, self.tail, self.timed_out, timeout)


def secrets(env: dict[str, str]) -> list[str]:
    """Token values the child could know (``HF_TOKEN``, the saved hub login): no line that reaches a
    log, a state message or an artifact may hold one. ckptconv never prints them; this is the
    second lock on that door, for messages a library might build."""
    values = [env.get("HF_TOKEN", "")]
    try:
        from huggingface_hub import get_token

        values.append(get_token() or "")
    except Exception:  # noqa: BLE001 - no hub library, an unreadable login: nothing to hide
        pass
    parts = {piece.strip() for value in values for piece in value.splitlines()}  # a malformed multi-line token
    return sorted((piece for piece in parts if len(piece) >= 8), key=len, reverse=True)


def scrub(line: str, hidden: list[str]) -> str:
    for value in hidden:
        line = line.replace(value, "[token]")
    return line


def stream_child(args: list[str], env: dict[str, str], on_line: Callable[[str, int], None],
                 timeout: float | None = None) -> ChildResult:
    """Run the CLI with ``args``; ``on_line(line, pid)`` sees every output line; killed after ``timeout`` s."""
    start = time.monotonic()
    env = {**env, "CKPTCONV_PARENT_PID": str(os.getpid())}  # the child ends itself if this process dies
    proc = subprocess.Popen(CLI + args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
    timed_out = threading.Event()
    timer = threading.Timer(timeout, _kill, (proc.pid, timed_out)) if timeout else None
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    sampler = _HighWaterSampler(proc.pid)
    hidden = secrets(env)
    reaped = False
    try:
        if timer:
            timer.start()
        sampler.start()
        for raw in proc.stdout:
            line = scrub(raw.rstrip("\n"), hidden)
            tail.append(line)
            sampler.sample()  # short-lived children exit between two timed samples
            on_line(line, proc.pid)
        if timer:
            timer.cancel()
            timer.join()
        sampler.stop()  # before the reap: afterwards the pid may belong to another process
        status, usage = _reap(proc, None if timed_out.is_set() else _remaining(start, timeout), timed_out)
        reaped = True
    finally:
        if timer:
            timer.cancel()
        sampler.stop()
        if not reaped:  # an exception (or cancellation) in this thread: never leave the child running
            _kill(proc.pid, None)
            _reap(proc, None, None)
        proc.stdout.close()
    return ChildResult(os.waitstatus_to_exitcode(status), sampler.peak, usage.ru_maxrss * 1024, time.monotonic() - start,
                       list(tail), timed_out.is_set())


def vm_hwm_bytes(pid: int) -> int:
    """``VmHWM`` of a live process (its own address space's high-water mark), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class _HighWaterSampler(threading.Thread):
    """Reads the child's VmHWM every 0.2 s (and whenever it prints), so a child killed without a
    report still has a figure.

    VmHWM never decreases while the process lives, so sampling misses at most the growth in its
    last moments (the conversion's own report, when there is one, has the exact figure).
    """

    def __init__(self, pid: int) -> None:
        super().__init__(name="ckptconv-hwm", daemon=True)
        self.pid, self.peak, self.done, self._lock = pid, 0, threading.Event(), threading.Lock()

    def sample(self) -> None:
        value = vm_hwm_bytes(self.pid)
        with self._lock:
            self.peak = max(self.peak, value)

    def run(self) -> None:
        while True:
            self.sample()
            if self.done.wait(0.2):
                return

    def stop(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join(timeout=1)


def run_json(args: list[str], env: dict[str, str], timeout: float, ok_codes: tuple[int, ...] = (0,)) -> dict:
    """Run a CLI command that prints JSON on stdout; failures raise the classes in ``tasks.failures``."""
    what = f"ckptconv {args[0]}"
    try:
        done = subprocess.run(CLI + args, env={**env, "CKPTCONV_PARENT_PID": str(os.getpid())},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise failure(what, -signal.SIGKILL, [], True, timeout) from None
    hidden = secrets(env)
    tail = [scrub(line, hidden) for line in done.stderr.splitlines()[-TAIL_LINES:]]
    if done.returncode not in ok_codes:
        raise failure(what, done.returncode, tail, False, timeout)
    try:
        return json.loads(done.stdout)
    except ValueError:
        error = BadInput if done.returncode == 2 else ChildFailed
        raise error(f"{what}: exit {done.returncode} without JSON output: {(tail or ['no output'])[-1]}") from None


def _kill(pid: int, flag: threading.Event | None) -> None:
    if flag is not None:
        flag.set()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remaining(start: float, timeout: float | None) -> float | None:
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


def _reap(proc: subprocess.Popen, timeout: float | None,
          timed_out: threading.Event | None) -> tuple[int, os.struct_rusage]:
    """``wait4`` the child (SIGKILL it first if it outlives ``timeout``); tell Popen it is gone."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        flags = 0 if deadline is None else os.WNOHANG
        pid, status, usage = os.wait4(proc.pid, flags)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status, usage
        if time.monotonic() >= deadline:
            _kill(proc.pid, timed_out)
            deadline = None
        else:
            time.sleep(0.05)
