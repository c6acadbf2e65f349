"""Tiles regrouped by the device that restores them, through local spill files, so that each OCDBT data file
holds one device's chunks (``convert --data-files-by-device``; by default when the output fills more than two
windows, ``settings.RunOptions.data_files_by_device``).

The tiles come in the source's order, each covering part of every device's shard. Committed as they come, every
data file would hold a slice of every device's shard, and a TPU host restoring its shard would read every data
file: one storage request per data file of the whole model (77 for a host of Llama-3-8B's widths with 8 layers,
5.2 GiB, against 15 for MaxText's checkpoint; 13 now, docs/bench/RESTORE.md). A data file is held in RAM until its
commit, so it cannot grow with the model. Instead each tile's device parts are appended to one local file per
device (a window of ``devices`` data files' worth), then written back device by device, one data file per device
per window: a host reads about model bytes / (devices x data file size) data files, 16x fewer on 16 devices, for
the same RAM. The spill is page cache and local disk, not the process's memory.

A replicated leaf's chunks, which every host reads, form a group of their own.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ckptconv.families.sharding import MESH_AXIS, partition_spec
from ckptconv.families.tiles import Region

REPLICATED = -1  # the group of replicated leaves' chunks
PREFIX = "ckptconv-spill-"  # then the writing process's pid and a random part
_OWNER = re.compile(re.escape(PREFIX) + r"(\d+)-")


@dataclass(frozen=True)
class Part:
    """One device's part of a tile, waiting in its group's spill file."""

    leaf: int  # the leaf's position in the writer's values
    region: Region  # where it goes in the leaf (whole chunks of one device's shard)
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # where its bytes start in the group's spill file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def device_parts(region: Region, shape: tuple[int, ...], devices: int) -> list[tuple[int, Region, Region]]:
    """(group, region in the leaf, slices of the tile's data) for each device whose shard ``region`` touches.

    A leaf sharded on an axis (MaxText's ``checkpoint_sharding_axis``) is split along it into equal
    shards, device d holding the d-th; a replicated leaf is one part of the ``REPLICATED`` group.

    >>> device_parts((slice(0, 8), slice(0, 4)), (8, 4), 4)[1]
    (1, (slice(2, 4, None), slice(0, 4, None)), (slice(2, 4, None), slice(None, None, None)))
    >>> device_parts((slice(0, 3),), (3,), 4)
    [(-1, (slice(0, 3, None),), (slice(None, None, None),))]
    """
    spec = tuple(partition_spec(shape, devices))
    if MESH_AXIS not in spec:
        return [(REPLICATED, region, tuple(slice(None) for _ in region))]
    axis = spec.index(MESH_AXIS)
    shard = shape[axis] // devices
    lo, hi = region[axis].start, region[axis].stop
    parts = []
    for device in range(lo // shard, (hi - 1) // shard + 1):
        start, stop = max(lo, device * shard), min(hi, (device + 1) * shard)
        into = region[:axis] + (slice(start, stop),) + region[axis + 1:]
        take = tuple(slice(None) for _ in region[:axis]) + (slice(start - lo, stop - lo),) + \
            tuple(slice(None) for _ in region[axis + 1:])
        parts.append((device, into, take))
    return parts


class DeviceSpill:
    """One local spill file per group, appended to until ``window`` bytes wait, then read back group by group.

    Writes and reads are positional (``pwrite``/``preadv`` at offsets kept here): reads of one window run in several
    threads at once, beside the writes into the other window. A window forgotten (:meth:`clear`) is overwritten from
    its files' start, not truncated: on gVisor dropping a file's cached pages cost about as much as writing them."""

    def __init__(self, window: int, directory: str | None = None):
        self.window = window
        sweep(directory or tempfile.gettempdir())
        self._dir = tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        self._files: dict[int, int] = {}  # group -> file descriptor
        self._ends: dict[int, int] = {}  # group -> bytes of this window in its file
        self._parts: dict[int, list[Part]] = {}
        self.bytes = 0

    def full(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would overflow the window (an empty window takes anything)."""
        return self.bytes > 0 and self.bytes + nbytes > self.window

    def add(self, group: int, leaf: int, region: Region, data: np.ndarray) -> None:
        write_reserved([self.reserve(group, leaf, region, data)])

    def reserve(self, group: int, leaf: int, region: Region, data: np.ndarray) -> tuple[int, int, np.ndarray]:
        """Take the place of a part in its group's file, in the order parts come; :func:`write_reserved` then writes
        it there, in any thread (each part has its own bytes of the file)."""
        fd = self._files.get(group)
        if fd is None:
            name = "replicated" if group == REPLICATED else f"device-{group}"
            fd = self._files[group] = os.open(os.path.join(self._dir.name, name), os.O_RDWR | os.O_CREAT, 0o600)
        offset = self._ends.get(group, 0)
        self._ends[group] = offset + data.nbytes
        self._parts.setdefault(group, []).append(Part(leaf, region, data.dtype, tuple(data.shape), offset))
        self.bytes += data.nbytes
        return fd, offset, data

    def reserve_tile(self, leaf: int, region: Region, data: np.ndarray, shape: tuple[int, ...],
                     devices: int) -> list[tuple[int, int, np.ndarray]]:
        """The places of a tile of leaf ``leaf`` (of ``shape`` on ``devices``), each device's part in that device's
        file (:meth:`reserve`)."""
        return [self.reserve(group, leaf, into, data[take]) for group, into, take in device_parts(region, shape, devices)]

    def add_tile(self, leaf: int, region: Region, data: np.ndarray, shape: tuple[int, ...], devices: int) -> None:
        """A tile of leaf ``leaf`` (of ``shape`` on ``devices``), each device's part into that device's file."""
        write_reserved(self.reserve_tile(leaf, region, data, shape, devices))

    def groups(self) -> Iterator[tuple[int, list[Part]]]:
        """The waiting parts, group by group (devices in order, the replicated leaves last)."""
        for group in sorted(self._parts, key=lambda g: (g == REPLICATED, g)):
            yield group, self._parts[group]

    def read(self, group: int, part: Part) -> np.ndarray:
        """A part's data back (a positional read: several may run at once, beside ``add`` on another window)."""
        data = np.empty(part.shape, part.dtype)
        view = memoryview(data.reshape(-1).view(np.uint8))
        done = 0
        while done < part.nbytes:
            count = os.preadv(self._files[group], [view[done:]], part.offset + done)
            if count == 0:
                raise OSError(f"spill file of group {group}: short read at {part.offset + done}")
            done += count
        return data

    def clear(self) -> None:
        """Forget the window: its parts are written (the next one overwrites its files from the start)."""
        self._parts.clear()
        self._ends.clear()
        self.bytes = 0

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._dir.cleanup()


def write_reserved(places: list[tuple[int, int, np.ndarray]]) -> None:
    """Write each part at the place :meth:`DeviceSpill.reserve` took for it (a positional write: several threads may
    write one window's parts at once)."""
    for fd, offset, data in places:
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)


def sweep(directory: str) -> list[str]:
    """Remove the spills of writers that are gone (a conversion killed by the OOM killer or SIGKILL cannot remove
    its own), so retried runs do not fill the disk; return their names. A live owner's spill, or one whose owner
    cannot be told (another user's process), stays."""
    removed = []
    for name in os.listdir(directory):
        owner = _OWNER.match(name)
        if owner is None or _alive(int(owner[1])):
            continue
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
