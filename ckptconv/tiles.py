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

from ckptconv.sharding import MESH_AXIS, partition_spec, write_shape
from ckptconv.spec import ModelSpec
from ckptconv.transforms import WHOLE, Box, Misaligned, Shape, Step, chain_quantum, forward_boxes, full_box

READ_BYTES = 16 * 1024 * 1024  # source bytes per read unit: large enough for few commits, small enough to stream


@dataclass(frozen=True)
class LeafShape:
    """What the tile plan needs of one leaf: its shape, stack axes, steps and item size."""

    shape: Shape
    stack_axes: tuple[int, ...]  # leaf axes holding the pieces (experts, layers), in order
    steps: tuple[Step, ...]
    itemsize: int

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
    band: int  # units of band_axis per read (whole pieces: the axis size is irrelevant)
    group: int  # consecutive pieces along the last stack axis per read (whole pieces only)
    chunks: tuple[Shape, ...]  # per leaf, in leaf coordinates
    unit_bytes: int  # source bytes of the largest read unit

    def to_json(self) -> dict:
        return {"band_axis": self.band_axis, "band": self.band, "group": self.group,
                "chunks": [list(c) for c in self.chunks], "unit_bytes": self.unit_bytes}


@dataclass(frozen=True)
class ReadUnit:
    """One read: which pieces, which source box, and where the result lands in each leaf."""

    pieces: tuple[int, ...]  # indices into the job's pieces, in order along the group axis
    source_box: Box
    leaf_boxes: tuple[Box | None, ...]  # per leaf (None: nothing of this read lands in it)
    step_boxes: tuple[list[Box], ...]  # per leaf, the box after each step (for apply_steps)


def plan_tiling(source_shape: Shape, itemsize: int, leaves: tuple[LeafShape, ...], stack_shape: Shape,
                spec: ModelSpec, devices: int, budget: int | None = None) -> Tiling:
    """Choose read units and chunks for one job; see the module docstring for the guarantees."""
    budget = READ_BYTES if budget is None else budget
    piece_bytes = math.prod(source_shape) * itemsize
    if piece_bytes <= budget:
        group = _group_size(piece_bytes, leaves, stack_shape, devices, budget)
        chunks = tuple(_chunk(leaf, _whole_box(leaf, spec, source_shape), devices, group) for leaf in leaves)
        return Tiling(None, source_shape[0] if source_shape else 1, group, chunks, piece_bytes * group)
    axis, quantum = _band_axis(source_shape, itemsize, leaves, spec, budget)
    band = _band(axis, quantum, source_shape, itemsize, leaves, spec, devices, budget)
    box = _band_box(source_shape, axis, 0, band)
    chunks = tuple(_chunk(leaf, forward_boxes(box, source_shape, leaf.steps, spec)[-1] if leaf.steps else box,
                          devices, 1) for leaf in leaves)
    row_bytes = math.prod(source_shape[axis + 1:]) * itemsize
    return Tiling(axis, band, 1, chunks, band * row_bytes)


def read_units(tiling: Tiling, source_shape: Shape, leaves: tuple[LeafShape, ...], positions: tuple[tuple[int, ...], ...],
               spec: ModelSpec) -> Iterator[ReadUnit]:
    """Every read of a job, in order; together their leaf boxes tile each leaf exactly once.

    ``positions``: each piece's index on the stack axes (the same for every leaf of the job).
    """
    if tiling.band_axis is None:
        for members in _groups(positions, tiling.group):
            boxes = tuple(_leaf_box(leaf, [positions[i] for i in members], full_box(_out_shape(leaf, spec, source_shape)))
                          for leaf in leaves)
            step_boxes = tuple(_whole_step_boxes(leaf, spec, source_shape) for leaf in leaves)
            yield ReadUnit(tuple(members), full_box(source_shape), boxes, step_boxes)
        return
    axis = tiling.band_axis
    for index, position in enumerate(positions):
        for prefix in itertools.product(*(range(n) for n in source_shape[:axis])):
            for start in range(0, source_shape[axis], tiling.band):
                box = tuple((i, i + 1) for i in prefix) + _band_box(source_shape[axis:], 0, start, tiling.band)
                steps = tuple(forward_boxes(box, source_shape, leaf.steps, spec) if leaf.steps else [box]
                              for leaf in leaves)
                boxes = tuple(None if _empty(s[-1]) else _leaf_box(leaf, [position], s[-1])
                              for leaf, s in zip(leaves, steps))
                yield ReadUnit((index,), box, boxes, steps)


# --- choosing ------------------------------------------------------------------------------

def _group_size(piece_bytes: int, leaves: tuple[LeafShape, ...], stack_shape: Shape, devices: int, budget: int) -> int:
    """Pieces per read along the last stack axis: as many as fit, dividing any shard of that axis."""
    if not stack_shape:
        return 1
    group = max(1, min(stack_shape[-1], budget // max(1, piece_bytes)))
    for leaf in leaves:
        axis = leaf.stack_axes[-1]
        if leaf.sharded_axis(devices) == axis:
            extent = leaf.part(devices)[axis]
            group = max(d for d in range(1, min(group, extent) + 1) if extent % d == 0)
    return group


def _band_axis(shape: Shape, itemsize: int, leaves: tuple[LeafShape, ...], spec: ModelSpec, budget: int) -> tuple[int, int]:
    """The first source axis along which one quantum (earlier axes fixed) fits the budget.

    Earlier axes must be cuttable to single indices (quantum 1), else a read is not one byte
    range; if nothing fits, the deepest valid axis (over budget, but correct).
    """
    best = None
    for axis in range(len(shape)):
        quantum = _quantum(axis, shape, leaves, spec)
        if quantum == WHOLE:
            break
        best = (axis, quantum)
        if quantum * math.prod(shape[axis + 1:]) * itemsize <= budget:
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


def _band(axis: int, quantum: int, shape: Shape, itemsize: int, leaves: tuple[LeafShape, ...], spec: ModelSpec,
          devices: int, budget: int) -> int:
    """The largest band (a multiple of ``quantum``) within budget whose images respect the shards.

    Along a sharded leaf axis a band's image must hold whole shards or divide one, so that
    chunks (within shards) tile every image.
    """
    row_bytes = math.prod(shape[axis + 1:]) * itemsize
    most = max(1, min(shape[axis] // quantum, budget // max(1, quantum * row_bytes)))
    for count in range(most, 0, -1):
        band = count * quantum
        if all(_fits_shards(leaf, shape, axis, band, spec, devices) for leaf in leaves):
            return band
    return quantum


def _fits_shards(leaf: LeafShape, shape: Shape, axis: int, band: int, spec: ModelSpec, devices: int) -> bool:
    sharded = leaf.sharded_axis(devices)
    if sharded is None or sharded in leaf.stack_axes:
        return True
    box = _band_box(shape, axis, 0, band)
    image = forward_boxes(box, shape, leaf.steps, spec)[-1] if leaf.steps else box
    piece_axis = leaf.piece_axes.index(sharded)
    extent = image[piece_axis][1] - image[piece_axis][0]
    shard = leaf.part(devices)[sharded]
    return extent % shard == 0 or shard % extent == 0


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

def _band_box(shape: Shape, axis: int, start: int, band: int) -> Box:
    """Axes before ``axis`` at index 0 (the caller replaces them), a band on ``axis``, the rest whole."""
    return tuple((0, 1) for _ in shape[:axis]) + ((start, min(start + band, shape[axis])),) + full_box(shape[axis + 1:])


def _out_shape(leaf: LeafShape, spec: ModelSpec, source_shape: Shape) -> Shape:
    return tuple(leaf.shape[axis] for axis in leaf.piece_axes)


def _whole_box(leaf: LeafShape, spec: ModelSpec, source_shape: Shape) -> Box:
    return full_box(_out_shape(leaf, spec, source_shape))


def _whole_step_boxes(leaf: LeafShape, spec: ModelSpec, source_shape: Shape) -> list[Box]:
    boxes, shape = [], source_shape
    for step in leaf.steps:
        shape = step.shape(shape, spec)
        boxes.append(full_box(shape))
    return boxes


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
