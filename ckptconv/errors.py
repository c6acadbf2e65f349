"""Error types that decide the process exit status.

The CLI turns a :class:`BadInputError` into one line on stderr and exit status 2, so
orchestration can tell "the input is wrong, retrying will not help" from everything else.
"""

from __future__ import annotations


class CkptConvError(Exception):
    """A conversion failed for a reason we can state in one line (exit status 1)."""

    exit_code = 1


class BadInputError(CkptConvError):
    """The source checkpoint or the request is invalid (exit status 2, never retried)."""

    exit_code = 2


class DestinationExistsError(BadInputError):
    """A complete checkpoint already sits at the destination and ``--overwrite`` was not given."""


class Terminated(BaseException):
    """SIGTERM or SIGINT arrived (a cancelled flow run, a stopped worker, ``kill``, Ctrl-C).

    A BaseException, like KeyboardInterrupt, so no ``except Exception`` in a library swallows it.
    The signal handler only records the signal in :data:`TERMINATION`; the producer checks it before
    every tile and raises this at a point where unwinding is safe.
    """


class _Termination:
    """The stop signal received, if any (set from a signal handler, read by the producer thread)."""

    def __init__(self) -> None:
        self._signum: int | None = None

    def request(self, signum: int) -> None:
        self._signum = signum

    @property
    def signum(self) -> int | None:
        return self._signum


TERMINATION = _Termination()


def stop_if_terminated() -> None:
    """Raise :class:`Terminated` if a stop signal arrived."""
    if TERMINATION.signum is not None:
        raise Terminated()
