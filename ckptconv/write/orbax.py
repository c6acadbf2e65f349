"""Write a MaxText-compatible Orbax checkpoint tile by tile, never holding a whole leaf, without Orbax or JAX.

MaxText's converter builds every leaf as a sharded ``jax.Array`` before saving: peak RAM
is the model. Here each leaf's zarr3 array is opened in OCDBT with the spec Orbax would write it with
(:mod:`ckptconv.write.orbax_layout`) and filled from one stream of tiles; the documents around the arrays
(``_METADATA``, ``_sharding``, ``array_metadatas/``, ``_CHECKPOINT_METADATA``), the merge of the per-process
databases and the step's atomic commit (:mod:`ckptconv.write.step_commit`) are Orbax 0.12.8's, reproduced as data:
importing Orbax and JAX only to lay them out was most of a small conversion's CPU.

Memory stays bounded because no tensorstore transaction spans a leaf (it would buffer all
of it) and no chunk spans two tiles (tensorstore would rebuild the chunk on every write
and OCDBT would keep each old version of it).
The chunk shapes come from the tile plan (:mod:`ckptconv.families.tiles`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import tensorstore as ts

from ckptconv import layout, settings
from ckptconv.families.sharding import write_shape
from ckptconv.families.tiles import Region, Tile
from ckptconv.monitor import trim
from ckptconv.write import codecs, orbax_layout
from ckptconv.write.orbax_layout import TARGET_FILE_BYTES
from ckptconv.write.spill import DeviceSpill, write_reserved
from ckptconv.write.step_commit import StepCommit, write_document

__all__ = ["LeafWrite", "TARGET_FILE_BYTES", "write_checkpoint", "write_partition", "write_shape"]

# The checksum codec that ends every chunk's codec chain (see _with_checksum).
CHUNK_CHECKSUM = "crc32c"
# Spilled parts read back ahead of the one being copied into its data file, with workers > 1 (each a device's part of
# a tile; the estimate's writer term counts them).
READ_AHEAD = 4
# Spilled parts being copied into a lane's data file at once, with workers > 1: their copies are not awaited one by
# one, each part is held until its write ends (the estimate's writer term counts them). On the 13-core host, by
# device, with READ_AHEAD 4 too: 23.4-24.6 s against 26.5-27.6 (docs/speed.md, "Session 14 on the host").
PARTS_IN_FLIGHT = 4
# Tiles whose device parts are being written to the spill while the stream goes on, with workers > 1 (the estimate's
# writer term counts them).
SPILL_AHEAD = 2
# The process id a whole conversion's arrays are written under (Orbax's process index on one host:
# ``ocdbt.process_0``); its other lanes write ``ocdbt.process_0lane<k>``.
PROCESS_ID = "0"


class Leaf(Protocol):
    """What the writer needs of a leaf (the planner's ``LeafPlan`` is one; so is :class:`LeafWrite`)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]


@dataclass(frozen=True)
class LeafWrite:
    """One leaf of the ``items`` tree: path, shape, dtype and its storage chunk shape.

    Every tile written to the leaf must be a union of whole chunks (start on a multiple of
    the chunk, end on one or at the leaf's end), and every chunk must lie inside one device
    shard: :mod:`ckptconv.families.tiles` plans both. No chunk is ever written twice.
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]


@dataclass(frozen=True)
class _StreamedLeaf:
    """A leaf as it is written: what the array is, without its data."""

    leaf: Leaf
    index: int  # position in the writer's leaves (tiles name leaves by it)
    shape: tuple[int, ...]  # python ints: they end up in JSON metadata
    dtype: np.dtype
    write_shape: tuple[int, ...]
    codec: str = codecs.DEFAULT  # a name in codecs.CODECS: how its chunks are compressed
    devices: int = 1  # the devices it is laid out for (its shards' count when sharded)

    @property
    def name(self) -> str:
        return orbax_layout.param_name(self.leaf.path)


def _region(value: _StreamedLeaf, index: Region, data: np.ndarray, chunk: tuple[int, ...]) -> Region:
    """Normalise a tile's index and reject tiles that would rewrite part of a chunk."""
    name, shape = "/".join(value.leaf.path), value.shape
    if not isinstance(index, tuple) or len(index) != len(shape):
        raise ValueError(f"{name}: tile index {index!r} is not a tuple of {len(shape)} slices")
    region = tuple(slice(*s.indices(dim)[:2]) for s, dim in zip(index, shape))
    extents = tuple(s.stop - s.start for s in region)
    if data.shape != extents or data.dtype != value.dtype:
        raise ValueError(f"{name}: tile {index} is {data.dtype}{data.shape}, "
                         f"expected {value.dtype}{extents}")
    for s, dim, step in zip(region, shape, chunk):
        if s.start % step or (s.stop % step and s.stop != dim):
            raise ValueError(f"{name}: tile {index} cuts through chunks of {chunk}")
    return region


def _write_spec(value: _StreamedLeaf, items_dir: str, process_id: str) -> dict:
    """The spec the leaf is written with: Orbax's (zarr3 in OCDBT, the planned chunks) under this process's
    ``ocdbt.process_<id>`` directory (a partition names its own), our codec in place of Orbax's zstd, and a
    checksum ending each chunk's chain."""
    spec = orbax_layout.array_write_spec(items_dir, value.name, shape=value.shape, dtype=value.dtype,
                                         chunk_shape=value.leaf.chunk_shape, compress=codecs.compresses(value.codec),
                                         process_id=process_id)
    return _with_checksum(codecs.with_codec(spec, value.codec, value.dtype))


async def _open_leaf(value: _StreamedLeaf, items_dir: str, process_id: str, context: ts.Context) -> Any:
    """Create the leaf's zarr3 array in OCDBT with the planned chunk shape."""
    return await ts.open(ts.Spec(_write_spec(value, items_dir, process_id)), create=True, open=True, context=context)


def _with_checksum(node: Any) -> Any:
    """``node`` (a spec's JSON) with a ``crc32c`` codec ending every chunk's codec chain.

    Orbax's chain stores a chunk compressed without a checksum of its own (zstd without its frame checksum, blosc,
    or raw bytes with ``--compression none``), so a flipped bit in a stored chunk decodes to other numbers without
    a sound; only the shard index carries a crc32c. With the codec every chunk carries one too, and any reader
    that decodes it (``inspect --deep``, ``export``, Orbax and MaxText restoring, which read the codecs from the
    stored ``zarr.json``) fails on bit rot instead of using it.
    """
    if isinstance(node, dict):
        out = {key: _with_checksum(value) for key, value in node.items()}
        if out.get("name") == "sharding_indexed":
            config = dict(out.get("configuration", {}))
            chain = list(config.get("codecs", []))
            if not any(codec.get("name") == CHUNK_CHECKSUM for codec in chain):
                config["codecs"] = chain + [{"name": CHUNK_CHECKSUM}]
            out["configuration"] = config
        return out
    if isinstance(node, list):
        return [_with_checksum(item) for item in node]
    return node


class _Lanes:
    """``count`` writers side by side, each committing its data files into an OCDBT database of its own
    (``ocdbt.process_<id>``, as each host of a multi-host save writes its own; the commit merges them into the
    step's root manifest, as Orbax does after such a save). A data file holds what one writer gathered, so commits
    can run at once without OCDBT putting two writers' chunks in one file; each storage key (a zarr3 shard) is
    written once, by one writer. Lane 0 writes where one writer would (``process_id``)."""

    def __init__(self, values: Sequence[_StreamedLeaf], items_dir: str, context: ts.Context, process_id: str,
                 count: int, on_tile: Callable[[Leaf, int], None] | None, options: settings.RunOptions,
                 held: int = 0):
        self.ids = [process_id] + [f"{process_id}lane{k}" for k in range(1, count)]
        self.writers = [_Writer(on_tile, options, held) for _ in range(count)]
        self._stores: list[dict[int, Any]] = [{} for _ in range(count)]
        self._values, self._items_dir, self._context = values, items_dir, context

    def __len__(self) -> int:
        return len(self.writers)

    async def store(self, lane: int, n: int) -> Any:
        """Leaf ``n``'s array as lane ``lane`` writes it (opened at its first write there)."""
        store = self._stores[lane].get(n)
        if store is None:
            store = await _open_leaf(self._values[n], self._items_dir, self.ids[lane], self._context)
            self._stores[lane][n] = store
        return store

    def let_go(self, n: int) -> None:
        """Leaf ``n`` is complete: the writes in flight keep what they need."""
        for stores in self._stores:
            stores.pop(n, None)

    async def finish(self) -> None:
        await asyncio.gather(*(writer.finish() for writer in self.writers))


async def _stream(values: Sequence[_StreamedLeaf], items_dir: str, context: ts.Context,
                  tiles: Callable[[], Iterable[Tile]], on_tile: Callable[[Leaf, int], None] | None,
                  process_id: str | None = None, options: settings.RunOptions | None = None) -> None:
    """Write the tile stream (``options.in_flight.writes`` at most per writer), opening each leaf at its first tile
    and letting go of it once complete (a 235B model has ~1000 leaves).

    With data files by device (``options.spill_window_bytes``: asked, or the planned output over one window; the
    output of these leaves where nothing was planned) sharded leaves go through :class:`_SpilledWrites` (one data file
    per device per window); otherwise each tile is written as it comes, data file after data file, each committed by
    the next of ``options.commit_lanes`` writers (:class:`_Lanes`) while the following one is gathered. A partition
    (``process_id`` given) writes with one lane."""
    options = options or settings.RunOptions()
    if options.planned_output_bytes is None:
        options = options.planned(sum(math.prod(value.shape) * value.dtype.itemsize for value in values))
    by_index = {value.index: n for n, value in enumerate(values)}
    devices = max((value.devices for value in values), default=1)
    window = options.spill_window_bytes(devices)
    lanes = _Lanes(values, items_dir, context, process_id or PROCESS_ID,
                   options.commit_lanes if process_id is None else 1, on_tile, options,
                   PARTS_IN_FLIGHT if window and options.overlaps_commits else 0)
    started: set[int] = set()
    written = [0] * len(values)
    spilled = _SpilledWrites(window, lanes, options.overlaps_commits,
                             hold_first=options.writes_after_stream(devices)) if window else None
    lane = 0
    stream = iter(tiles())
    try:
        # the next tile is awaited in a thread, so a window being written in the background goes on meanwhile
        while (tile := await asyncio.to_thread(next, stream, None)) is not None:
            index, region, data = tile
            n = by_index.get(index)
            if n is None:
                raise ValueError(f"tile for leaf {index}, which this checkpoint does not hold")
            value = values[n]
            if written[n] >= math.prod(value.shape):  # its store let go: a late tile would open the leaf anew
                raise ValueError(f"{'/'.join(value.leaf.path)}: tile {region} after the leaf was complete")
            starts = n not in started
            if starts:
                started.add(n)
                await lanes.store(lane, n)  # created (its zarr.json), whichever lane writes it
            region = _region(value, region, data, tuple(value.leaf.chunk_shape))
            if spilled is None:
                # Commit the data file being filled if this tile would overflow it, or if a leaf starts that does
                # not fit whole in what is left of it: a host restoring its shard reads its chunks of one leaf in
                # one data file in one request, but of two leaves in two (OCDBT stores a file's chunks in key
                # order, leaf by leaf), so each leaf is in as few files as it can be. The next data file is the next
                # lane's, gathered while this one commits.
                writer = lanes.writers[lane]
                if writer.batch.full(data.nbytes) or (
                        starts and writer.batch.full(math.prod(value.shape) * value.dtype.itemsize)):
                    await writer.commit()
                    lane = (lane + 1) % len(lanes)
                await lanes.writers[lane].write(await lanes.store(lane, n), region, data, value.leaf)
            else:
                await spilled.add(n, value, region, data)
                if on_tile is not None:  # gathered, as a tile written into the data file being filled
                    on_tile(value.leaf, data.nbytes)
            written[n] += data.size
            del data, tile
            if written[n] == math.prod(value.shape):
                if spilled is None:
                    lanes.let_go(n)
                else:
                    spilled.complete(n)
        if spilled is not None:
            await spilled.finish()
        await lanes.finish()
    finally:
        if spilled is not None:
            await spilled.close()
        # a stream left by a failed write ends here, not with the traceback: its workers stop and its reused
        # buffers (ckptconv.read.buffers) go back, also in a process that goes on (a library caller, a test)
        close = getattr(stream, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
    for value, count in zip(values, written):
        if count != math.prod(value.shape):
            raise ValueError(f"{'/'.join(value.leaf.path)}: tiles covered {count} of "
                             f"{math.prod(value.shape)} elements")


class _SpilledWrites:
    """Two spill windows (:class:`~ckptconv.write.spill.DeviceSpill`): one filling from the tile stream while the
    other is written in the background, device by device, each device's parts committed apart (its own data files),
    the devices shared out among the lanes (:class:`_Lanes`), which write theirs side by side.

    So the source's reads and transforms overlap the writer's compression and commits, as they do without a spill.
    With one window they took turns: Llama-3-8B's widths with 8 layers converted in 45 s against 27 s. A leaf's
    stores stay open until the window holding its last parts is written.

    ``hold_first``: an output of two windows at most keeps its first window until the stream ends, then writes the
    two in turn (the second takes the rest: what did not fit the first, windows being filled up to their last whole
    tile, is a tile or two at most). Its stream past the first window is short, so the overlap saved little time,
    but where it ran the peak was the stream's and a commit's together, and only when they met: Gemma 2 2B's widths
    (1.4 windows) peaked at 246-311 MiB in nine runs, Mixtral-8x7B's (1.2) at 213-245 in seven, no prediction tight
    for both."""

    def __init__(self, window: int, lanes: _Lanes, read_ahead: bool, hold_first: bool = False):
        self._spills = [DeviceSpill(window), DeviceSpill(window)]
        self._filling = 0
        self._done: list[int] = []  # leaves complete in the filling window
        self._flush: asyncio.Task | None = None
        self._hold_first = hold_first
        self._held: tuple[DeviceSpill, list[int]] | None = None  # the first window, full, written after the stream
        self._lanes = lanes
        self._read_ahead = READ_AHEAD if read_ahead else 0
        self._spill_ahead = SPILL_AHEAD if read_ahead else 0
        self._adding: collections.deque = collections.deque()  # the filling window's parts being written

    async def add(self, n: int, value: _StreamedLeaf, region: Region, data: np.ndarray) -> None:
        # with the first window held back the second takes the rest, if a tile or two more than a window
        if self._held is None and self._spills[self._filling].full(data.nbytes):
            await self._rotate()
        # Written in a thread: the window being written goes on in this loop meanwhile (the copies and writes free the
        # GIL); with workers > 1 the stream goes on too, ``SPILL_AHEAD`` tiles at most waiting for their writes.
        places = self._spills[self._filling].reserve_tile(n, region, data, value.shape, value.devices)
        self._adding.append(asyncio.ensure_future(asyncio.to_thread(write_reserved, places)))
        while len(self._adding) > self._spill_ahead:
            await self._adding.popleft()

    def complete(self, n: int) -> None:
        self._done.append(n)

    async def finish(self) -> None:
        """Write what waits, and wait for it."""
        self._hold_first = False  # the stream has ended: a window that fills no more is written now
        await self._rotate()
        await self._wait()

    async def close(self) -> None:
        if self._flush is not None and not self._flush.done():
            self._flush.cancel()  # the write failed: nothing more of it is needed
        if self._flush is not None:  # no read of the spill left running when its files close (its lanes wait theirs)
            await asyncio.gather(self._flush, return_exceptions=True)
        await asyncio.gather(*self._adding, return_exceptions=True)  # no write left to a closed file
        for spill in self._spills:
            spill.close()

    async def _rotate(self) -> None:
        await self._wait()  # the other window written and its leaves let go: it is empty again
        if self._held is not None:  # ... or held back (``hold_first``): written now, before the next one is
            held, self._held = self._held, None
            await self._write(*held)
        while self._adding:  # the filling window's parts all in its files before it is read back
            await self._adding.popleft()
        spill, done = self._spills[self._filling], self._done
        self._filling, self._done = 1 - self._filling, []
        if self._hold_first:
            self._hold_first, self._held = False, (spill, done)
            return
        self._flush = asyncio.get_running_loop().create_task(self._write(spill, done))

    async def _wait(self) -> None:
        if self._flush is not None:
            flush, self._flush = self._flush, None
            await flush

    async def _write(self, spill: DeviceSpill, done: list[int]) -> None:
        groups = list(spill.groups())
        count = len(self._lanes)
        # A task group, not gather: a lane that fails cancels the others, and the group ends only once every lane
        # has (each waits for its own reads of the spill), so nothing reads the spill after this fails.
        try:
            async with asyncio.TaskGroup() as lanes:
                for lane in range(count):
                    lanes.create_task(self._write_lane(lane, spill, groups[lane::count]))
        except BaseExceptionGroup as failed:  # the first lane's error, as one write raises it (its message, its exit)
            raise failed.exceptions[0] from None
        spill.clear()
        for n in done:
            self._lanes.let_go(n)  # complete, and all of it written

    async def _write_lane(self, lane: int, spill: DeviceSpill, groups: list) -> None:
        """One lane's devices, one data file each, committed before the next is gathered (a lane holds one data file:
        gathering the next while one commits added a data file to every by-device prediction, and the memory examples
        did not show a peak for it); each part read back in a thread, the next ones read while this one is copied
        into the data file."""
        writer = self._lanes.writers[lane]
        ahead: collections.deque = collections.deque()
        try:
            for group, parts in groups:
                for part in parts:
                    ahead.append((part, asyncio.ensure_future(asyncio.to_thread(spill.read, group, part))))
                    if len(ahead) > self._read_ahead:
                        await self._write_part(lane, *ahead.popleft())
                while ahead:
                    await self._write_part(lane, *ahead.popleft())
                await writer.finish()
        finally:  # failed or cancelled: the reads already started finish before the spill may close
            await asyncio.gather(*(read for _, read in ahead), return_exceptions=True)

    async def _write_part(self, lane: int, part, data) -> None:
        await self._lanes.writers[lane].write(await self._lanes.store(lane, part.leaf), part.region, await data, None)


class _Writer:
    """Tile writes into the data file being gathered (:class:`_Batch`), at most ``options.in_flight.writes``
    in flight; ``on_tile(leaf, nbytes)`` once each is written (``leaf`` None: already counted). ``held`` > 0 (a lane
    writing spilled parts): that many in flight, each copy into the transaction not awaited and its part held until
    its write ends, so a lane does not wait on one small part's copy at a time.

    With ``options.overlaps_commits`` (workers > 1) a data file commits in the background while the next is
    gathered: commits stay one at a time and in order (each data file holds what it held before), but the stream no
    longer waits for each one's compression and write."""

    def __init__(self, on_tile: Callable[[Leaf, int], None] | None, options: settings.RunOptions | None = None,
                 held: int = 0):
        options = options or settings.RunOptions()
        self.batch = _Batch(options.data_file_bytes)
        self._writes = held or options.in_flight.writes
        self._held = held > 0
        self._overlap = options.overlaps_commits
        self._committing: asyncio.Future | None = None
        self._on_tile = on_tile
        self._in_flight: collections.deque = collections.deque()  # (tensorstore future, leaf, bytes, held data)

    async def write(self, store: Any, region: Region, data: np.ndarray, leaf: Leaf | None) -> None:
        if self.batch.full(data.nbytes):
            await self.commit()
        write = self.batch.store(store)[region].write(data)
        if not self._held:
            await write.copy  # tensorstore holds its own copy now: the producer may reuse `data`
        self._in_flight.append((write, leaf, data.nbytes, data if self._held else None))
        self.batch.add(data.nbytes)
        while len(self._in_flight) >= self._writes:
            await self._settle()

    async def _settle(self) -> None:
        write, leaf, nbytes, _held = self._in_flight.popleft()
        await write
        if leaf is not None and self._on_tile is not None:
            self._on_tile(leaf, nbytes)

    async def commit(self) -> None:
        """Wait for the writes in flight and commit the data file being gathered (in the background when commits
        overlap, once the one before has committed)."""
        while self._in_flight:
            await self._settle()
        if not self._overlap:
            await self.batch.commit()
            return
        await self._committed()
        self._committing = asyncio.ensure_future(self.batch.commit_detached())

    async def finish(self) -> None:
        """Commit what is gathered and wait until every data file is committed."""
        await self.commit()
        await self._committed()

    async def _committed(self) -> None:
        if self._committing is not None:
            committing, self._committing = self._committing, None
            await committing


class _Batch:
    """Tiles gathered into one tensorstore transaction, committed as one OCDBT data file.

    Without a transaction every tile (at most one read unit's image, <= 16 MiB) commits on its own
    and becomes its own data file: Qwen3-0.6B's shape on 16 devices had 114 of them, and a restore makes
    about one storage request per (leaf, data file) pair it reads (docs/bench/RESTORE.md). A transaction holds its tiles (uncompressed) until its
    commit writes them, compressed, as one data file, so ``limit`` bytes of tiles are what a data file
    costs in RAM (settings.IN_FLIGHT.data_file_bytes; the memory estimate counts them). Tiles are
    whole chunks (the tile plan), so no chunk is split over two transactions. ``limit`` 0: no
    transaction, each tile commits on its own.
    """

    def __init__(self, limit: int):
        self._limit = limit
        self._txn: ts.Transaction | None = None
        self._bytes = 0

    def full(self, nbytes: int) -> bool:
        return self._txn is not None and self._bytes + nbytes > self._limit

    def store(self, store: Any) -> Any:
        if self._limit <= 0:
            return store
        if self._txn is None:
            # atomic: the commit is one OCDBT commit, one data file. A non-atomic transaction hands its chunks
            # to OCDBT one by one, which commits them in batches as they arrive: data files of 0.6-29 MiB
            # (45 files instead of 20 for Qwen3-0.6B's shape with 64 MiB gathered, device 0's reads 43, not 23).
            self._txn = ts.Transaction(atomic=True)
        return store.with_transaction(self._txn)

    def add(self, nbytes: int) -> None:
        self._bytes += nbytes

    async def commit(self) -> None:
        await self.commit_detached()

    def commit_detached(self) -> Any:
        """Start committing the data file gathered so far and begin the next one at once; the returned awaitable
        ends with the commit."""
        txn, self._txn, self._bytes = self._txn, None, 0
        return _commit(txn)


async def _commit(txn: ts.Transaction | None) -> None:
    if txn is not None:
        await txn.commit_async()
        # the data file's chunks, freed together: none of it resident beside the next one (in a thread: on gVisor
        # returning pages is a dear system call, and the loop has tiles to hand out meanwhile)
        await asyncio.to_thread(trim)



def _validate(leaves: Sequence[Leaf], devices: int) -> None:
    """Fail before a byte is written, naming the leaf and what is wrong with it."""
    seen: set[tuple[str, ...]] = set()
    for leaf in leaves:
        name = "/".join(leaf.path) or "<empty path>"
        if not leaf.path or not all(isinstance(key, str) and key for key in leaf.path):
            raise ValueError(f"{name}: path must be a non-empty tuple of non-empty str")
        if any(other[:len(leaf.path)] == leaf.path or leaf.path[:len(other)] == other
               for other in seen):
            raise ValueError(f"{name}: path duplicates, or nests with, another leaf's path")
        seen.add(leaf.path)
        if any(dim <= 0 for dim in leaf.shape):
            raise ValueError(f"{name}: shape {leaf.shape} is empty (Orbax refuses zero-size arrays)")
        if len(leaf.chunk_shape) != len(leaf.shape) or any(
                not 1 <= c <= max(dim, 1) for c, dim in zip(leaf.chunk_shape, leaf.shape)):
            raise ValueError(f"{name}: chunk shape {leaf.chunk_shape} does not fit shape {leaf.shape}")
        part = write_shape(tuple(leaf.shape), devices)
        if any(p != dim and p % c for p, dim, c in zip(part, leaf.shape, leaf.chunk_shape)):
            raise ValueError(f"{name}: chunk shape {leaf.chunk_shape} crosses the shards of {leaf.shape} "
                             f"on {devices} devices (each device writes {part})")


def _streamed(leaves: Sequence[Leaf], indices: Sequence[int], devices: int, codec: str) -> list[_StreamedLeaf]:
    """The leaves as written (``indices``: their positions in the tile stream), shapes as Python ints (they end up
    in JSON metadata; a planner may hand NumPy ints over)."""
    return [_StreamedLeaf(dataclasses.replace(leaf, shape=tuple(int(d) for d in leaf.shape),
                                              chunk_shape=tuple(int(c) for c in leaf.chunk_shape)),
                          index, tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype),
                          write_shape(tuple(int(d) for d in leaf.shape), devices), codec, devices)
            for leaf, index in zip(leaves, indices)]


async def _write_extras(extra_items: dict[str, Any], items_dir: str, context: ts.Context, codec: str) -> None:
    """The small extra items as Orbax's standard handlers store them: a number as a ``scalar`` zarr3 array (Orbax's
    own chain: its zstd when the save compresses, no checksum), an empty dict as nothing but its place in the tree."""
    for key, value in extra_items.items():
        if orbax_layout.extra_value_type(key, value) != orbax_layout.SCALAR:
            continue
        array = np.asarray(value)
        spec = orbax_layout.array_write_spec(items_dir, key, shape=(), dtype=array.dtype, chunk_shape=(),
                                             compress=codecs.compresses(codec), process_id=PROCESS_ID)
        store = await ts.open(ts.Spec(spec), create=True, open=True, context=context)
        await store.write(array)


def _write_documents(items_dir: str, values: Sequence[_StreamedLeaf], extra_items: dict[str, Any],
                     sharded: bool) -> None:
    """``_sharding`` and ``array_metadatas/process_0`` (sharded saves only: 1-device leaves are numpy arrays to
    Orbax), then ``_METADATA``, in the tree's order, as Orbax writes them once the arrays are committed."""
    items = layout.path(items_dir)
    ordered = sorted(values, key=lambda value: value.leaf.path)
    if sharded:
        write_document(items / orbax_layout.SHARDING_FILE, orbax_layout.shardings(
            ((value.name, value.shape) for value in ordered), ordered[0].devices))
        (items / orbax_layout.ARRAY_METADATAS).mkdir(parents=True, exist_ok=True)
        write_document(items / orbax_layout.ARRAY_METADATAS / f"process_{PROCESS_ID}",
                       orbax_layout.array_metadatas((value.name, value.write_shape, value.leaf.chunk_shape)
                                                    for value in ordered))
    leaf_type = orbax_layout.SHARDED if sharded else orbax_layout.NUMPY
    entries = [(value.leaf.path, leaf_type, value.write_shape if sharded else None) for value in ordered]
    entries += [((key,), orbax_layout.extra_value_type(key, value), None) for key, value in extra_items.items()]
    write_document(items / orbax_layout.METADATA_FILE, orbax_layout.tree_metadata(entries))


def write_checkpoint(destination: str, leaves: Sequence[Leaf], tiles: Callable[[], Iterable[Tile]], *,
                     devices: int, custom_metadata: dict, on_tile: Callable[[Leaf, int], None] | None = None,
                     codec: str = codecs.DEFAULT, extra_items: dict[str, Any] | None = None,
                     adopt: Callable[[Any], None] | None = None,
                     options: settings.RunOptions | None = None) -> None:
    """Write step 0 of a checkpoint at `destination` (local path or gs://...), tree under `destination/0/items`.

    Same layout as MaxText's converter (Orbax 0.12.8's PyTreeCheckpointHandler with OCDBT + zarr3): leaves
    sharded over a 1-D mesh of ``devices`` (numpy leaves when 1), ``custom_metadata`` on the step. No JAX devices
    are needed: the data is laid out by the chunk plan and the sharding rule alone. ``tiles()``
    yields ``(leaf index, region, data)`` covering every leaf exactly once, in any order;
    ``on_tile(leaf, nbytes)`` runs in the writer's thread each time a tile of ``nbytes``
    is written (for progress): into the data file being gathered (or the spill), on storage once that commits.
    The commit is atomic (rename locally, ``commit_success.txt`` on GCS, :mod:`ckptconv.write.step_commit`);
    temporary directories of ours left by an interrupted earlier run are deleted first (locally); a complete step 0
    is never overwritten. Errors raised by ``tiles()`` propagate unchanged and leave no complete step.
    ``extra_items`` are small plain values saved beside the leaves as Orbax's standard handlers save them
    (MaxText's ``step`` int and empty ``opt_state``).

    ``adopt(items_dir)``, for a checkpoint written by partitions (:func:`write_partition`), puts
    their ``ocdbt.process_*`` directories into the step being saved instead of streaming tiles;
    the metadata is then written, every process directory merged into the root OCDBT manifest
    and the step committed once, exactly as after a multi-host Orbax save.
    """
    _validate(leaves, devices)
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if not leaves:
        raise ValueError("no leaves to write")
    extra_items = dict(extra_items or {})
    for key, value in extra_items.items():
        orbax_layout.extra_value_type(key, value)  # refused before anything is written
    step = StepCommit(destination)
    step.begin(custom_metadata)
    items_dir = str(step.items)
    # the tree's order, as Orbax hands a save's leaves to its handler (the spill writes its parts in that order)
    order = sorted(range(len(leaves)), key=lambda index: tuple(leaves[index].path))
    values = _streamed([leaves[index] for index in order], order, devices, codec)
    cache = settings.IN_FLIGHT.ocdbt_cache_bytes

    async def save() -> None:
        context = orbax_layout.context(cache)
        if adopt is not None:
            adopt(step.items)
        else:
            await _stream(values, items_dir, context, tiles, on_tile, options=options)
        await _write_extras(extra_items, items_dir, context, codec)
        _write_documents(items_dir, values, extra_items, devices > 1)
        merged = orbax_layout.context(cache)  # a context of its own, as Orbax's merge opens one; the check reads it
        await orbax_layout.merge_process_databases(items_dir, merged)
        scalars = [key for key, value in extra_items.items()
                   if orbax_layout.extra_value_type(key, value) == orbax_layout.SCALAR]
        missing = await orbax_layout.missing_arrays(items_dir, [value.name for value in values] + scalars, merged)
        if missing:
            raise ValueError(f"{destination}: {len(missing)} array(s) missing from the merged checkpoint, not "
                             f"committed: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

    asyncio.run(save())
    step.commit()


def write_partition(staging: str, leaves: Sequence[Leaf], indices: Sequence[int], tiles: Callable[[], Iterable[Tile]],
                    *, devices: int, process_id: str, on_tile: Callable[[Leaf, int], None] | None = None,
                    codec: str = codecs.DEFAULT, options: settings.RunOptions | None = None) -> None:
    """Write the data of some leaves into ``staging/ocdbt.process_<process_id>``, as one host of a
    multi-host Orbax save writes its part: the same array specs, names and chunks, no metadata.

    ``indices`` are the leaves' positions in the whole checkpoint (the tiles name leaves by them).
    :func:`write_checkpoint` with ``adopt`` later turns the partitions into one checkpoint.
    """
    _validate(leaves, devices)
    staging = layout.absolute(staging)
    layout.path(staging).mkdir(parents=True, exist_ok=True)
    values = _streamed(leaves, indices, devices, codec)

    async def run() -> None:
        await _stream(values, staging, orbax_layout.context(settings.IN_FLIGHT.ocdbt_cache_bytes), tiles, on_tile,
                      process_id, options)

    asyncio.run(run())
