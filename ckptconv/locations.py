"""What a command-line path or URI names, checked before any command opens it.

Each argument has a *role*: a source read for its HF files, a checkpoint read back, or an output
written. The role decides which schemes it may use and what must already be on disk, so that a
mistyped path says what is wrong ("no such directory", "a file, not a directory", "scheme not
supported") instead of whatever the first library to touch it raises. Pure checks: nothing is
created, nothing remote is contacted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ckptconv.errors import BadInputError

URI_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class Role:
    """What an argument is: how to call it, the remote forms it accepts, whether it must exist locally."""

    what: str
    holds: str  # what the directory holds, for the "is a file" message
    remote: tuple[str, ...]  # accepted remote forms, e.g. "gs://BUCKET/DIR"
    must_exist: bool

    def schemes(self) -> tuple[str, ...]:
        return tuple(form.split("://", 1)[0] for form in self.remote)

    def accepted(self) -> str:
        return ", ".join(("a local directory", *self.remote))


SOURCE = Role("source", "config.json and *.safetensors", ("gs://BUCKET/DIR", "hf://ORG/REPO[@REVISION]"),
              must_exist=True)
CHECKPOINT = Role("checkpoint", "what `ckptconv convert` wrote", ("gs://BUCKET/DIR",), must_exist=True)
OUTPUT = Role("destination", "what this command writes", ("gs://BUCKET/DIR",), must_exist=False)
EXPORT_OUTPUT = Role("destination", "what this command writes", ("gs://BUCKET/DIR", "hf://ORG/REPO[@BRANCH]"),
                     must_exist=False)


def check(location: str, role: Role) -> None:
    """Refuse, in one line, a location that cannot be what ``role`` needs (exit 2 through the CLI)."""
    scheme = URI_SCHEME.match(location)
    if scheme:
        if scheme.group(1).lower() not in role.schemes():
            raise BadInputError(f"{location}: {scheme.group(1)}:// is not a supported scheme for the {role.what}; "
                                f"supported: {role.accepted()}")
        return
    if not location.strip():
        if role.must_exist:  # an output's emptiness is the writer's to refuse, with its own advice
            raise BadInputError(f"the {role.what} is empty (an unset shell variable?)")
        return
    if os.path.exists(location) and not os.path.isdir(location):
        raise BadInputError(f"{location}: is a file, not a directory; the {role.what} is a directory "
                            f"(holding {role.holds})")
    if role.must_exist and not os.path.exists(location):
        raise BadInputError(f"{location}: does not exist (no such directory; the {role.what} must exist)")
