"""Who is writing a destination: a lock file the filesystem itself arbitrates.

``DST/ckptconv.lock`` is created with ``O_CREAT | O_EXCL``, which NFS (v3+) and local
filesystems make atomic across hosts, so two conversions into one directory cannot both own
it. It records host, boot id, pid and the process's start time: on the same host and boot, a
holder whose pid is gone (or now belongs to a younger process) is stale and is taken over; a
holder on another host cannot be checked from here, so the run is refused unless
``--overwrite`` says to break it (a holder alive on this host is never broken). On ``gs://``
the lock is an object created with a generation precondition (``ifGenerationMatch=0``), which
GCS arbitrates the same way.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ckptconv.errors import BusyError, StorageError

LOCK_NAME = "ckptconv.lock"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _me() -> dict:
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
            "start_ticks": _start_ticks(os.getpid())}


def stale(holder: dict) -> bool:
    """Whether ``holder`` certainly no longer runs (same host: rebooted, or its pid is gone or reused)."""
    me = _me()
    if holder.get("host") != me["host"]:
        return False
    if holder.get("boot_id") != me["boot_id"]:
        return True
    pid = holder.get("pid")
    return not isinstance(pid, int) or _start_ticks(pid) != holder.get("start_ticks")


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"


class _LocalLock:
    """The lock as a local (or NFS) file: created whole or not at all, read, removed."""

    def __init__(self, destination: str, name: str = LOCK_NAME) -> None:
        Path(destination).mkdir(parents=True, exist_ok=True)
        self.path = Path(destination) / name
        self.name = str(self.path)

    def create(self, text: str) -> bool:
        """Write the holder to a private file, then hard-link it to the lock's name (atomic, and fails
        if the name exists, on local filesystems and NFS alike): the lock never exists empty or half
        written, so a full disk leaves no lock behind. Without hard links, ``O_EXCL`` and clean up."""
        private = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            private.write_text(text)
            os.link(private, self.path)
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):  # a full disk, no permission
                raise
            return self._create_exclusive(text)
        finally:
            private.unlink(missing_ok=True)
        return True

    def _create_exclusive(self, text: str) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except BaseException:
            self.path.unlink(missing_ok=True)  # never leave an empty lock that wedges the destination
            raise
        return True

    def read(self) -> tuple[str, object] | None:
        """(text, version) of the current lock, None if there is none."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data.decode("utf-8", errors="replace"), data

    def remove(self, version: object) -> None:
        """Remove the lock if it is still ``version`` (re-read just before: NFS has no compare-and-delete)."""
        current = self.read()
        if current is not None and current[1] == version:
            self.path.unlink(missing_ok=True)


class _GcsLock:
    """The lock as a GCS object: created with ``ifGenerationMatch=0`` (fails if it exists), removed
    with ``ifGenerationMatch`` of the holder we judged, so exactly one of two racing runs wins."""

    def __init__(self, destination: str, name: str = LOCK_NAME) -> None:
        from ckptconv.read.gcs import gcs_client

        bucket, _, prefix = destination[len("gs://"):].partition("/")
        self.name = f"{destination.rstrip('/')}/{name}"
        client = gcs_client(destination)  # no credentials: one line naming the fix, not a traceback
        self._blob = client.bucket(bucket).blob(f"{prefix.strip('/')}/{name}".lstrip("/"))

    def create(self, text: str) -> bool:
        from google.api_core import exceptions as gexc
        from google.cloud.storage.retry import DEFAULT_RETRY

        from ckptconv.read.waits import Deadlines, announced

        deadlines = Deadlines.from_env()
        try:
            with announced(f"the lock object {self.name}", deadlines):
                self._blob.upload_from_string(text, content_type="application/json", if_generation_match=0,
                                              retry=DEFAULT_RETRY.with_timeout(deadlines.total_seconds),
                                              timeout=deadlines.request_seconds)
        except gexc.PreconditionFailed:
            return False
        except gexc.GoogleAPICallError as err:  # no permission, out of quota: before anything is written
            message = " ".join(str(getattr(err, "message", err)).split())
            raise StorageError(f"{self.name}: the bucket refused the lock object ({err.code} {message}); "
                                "nothing was written") from None
        except gexc.RetryError as err:  # refused again and again (429: out of quota, or too fast)
            raise StorageError(f"{self.name}: the bucket refused the lock object for {deadlines.total_seconds:g}s "
                                f"(last: {_http_said(err.cause)}); nothing was written") from None
        return True

    def read(self) -> tuple[str, object] | None:
        from google.api_core import exceptions as gexc

        try:
            self._blob.reload()
            return self._blob.download_as_text(if_generation_match=self._blob.generation), self._blob.generation
        except (gexc.NotFound, gexc.PreconditionFailed):
            return None

    def remove(self, version: object) -> None:
        from google.api_core import exceptions as gexc

        try:
            self._blob.delete(if_generation_match=version)
        except (gexc.NotFound, gexc.PreconditionFailed):
            pass  # released or taken over meanwhile: not ours to remove


def _http_said(error: BaseException | None) -> str:
    """``HTTP 429 <GCS's message>`` for a failed response, else the error's text, on one line."""
    response = getattr(error, "response", None)
    if response is None:
        return " ".join(str(error).split())
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    return " ".join(f"HTTP {response.status_code} {message}".split())


def _holder(text: str) -> dict | None:
    """The holder a lock names; None if it names none (empty, not JSON, not an object).

    Such a lock is stale, never someone else's: a lock is written whole before it exists (a local
    file is hard-linked into place once written, a GCS object appears whole), so no live run's lock
    reads like that, even for an instant.
    """
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


@contextmanager
def hold(destination: str, *, break_foreign: bool = False, name: str = LOCK_NAME) -> Iterator[None]:
    """Own ``destination`` (or, with ``name``, one part of it) for the block, or raise naming who does."""
    if "://" in destination and not destination.startswith("gs://"):
        yield
        return
    store = _GcsLock(destination, name) if destination.startswith("gs://") else _LocalLock(destination, name)
    me = _me()
    mine = json.dumps(me)
    for _ in range(3):
        if store.create(mine):
            break
        current = store.read()
        if current is None:
            continue  # released meanwhile
        text, version = current
        holder = _holder(text)
        # --overwrite breaks what cannot be checked from here (another host), never a holder alive on this one
        foreign = holder is not None and holder.get("host") != me["host"]
        if holder is None or stale(holder) or (break_foreign and foreign):
            store.remove(version)  # only if it is still the lock we judged
            continue
        raise BusyError(f"{store.name}: another conversion ({_describe(holder or {})}) is writing this "
                            "destination; wait for it, or if it is gone (another host), rerun with --overwrite "
                            "to break the lock")
    else:
        raise BusyError(f"{store.name}: could not take the lock (it keeps changing hands)")
    try:
        yield
    finally:
        try:
            current = store.read()
            if current is not None and (_holder(current[0]) or {}).get("pid") == me["pid"]:
                store.remove(current[1])
        except OSError:
            pass
