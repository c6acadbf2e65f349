"""Write a MaxText-compatible Orbax checkpoint slab by slab, never holding a whole leaf.

MaxText's converter builds every leaf as a sharded ``jax.Array`` before saving: peak RAM
is the model. Here each leaf is a placeholder (:class:`_StreamedLeaf`) that a custom Orbax
``TypeHandler`` writes from a generator of slabs, so Orbax itself still writes the
layout (``_METADATA``, ``_sharding``, ``array_metadatas/``, OCDBT) and commits atomically.

Memory stays bounded because no tensorstore transaction spans a leaf (it would buffer all
of it) and no chunk spans two slabs (tensorstore would rebuild the chunk on every write
and OCDBT would keep each old version): see FIELD-NOTES, "Writing a huge stacked leaf".

Orbax internals used (pin orbax-checkpoint 0.12.8): jax_array_handlers.ArrayHandler and
_async_serialize_shardings, tensorstore_utils.build_array_write_spec and
calculate_chunk_byte_size, subchunking.choose_chunk_shape,
ocdbt_utils.get_process_index_for_subdir, future.CommitFutureAwaitingContractedSignals,
type_handler_registry.create_type_handler_registry, array_metadata_store.Store.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint._src.arrays import subchunking
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import jax_array_handlers, ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

from ckptconv.sharding import MESH_AXIS, partition_spec, shard_shape

# MaxText's DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE: its save passes it both as the OCDBT data
# file size and as every leaf's chunk_byte_size, so we do too (same chunks, same files).
TARGET_FILE_BYTES = 2 * 1024**3
# Slab size slab_rows() aims for: large enough for few, big chunks, small enough to stream.
SLAB_BYTES = 64 * 1024**2
# Two writes in flight overlap making a slab with writing one: ~15% faster, one slab of RAM.
WRITES_IN_FLIGHT = 2

Slab = tuple[tuple[slice, ...], np.ndarray]


@dataclass(frozen=True)
class LeafWrite:
    """One leaf of the ``items`` tree and how its data arrives.

    ``slabs()`` yields ``(index, data)``: ``index`` a tuple of one ``slice`` per axis into
    the global leaf, ``data`` exactly that region in ``dtype``; the regions tile the leaf
    once. ``stream_axis=None``: one slab holds the whole leaf. Otherwise the chunk extent
    along ``stream_axis`` is gcd(first slab's thickness, shard extent), and every slab must
    start and end on that grid (or at the leaf's end) and span whole chunks on other axes:
    uniform slabs always do. One layer per slab suits a layer axis; for row blocks take
    :func:`slab_rows`, since e.g. 32768-row slabs of a 9496-row shard give 8-row chunks.
    Each slab is copied before the next is requested, so producers may reuse buffers.
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    stream_axis: int | None
    slabs: Callable[[], Iterable[Slab]]


@dataclass(frozen=True)
class _StreamedLeaf:
    """Placeholder Orbax sees as the leaf value: what the array would be, without its data."""

    leaf: LeafWrite
    shape: tuple[int, ...]  # python ints: they end up in JSON metadata
    dtype: np.dtype
    sharding: NamedSharding | None  # None: written like MaxText's 1-device numpy leaves
    write_shape: tuple[int, ...]
    on_slab: Callable[[LeafWrite, int], None] | None


def write_shape(shape: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """Shape Orbax records as ``write_shape``: one shard, or one replica's part of it.

    Orbax's replica-parallel save (the CPU default) splits a replicated leaf across the
    replicas on its first axis divisible by the device count; we record the same.
    """
    shard = shard_shape(shape, devices)
    if devices > 1 and MESH_AXIS not in partition_spec(shape, devices):
        axis = next((i for i, dim in enumerate(shard) if dim % devices == 0), None)
        if axis is not None:
            shard = shard[:axis] + (shard[axis] // devices,) + shard[axis + 1:]
    return shard


def _slab_local(shape: tuple[int, ...], axis: int | None, rows: int | None) -> tuple[int, ...]:
    """``shape`` with its ``axis`` extent cut to ``gcd(rows, extent)``: what every slab spans."""
    if axis is None or rows is None:
        return shape
    return shape[:axis] + (math.gcd(rows, shape[axis]),) + shape[axis + 1:]


def chunk_shape(shape: tuple[int, ...], dtype: np.dtype, devices: int,
                stream_axis: int | None = None, rows: int | None = None) -> tuple[int, ...]:
    """Chunk shape written for a leaf whose slabs are ``rows`` thick along ``stream_axis``.

    Orbax chunks the "local" shape it is given (with MaxText's chunk_byte_size); the
    writer gives it the write shape cut along the stream axis, so every chunk lies inside
    one device's shard and one slab. ``rows=1`` equals ``SaveArgs(shard_axes=(axis,))``.
    """
    local = _slab_local(write_shape(shape, devices), stream_axis, rows)
    chunk_bytes = ts_utils.calculate_chunk_byte_size(
        local, np.dtype(dtype), chunk_byte_size=TARGET_FILE_BYTES,
        ocdbt_target_data_file_size=TARGET_FILE_BYTES)
    return tuple(subchunking.choose_chunk_shape(shape, local, np.dtype(dtype), chunk_bytes))


def slab_rows(shape: tuple[int, ...], dtype: np.dtype, devices: int, stream_axis: int = 0,
              slab_bytes: int = SLAB_BYTES) -> int:
    """Slab thickness along ``stream_axis`` that keeps slabs near ``slab_bytes`` and chunks big.

    Whole shards (a multiple of the shard extent) when a shard fits the budget, else the
    largest divisor of the shard extent that fits; at least 1. Slabs of this thickness
    (the last one may be shorter) start on chunk boundaries by construction.
    """
    extent = write_shape(shape, devices)[stream_axis]
    per_row = np.dtype(dtype).itemsize * math.prod(shape) // max(shape[stream_axis], 1)
    if extent * per_row <= slab_bytes:
        return extent * max(1, min(slab_bytes // (extent * per_row), shape[stream_axis] // extent))
    fitting = [d for d in range(1, extent + 1) if extent % d == 0 and d * per_row <= slab_bytes]
    return max(fitting, default=1)


def _region(value: _StreamedLeaf, index: tuple[slice, ...], data: np.ndarray,
            chunk: tuple[int, ...]) -> tuple[slice, ...]:
    """Normalise a slab's index and reject slabs that would rewrite part of a chunk."""
    name, shape = "/".join(value.leaf.path), value.shape
    if not isinstance(index, tuple) or len(index) != len(shape):
        raise ValueError(f"{name}: slab index {index!r} is not a tuple of {len(shape)} slices")
    region = tuple(slice(*s.indices(dim)[:2]) for s, dim in zip(index, shape))
    extents = tuple(s.stop - s.start for s in region)
    if data.shape != extents or data.dtype != value.dtype:
        raise ValueError(f"{name}: slab {index} is {data.dtype}{data.shape}, "
                         f"expected {value.dtype}{extents}")
    for s, dim, step in zip(region, shape, chunk):
        if s.start % step or (s.stop % step and s.stop != dim):
            raise ValueError(f"{name}: slab {index} cuts through chunks of {chunk}; "
                             "start slabs on multiples of the chunk (see slab_rows)")
    return region


async def _open_leaf(value: _StreamedLeaf, info: Any, arg: ocp.SaveArgs,
                     slab_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """Create the leaf's zarr3 array in OCDBT with chunks no thicker than a slab."""
    await info.await_path_creation()
    axis = value.leaf.stream_axis
    rows = None if axis is None else slab_shape[axis]
    local = _slab_local(value.write_shape, axis, rows)  # chunks as chunk_shape() predicts
    spec = ts_utils.build_array_write_spec(
        info, arg, global_shape=value.shape, local_shape=local, dtype=value.dtype,
        use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_utils.get_process_index_for_subdir(info.is_ocdbt_checkpoint))
    store = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
    return store, spec.metadata


async def _stream_leaf(value: _StreamedLeaf, info: Any, arg: ocp.SaveArgs) -> Any:
    """Write one leaf slab by slab, ``WRITES_IN_FLIGHT`` at most; return its ArrayMetadata."""
    leaf, store, metadata = value.leaf, None, None
    in_flight: collections.deque = collections.deque()  # (tensorstore future, slab bytes)
    written = 0
    for index, data in leaf.slabs():
        if store is None:  # the first slab's thickness sets the chunk grid
            store, metadata = await _open_leaf(value, info, arg, data.shape)
        region = _region(value, index, data, tuple(metadata.chunk_shape))
        # No transaction: each slab commits on its own, so only slabs in flight use RAM.
        write = store[region].write(data)
        await write.copy  # tensorstore holds its own copy now: the producer may reuse `data`
        in_flight.append((write, data.nbytes))
        written += data.size
        del data
        while len(in_flight) >= WRITES_IN_FLIGHT:
            await _settle(value, *in_flight.popleft())
    while in_flight:
        await _settle(value, *in_flight.popleft())
    if written != math.prod(value.shape):
        raise ValueError(f"{'/'.join(leaf.path)}: slabs covered {written} of "
                         f"{math.prod(value.shape)} elements")
    return dataclasses.replace(metadata, write_shape=value.write_shape)


async def _settle(value: _StreamedLeaf, write: Any, nbytes: int) -> None:
    """Wait for one slab to be written, then tell the caller how many bytes it held."""
    await write
    if value.on_slab is not None:
        value.on_slab(value.leaf, nbytes)


class _StreamingHandler(jax_array_handlers.ArrayHandler):
    """Saves :class:`_StreamedLeaf` values as Orbax would save the arrays they stand for.

    ``typestr`` is ``jax.Array`` (sharded saves) or ``np.ndarray`` (1 device, as MaxText
    writes then), so the tree metadata names the normal handlers and restores use them.
    """

    def __init__(self, store: array_metadata_store.Store | None, typestr: str):
        super().__init__(array_metadata_store=store)
        self._typestr = typestr

    def typestr(self) -> str:
        return self._typestr

    async def serialize(self, values: Sequence[_StreamedLeaf], infos: Sequence[Any],
                        args: Sequence[ocp.SaveArgs] | None = None) -> list[Any]:
        """Return commit futures, like ArrayHandler: `_sharding` entries, then the data."""
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
        """Leaves one after another (memory is per leaf), then their ArrayMetadata."""
        metadatas = [await _stream_leaf(v, i, a) for v, i, a in zip(values, infos, args)]
        if self._array_metadata_store is not None:
            await self._array_metadata_store.write(
                checkpoint_dir=infos[0].parent_dir, array_metadatas=metadatas,
                process_index=jax.process_index())


def _validate(leaves: Sequence[LeafWrite]) -> None:
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
        if leaf.stream_axis is not None and not 0 <= leaf.stream_axis < len(leaf.shape):
            raise ValueError(f"{name}: stream_axis {leaf.stream_axis} not an axis of {leaf.shape}")


def _tree(leaves: Sequence[LeafWrite], make: Callable[[LeafWrite], Any]) -> dict:
    """Nest ``make(leaf)`` under each leaf's path."""
    tree: dict = {}
    for leaf in leaves:
        node = tree
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = make(leaf)
    return tree


def write_checkpoint(destination: str, leaves: Sequence[LeafWrite], *, devices: int,
                     custom_metadata: dict, on_slab: Callable[[LeafWrite, int], None] | None = None,
                     use_compression: bool = True, extra_items: dict[str, Any] | None = None) -> None:
    """Write step 0 of a checkpoint at `destination` (local path or gs://...), tree under `destination/0/items`.

    Same layout as MaxText's converter: PyTreeCheckpointHandler with OCDBT + zarr3, leaves
    sharded over a 1-D mesh of ``devices`` (numpy leaves when 1), ``custom_metadata`` on
    the step. For ``devices > 1`` JAX must already run with exactly that many. Leaves are
    written one after another; ``on_slab(leaf, nbytes)`` runs in Orbax's writer thread
    each time a slab of ``nbytes`` is on storage (for progress). Orbax commits atomically
    (rename locally, ``commit_success.txt`` on GCS); temporary directories left by an
    interrupted earlier run are deleted first; a complete step 0 is never overwritten.
    Errors raised by ``slabs()`` propagate unchanged and leave no complete step.
    ``extra_items`` are small plain values saved beside the leaves by Orbax's standard
    handlers (MaxText's ``step`` int and empty ``opt_state``).
    """
    _validate(leaves)
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if devices > 1 and jax.device_count() != devices:  # 1 device: numpy leaves, any JAX will do
        raise RuntimeError(f"JAX has {jax.device_count()} devices, expected {devices}: set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts")
    mesh = Mesh(np.array(jax.devices()), (MESH_AXIS,)) if devices > 1 else None

    def placeholder(leaf: LeafWrite) -> _StreamedLeaf:
        shape = tuple(int(dim) for dim in leaf.shape)
        spec = PartitionSpec(*partition_spec(shape, devices))
        sharding = NamedSharding(mesh, spec) if mesh is not None else None
        return _StreamedLeaf(leaf, shape, np.dtype(leaf.dtype), sharding,
                             write_shape(shape, devices), on_slab)

    store = array_metadata_store.Store()
    sharded = mesh is not None
    streaming = _StreamingHandler(store if sharded else None, "jax.Array" if sharded else "np.ndarray")
    registry = type_handler_registry.create_type_handler_registry(
        (_StreamedLeaf, streaming),  # standard handlers last: they own the typestrs
        (int, type_handlers.ScalarHandler()),
        (np.ndarray, type_handlers.NumpyHandler()),
        (jax.Array, type_handlers.ArrayHandler(array_metadata_store=store)))
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                          use_compression=use_compression,
                                          type_handler_registry=registry)
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False,
                                           cleanup_tmp_directories=True)
    with ocp.CheckpointManager(destination, item_names=("items",), options=options,
                               item_handlers={"items": handler}) as manager:
        if 0 in manager.all_steps():
            raise FileExistsError(f"{destination} already holds a complete step 0; "
                                  "remove it or choose another destination")
        tree = {**(extra_items or {}), **_tree(leaves, placeholder)}
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=TARGET_FILE_BYTES), tree,
                                 is_leaf=lambda node: isinstance(node, _StreamedLeaf))
        manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(
            item=tree, save_args=save_args, ocdbt_target_data_file_size=TARGET_FILE_BYTES)),
            custom_metadata=custom_metadata)
        manager.wait_until_finished()
