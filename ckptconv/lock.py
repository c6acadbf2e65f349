"""Who is writing a destination: a lock file the filesystem itself arbitrates.

``DST/ckptconv.lock`` is created with ``O_CREAT | O_EXCL``, which NFS (v3+) and local
filesystems make atomic across hosts, so two conversions into one directory cannot both own
it. It records host, boot id, pid and the process's start time: on the same host and boot, a
holder whose pid is gone (or now belongs to a younger process) is stale and is taken over; a
holder on another host cannot be checked from here, so the run is refused unless
``--overwrite`` says to break it. Not for ``gs://`` yet (there the "writing" report guards).
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ckptconv.errors import CkptConvError

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


@contextmanager
def hold(destination: str, *, break_foreign: bool = False) -> Iterator[None]:
    """Own ``destination`` for the block, or raise naming who does."""
    if "://" in destination:
        yield
        return
    root = Path(destination)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    me = _me()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                text = path.read_text()
                holder = json.loads(text)
            except FileNotFoundError:
                continue  # released meanwhile
            except ValueError:
                holder, text = {}, None  # being written this instant, or damaged: not ours to judge
            if text is not None and (stale(holder) or break_foreign):
                if path.read_text() == text:  # the same holder still: take it over
                    path.unlink(missing_ok=True)
                continue
            raise CkptConvError(f"{path}: another conversion ({_describe(holder)}) is writing this destination; "
                                "wait for it, or if it is gone (another host), rerun with --overwrite to break "
                                "the lock") from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise CkptConvError(f"{path}: could not take the lock (it keeps changing hands)")
    try:
        yield
    finally:
        try:
            if json.loads(path.read_text()).get("pid") == me["pid"]:
                path.unlink()
        except (OSError, ValueError):
            pass
