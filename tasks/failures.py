"""How a child conversion failed, and which failures are worth another attempt.

The CLI exits 2 for bad input (retrying cannot help) and 1 for everything else. A negative
return code means the kernel killed the child (SIGKILL is what the OOM killer sends): that,
and I/O errors that are known to pass (network resets, throttling), are retried with backoff.
"""

from __future__ import annotations

import re
import signal
from typing import Any

TRANSIENT = re.compile(
    r"ConnectionError|ConnectionResetError|ConnectionAbortedError|BrokenPipeError|TimeoutError|timed out|"
    r"Temporary failure in name resolution|Service Unavailable|Too Many Requests|\b(429|500|502|503|504)\b|"
    r"Input/output error|Resource temporarily unavailable|RemoteDisconnected|IncompleteRead",
    re.IGNORECASE,
)


class ChildFailed(Exception):
    """The child exited non-zero for a reason not known to be transient (not retried)."""


class BadInput(ChildFailed):
    """Exit status 2: the source or the request is wrong (never retried)."""


class ChildKilled(ChildFailed):
    """The kernel killed the child, e.g. SIGKILL from the OOM killer (retried)."""


class TransientIOError(ChildFailed):
    """Exit status 1 with an I/O error that usually passes (retried)."""


class ChildTimeout(ChildFailed):
    """The child ran past its timeout and was killed (not retried)."""


class AcceleratorBusy(ChildFailed):
    """Exit status 75: the host's accelerator is held by another program (retried by the restore check only)."""


ACCELERATOR_BUSY_EXIT = 75  # ckptconv.accelerator.AcceleratorUnavailableError's status (EX_TEMPFAIL)


class TooBigForWorker(Exception):
    """The predicted peak memory exceeds this worker's memory limit (not retried)."""


RETRYABLE = (ChildKilled, TransientIOError)


def retryable(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn``: retry only kills and transient I/O errors."""
    return isinstance(state.result(raise_on_failure=False), RETRYABLE)


def retryable_io(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn`` when a kill goes to a bigger pool instead: retry transient I/O errors only."""
    return isinstance(state.result(raise_on_failure=False), TransientIOError)


def killed(message: str | None) -> bool:
    """Whether a failed run's state message says the kernel killed the conversion (OOM, most likely)."""
    return bool(message) and (ChildKilled.__name__ in message or "killed by SIGKILL" in message)


def error_line(tail: list[str]) -> str:
    """The child's own one-line error if it printed one, else its last line (a traceback's exception)."""
    for line in reversed(tail):
        if line.startswith("ckptconv: error:"):
            return line.removeprefix("ckptconv: error:").strip()
    return next((line for line in reversed(tail) if line.strip()), "no output")


def failure(what: str, returncode: int, tail: list[str], timed_out: bool, timeout: float | None) -> ChildFailed:
    """The exception that describes a finished child's non-zero exit."""
    if timed_out:
        return ChildTimeout(f"{what}: no result after {timeout:g} s; the child was killed")
    if returncode < 0:
        name = _signal_name(-returncode)
        hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return ChildKilled(f"{what}: killed by {name} (exit {returncode}){hint}")
    message = f"{what}: exit {returncode}: {error_line(tail)}"
    if returncode == 2:
        return BadInput(message)
    if returncode == ACCELERATOR_BUSY_EXIT:
        return AcceleratorBusy(message)
    if any(TRANSIENT.search(line) for line in tail[-20:]):
        return TransientIOError(message)
    return ChildFailed(message)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
