"""The errors ckptconv can state in one line, each carrying its own exit status.

The CLI maps by type only: a :class:`CkptConvError` is one line on stderr and its ``exit_code``
(2 for bad input, so orchestration can tell "the input is wrong, retrying will not help" from
everything else); anything else is a bug and keeps its traceback. Failures of the libraries below
(tensorstore, Orbax, gcsfs, the OS) become these types where those libraries are called
(:mod:`ckptconv.storage_failures`), never by reading their text in the CLI.
"""

from __future__ import annotations


# What a writer's failure or stop leaves behind, said after its one line: nothing is committed mid-run.
INCOMPLETE = "; what is at the destination is incomplete and a rerun resumes or redoes it"


class CkptConvError(Exception):
    """A conversion failed for a reason we can state in one line (exit status 1)."""

    exit_code = 1


class BadInputError(CkptConvError):
    """The source checkpoint or the request is invalid (exit status 2, never retried)."""

    exit_code = 2


class DestinationExistsError(BadInputError):
    """A complete checkpoint already sits at the destination and ``--overwrite`` was not given."""


class StorageError(CkptConvError):
    """The storage refused a read or a write: no space, no permission, a read-only file system, a
    bucket out of quota. Retrying elsewhere, or after freeing room, can help (exit status 1)."""


class DamagedCheckpointError(CkptConvError):
    """A written checkpoint cannot be read back (truncated, emptied, another layout)."""


class RemoteError(CkptConvError):
    """A remote store (GCS, the Hub) failed or answered what it should not; a retry may help."""


class BusyError(CkptConvError):
    """Another live run holds the destination (its lock, or its "writing" report)."""


class UnfinishedError(CkptConvError):
    """Work this run builds on is not finished yet (a partition a finalize needs)."""


class RuntimeSetupError(CkptConvError):
    """The process cannot provide what the run needs (JAX started with another device count)."""


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
