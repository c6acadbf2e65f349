"""The destination protocol: how every writer (``convert``, its partitions, ``export``) stages,
locks, proves complete and commits its work, on a local directory or ``gs://``.

Orbax's own commit is the model: a write is invisible until one small final step. Here that step
is our report, written last, and the order of writing is the protocol (:class:`Destination`):

1. **look** (:meth:`Destination.report`, :func:`inspect_state`): what is there is judged by our
   report alone. It is written before any other byte, so what has none is not ours and is never
   removed; a complete report whose fingerprint matches means there is nothing to do (:meth:`skip`).
2. **hold** (:meth:`Destination.hold`): one writer per destination (or per partition), across hosts.
3. **stage** (:meth:`Destination.begin`, :meth:`Destination.staging`): the report says "writing"
   before the first byte, so a crash leaves a destination that reads as ours and unfinished. The
   data goes to its final place, or into a staging directory of ours inside DST (one table,
   :data:`STAGING`) when a complete old result must stay complete meanwhile, or a partition's
   share waits for the finalize.
4. **commit** (:meth:`Destination.swap_in`, :meth:`Destination.commit`): the writer proves its data
   whole (Orbax's finalised step; every safetensors file renamed from ``.partial``; a partition's
   sizes and checksums), staged data moves in, and the report saying "complete" is written last.

Works on local paths and ``gs://`` through ``etils.epath`` (fsspec/gcsfs), as Orbax does.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass

from etils import epath

from ckptconv.errors import BadInputError, StorageError
from ckptconv.layout import COMMIT_MARKER, REPORT_NAME, STEP, is_gcs, path
from ckptconv.settings import Status

PARTIAL = ".partial"  # a file still being written (renamed when whole)

# What Orbax's CheckpointManager deletes as an unfinished step when it opens a directory
# (orbax step.TMP_DIR_STEP_PATTERN): such a name that is not provably ours must stop us first.
ORBAX_TMP = re.compile(r".*?_*?(\d+)\.orbax-checkpoint-tmp")
# The temporaries our own save of step 0 makes (locally ``0.orbax-checkpoint-tmp-<time>``).
OUR_TMP = re.compile(r"0\.orbax-checkpoint-tmp(-\d+)?")
# Where staged work waits inside DST, by what it is. ``replacement``: ``convert --overwrite`` writes the
# new checkpoint there (its step at REPLACEMENT/0) while the old one stays complete; ``replaced``: the old
# step for the moment between two renames; ``export``: an export's files until they are all whole;
# ``partitions``: each partition's share and marker until the finalize.
STAGING: dict[str, str] = {"replacement": "ckptconv-replacement", "replaced": "ckptconv-replaced",
                           "export": ".ckptconv-pending", "partitions": "ckptconv-partitions"}
REPLACEMENT, REPLACED = STAGING["replacement"], STAGING["replaced"]
OUR_DIRS = (REPLACEMENT, REPLACED)  # a checkpoint's own (export and partitions keep theirs apart)


def ours(name: str) -> bool:
    """A name at DST that only ckptconv writes (besides the step and the report)."""
    return bool(OUR_TMP.fullmatch(name)) or name in OUR_DIRS


@dataclass(frozen=True)
class DestinationState:
    """``checkpoint``: Orbax finalised step 0; ``report``: our report if present; ``leftovers``: partial writes."""

    checkpoint: bool
    report: dict | None
    leftovers: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return self.checkpoint and self.report is not None and self.report.get("status") == Status.COMPLETE

    @property
    def empty(self) -> bool:
        return not self.checkpoint and self.report is None and not self.leftovers


def inspect_state(destination: str) -> DestinationState:
    root = path(destination)
    if not root.exists():
        return DestinationState(False, None, ())
    step = root / STEP
    finalised = (step / "_CHECKPOINT_METADATA").exists() and (step / "items").exists()
    if is_gcs(destination):
        finalised = finalised and (step / COMMIT_MARKER).exists()
    leftovers = tuple(sorted(p.name for p in root.iterdir() if ours(p.name)))
    if step.exists() and not finalised:
        leftovers += (STEP,)
    return DestinationState(finalised, read_report(root / REPORT_NAME), leftovers)


def check_ownership(destination: str, state: DestinationState) -> None:
    """Refuse (one line naming the path) to run where we would delete what we cannot prove we wrote.

    Ours is what a ckptconv report vouches for: the report is written before anything else, so a
    step or temporary without one is someone else's (a MaxText conversion, the user's notes). And
    Orbax deletes every name that looks like its temporary when it opens DST: such a name that is
    not one of ours stops the run before Orbax sees it.
    """
    root = path(destination)
    if not root.exists():
        return
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if ORBAX_TMP.match(child.name) and not OUR_TMP.fullmatch(child.name):
            raise BadInputError(f"{child}: Orbax would delete this as an unfinished checkpoint step; "
                                "move it out of the destination")
    if state.report is None and (state.checkpoint or state.leftovers):
        what = root / (STEP if STEP in state.leftovers or state.checkpoint else state.leftovers[0])
        raise BadInputError(f"{what}: not written by ckptconv (no {REPORT_NAME} beside it), so not replaced or "
                            "removed; move it away or choose another destination")


def check_space(destination: str, needed: int) -> bool:
    """Before anything is deleted or written: the local filesystem can hold the output (counted
    uncompressed, an upper bound), counting what clearing our old step would free. Returns whether
    it fits beside what is there now (always on gs://, where space is not ours to measure)."""
    if "://" in destination:
        return True
    probe = os.path.abspath(destination)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    names = os.listdir(destination) if os.path.isdir(destination) else []
    reclaim = sum(os.path.getsize(os.path.join(top, f)) for name in names if name == STEP or ours(name)
                  for top, _, files in os.walk(os.path.join(destination, name)) for f in files)
    if free + reclaim < needed:
        raise StorageError(f"{destination}: needs up to {needed / 2**20:.1f} MiB (the output uncompressed), "
                            f"{free / 2**20:.1f} MiB free" + (f" + {reclaim / 2**20:.1f} MiB of the old step" if reclaim
                                                              else "") + "; nothing was deleted or written")
    return free >= needed


def drop_leftovers(destination: str) -> None:
    """Remove ckptconv's own names beside the step (an old replacement or replaced step, Orbax
    temporaries of ours); the step and the report stay."""
    _remove_children(path(destination), ours)


def _remove_children(root: epath.Path, chosen) -> None:
    """Remove every entry of ``root`` whose name ``chosen`` accepts (directories with their contents)."""
    if not root.exists():
        return
    for child in root.iterdir():
        if chosen(child.name):
            if child.is_dir():
                child.rmtree()
            else:
                child.unlink()


def read_report(report_path: epath.Path) -> dict | None:
    """The report at ``report_path``; None if absent, not JSON, or JSON but not an object (damaged)."""
    try:
        report = json.loads(report_path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def write_report(report_path: str, report: dict) -> None:
    """Write the JSON report atomically: temp name then rename locally; one object write on GCS."""
    target = path(report_path)
    text = json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"
    if is_gcs(report_path):
        target.write_text(text)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / (target.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(target)


def clear(destination: str) -> None:
    """Remove what ``convert`` writes at ``destination`` (step dir, leftovers, report); nothing else."""
    Destination(destination).clear(lambda name: name == STEP or ours(name))


def writer_alive(report: dict) -> bool:
    """Whether the process that wrote a "writing" report still runs (same host only: else unknowable)."""
    if report.get("host") != socket.gethostname() or not isinstance(report.get("pid"), int):
        return False
    if report["pid"] == os.getpid():
        return False
    try:
        os.kill(report["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_report_path(report: str | None, places: dict[str, str]) -> None:
    """``--report PATH``, checked before any work: never inside any of ``places`` (label -> path: the
    source, the checkpoint, the destination), where it could replace a weight, a data file or the
    source itself; and writable, so a finished run cannot end in a failure to write it."""
    if report is None:
        return
    if "://" in report:
        for label, place in places.items():
            if "://" in place and (report.rstrip("/") + "/").startswith(place.rstrip("/") + "/"):
                raise BadInputError(f"--report {report}: inside the {label} {place}; put it elsewhere")
        return  # written through epath; a bad bucket fails before the first byte anyway
    real = os.path.realpath(report)
    for label, place in places.items():
        if "://" not in place and (real + os.sep).startswith(os.path.realpath(place) + os.sep):
            raise BadInputError(f"--report {report}: inside the {label} {place} (it could replace a file there); "
                                "put it elsewhere")
    parent = os.path.dirname(real) or "."
    if os.path.isdir(real):
        raise BadInputError(f"--report {report}: is a directory")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise BadInputError(f"--report {report}: cannot write there ({parent} is not a writable directory)")


def write_extra_report(report_path: str | None, report: dict) -> None:
    """The report again where ``--report`` asked for it (the destination always holds its own)."""
    if report_path:
        write_report(report_path, report)


def now() -> str:
    """UTC now, as reports record times."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Destination:
    """One place a command writes, and the steps of the protocol (see the module docstring) that every
    writer takes there in the same order. What differs between writers is only what their data is:
    which names at DST they own, and how the old data leaves when new data replaces it."""

    uri: str

    @property
    def root(self) -> epath.Path:
        return path(self.uri)

    @property
    def report_path(self) -> str:
        return f"{self.uri.rstrip('/')}/{REPORT_NAME}"

    def report(self) -> dict | None:
        return read_report(path(self.report_path))

    def staging(self, what: str) -> str:
        """The staging directory of ours inside DST for ``what`` (a key of :data:`STAGING`)."""
        return f"{self.uri.rstrip('/')}/{STAGING[what]}"

    def hold(self, *, overwrite: bool, part: str | None = None, name: str | None = None):
        """The lock on DST (or on the staging directory ``part``, under ``name``): one writer at a time."""
        from ckptconv.write import lock

        where = self.staging(part) if part else self.uri
        return lock.hold(where, break_foreign=overwrite, **({"name": name} if name else {}))

    def skip(self, report: dict, extra_report: str | None) -> dict:
        """Nothing to do: the complete result of the same work is here. The report again, marked skipped."""
        skipped = {**report, "skipped": True}
        write_extra_report(extra_report, skipped)
        return skipped

    def begin(self, writing: dict, at: str | None = None) -> None:
        """The "writing" report, before any byte of data: at DST, or in the staging directory ``at``
        when the complete old result keeps its own report until the swap."""
        write_report(f"{at.rstrip('/')}/{REPORT_NAME}" if at else self.report_path, writing)

    def clear(self, owns) -> None:
        """Remove the report, then every name at DST that ``owns`` accepts; nothing else.

        The report goes first: without it nothing reads as complete, so a crash part-way through
        removing the data (file by file locally, batch by batch on GCS, in no useful order) cannot
        leave a result with missing files that still reads as complete.
        """
        if not self.root.exists():
            return
        try:
            path(self.report_path).unlink()
        except FileNotFoundError:
            pass
        _remove_children(self.root, owns)

    def swap_in(self, staged: str, writing: dict, retire_old) -> None:
        """Replace the complete old result with the one staged (local only: renames).

        The old result stays complete until here. The report first stops saying complete, under a
        fingerprint no run resumes (a crash while the old data leaves is redone, never taken for new
        data of the same names and sizes); ``retire_old`` removes or renames the old data; the report
        then says what is being moved in, which a rerun may resume; the staged entries move in. The
        caller proves the result whole and :meth:`commit` s it.
        """
        write_report(self.report_path, {**writing, "fingerprint": f"retiring-old-result-for-{writing['fingerprint']}"})
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(staged, REPORT_NAME))
        retire_old()
        write_report(self.report_path, writing)
        self.move_in(staged)

    def move_in(self, staged: str) -> None:
        """Move every finished entry of the staging directory into DST, then remove it."""
        for name in sorted(os.listdir(staged)):
            if not name.endswith(PARTIAL) and name != REPORT_NAME:
                os.replace(os.path.join(staged, name), os.path.join(self.uri, name))
        shutil.rmtree(staged)

    def commit(self, report: dict, extra_report: str | None) -> None:
        """The one small final step: the report saying complete, written last (then ``--report``'s copy)."""
        write_report(self.report_path, report)
        write_extra_report(extra_report, report)


def writing_report(fingerprint: str, started: str, **fields) -> dict:
    """What a report says while its run writes: under way (or died), whose, since when."""
    return {"status": Status.WRITING, "fingerprint": fingerprint, "started_at": started, **fields,
            "pid": os.getpid(), "host": socket.gethostname()}
