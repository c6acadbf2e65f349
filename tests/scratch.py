"""Removing the memory tests' gigabytes late, so that their page cache is reused rather than handed back.

The memory phase writes about 100 GiB (synthesised sources and the conversions' outputs) through a 24 GiB machine.
Removed as soon as it is read, each file frees its page cache at once; on a VM whose balloon reports free memory to
the host (``virtio_balloon`` free page reporting, as on the 2-core machine the suite is measured on), memory freed
is taken back within moments and costs a fault in the host on every page touched again. Writing 6 GiB took 15.7-16.1
s of system time into such memory, 2.0-3.0 s when memory was full of clean page cache the kernel could reclaim
(measured on 2 cores, session 20).

So a test hands what it no longer needs to :func:`discard`, which moves it aside (a rename, out of the test's
``tmp_path``) and removes it only once ``lag`` bytes more have been discarded after it in this process: by then the
kernel has reclaimed its page cache for newer files and removing it frees disk, not memory. The disk holds about
``lag`` bytes more than it would; :func:`flush` (at the end of the session) removes the rest. Nothing a test measures
changes: a conversion's peak RSS counts no page cache.
"""

from __future__ import annotations

import collections
import itertools
import os
import shutil
from pathlib import Path


class LateRemoval:
    """Discarded paths moved under ``root`` and removed once ``lag`` bytes have been discarded after them."""

    def __init__(self, root: Path, lag: int) -> None:
        self.root, self.lag = root, lag
        root.mkdir(parents=True, exist_ok=True)
        self.queue: collections.deque[tuple[Path, int]] = collections.deque()
        self.queued = 0
        self.names = itertools.count()

    def discard(self, path: Path) -> None:
        size = _bytes_under(path)
        target = self.root / f"{next(self.names)}-{path.name}"
        path.rename(target)  # the same file system: tmp_path and root are both under pytest's basetemp
        self.queue.append((target, size))
        self.queued += size
        while self.queue and self.queued - self.queue[0][1] >= self.lag:
            oldest, oldest_size = self.queue.popleft()
            self.queued -= oldest_size
            _remove(oldest)

    def flush(self) -> None:
        while self.queue:
            _remove(self.queue.popleft()[0])
        self.queued = 0


_session: LateRemoval | None = None  # this process's, set by tests/conftest.py for the session


def configure(root: Path, workers: int) -> None:
    """Discarded paths go under ``root`` (on the tests' file system); the lag is this process's share of the
    machine's memory, and never more than a quarter of its share of the free disk."""
    global _session
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    disk = shutil.disk_usage(root.parent).free  # LateRemoval makes root
    _session = LateRemoval(root, min(memory, disk // 4) // max(1, workers))


def discard(path: Path) -> None:
    """Move ``path`` (a file or directory tree) aside, and remove the oldest discarded paths that the lag's bytes
    have followed. Outside a configured session it is removed at once."""
    if _session is None:
        _remove(path)
    else:
        _session.discard(path)


def flush() -> None:
    """Remove everything still queued (the end of the session)."""
    if _session is not None:
        _session.flush()


def _bytes_under(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
