"""Step 0 written aside and committed at once, as Orbax 0.12.8's ``CheckpointManager`` commits a step.

Locally (``AtomicRenameTemporaryPath``) the step is written as ``0.orbax-checkpoint-tmp`` and its item as
``items.orbax-checkpoint-tmp`` inside it; each is committed by writing its ``commit_success.txt`` and renaming it to
its final name, the item first. On gs://, where a rename copies every object (``CommitFileTemporaryPath``), the step
is written in place and is complete once ``0/commit_success.txt`` exists. ``_CHECKPOINT_METADATA`` is written when
the step begins and again, with its commit time, just before the step commits. Readers (Orbax, MaxText, ``inspect``)
see no step until then; a crash leaves a temporary the next run removes (locally, our own names only: the destination
protocol, :mod:`ckptconv.write.destination`, has refused any other before this point).
"""

from __future__ import annotations

import os
import time

from ckptconv import layout
from ckptconv.write import orbax_layout
from ckptconv.write.destination import OUR_TMP

COMMIT_TEXT = "Checkpoint commit was successful to {}"


def _fsync(path, flags: int) -> None:
    """Flush a local file or directory (``flags``: how to open it) to the disk; nothing to do on gs://, where an
    object is durable once its upload returns."""
    if layout.is_gcs(str(path)):
        return
    descriptor = os.open(os.fspath(path), flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_document(path, text: str) -> None:
    """Write one of the step's small documents and flush it, so that the renames that commit the step (after
    :func:`sync_directory`) never publish a document a power cut could leave empty."""
    path.write_text(text)
    _fsync(path, os.O_RDONLY)


def sync_directory(path) -> None:
    """Flush a local directory's entries (its new files and renames) to the disk."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


class StepCommit:
    """Step 0 at ``destination`` (absolute path or gs:// URI): where it is written, and its commit."""

    def __init__(self, destination: str):
        self.root = layout.path(layout.absolute(destination))
        self.remote = layout.is_gcs(destination)
        self.final = self.root / layout.STEP
        self.step = self.final if self.remote else self.root / (layout.STEP + orbax_layout.TMP_SUFFIX)
        self.items_final = self.step / orbax_layout.ITEMS
        self.items = self.items_final if self.remote else self.step / (orbax_layout.ITEMS + orbax_layout.TMP_SUFFIX)
        self._init_ns = 0

    def complete(self) -> bool:
        """A committed step 0 is there (Orbax's ``all_steps`` would list it)."""
        if self.remote:
            return (self.final / layout.COMMIT_MARKER).exists()
        return self.final.exists()

    def begin(self, custom_metadata: dict) -> None:
        """Refuse a complete step 0; remove our unfinished temporaries (locally; on gs:// the destination protocol
        has removed ours, and a prefix there may hold others' files); create the step and item directories."""
        if self.complete():
            raise FileExistsError(f"{self.root} already holds a complete step 0; "
                                  "remove it or choose another destination")
        if not self.remote and self.root.exists():
            for child in self.root.iterdir():
                if OUR_TMP.fullmatch(child.name):
                    child.rmtree()
        if self.step.exists():  # Orbax's _create_tmp_directory: an unfinished step is removed first
            self.step.rmtree()
        self.step.mkdir(parents=True, exist_ok=False)
        self._init_ns = time.time_ns()
        self._custom = custom_metadata
        self._write_step_metadata(None)
        self.items.mkdir(parents=False, exist_ok=False)

    def _write_step_metadata(self, commit_ns: int | None) -> None:
        write_document(self.step / orbax_layout.STEP_METADATA_FILE,
                       orbax_layout.step_metadata(self._custom, self._init_ns, commit_ns))

    def commit(self) -> None:
        """The item's commit file and rename, then the step's: from here step 0 is complete."""
        write_document(self.items / layout.COMMIT_MARKER, COMMIT_TEXT.format(self.items_final))
        if not self.remote:
            sync_directory(self.items)
            self.items.rename(self.items_final)
        self._write_step_metadata(time.time_ns())
        write_document(self.step / layout.COMMIT_MARKER, COMMIT_TEXT.format(self.final))
        if not self.remote:
            sync_directory(self.step)
            self.step.rename(self.final)
            sync_directory(self.root)
