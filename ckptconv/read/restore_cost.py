"""What a TPU host pays to restore a written checkpoint, computed from its stored layout (issue 27).

The OCDBT database says where every stored chunk is: which data file, at which offset, how long
(``tensorstore.ocdbt.dump`` of the manifest and b-tree nodes; no data is read). A host restoring
one device's shard reads that device's chunks of every leaf; Orbax's restore merges byte ranges
of one data file that lie less than ``READ_COALESCING_BYTES`` apart into one request (its
``experimental_read_coalescing_threshold_bytes``), so the requests are the merged ranges, plus the
manifest and the b-tree nodes it walks. On gs:// the bench (bench/restore.py) counts the same
reads at the server: the figures here are what a zoo team's hosts will pay, without a restore.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from ckptconv.read.stored import StoredLeaf, kvstore_url

# Orbax 0.12.8's restore context (tensorstore_utils: experimental_read_coalescing_threshold_bytes):
# ranges of one file closer than this are read in one request.
READ_COALESCING_BYTES = 1_000_000
_VALUE = re.compile(r"^value:(?P<prefix>.*?):?(?P<file>d/[0-9a-f]+):(?P<offset>\d+):(?P<length>\d+)$")
_NODE = re.compile(r"^btreenode::(?P<file>.+?):(?P<offset>\d+):(?P<length>\d+)$")


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk of a leaf: its grid index and where its bytes are (None: inline in the b-tree)."""

    leaf: str  # the leaf's storage name (its path joined by dots)
    index: tuple[int, ...]
    file: str | None
    offset: int
    length: int


def stored_chunks(items: str) -> tuple[list[StoredChunk], int, int]:
    """(every chunk, b-tree nodes, b-tree bytes) of the OCDBT database at ``items`` (``DST/0/items``)."""
    import tensorstore as ts

    kvstore = ts.KvStore.open(kvstore_url(str(items).rstrip("/")) + "/").result()
    manifest = ts.ocdbt.dump(kvstore).result()
    versions = manifest.get("versions") or []
    if not versions:
        return [], 0, 0
    chunks: list[StoredChunk] = []
    nodes = [versions[-1]["root"]["location"]]
    count = size = 0
    while nodes:
        location = nodes.pop()
        match = _NODE.match(location)
        count += 1
        size += int(match["length"]) if match else 0
        node = ts.ocdbt.dump(kvstore, location).result()
        for entry in node.get("entries", []):
            child = _child(entry)
            if child is not None:
                nodes.append(child)
                continue
            key = entry["key"].decode() if isinstance(entry["key"], bytes) else str(entry["key"])
            name, _, rest = key.partition("/c/")
            if not rest and not key.endswith("/c"):
                continue  # zarr.json and other metadata
            index = tuple(int(part) for part in rest.split("/")) if rest else ()
            value = entry.get("indirect_value")
            found = _VALUE.match(value) if isinstance(value, str) else None
            if found:
                file = f"{found['prefix'].rstrip('/')}/{found['file']}" if found["prefix"] else found["file"]
                chunks.append(StoredChunk(name, index, file, int(found["offset"]), int(found["length"])))
            else:
                chunks.append(StoredChunk(name, index, None, 0, len(entry.get("inline_value") or b"")))
    return chunks, count, size


def _child(entry: dict) -> str | None:
    """The b-tree node an interior entry points to (None: a leaf entry holding a key)."""
    for value in entry.values():
        if isinstance(value, str) and value.startswith("btreenode::"):
            return value
        if isinstance(value, dict):
            found = _child(value)
            if found is not None:
                return found
    return None


def device_boxes(leaf: StoredLeaf, device: int) -> tuple[tuple[int, int], ...]:
    """The box of ``leaf`` device ``device`` restores (the whole leaf when it is replicated)."""
    devices = math.prod(leaf.mesh_shape or (1,))
    box = [(0, dim) for dim in leaf.shape]
    for axis, name in enumerate(leaf.partition_spec or ()):
        if name is not None and devices > 1:
            part = -(-leaf.shape[axis] // devices)
            box[axis] = (min(device * part, leaf.shape[axis]), min((device + 1) * part, leaf.shape[axis]))
    return tuple(box)


def _inside(chunk: StoredChunk, shape: tuple[int, ...], chunk_shape: tuple[int, ...],
            box: tuple[tuple[int, int], ...]) -> bool:
    for i, c, (lo, hi) in zip(chunk.index, chunk_shape, box):
        if not (i * c < hi and (i + 1) * c > lo):
            return False
    return True


def requests(chunks: Iterable[StoredChunk], gap: int = READ_COALESCING_BYTES) -> tuple[int, int]:
    """(requests, bytes) to read ``chunks``: ranges of one data file closer than ``gap`` merged."""
    by_file: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for chunk in chunks:
        if chunk.file is not None:
            by_file[chunk.file].append((chunk.offset, chunk.offset + chunk.length))
    count = nbytes = 0
    for ranges in by_file.values():
        ranges.sort()
        first, end = ranges[0]
        count += 1
        for start, stop in ranges[1:]:
            if start - end >= gap:  # a new request
                count += 1
                nbytes += end - first
                first, end = start, stop
            else:
                end = max(end, stop)
        nbytes += end - first
    return count, nbytes


def restore_figures(items: str, leaves: list[StoredLeaf], device: int = 0) -> dict:
    """The layout's restore figures: chunks, data files, and the requests and bytes a host restoring
    ``device``'s shard makes (and one restoring every shard, as a single host with all devices does)."""
    chunks, nodes, node_bytes = stored_chunks(items)
    by_name = {".".join(leaf.path): leaf for leaf in leaves}
    mine, arrays = [], 0
    for chunk in chunks:
        leaf = by_name.get(chunk.leaf)
        if leaf is None or leaf.chunk_shape is None:
            continue  # a scalar (MaxText's step)
        arrays += 1
        if _inside(chunk, leaf.shape, leaf.chunk_shape, device_boxes(leaf, device)):
            mine.append(chunk)
    files: dict[str, int] = defaultdict(int)
    for chunk in chunks:
        if chunk.file is not None:
            files[chunk.file] = max(files[chunk.file], chunk.offset + chunk.length)
    index_reads = 1 + nodes  # the manifest, then every b-tree node (a restore looks up every leaf)
    device_reads, device_bytes = requests(mine)
    all_reads, all_bytes = requests(chunks)
    devices = max((math.prod(leaf.mesh_shape or (1,)) for leaf in leaves), default=1)
    return {
        "chunks": arrays,
        "data_files": len(files),
        "largest_data_file_bytes": max(files.values(), default=0),
        "btree_nodes": nodes,
        "devices": devices,
        "device": device,
        "device_chunks": len(mine),
        "device_data_files": len({chunk.file for chunk in mine if chunk.file is not None}),
        "device_reads": index_reads + device_reads,
        "device_read_bytes": node_bytes + device_bytes,
        "all_devices_reads": index_reads + all_reads,
        "all_devices_read_bytes": node_bytes + all_bytes,
        "coalescing_bytes": READ_COALESCING_BYTES,
    }


def figures_or_none(items: str, leaves: list[StoredLeaf]) -> dict[str, Any] | None:
    """:func:`restore_figures`, or None when the layout cannot be read (the conversion stays complete)."""
    try:
        return restore_figures(items, leaves)
    except (ValueError, KeyError, OSError) as err:  # a report field, never a reason to fail a finished conversion
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
