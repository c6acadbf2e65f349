"""Per-leaf slab producers: read HF bytes, transform, cast, and hand the writer one slab at a time.

A slab is one layer of a stacked leaf, or a block of rows of a single large tensor, so the
memory a conversion needs is a few slabs, whatever the model size. A small background thread
reads and transforms the next slabs while the writer writes (bounded queue: flat memory).
"""

from __future__ import annotations

import queue
import threading

from typing import Callable, Iterable, Iterator

import numpy as np

from ckptconv.monitor import StageTimer
from ckptconv.plan import SCAN_AXIS, LeafPlan
from ckptconv.safetensors_io import read_tensor
from ckptconv.sharding import MESH_AXIS, partition_spec, shard_shape
from ckptconv.sources import Source
from ckptconv.spec import ModelSpec
from ckptconv.transforms import apply_steps, column_sliceable

Index = tuple[slice, ...]
Slab = tuple[Index, np.ndarray]

SLAB_BYTES = 16 * 1024 * 1024  # target slab size: big enough for few storage commits, small enough to stream


def layers_per_slab(leaf: LeafPlan) -> int:
    """Layers stacked into one slab: the largest divisor of the layer count within ``SLAB_BYTES``.

    Every storage write is an OCDBT commit, so a 2 MiB layer per write is slow; a divisor
    keeps all slabs the same thickness, which the writer's chunk grid needs.
    """
    layers = leaf.shape[SCAN_AXIS]
    layer_bytes = max(1, leaf.nbytes // layers)
    return max(k for k in range(1, layers + 1) if layers % k == 0 and (k == 1 or k * layer_bytes <= SLAB_BYTES))


def leaf_slabs(leaf: LeafPlan, source: Source, spec: ModelSpec, timer: StageTimer,
               rows_per_slab: int | None = None, devices: int = 1) -> Iterator[Slab]:
    """Yield ``(index, data)`` slabs that tile ``leaf`` exactly once.

    ``rows_per_slab`` sizes row blocks of a single big tensor; the writer picks it so slabs
    start on its chunk grid (``writer.slab_rows``). By default blocks are ~``SLAB_BYTES``.
    ``devices`` lets a layer bigger than ``SLAB_BYTES`` go out in pieces of whole device
    shards (its chunks never cross a shard), so the write queue never holds whole layers.
    """
    full = tuple(slice(None) for _ in leaf.shape)
    if leaf.stacked:
        yield from _stacked_slabs(leaf, source, spec, timer, devices, full)
        return
    info = leaf.sources[0]
    axis = leaf.row_axis
    row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
    rows = rows_per_slab or max(1, SLAB_BYTES // row_bytes)
    if axis is None or not info.shape or rows >= info.shape[0]:
        yield full, _convert(leaf, source, spec, timer, info, None)
        return
    for start in range(0, info.shape[0], rows):
        stop = min(start + rows, info.shape[0])
        yield full[:axis] + (slice(start, stop),) + full[axis + 1:], _convert(leaf, source, spec, timer, info, slice(start, stop))


def _stacked_slabs(leaf: LeafPlan, source: Source, spec: ModelSpec, timer: StageTimer, devices: int,
                   full: Index) -> Iterator[Slab]:
    group = layers_per_slab(leaf)
    if group == 1:
        yield from _layer_pieces(leaf, source, spec, timer, devices, full)
        return
    for first in range(0, len(leaf.sources), group):
        slab = np.empty((*leaf.shape[:SCAN_AXIS], group, *leaf.shape[SCAN_AXIS + 1:]), dtype=leaf.dtype)
        for offset, info in enumerate(leaf.sources[first:first + group]):
            slab[(slice(None),) * SCAN_AXIS + (offset,)] = _convert(leaf, source, spec, timer, info, None)
        yield full[:SCAN_AXIS] + (slice(first, first + group),) + full[SCAN_AXIS + 1:], slab


def _layer_pieces(leaf: LeafPlan, source: Source, spec: ModelSpec, timer: StageTimer, devices: int,
                  full: Index) -> Iterator[Slab]:
    """One big layer at a time, written in pieces of whole device shards.

    When the steps start with a transpose (MLP and q/k/v kernels), each piece is made from
    its own block of source columns, so the converted layer never exists whole: the memory
    is one raw layer plus a few pieces.
    """
    pieces = _shard_pieces(leaf, devices)
    by_columns = len(pieces) > 1 and column_sliceable(leaf.steps)
    for layer, info in enumerate(leaf.sources):
        where = (slice(layer, layer + 1),) + full[SCAN_AXIS + 1:]
        if not by_columns:
            data = np.expand_dims(_convert(leaf, source, spec, timer, info, None), SCAN_AXIS)
            yield from (((rows,) + where, data[rows]) for rows in pieces)
            continue
        with timer.stage("read"):
            raw = read_tensor(source, info)
        for rows in pieces:
            with timer.stage("transform"):
                piece = _finish(leaf, apply_steps(raw[:, rows], leaf.steps, spec))
            yield (rows,) + where, np.expand_dims(piece, SCAN_AXIS)
        del raw


def _shard_pieces(leaf: LeafPlan, devices: int) -> list[slice]:
    """Axis-0 ranges of whole device shards, ~``SLAB_BYTES`` each, covering one layer."""
    extent = shard_shape(leaf.shape, devices)[0]
    if MESH_AXIS not in partition_spec(leaf.shape, devices)[:1]:
        return [slice(None)]
    shard_bytes = leaf.nbytes // leaf.shape[SCAN_AXIS] // devices
    step = extent * max(1, SLAB_BYTES // max(1, shard_bytes))
    return [slice(start, min(start + step, leaf.shape[0])) for start in range(0, leaf.shape[0], step)]


def _convert(leaf: LeafPlan, source: Source, spec: ModelSpec, timer: StageTimer, info, rows: slice | None) -> np.ndarray:
    with timer.stage("read"):
        raw = read_tensor(source, info, rows)
    with timer.stage("transform"):
        return _finish(leaf, apply_steps(raw, leaf.steps, spec))


def _finish(leaf: LeafPlan, data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data.astype(leaf.dtype, copy=False))


_DONE = object()


def prefetch(produce: Callable[[], Iterable[Slab]], depth: int = 2) -> Iterator[Slab]:
    """Run ``produce`` in a thread, at most ``depth`` slabs ahead of the consumer."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        """Queue ``item`` unless the consumer has gone away (then say so)."""
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def worker() -> None:
        try:
            for item in produce():
                if not put(item):
                    return
            put(_DONE)
        except BaseException as err:  # re-raised in the consumer, with its traceback
            put(err)

    thread = threading.Thread(target=worker, name="ckptconv-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


