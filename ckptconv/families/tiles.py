"""The tile plan: how a rule's source tensors are cut into bounded reads, and the leaves into chunks.

One plan per *job* (a rule applied to one layer stack: its source pieces, one per layer and
expert, and the leaves its outputs make). The producer, the memory estimate and the writer
all use it, so what is read, what is predicted and what is written cannot drift apart:

- a **read unit** is a contiguous byte range of one source tensor: whole pieces (``group``
  consecutive layers or experts at once when they are small) or a band of ``band`` units
  along ``band_axis`` (earlier axes fixed), never more than ``budget`` bytes, whatever the
  device count or the divisibility of any axis;
- its image in each leaf (through the rule's steps) is a box that is a union of whole
  **chunks**; every chunk lies inside one device shard and inside one read unit's image, so
  no storage chunk is ever written twice (tensorstore would rebuild it, OCDBT keep both).

Pure arithmetic on shapes: no JAX, no I/O.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ckptconv import settings
from ckptconv.families.sharding import MESH_AXIS, partition_spec, write_shape
from ckptconv.families.transforms import (
    WHOLE, Box, Misaligned, Resize, Scale, Shape, Step, chain_quantum, forward_boxes, full_box,
)
from ckptconv.read.spec import ModelSpec


Region = tuple[slice, ...]
Tile = tuple[int, Region, np.ndarray]  # (leaf index, region of the leaf, its data): what the writer takes


@dataclass(frozen=True)
class LeafShape:
    """What the tile plan needs of one leaf: its shape, stack axes, steps and item size."""

    shape: Shape
    stack_axes: tuple[int, ...]  # leaf axes holding the pieces (experts, layers), in order
    steps: tuple[Step, ...]
    itemsize: int

    @property
    def piece_shape(self) -> Shape:
        return tuple(self.shape[axis] for axis in self.piece_axes)

    @property
    def piece_axes(self) -> tuple[int, ...]:
        return tuple(axis for axis in range(len(self.shape)) if axis not in self.stack_axes)

    def sharded_axis(self, devices: int) -> int | None:
        """The axis cut across devices: the sharded one, or where Orbax splits a replicated leaf's writes."""
        spec = partition_spec(self.shape, devices)
        if MESH_AXIS in spec:
            return spec.index(MESH_AXIS)
        split = [a for a, (w, d) in enumerate(zip(write_shape(self.shape, devices), self.shape)) if w != d]
        return split[0] if split else None

    def part(self, devices: int) -> Shape:
        """One device's part (shard or replica slice): chunks never cross it."""
        return write_shape(self.shape, devices)


@dataclass(frozen=True)
class Tiling:
    """How one job is read and chunked (see the module docstring)."""

    band_axis: int | None  # None: whole pieces per read
    band: int | None  # units of band_axis per read (None for whole pieces)
    group: int  # consecutive pieces along the last stack axis per read (whole pieces only)
    chunks: tuple[Shape, ...]  # per leaf, in leaf coordinates
    unit_bytes: int  # source bytes of the largest read unit
    budget: int  # the read budget this plan was made for (zero padding is written in units of it too)
    order: tuple[int, ...]  # source axes as stored, outermost first (a read is contiguous along it)


@dataclass(frozen=True)
class ReadUnit:
    """One read: which pieces, which source box, and where the result lands in each leaf.

    ``source_box`` None: nothing to read, the leaf boxes are zero padding (a vocabulary padded
    to MaxText's size), written in bounded units like everything else.
    """

    pieces: tuple[int, ...]  # indices into the job's pieces, in order along the group axis
    source_box: Box | None
    leaf_boxes: tuple[Box | None, ...]  # per leaf (None: nothing of this read lands in it)
    step_boxes: tuple[list[Box], ...]  # per leaf, the box after each step (for apply_steps)


def plan_tiling(source_shape: Shape, itemsize: int, leaves: tuple[LeafShape, ...], stack_shape: Shape,
                spec: ModelSpec, devices: int, budget: int | None = None, order: tuple[int, ...] | None = None,
                whole: tuple[int, ...] = ()) -> Tiling:
    """Choose read units and chunks for one job; see the module docstring for the guarantees.

    ``itemsize``: bytes per element of the source as read (decoded); ``order``: its axes as stored,
    outermost first (default: as indexed), so that every read is one byte range of storage;
    ``whole``: source axes a read may not cut (its decoder needs them whole).
    """
    budget = settings.IN_FLIGHT.read_bytes if budget is None else budget
    order = tuple(range(len(source_shape))) if order is None else order
    piece_bytes = math.prod(source_shape) * itemsize
    if piece_bytes <= budget:
        group = _group_size(piece_bytes, leaves, stack_shape, devices, budget)
        chunks = tuple(_chunk(leaf, _image(leaf, full_box(source_shape), source_shape, spec), devices, group)
                       for leaf in leaves)
        chunks = _Padding.widen(chunks, leaves, full_box(source_shape), source_shape, spec, devices, budget)
        return Tiling(None, None, group, chunks, piece_bytes * group, budget, order)
    axis, quantum = _band_axis(source_shape, order, itemsize, leaves, spec, budget, whole)
    band = _band(axis, quantum, source_shape, order, itemsize, leaves, spec, devices, budget)
    box = _band_box(source_shape, order, axis, 0, band)
    chunks = tuple(_chunk(leaf, _image(leaf, box, source_shape, spec), devices, 1) for leaf in leaves)
    chunks = _Padding.widen(chunks, leaves, box, source_shape, spec, devices, budget)
    return Tiling(axis, band, 1, chunks, band * _inner_bytes(source_shape, order, axis, itemsize), budget, order)


def read_units(tiling: Tiling, source_shape: Shape, leaves: tuple[LeafShape, ...], positions: tuple[tuple[int, ...], ...],
               spec: ModelSpec) -> Iterator[ReadUnit]:
    """Every read of a job, in order; together their leaf boxes tile each leaf exactly once.

    ``positions``: each piece's index on the stack axes (the same for every leaf of the job).
    Reads that land in no leaf (rows beyond a truncated vocabulary) are skipped; a padded
    vocabulary's zero rows follow each piece as units with nothing to read.
    """
    pads = tuple(_Padding.of(leaf, chunk, source_shape, spec) for leaf, chunk in zip(leaves, tiling.chunks))
    for members, box in _source_boxes(tiling, source_shape, positions):
        where = [positions[i] for i in members]
        steps = tuple(pad.stretch(forward_boxes(box, source_shape, leaf.steps, spec) if leaf.steps else [box])
                      for leaf, pad in zip(leaves, pads))
        boxes = tuple(None if _empty(s[-1]) else _leaf_box(leaf, where, s[-1]) for leaf, s in zip(leaves, steps))
        if any(b is not None for b in boxes):
            yield ReadUnit(members, box, boxes, steps)
        if all(stop == dim for (_, stop), dim in zip(box, source_shape)):  # the piece's last read: padding follows
            for k, (leaf, pad) in enumerate(zip(leaves, pads)):
                for piece_box in pad.units(leaf, tiling.budget):
                    boxes = tuple(_leaf_box(leaf, where, piece_box) if n == k else None for n in range(len(leaves)))
                    yield ReadUnit(members, None, boxes, tuple([] for _ in leaves))


def source_reads(tiling: Tiling, source_shape: Shape,
                 positions: tuple[tuple[int, ...], ...]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """(pieces, source box) of every read in order, rows no leaf holds included: the units ``export``
    writes, each piece's regions consecutive and in row-major order."""
    return _source_boxes(tiling, source_shape, positions)


def leaf_region(leaf: LeafShape, positions: list[tuple[int, ...]], piece_box: Box) -> Box:
    """The leaf box holding ``piece_box`` of the pieces at ``positions`` (consecutive on the last stack axis)."""
    return _leaf_box(leaf, positions, piece_box)


def _source_boxes(tiling: Tiling, source_shape: Shape,
                  positions: tuple[tuple[int, ...], ...]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """(pieces, source box) of every read, in order: groups of whole pieces, or bands of each piece."""
    if tiling.band_axis is None:
        for members in _groups(positions, tiling.group):
            yield tuple(members), full_box(source_shape)
        return
    axis, band, order = tiling.band_axis, tiling.band, tiling.order
    outer = order[:order.index(axis)]  # stored outside the band axis: one index at a time
    for index in range(len(positions)):
        for prefix in itertools.product(*(range(source_shape[a]) for a in outer)):
            for start in range(0, source_shape[axis], band):
                box = list(_band_box(source_shape, order, axis, start, band))
                for a, i in zip(outer, prefix):
                    box[a] = (i, i + 1)
                yield (index,), tuple(box)


@dataclass(frozen=True)
class _Padding:
    """Zero rows a Resize adds to a leaf (a vocabulary padded to MaxText's size), along one piece axis.

    The rows between the data's end and the next chunk boundary share a chunk with the data, so
    the piece's last read carries them (a chunk is never written twice); the rest are written
    as zeros in units of the read budget, with nothing to read.
    """

    axis: int | None = None  # piece axis; None: no padding
    filled: int = 0  # rows the source fills
    stop: int = 0  # rows of the leaf
    chunk: int = 1
    first: int = 0  # index of the Resize step: its box and those after it hold the padded rows

    @staticmethod
    def of(leaf: LeafShape, chunk: Shape, source_shape: Shape, spec: ModelSpec) -> "_Padding":
        resizes = [n for n, step in enumerate(leaf.steps) if isinstance(step, Resize)]
        if not resizes:
            return _Padding()
        if len(resizes) > 1 or not all(isinstance(step, Scale) for step in leaf.steps[resizes[0] + 1:]):
            raise Misaligned(f"steps {[s.name for s in leaf.steps]}: only scaling may follow a Resize "
                             "(padding is written as zeros)")
        image = forward_boxes(full_box(source_shape), source_shape, leaf.steps, spec)[-1]
        for axis, ((_, stop), dim) in enumerate(zip(image, leaf.piece_shape)):
            if stop < dim:
                return _Padding(axis, stop, dim, chunk[leaf.piece_axes[axis]], resizes[0])
        return _Padding()

    @property
    def carried(self) -> int:
        """Where the last read's rows end: the chunk boundary after the data (or the leaf's end)."""
        return min(self.stop, -(-self.filled // self.chunk) * self.chunk)

    def stretch(self, boxes: list[Box]) -> list[Box]:
        """Step boxes of a read; the read that ends the data also covers rows up to ``carried``."""
        if self.axis is None or boxes[-1][self.axis][1] != self.filled:
            return boxes
        a = self.axis
        return boxes[:self.first] + [b[:a] + ((b[a][0], self.carried),) + b[a + 1:] for b in boxes[self.first:]]

    @staticmethod
    def widen(chunks: tuple[Shape, ...], leaves: tuple[LeafShape, ...], box: Box, source_shape: Shape,
              spec: ModelSpec, devices: int, budget: int) -> tuple[Shape, ...]:
        """Chunks of padded leaves, along the padded axis no longer limited by the data's extent.

        Cut at the image of a read, a 100-row vocabulary padded to 262144 rows on 4 devices gets
        gcd(100, 65536) = 4-row chunks: 65536 of them. When every read holds the data's whole
        extent along the padded axis (``box``: the first read), the data's last read may carry
        zeros up to any chunk boundary, so the chunk there can be the largest divisor of the
        device part whose carried rows, as the steps make them, stay within the read budget;
        never smaller than before.
        """
        return tuple(_Padding.of(leaf, chunk, source_shape, spec)._wider(leaf, chunk, box, source_shape, spec,
                                                                          devices, budget)
                     for leaf, chunk in zip(leaves, chunks))

    def _wider(self, leaf: LeafShape, chunk: Shape, box: Box, source_shape: Shape, spec: ModelSpec, devices: int,
               budget: int) -> Shape:
        image = _image(leaf, box, source_shape, spec)
        if self.axis is None or image[self.axis] != (0, self.filled):
            return chunk
        axis = leaf.piece_axes[self.axis]
        part = leaf.part(devices)[axis]
        # one row of the last read's tile: the read's image across the other piece axes, its pieces; the
        # steps make it in float32, two arrays at once (a step's input and output), within one read's budget
        row = math.prod(stop - start for n, (start, stop) in enumerate(image) if n != self.axis)
        row_bytes = row * math.prod(chunk[a] for a in leaf.stack_axes) * 2 * max(4, leaf.itemsize)
        fits = [d for d in _divisors(part) if d > chunk[axis]
                and min(self.stop, -(-self.filled // d) * d) * row_bytes <= budget]
        if not fits:
            return chunk
        return chunk[:axis] + (max(fits),) + chunk[axis + 1:]

    def extra_elements(self, leaf: LeafShape, group: int) -> int:
        """Elements of the zero rows the data's last read carries (made by the steps besides the read)."""
        if self.axis is None:
            return 0
        return (self.carried - self.filled) * math.prod(leaf.piece_shape) // self.stop * group

    def units(self, leaf: LeafShape, budget: int) -> Iterator[Box]:
        """Piece boxes of the zero rows after ``carried``, each within the budget."""
        if self.axis is None:
            return
        row_bytes = math.prod(leaf.piece_shape) // self.stop * leaf.itemsize
        step = max(self.chunk, budget // max(1, row_bytes) // self.chunk * self.chunk)
        for first in range(self.carried, self.stop, step):
            box = full_box(leaf.piece_shape)
            yield box[:self.axis] + ((first, min(first + step, self.stop)),) + box[self.axis + 1:]


def padding_elements(tiling: Tiling, source_shape: Shape, leaves: tuple[LeafShape, ...], spec: ModelSpec) -> int:
    """The most zero-row elements a read carries into one leaf besides its data (a padded vocabulary's last read)."""
    return max((_Padding.of(leaf, chunk, source_shape, spec).extra_elements(leaf, tiling.group)
                for leaf, chunk in zip(leaves, tiling.chunks)), default=0)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# --- choosing ------------------------------------------------------------------------------

def _group_size(piece_bytes: int, leaves: tuple[LeafShape, ...], stack_shape: Shape, devices: int, budget: int) -> int:
    """Pieces per read along the last stack axis: as many as fit, dividing every leaf's shard of that axis."""
    if not stack_shape:
        return 1
    most = max(1, min(stack_shape[-1], budget // max(1, piece_bytes)))
    parts = [leaf.part(devices)[leaf.stack_axes[-1]] for leaf in leaves
             if leaf.sharded_axis(devices) == leaf.stack_axes[-1]]
    return max(g for g in range(1, most + 1) if all(part % g == 0 for part in parts))


def _inner_bytes(shape: Shape, order: tuple[int, ...], axis: int, itemsize: int) -> int:
    """Bytes of one index of ``axis`` with the axes stored inside it whole."""
    return math.prod(shape[a] for a in order[order.index(axis) + 1:]) * itemsize


def _band_axis(shape: Shape, order: tuple[int, ...], itemsize: int, leaves: tuple[LeafShape, ...], spec: ModelSpec,
               budget: int, whole: tuple[int, ...] = ()) -> tuple[int, int]:
    """The outermost stored axis along which one quantum (outer axes fixed) fits the budget.

    Axes stored outside it must be cuttable to single indices (quantum 1), else a read is not
    one byte range; if nothing fits, the innermost valid axis (over budget, but correct).
    """
    best = None
    for axis in order:
        quantum = WHOLE if axis in whole else _quantum(axis, shape, leaves, spec)
        if quantum == WHOLE:
            break
        best = (axis, quantum)
        if quantum * _inner_bytes(shape, order, axis, itemsize) <= budget:
            return best
        if quantum != 1:  # a later cut would need this axis in single indices
            break
    if best is None:
        raise Misaligned(f"a tensor of shape {shape} cannot be cut for these steps")
    return best


def _quantum(axis: int, shape: Shape, leaves: tuple[LeafShape, ...], spec: ModelSpec) -> int:
    quantum = 1
    for leaf in leaves:
        q, _ = chain_quantum(axis, shape, leaf.steps, spec)
        if q == WHOLE:
            return WHOLE
        quantum = math.lcm(quantum, q)
    return quantum


def _band(axis: int, quantum: int, shape: Shape, order: tuple[int, ...], itemsize: int, leaves: tuple[LeafShape, ...],
          spec: ModelSpec, devices: int, budget: int) -> int:
    """The largest band (a multiple of ``quantum``) within budget whose images respect the shards.

    Along a sharded leaf axis a band's image must hold whole shards or divide one, so that
    chunks (within shards) tile every image.
    """
    row_bytes = _inner_bytes(shape, order, axis, itemsize)
    most = max(1, min(shape[axis] // quantum, budget // max(1, quantum * row_bytes)))
    for count in range(most, 0, -1):
        band = count * quantum
        if all(_fits_shards(leaf, shape, order, axis, band, spec, devices) for leaf in leaves):
            return band
    return quantum


def _fits_shards(leaf: LeafShape, shape: Shape, order: tuple[int, ...], axis: int, band: int, spec: ModelSpec,
                 devices: int) -> bool:
    sharded = leaf.sharded_axis(devices)
    if sharded is None or sharded in leaf.stack_axes:
        return True
    image = _image(leaf, _band_box(shape, order, axis, 0, band), shape, spec)
    piece_axis = leaf.piece_axes.index(sharded)
    extent = image[piece_axis][1] - image[piece_axis][0]
    shard = leaf.part(devices)[sharded]
    return extent % shard == 0 or shard % extent == 0


def _image(leaf: LeafShape, box: Box, source_shape: Shape, spec: ModelSpec) -> Box:
    """Where a source region lands in the leaf's piece (no padding)."""
    return forward_boxes(box, source_shape, leaf.steps, spec)[-1] if leaf.steps else box


def _chunk(leaf: LeafShape, piece_box: Box, devices: int, group: int) -> Shape:
    """Chunk shape of ``leaf`` for reads whose piece image is ``piece_box``: the image, cut at shards."""
    extents = dict(zip(leaf.piece_axes, (stop - start for start, stop in piece_box)))
    chunk = [extents.get(axis, 1) for axis in range(len(leaf.shape))]
    if leaf.stack_axes:
        chunk[leaf.stack_axes[-1]] = group
    sharded = leaf.sharded_axis(devices)
    if sharded is not None:
        chunk[sharded] = math.gcd(chunk[sharded], leaf.part(devices)[sharded])
    return tuple(max(1, c) for c in chunk)


# --- boxes ---------------------------------------------------------------------------------

def _band_box(shape: Shape, order: tuple[int, ...], axis: int, start: int, band: int) -> Box:
    """Axes stored outside ``axis`` at index 0 (the caller sets them), a band on ``axis``, the rest whole."""
    outer = set(order[:order.index(axis)])
    return tuple((0, 1) if a in outer else (start, min(start + band, dim)) if a == axis else (0, dim)
                 for a, dim in enumerate(shape))


def _leaf_box(leaf: LeafShape, positions: list[tuple[int, ...]], piece_box: Box) -> Box:
    """``piece_box`` (piece coordinates) at stack ``positions`` (consecutive on the last stack axis)."""
    box: list[tuple[int, int]] = [(0, 0)] * len(leaf.shape)
    for axis, extent in zip(leaf.piece_axes, piece_box):
        box[axis] = extent
    for n, axis in enumerate(leaf.stack_axes):
        first = positions[0][n]
        last = positions[-1][n]
        box[axis] = (first, last + 1)
    return tuple(box)


def _empty(box: Box) -> bool:
    return any(stop <= start for start, stop in box)


def _groups(positions: tuple[tuple[int, ...], ...], group: int) -> Iterator[list[int]]:
    """Runs of at most ``group`` pieces that differ only in (consecutive) last stack index."""
    if not positions or not positions[0]:
        yield from ([index] for index in range(len(positions)))
        return
    run: list[int] = []
    for index, position in enumerate(positions):
        if run:
            head = positions[run[0]]
            aligned = position[:-1] == head[:-1] and position[-1] == positions[run[-1]][-1] + 1
            if not aligned or len(run) == group or position[-1] % group == 0:
                yield run
                run = []
        run.append(index)
    if run:
        yield run
