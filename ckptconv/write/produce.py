"""The producer: for every read unit of the plan, read, transform and cast, and hand out tiles.

A tile is ``(leaf index, region, data)``: the image of one read unit in one leaf, a union of
whole storage chunks (see :mod:`ckptconv.families.tiles`). Every source tensor is read once even when
it feeds several leaves. A small background thread produces the next tiles while the writer
writes (bounded queue: flat memory). The conversion and ``verify`` share this module.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Collection, Iterable, Iterator

import numpy as np

from ckptconv import settings
from ckptconv.errors import stop_if_terminated
from ckptconv.families.tiles import ReadUnit, Tile
from ckptconv.families.transforms import Box, apply_steps, box_shape, box_slices
from ckptconv.monitor import StageTimer
from ckptconv.plan.conversion import ConversionPlan, Job, LeafPlan
from ckptconv.read.sources import Source
from ckptconv.read.spec import ModelSpec


def plan_tiles(plan: ConversionPlan, source: Source, timer: StageTimer,
               jobs: Collection[int] | None = None) -> Iterator[Tile]:
    """Every tile of every leaf (of the ``jobs`` given, by index), job by job; leaf indices follow ``plan.leaves``."""
    first = 0
    for index, job in enumerate(plan.jobs):
        if jobs is None or index in jobs:
            yield from job_tiles(job, plan.spec, source, timer, first)
        first += len(job.leaves)


def job_tiles(job: Job, spec: ModelSpec, source: Source, timer: StageTimer, first_leaf: int = 0) -> Iterator[Tile]:
    """The tiles of one job, read unit by read unit; each source region is read once."""
    for unit in job.units(spec):
        with timer.stage("read"):
            raws = [] if unit.source_box is None else [job.pieces[i].read(source, unit.source_box)
                                                       for i in unit.pieces]
        for k, leaf in enumerate(job.leaves):
            box = unit.leaf_boxes[k]
            if box is None:
                continue
            with timer.stage("transform"):
                data = _assemble(leaf, box, raws, unit, k, spec)
            yield first_leaf + k, box_slices(box), data
        del raws


def _assemble(leaf: LeafPlan, box: Box, raws: list[np.ndarray], unit: ReadUnit, k: int, spec: ModelSpec) -> np.ndarray:
    """The leaf region of one read: each piece transformed, cast, and placed on the stack axes
    (zeros for a unit of vocabulary padding, which reads nothing)."""
    shape = box_shape(box)
    if not raws:
        return np.zeros(shape, dtype=leaf.dtype)
    if len(raws) == 1:
        return _finish(leaf, apply_steps(raws[0], leaf.steps, spec, unit.step_boxes[k])).reshape(shape)
    out = np.empty(shape, dtype=leaf.dtype)
    axis = leaf.stack_axes[-1]
    for n, raw in enumerate(raws):
        index = (slice(None),) * axis + (n,)
        out[index] = apply_steps(raw, leaf.steps, spec, unit.step_boxes[k]).reshape(out[index].shape)
    return out


def _finish(leaf: LeafPlan, data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data.astype(leaf.dtype, copy=False))


_DONE = object()


def prefetch(produce: Callable[[], Iterable[Tile]]) -> Iterator[Tile]:
    """Run ``produce`` in a thread, at most ``settings.IN_FLIGHT.prefetch`` tiles ahead of the consumer."""
    slots: queue.Queue = queue.Queue(maxsize=settings.IN_FLIGHT.prefetch)
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
                stop_if_terminated()
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
