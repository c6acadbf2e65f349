"""The producer: for every read unit of the plan, read, transform and cast, and hand out tiles.

A tile is ``(leaf index, region, data)``: the image of one read unit in one leaf, a union of
whole storage chunks (see :mod:`ckptconv.families.tiles`). Every source tensor is read once even when
it feeds several leaves. With one worker a small background thread produces the next tiles while the
writer writes (bounded queue: flat memory); with more (``RunOptions.workers``) that many threads each
read and transform a read unit at once, and the tiles still come out in the plan's order
(:func:`produce_tiles`), so the writer sees the same stream and writes the same data files. The reads
(``preadv``), the transposes and casts (NumPy) run outside the GIL. The conversion and ``verify`` share
this module.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Collection, Iterable, Iterator

import numpy as np

from ckptconv import settings
from ckptconv.errors import stop_if_terminated
from ckptconv.families.tiles import ReadUnit, Tile
from ckptconv.families.transforms import Box, apply_steps, box_shape, box_slices
from ckptconv.monitor import StageTimer
from ckptconv.plan.conversion import ConversionPlan, Job, LeafPlan
from ckptconv.read import buffers
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


def produce_tiles(plan: ConversionPlan, source: Source, timer: StageTimer,
                  options: settings.RunOptions | None = None, jobs: Collection[int] | None = None) -> Iterator[Tile]:
    """The tile stream a writer takes, in the plan's order: from one prefetch thread with one worker, else from
    ``options.workers`` threads making read units at once, at most ``workers + prefetch`` units made and not yet
    handed over (what :func:`ckptconv.plan.estimate.producer_bytes` counts)."""
    options = options or settings.RunOptions()
    if options.workers <= 1:
        return _pooled(lambda: prefetch(lambda: plan_tiles(plan, source, timer, jobs)))
    slots = threading.BoundedSemaphore(options.transforming)
    return _pooled(lambda: in_order(_unit_makers(plan, source, timer, jobs, slots), options.workers,
                                    options.workers + options.in_flight.prefetch))


def _pooled(stream: Callable[[], Iterator[Tile]]) -> Iterator[Tile]:
    """``stream()``'s tiles, its reads, transposes and casts made in reused buffers (:mod:`ckptconv.read.buffers`)
    until it ends: the kept buffers are dropped then, before the writer writes what it spilled."""
    with buffers.pooled():
        yield from stream()


def _unit_makers(plan: ConversionPlan, source: Source, timer: StageTimer, jobs: Collection[int] | None,
                 slots: threading.BoundedSemaphore) -> Iterator[Callable[[], list[Tile]]]:
    first = 0
    for index, job in enumerate(plan.jobs):
        if jobs is None or index in jobs:
            for unit in job.units(plan.spec):
                yield functools.partial(_unit_tiles, job, unit, plan.spec, source, timer, first, slots)
        first += len(job.leaves)


def _unit_tiles(job: Job, unit: ReadUnit, spec: ModelSpec, source: Source, timer: StageTimer,
                first_leaf: int, slots: threading.BoundedSemaphore) -> list[Tile]:
    """One read unit's tiles, all its leaves' (made in a worker thread; transformed holding one of ``slots``,
    ``RunOptions.transforming``)."""
    stop_if_terminated()
    with timer.stage("read"):
        raws = [] if unit.source_box is None else [job.pieces[i].read(source, unit.source_box) for i in unit.pieces]
    tiles = []
    with slots:
        for k, leaf in enumerate(job.leaves):
            box = unit.leaf_boxes[k]
            if box is not None:
                with timer.stage("transform"):
                    tiles.append((first_leaf + k, box_slices(box), _assemble(leaf, box, raws, unit, k, spec)))
    return tiles


def in_order(makers: Iterator[Callable[[], list[Tile]]], workers: int, depth: int) -> Iterator[Tile]:
    """Run ``makers`` on ``workers`` threads, at most ``depth`` made or being made and not yet handed over; yield
    their tiles in the makers' order (an error raised by one is raised here, in its turn)."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptconv-produce")
    pending: collections.deque[Future] = collections.deque()
    try:
        for make in makers:
            pending.append(pool.submit(make))
            while len(pending) >= depth:
                yield from _handed_over(pending.popleft())
        while pending:
            yield from _handed_over(pending.popleft())
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _handed_over(future: Future) -> Iterator[Tile]:
    """A unit's tiles one by one, each let go of here once handed over."""
    tiles = future.result()
    while tiles:
        yield tiles.pop(0)


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
    out = buffers.empty(shape, leaf.dtype)
    axis = leaf.stack_axes[-1]
    for n, raw in enumerate(raws):
        index = (slice(None),) * axis + (n,)
        out[index] = apply_steps(raw, leaf.steps, spec, unit.step_boxes[k]).reshape(out[index].shape)
    return out


def _finish(leaf: LeafPlan, data: np.ndarray) -> np.ndarray:
    return buffers.cast(data, leaf.dtype)


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
