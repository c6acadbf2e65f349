"""Write a MaxText-compatible Orbax checkpoint tile by tile, never holding a whole leaf.

MaxText's converter builds every leaf as a sharded ``jax.Array`` before saving: peak RAM
is the model. Here each leaf is a placeholder (:class:`_StreamedLeaf`) that a custom Orbax
``TypeHandler`` fills from one stream of tiles, so Orbax itself still writes the layout
(``_METADATA``, ``_sharding``, ``array_metadatas/``, OCDBT) and commits atomically.

Memory stays bounded because no tensorstore transaction spans a leaf (it would buffer all
of it) and no chunk spans two tiles (tensorstore would rebuild the chunk on every write
and OCDBT would keep each old version of it).
The chunk shapes come from the tile plan (:mod:`ckptconv.families.tiles`).

Orbax internals used (pin orbax-checkpoint 0.12.8): jax_array_handlers.ArrayHandler and
_async_serialize_shardings, tensorstore_utils.build_array_write_spec,
ocdbt_utils.get_process_index_for_subdir, future.CommitFutureAwaitingContractedSignals,
type_handler_registry.create_type_handler_registry, array_metadata_store.Store.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

from ckptconv import settings
from ckptconv.families.sharding import MESH_AXIS, partition_spec, write_shape
from ckptconv.families.tiles import Region, Tile
from ckptconv.layout import is_gcs
from ckptconv.monitor import trim
from ckptconv.write import codecs
from ckptconv.write.spill import DeviceSpill, write_reserved

# MaxText's DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE: its save passes it both as the OCDBT data
# file size and as every leaf's chunk_byte_size, so we do too (same data files).
TARGET_FILE_BYTES = 2 * 1024**3
# The checksum codec that ends every chunk's codec chain (see _with_checksum).
CHUNK_CHECKSUM = "crc32c"
# Spilled parts read back ahead of the one being copied into its data file, with workers > 1 (each a device's part of
# a tile; the estimate's writer term counts them).
READ_AHEAD = 2
# Tiles whose device parts are being written to the spill while the stream goes on, with workers > 1 (the estimate's
# writer term counts them).
SPILL_AHEAD = 2


@contextlib.contextmanager
def _ocdbt_cache(total_bytes: int) -> Iterator[None]:
    """Orbax's saves open their tensorstore context with a ``total_bytes`` OCDBT node cache while inside.

    Orbax builds one context per save from a module-level default and takes no context from its
    caller; every leaf, scalar and the final manifest merge of a save must share that one context
    (one OCDBT writer per database), so the default is what has to change. Without the default
    where this Orbax keeps it, saves keep Orbax's cache (the peak-RSS tests then fail).
    """
    default = getattr(ts_utils, "_DEFAULT_OCDBT_TS_CONTEXT", {}).get("cache_pool#ocdbt")
    if not isinstance(default, dict) or "total_bytes_limit" not in default:
        yield
        return
    before = default["total_bytes_limit"]
    default["total_bytes_limit"] = total_bytes
    try:
        yield
    finally:
        default["total_bytes_limit"] = before



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
    """Placeholder Orbax sees as the leaf value: what the array would be, without its data."""

    leaf: Leaf
    index: int  # position in the writer's leaves (tiles name leaves by it)
    shape: tuple[int, ...]  # python ints: they end up in JSON metadata
    dtype: np.dtype
    sharding: NamedSharding | None  # None: written like MaxText's 1-device numpy leaves
    write_shape: tuple[int, ...]
    codec: str = codecs.DEFAULT  # a name in codecs.CODECS: how its chunks are compressed
    devices: int = 1  # the devices it is laid out for (its shards' count when sharded)


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


def _write_spec(value: _StreamedLeaf, info: Any, arg: ocp.SaveArgs, process_id: str | None = None) -> Any:
    """The spec Orbax would write the leaf with (zarr3 in OCDBT, the planned chunks), under this
    process's ``ocdbt.process_<id>`` directory (a partition names its own)."""
    process_index = process_id if process_id is not None else ocdbt_utils.get_process_index_for_subdir(
        info.is_ocdbt_checkpoint)
    spec = ts_utils.build_array_write_spec(
        info, arg, global_shape=value.shape, local_shape=value.leaf.chunk_shape, dtype=value.dtype,
        use_ocdbt=info.is_ocdbt_checkpoint, process_index=process_index)
    if tuple(spec.metadata.chunk_shape) != value.leaf.chunk_shape:
        raise ValueError(f"{'/'.join(value.leaf.path)}: Orbax chose chunks {spec.metadata.chunk_shape}, "
                         f"planned {value.leaf.chunk_shape}")
    return spec


async def _open_leaf(value: _StreamedLeaf, info: Any, arg: ocp.SaveArgs, process_id: str | None) -> tuple[Any, Any]:
    """Create the leaf's zarr3 array in OCDBT with the planned chunk shape."""
    await info.await_path_creation()
    spec = _write_spec(value, info, arg, process_id)
    store = await ts.open(ts.Spec(_with_checksum(codecs.with_codec(spec.json, value.codec, value.dtype))),
                          create=True, open=True,
                          context=info.ts_context)
    return store, spec.metadata


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
    (``ocdbt.process_<id>``, as each host of a multi-host save writes its own; Orbax merges them into the step's root
    manifest at its commit, as after such a save). A data file holds what one writer gathered, so commits can run
    at once without OCDBT putting two writers' chunks in one file; each storage key (a zarr3 shard) is written once,
    by one writer. Lane 0 writes where one writer would (``process_id``)."""

    def __init__(self, values: Sequence[_StreamedLeaf], infos: Sequence[Any], args: Sequence[ocp.SaveArgs],
                 process_id: str | None, count: int, on_tile: Callable[[Leaf, int], None] | None,
                 options: settings.RunOptions):
        base = process_id if process_id is not None else str(ocdbt_utils.get_process_index_for_subdir(
            infos[0].is_ocdbt_checkpoint if infos else True))
        self.ids = [process_id] + [f"{base}lane{k}" for k in range(1, count)]
        self.writers = [_Writer(on_tile, options) for _ in range(count)]
        self._stores: list[dict[int, Any]] = [{} for _ in range(count)]
        self._values, self._infos, self._args = values, infos, args
        self.metadatas: list[Any] = [None] * len(values)

    def __len__(self) -> int:
        return len(self.writers)

    async def store(self, lane: int, n: int) -> Any:
        """Leaf ``n``'s array as lane ``lane`` writes it (opened at its first write there)."""
        store = self._stores[lane].get(n)
        if store is None:
            store, metadata = await _open_leaf(self._values[n], self._infos[n], self._args[n], self.ids[lane])
            self._stores[lane][n] = store
            if self.metadatas[n] is None:
                self.metadatas[n] = metadata
        return store

    def let_go(self, n: int) -> None:
        """Leaf ``n`` is complete: the writes in flight keep what they need."""
        for stores in self._stores:
            stores.pop(n, None)

    async def finish(self) -> None:
        await asyncio.gather(*(writer.finish() for writer in self.writers))


async def _stream(values: Sequence[_StreamedLeaf], infos: Sequence[Any], args: Sequence[ocp.SaveArgs],
                  tiles: Callable[[], Iterable[Tile]], on_tile: Callable[[Leaf, int], None] | None,
                  process_id: str | None = None, options: settings.RunOptions | None = None) -> list[Any]:
    """Write the tile stream (``options.in_flight.writes`` at most per writer), opening each leaf at its first tile
    and letting go of it once complete (a 235B model has ~1000 leaves); return every ArrayMetadata.

    With data files by device (``options.spill_window_bytes``: asked, or the planned output over one window; the
    output of these leaves where nothing was planned) sharded leaves go through :class:`_SpilledWrites` (one data file
    per device per window); otherwise each tile is written as it comes, data file after data file, each committed by
    the next of ``options.commit_lanes`` writers (:class:`_Lanes`) while the following one is gathered."""
    options = options or settings.RunOptions()
    if options.planned_output_bytes is None:
        options = options.planned(sum(math.prod(value.shape) * value.dtype.itemsize for value in values))
    by_index = {value.index: n for n, value in enumerate(values)}
    lanes = _Lanes(values, infos, args, process_id, options.commit_lanes if process_id is None else 1, on_tile,
                   options)
    started: set[int] = set()
    written = [0] * len(values)
    devices = max((value.devices for value in values), default=1)
    window = options.spill_window_bytes(devices)
    spilled = _SpilledWrites(window, lanes, options.overlaps_commits) if window else None
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
                await lanes.store(lane, n)  # its metadata, whichever lane writes it
            region = _region(value, region, data, tuple(lanes.metadatas[n].chunk_shape))
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
    for value, count in zip(values, written):
        if count != math.prod(value.shape):
            raise ValueError(f"{'/'.join(value.leaf.path)}: tiles covered {count} of "
                             f"{math.prod(value.shape)} elements")
    return [dataclasses.replace(metadata, write_shape=value.write_shape)
            for value, metadata in zip(values, lanes.metadatas)]


class _SpilledWrites:
    """Two spill windows (:class:`~ckptconv.write.spill.DeviceSpill`): one filling from the tile stream while the
    other is written in the background, device by device, each device's parts committed apart (its own data files),
    the devices shared out among the lanes (:class:`_Lanes`), which write theirs side by side.

    So the source's reads and transforms overlap the writer's compression and commits, as they do without a spill.
    With one window they took turns: Llama-3-8B's widths with 8 layers converted in 45 s against 27 s. A leaf's
    stores stay open until the window holding its last parts is written."""

    def __init__(self, window: int, lanes: _Lanes, read_ahead: bool):
        self._spills = [DeviceSpill(window), DeviceSpill(window)]
        self._filling = 0
        self._done: list[int] = []  # leaves complete in the filling window
        self._flush: asyncio.Task | None = None
        self._lanes = lanes
        self._read_ahead = READ_AHEAD if read_ahead else 0
        self._spill_ahead = SPILL_AHEAD if read_ahead else 0
        self._adding: collections.deque = collections.deque()  # the filling window's parts being written

    async def add(self, n: int, value: _StreamedLeaf, region: Region, data: np.ndarray) -> None:
        if self._spills[self._filling].full(data.nbytes):
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
        while self._adding:  # the filling window's parts all in its files before it is read back
            await self._adding.popleft()
        spill, done = self._spills[self._filling], self._done
        self._filling, self._done = 1 - self._filling, []
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
    in flight; ``on_tile(leaf, nbytes)`` once each is written (``leaf`` None: already counted).

    With ``options.overlaps_commits`` (workers > 1) a data file commits in the background while the next is
    gathered: commits stay one at a time and in order (each data file holds what it held before), but the stream no
    longer waits for each one's compression and write."""

    def __init__(self, on_tile: Callable[[Leaf, int], None] | None, options: settings.RunOptions | None = None):
        options = options or settings.RunOptions()
        self.batch = _Batch(options.data_file_bytes)
        self._writes = options.in_flight.writes
        self._overlap = options.overlaps_commits
        self._committing: asyncio.Future | None = None
        self._on_tile = on_tile
        self._in_flight: collections.deque = collections.deque()  # (tensorstore future, leaf, bytes)

    async def write(self, store: Any, region: Region, data: np.ndarray, leaf: Leaf | None) -> None:
        if self.batch.full(data.nbytes):
            await self.commit()
        write = self.batch.store(store)[region].write(data)
        await write.copy  # tensorstore holds its own copy now: the producer may reuse `data`
        self._in_flight.append((write, leaf, data.nbytes))
        self.batch.add(data.nbytes)
        while len(self._in_flight) >= self._writes:
            await self._settle()

    async def _settle(self) -> None:
        write, leaf, nbytes = self._in_flight.popleft()
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


class _StreamingHandler(jax_array_handlers.ArrayHandler):
    """Saves :class:`_StreamedLeaf` values as Orbax would save the arrays they stand for.

    ``typestr`` is ``jax.Array`` (sharded saves) or ``np.ndarray`` (1 device, as MaxText
    writes then), so the tree metadata names the normal handlers and restores use them.
    All streamed leaves arrive in one ``serialize`` call; their data comes from one tile
    stream, in the order the producer reads the source (a source tensor feeding two leaves
    is read once).
    """

    def __init__(self, store: array_metadata_store.Store | None, typestr: str,
                 tiles: Callable[[], Iterable[Tile]], on_tile: Callable[[Leaf, int], None] | None,
                 adopt: Callable[[epath.Path], None] | None = None, options: settings.RunOptions | None = None):
        super().__init__(array_metadata_store=store)
        self._options = options
        self._typestr = typestr
        self._tiles = tiles
        self._on_tile = on_tile
        self._adopt = adopt
        self._serialized = False

    def typestr(self) -> str:
        return self._typestr

    async def serialize(self, values: Sequence[_StreamedLeaf], infos: Sequence[Any],
                        args: Sequence[ocp.SaveArgs] | None = None) -> list[Any]:
        """Return commit futures, like ArrayHandler: `_sharding` entries, then the data."""
        if self._serialized:
            raise RuntimeError("Orbax split the streamed leaves over two serialize calls")
        self._serialized = True
        args = args or [ocp.SaveArgs()] * len(values)
        futures = []
        shardings = [value.sharding for value in values]
        if any(sharding is not None for sharding in shardings):
            futures.append(future.CommitFutureAwaitingContractedSignals(
                jax_array_handlers._async_serialize_shardings(  # pylint: disable=protected-access
                    shardings, infos, primary_host=self._primary_host),
                name="streamed_shardings"))
        futures.append(future.CommitFutureAwaitingContractedSignals(
            self._write_leaves(values, infos, args), name="streamed_arrays"))
        return futures

    async def _write_leaves(self, values: Sequence[_StreamedLeaf], infos: Sequence[Any],
                            args: Sequence[ocp.SaveArgs]) -> None:
        """The tile stream into all leaves (or the partitions' data, adopted), then their ArrayMetadata."""
        if self._adopt is not None:
            await infos[0].await_path_creation()
            self._adopt(epath.Path(infos[0].parent_dir))
            for value, info in zip(values, infos):  # the partitions wrote under these names
                if info.name != ".".join(value.leaf.path):
                    raise ValueError(f"Orbax names leaf {'/'.join(value.leaf.path)} {info.name!r}")
            metadatas = [dataclasses.replace(_write_spec(value, info, arg).metadata, write_shape=value.write_shape)
                         for value, info, arg in zip(values, infos, args)]
        else:
            metadatas = await _stream(values, infos, args, self._tiles, self._on_tile, options=self._options)
        if self._array_metadata_store is not None:
            await self._array_metadata_store.write(
                checkpoint_dir=infos[0].parent_dir, array_metadatas=metadatas,
                process_index=jax.process_index())


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


def _tree(leaves: Sequence[Leaf], make: Callable[[int, Leaf], Any]) -> dict:
    """Nest ``make(index, leaf)`` under each leaf's path."""
    tree: dict = {}
    for index, leaf in enumerate(leaves):
        node = tree
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = make(index, leaf)
    return tree


def write_checkpoint(destination: str, leaves: Sequence[Leaf], tiles: Callable[[], Iterable[Tile]], *,
                     devices: int, custom_metadata: dict, on_tile: Callable[[Leaf, int], None] | None = None,
                     codec: str = codecs.DEFAULT, extra_items: dict[str, Any] | None = None,
                     adopt: Callable[[epath.Path], None] | None = None,
                     options: settings.RunOptions | None = None) -> None:
    """Write step 0 of a checkpoint at `destination` (local path or gs://...), tree under `destination/0/items`.

    Same layout as MaxText's converter: PyTreeCheckpointHandler with OCDBT + zarr3, leaves
    sharded over a 1-D mesh of ``devices`` (numpy leaves when 1), ``custom_metadata`` on
    the step. For ``devices > 1`` JAX must already run with exactly that many. ``tiles()``
    yields ``(leaf index, region, data)`` covering every leaf exactly once, in any order;
    ``on_tile(leaf, nbytes)`` runs in Orbax's writer thread each time a tile of ``nbytes``
    is written (for progress): into the data file being gathered (or the spill), on storage once that commits.
    Orbax commits atomically (rename locally, ``commit_success.txt`` on GCS); temporary directories left by an
    interrupted earlier run are deleted first; a complete step 0 is never overwritten. Errors raised by
    ``tiles()`` propagate unchanged and leave no complete step. ``extra_items`` are small plain values
    saved beside the leaves by Orbax's standard handlers (MaxText's ``step`` int and empty
    ``opt_state``).

    ``adopt(items_dir)``, for a checkpoint written by partitions (:func:`write_partition`), puts
    their ``ocdbt.process_*`` directories into the step being saved instead of streaming tiles;
    Orbax then writes the metadata, merges every process directory into the root OCDBT manifest
    and commits once, exactly as after a multi-host save.
    """
    _validate(leaves, devices)
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if devices > 1 and jax.device_count() != devices:  # 1 device: numpy leaves, any JAX will do
        raise RuntimeError(f"JAX has {jax.device_count()} devices, expected {devices}: set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts")
    mesh = Mesh(np.array(jax.devices()), (MESH_AXIS,)) if devices > 1 else None

    def placeholder(index: int, leaf: Leaf) -> _StreamedLeaf:
        shape = tuple(int(dim) for dim in leaf.shape)
        leaf = dataclasses.replace(leaf, shape=shape, chunk_shape=tuple(int(c) for c in leaf.chunk_shape))
        spec = PartitionSpec(*partition_spec(shape, devices))
        sharding = NamedSharding(mesh, spec) if mesh is not None else None
        return _StreamedLeaf(leaf, index, shape, np.dtype(leaf.dtype), sharding, write_shape(shape, devices), codec,
                             devices)

    store = array_metadata_store.Store()
    sharded = mesh is not None
    streaming = _StreamingHandler(store if sharded else None, "jax.Array" if sharded else "np.ndarray",
                                  tiles, on_tile, adopt, options)
    registry = type_handler_registry.create_type_handler_registry(
        (_StreamedLeaf, streaming),  # standard handlers last: they own the typestrs
        (int, type_handlers.ScalarHandler()),
        (np.ndarray, type_handlers.NumpyHandler()),
        (jax.Array, type_handlers.ArrayHandler(array_metadata_store=store)))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                          use_compression=codecs.compresses(codec),
                                          type_handler_registry=registry)
    # Orbax's clean-up of unfinished steps: locally it deletes ``*.orbax-checkpoint-tmp*`` names (the
    # destination protocol has refused any that is not ours before this point); on GCS it would delete
    # *every* directory under DST without a commit_success.txt, whoever wrote it (another team's files
    # in a shared prefix, the partitions' staging before the finalize adopts it). There our protocol
    # has already removed the leftovers that are ours, so Orbax's clean-up stays off.
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False,
                                           cleanup_tmp_directories=not is_gcs(destination))
    with _ocdbt_cache(settings.IN_FLIGHT.ocdbt_cache_bytes), \
            ocp.CheckpointManager(destination, item_names=("items",), options=options,
                                  item_handlers={"items": handler}) as manager:
        if 0 in manager.all_steps():
            raise FileExistsError(f"{destination} already holds a complete step 0; "
                                  "remove it or choose another destination")
        tree = {**(extra_items or {}), **_tree(leaves, placeholder)}
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=TARGET_FILE_BYTES), tree,
                                 is_leaf=lambda node: isinstance(node, _StreamedLeaf))
        if not leaves:
            raise ValueError("no leaves to write")
        manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(
            item=tree, save_args=save_args, ocdbt_target_data_file_size=TARGET_FILE_BYTES)),
            custom_metadata=custom_metadata)
        manager.wait_until_finished()


def write_partition(staging: str, leaves: Sequence[Leaf], indices: Sequence[int], tiles: Callable[[], Iterable[Tile]],
                    *, devices: int, process_id: str, on_tile: Callable[[Leaf, int], None] | None = None,
                    codec: str = codecs.DEFAULT, options: settings.RunOptions | None = None) -> None:
    """Write the data of some leaves into ``staging/ocdbt.process_<process_id>``, as one host of a
    multi-host Orbax save writes its part: the same array specs, names and chunks, no metadata.

    ``indices`` are the leaves' positions in the whole checkpoint (the tiles name leaves by them).
    :func:`write_checkpoint` with ``adopt`` later turns the partitions into one checkpoint. No JAX
    devices are needed: the data is laid out by the chunk plan alone.
    """
    _validate(leaves, devices)
    with _ocdbt_cache(settings.IN_FLIGHT.ocdbt_cache_bytes):
        context = ts_utils.get_ts_context(use_ocdbt=True)
    parent = epath.Path(staging)
    parent.mkdir(parents=True, exist_ok=True)
    values = [_StreamedLeaf(leaf, index, tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype), None,
                            write_shape(tuple(leaf.shape), devices), codec, devices)
              for leaf, index in zip(leaves, indices)]
    infos = [type_handlers.ParamInfo(name=".".join(leaf.path), parent_dir=parent, is_ocdbt_checkpoint=True,
                                     use_compression=codecs.compresses(codec), use_zarr3=True,
                                     ocdbt_target_data_file_size=TARGET_FILE_BYTES, ts_context=context)
             for leaf in leaves]
    args = [ocp.SaveArgs(chunk_byte_size=TARGET_FILE_BYTES)] * len(values)
    asyncio.run(_stream(values, infos, args, tiles, on_tile, process_id, options))
