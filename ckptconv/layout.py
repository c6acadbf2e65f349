"""Where things sit in a ckptconv checkpoint directory: the one step Orbax writes, its ``items``, the
commit marker and our report. Both the writers and the readers of a checkpoint need these names; they
live here, below both, so that reading a checkpoint back never depends on how it was written."""

from __future__ import annotations

import os

from etils import epath

STEP = "0"
REPORT_NAME = "ckptconv-report.json"
COMMIT_MARKER = "commit_success.txt"


def is_gcs(location: str) -> bool:
    return location.startswith("gs://")


def is_hub(location: str) -> bool:
    return location.startswith("hf://")


def absolute(location: str) -> str:
    """``location`` as Orbax needs it: URIs unchanged, local paths made absolute."""
    return location if "://" in location else os.path.abspath(location)


def path(location: str) -> epath.Path:
    return epath.Path(location)


def items_path(checkpoint: str) -> epath.Path:
    """The Orbax ``items`` directory of a checkpoint at ``checkpoint``."""
    return path(checkpoint) / STEP / "items"
