"""One host's restore, timed: device 0's shard of every leaf read back from the destination, as Orbax's restore
reads it (its OCDBT kvstore spec and context, with its read coalescing), decoded, and dropped.

:mod:`ckptconv.read.restore_cost` counts what a host will ask storage for; this measures how long the asking
takes from where the conversion ran (for a ``gs://`` destination, the bucket over the worker's network). The
reads go in pieces of at most ``PIECE_BYTES``, ``IN_FLIGHT`` at a time, so they stay bounded whatever a shard's
size (a 1T model's expert shard is tens of GB) and below the conversion's own peak; a TPU host reading all of its
leaves at once with its RAM to spare is faster, so the figure is an upper bound on its read time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Iterator

import numpy as np

from ckptconv.read.restore_cost import device_boxes
from ckptconv.read.stored import StoredLeaf, open_items_leaf

PIECE_BYTES = 16 * 1024**2  # at most this much decoded per read
IN_FLIGHT = 2  # reads outstanding at once


def pieces(box: tuple[tuple[int, int], ...], chunk_shape: tuple[int, ...], itemsize: int,
           limit: int = PIECE_BYTES) -> Iterator[tuple[slice, ...]]:
    """``box`` cut into boxes of whole chunks of at most ``limit`` bytes (a chunk larger than that is one piece),
    along its first axis that spans several chunks, then within a run along the next, so no chunk is read twice.

    >>> [p[0] for p in pieces(((0, 8), (0, 4)), (2, 4), 4, limit=64)]
    [slice(0, 4, None), slice(4, 8, None)]
    >>> [(p[0].start, p[1].start) for p in pieces(((0, 2), (0, 8)), (1, 2), 4, limit=16)]
    [(0, 0), (0, 4), (1, 0), (1, 4)]
    """
    size = itemsize * math.prod(hi - lo for lo, hi in box)
    axis = next((n for n, ((lo, hi), c) in enumerate(zip(box, chunk_shape)) if hi - lo > c), None)
    if size <= limit or axis is None:
        yield tuple(slice(lo, hi) for lo, hi in box)
        return
    lo, hi = box[axis]
    steps = -(-(hi - lo) // chunk_shape[axis])
    run = max(1, limit // -(-size // steps)) * chunk_shape[axis]  # whole chunk steps per piece
    for start in range(lo, hi, run):
        yield from pieces(box[:axis] + ((start, min(hi, start + run)),) + box[axis + 1:], chunk_shape, itemsize,
                          limit)


def time_device_read(items: str, leaves: list[StoredLeaf], device: int = 0) -> dict:
    """``{"device_read_seconds", "device_decoded_bytes"}``: the wall time to read and decode ``device``'s shard
    of every leaf at ``items`` (``DST/0/items``), opening included."""
    start = time.perf_counter()
    decoded = 0
    in_flight: deque = deque()
    for leaf in leaves:
        if leaf.chunk_shape is None or not leaf.shape:
            continue  # MaxText's scalar step
        store = open_items_leaf(items, leaf.path)
        itemsize = np.dtype(store.dtype.numpy_dtype).itemsize
        for index in pieces(device_boxes(leaf, device), leaf.chunk_shape, itemsize):
            in_flight.append(store[index].read())
            while len(in_flight) >= IN_FLIGHT:
                decoded += in_flight.popleft().result().nbytes
    while in_flight:
        decoded += in_flight.popleft().result().nbytes
    return {"device_read_seconds": round(time.perf_counter() - start, 3), "device_decoded_bytes": decoded}
