"""One host's restore, timed: device 0's shard of every leaf read back from the destination, as Orbax's restore
reads it (its OCDBT kvstore spec and context, with its read coalescing), decoded, and dropped.

:mod:`ckptconv.read.restore_cost` counts what a host will ask storage for; this measures how long the asking
takes from where the conversion ran (for a ``gs://`` destination, the bucket over the worker's network). The
reads go in pieces of at most ``PIECE_BYTES``, ``IN_FLIGHT`` at a time, so they stay bounded whatever a shard's
size (a 1T model's expert shard is tens of GB) and below the conversion's own peak; a TPU host reading all of its
leaves at once with its RAM to spare is faster, so the figure is an upper bound on its read time.

A shard over ``SAMPLE_BYTES`` is sampled: pieces spread evenly over all its leaves, about ``SAMPLE_BYTES`` of them,
and the report says how much was read of how much (``device_decoded_bytes`` of ``device_shard_bytes``). Read whole,
a one-device conversion's shard is its whole output: OLMo 3 32B's block (5.6 GB) ran 8.5 s more after its 32.5 s
conversion, Llama-3-8B's widths with 2 layers (3.0 GB) 5.3 s more, to say what a sample says.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Iterator, TypeVar

import numpy as np

from ckptconv.read.restore_cost import device_boxes
from ckptconv.read.stored import StoredLeaf, open_items_leaf

PIECE_BYTES = 16 * 1024**2  # at most this much decoded per read
IN_FLIGHT = 2  # reads outstanding at once
SAMPLE_BYTES = 256 * 1024**2  # decoded bytes read at most (a shard larger than this is sampled)

T = TypeVar("T", bound=tuple)


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


def time_device_read(items: str, leaves: list[StoredLeaf], device: int = 0, limit: int = SAMPLE_BYTES) -> dict:
    """``{"device_read_seconds", "device_decoded_bytes", "device_shard_bytes"}``: the wall time to read and decode
    ``device``'s shard of every leaf at ``items`` (``DST/0/items``), opening included, or of an even sample of its
    pieces, ``limit`` bytes or about that, when the shard is larger (:func:`sample`); the bytes read, and the shard's."""
    planned = list(_shard_pieces(leaves, device))
    shard = sum(size for _, _, size in planned)
    start = time.perf_counter()
    decoded = 0
    in_flight: deque = deque()
    path, store = None, None  # the leaf being read: pieces come leaf by leaf, so one store is open at a time
    for leaf, index, _ in sample(planned, shard, limit):
        if leaf.path != path:
            path, store = leaf.path, open_items_leaf(items, leaf.path)
        in_flight.append(store[index].read())
        while len(in_flight) >= IN_FLIGHT:
            decoded += in_flight.popleft().result().nbytes
    while in_flight:
        decoded += in_flight.popleft().result().nbytes
    return {"device_read_seconds": round(time.perf_counter() - start, 3), "device_decoded_bytes": decoded,
            "device_shard_bytes": shard}


def _shard_pieces(leaves: list[StoredLeaf], device: int) -> Iterator[tuple[StoredLeaf, tuple[slice, ...], int]]:
    """Every piece of ``device``'s shard, leaf by leaf, with its decoded size (MaxText's scalar step has none)."""
    for leaf in leaves:
        if leaf.chunk_shape is None or not leaf.shape:
            continue
        itemsize = np.dtype(leaf.dtype).itemsize
        for index in pieces(device_boxes(leaf, device), leaf.chunk_shape, itemsize):
            yield leaf, index, itemsize * math.prod(s.stop - s.start for s in index)


def sample(planned: list[T], total: int, limit: int) -> list[T]:
    """All of ``planned`` (items whose last field is a size in bytes, ``total`` in all) if ``total`` is within
    ``limit``; else every item whose share of ``limit``, accumulated in order, has reached its size: about ``limit``
    bytes, spread evenly from the first item to the last.

    >>> [n for n, _ in sample([(n, 4) for n in range(8)], 32, 8)]
    [3, 7]
    >>> len(sample([(n, 4) for n in range(8)], 32, 32))
    8
    """
    if total <= limit:
        return list(planned)
    chosen, credit = [], 0.0
    for item in planned:
        credit += item[-1] * limit / total
        if credit >= item[-1]:
            chosen.append(item)
            credit -= item[-1]
    return chosen
