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
