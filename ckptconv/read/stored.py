"""Reading a written checkpoint back: its leaf metadata, and any leaf's slices via tensorstore.

``inspect`` and ``verify`` share this. Leaves are read slice by slice straight from the
OCDBT/zarr3 store (never by restoring the tree), so checking a 70B checkpoint needs about one
layer of memory, not 2-3x the model as an Orbax restore would.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np

from ckptconv import layout, storage_failures
from ckptconv.errors import BadInputError, CkptConvError, DamagedCheckpointError
from ckptconv.read import pytree_metadata
from ckptconv.read.pytree_metadata import kvstore_url  # noqa: F401 - the readers' name for it

T = TypeVar("T")


@dataclass(frozen=True)
class StoredLeaf:
    """One leaf as recorded in the checkpoint metadata."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...] | None
    axis_names: tuple[str, ...] | None
    partition_spec: tuple[Any, ...] | None
    chunk_shape: tuple[int, ...] | None

    @property
    def name(self) -> str:
        return "/".join(self.path)

    def to_json(self) -> dict:
        return {
            "name": self.name, "shape": list(self.shape), "dtype": self.dtype,
            "mesh_shape": None if self.mesh_shape is None else list(self.mesh_shape),
            "axis_names": None if self.axis_names is None else list(self.axis_names),
            "partition_spec": None if self.partition_spec is None else list(self.partition_spec),
            "chunk_shape": None if self.chunk_shape is None else list(self.chunk_shape),
        }


def read_metadata(dst: str) -> tuple[list[StoredLeaf], dict]:
    """Leaves (sorted by name) and the step's custom metadata of the checkpoint at ``dst``."""
    items = layout.items_path(dst)
    if not (items / "_METADATA").exists():
        raise BadInputError(f"{dst}: no checkpoint metadata at {items}")
    return read_items_metadata(items.as_posix()), _step_metadata(dst)


def read_items_metadata(items: str) -> list[StoredLeaf]:
    """Leaves (sorted by name) of the Orbax PyTree at ``items`` (``DST/0/items``), from its metadata alone: read
    with tensorstore (:mod:`ckptconv.read.pytree_metadata`), or by Orbax for a layout that module leaves to it."""
    try:
        list_keys(items)  # a damaged database fails here, in one call, before the concurrent metadata reads
    except ValueError as err:  # tensorstore names the damaged file (the manifest, a b-tree node)
        raise _damaged(f"{items}: damaged OCDBT database: {_first_line(err, 300)}", err) from None
    try:
        tree = pytree_metadata.tree_leaves(items)
    except (ValueError, TypeError, AttributeError, KeyError) as err:  # not JSON, not UTF-8, another layout
        raise _unreadable(items, "_METADATA", err) from None
    if tree is None:
        return _orbax_items_metadata(items)
    try:  # each recorded sharding's fields too: an entry without them is this file's damage, named as such
        recorded = {name: pytree_metadata.sharding_fields(sharding)
                    for name, sharding in pytree_metadata.shardings(items).items()}
    except (ValueError, TypeError, AttributeError, KeyError) as err:
        raise _unreadable(items, "_sharding", err) from None
    names = [".".join(path) for path, _ in tree]
    shared = pytree_metadata.context()
    opening = [pytree_metadata.open_leaf(items, name, shared) for name in names]  # all at once, as Orbax does
    leaves = []
    for (path, kind), name, future in zip(tree, names, opening):
        try:
            store = future.result()
        except ValueError as err:
            raise _damaged(f"{items}: leaf {'/'.join(path)} cannot be opened (damaged, or the metadata of another "
                           f"checkpoint): {_first_line(err, 300)}", err) from None
        scalar = kind == "scalar"
        mesh, axes, spec = recorded.get(name, (None, None, None)) if kind == "jax.Array" else (None, None, None)
        leaves.append(StoredLeaf(
            path=path, shape=() if scalar else tuple(int(d) for d in store.shape), dtype=store.dtype.name,
            mesh_shape=mesh, axis_names=axes, partition_spec=spec,
            chunk_shape=None if scalar else tuple(int(d) for d in store.chunk_layout.read_chunk_template.shape)))
    return sorted(leaves, key=lambda leaf: leaf.name)


def _unreadable(items: str, file: str, err: BaseException) -> CkptConvError:
    return _damaged(f"{items}/{file}: not readable as this checkpoint's metadata (damaged, or another "
                    f"checkpoint's): {type(err).__name__}: {_first_line(err, 200)}", err)


def _damaged(message: str, err: BaseException) -> CkptConvError:
    """A :class:`DamagedCheckpointError` saying ``message``, unless the storage refused the read (no permission, out
    of quota): then that refusal, a :class:`StorageError`, since nothing in the checkpoint is wrong (issue 39)."""
    return storage_failures.as_storage_error(err, work="read") or DamagedCheckpointError(message)


def _orbax_items_metadata(items: str) -> list[StoredLeaf]:
    """Orbax's own reading of the metadata: for a layout :mod:`ckptconv.read.pytree_metadata` does not cover."""
    import jax
    import orbax.checkpoint as ocp

    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(layout.path(layout.absolute(str(items))))
    except (ValueError, TypeError, AttributeError, KeyError) as err:  # not JSON, not UTF-8, another layout
        raise _unreadable(items, "_METADATA", err) from None
    tree = getattr(tree, "tree", tree)
    leaves = []
    for key_path, meta in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_meta)[0]:
        path = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)
        leaves.append(_stored_leaf(path, meta))
    return sorted(leaves, key=lambda leaf: leaf.name)


def list_keys(items: str) -> set[str]:
    """Every key of the OCDBT database at ``items`` (reads the manifest and b-tree nodes, no data).

    Orbax's metadata reads open every leaf concurrently; when the database itself is damaged, the
    first failure closes its event loop while the other reads still complete into it, and their
    callbacks print "Event loop is closed" tracebacks after our one-line error. One synchronous
    listing finds that damage first.
    """
    return {key.decode() for key in open_database(items).list().result()}


def open_database(items: str):
    """The OCDBT database at ``items`` (a local path or a URL) as a tensorstore KvStore."""
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": kvstore_url(items)}).result()


def _is_meta(node: Any) -> bool:
    return hasattr(node, "shape") and hasattr(node, "dtype")


def _stored_leaf(path: tuple[str, ...], meta: Any) -> StoredLeaf:
    """A leaf of Orbax's metadata tree: a mesh and partition only for a NamedSharding's metadata (a single device's,
    a jax.Array saved from one device, records neither, as :func:`pytree_metadata.sharding_fields` reads it)."""
    sharding = getattr(meta, "sharding", None)
    if not hasattr(sharding, "axis_names"):  # SingleDeviceShardingMetadata: a device string, no mesh
        sharding = None
    storage = getattr(meta, "storage", None)
    spec = getattr(sharding, "partition_spec", None)
    return StoredLeaf(
        path=path,
        shape=tuple(int(d) for d in getattr(meta, "shape", ()) or ()),
        dtype=str(getattr(meta, "dtype", "")),
        mesh_shape=None if sharding is None else tuple(int(d) for d in sharding.shape),
        axis_names=None if sharding is None else tuple(str(a) for a in sharding.axis_names),
        partition_spec=None if spec is None else tuple(spec),
        chunk_shape=None if storage is None or storage.chunk_shape is None else tuple(int(d) for d in storage.chunk_shape),
    )


def _step_metadata(dst: str) -> dict:
    import json

    try:
        meta = json.loads((layout.path(dst) / layout.STEP / "_CHECKPOINT_METADATA").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return meta.get("custom_metadata") or {}


def open_leaf(dst: str, path: tuple[str, ...]):
    """A tensorstore handle on one stored leaf (read lazily, slice by slice)."""
    return open_items_leaf(layout.items_path(dst).as_posix(), path)


def open_items_leaf(items: str, path: tuple[str, ...]):
    """A tensorstore handle on one leaf of the Orbax PyTree at ``items`` (the spec Orbax reads it with)."""
    return pytree_metadata.open_leaf(layout.absolute(str(items)), ".".join(path)).result()


def read_region(store, index: tuple[slice, ...]) -> np.ndarray:
    return np.asarray(store[index].read().result())


def read_leaf_region(items: str, leaf_name: str, store, index: tuple[slice, ...]) -> np.ndarray:
    """:func:`read_region` for a reader that trusts the checkpoint: a chunk that is missing, cut
    short or does not decode is one line naming the leaf and the file (tensorstore's words)."""
    return finish_leaf_read(items, leaf_name, store[index].read())


def finish_leaf_read(items: str, leaf_name: str, read) -> np.ndarray:
    """A started read of a leaf's region (a tensorstore future), finished as :func:`read_leaf_region` finishes it:
    a chunk that is missing, cut short or does not decode is one line naming the leaf; a refused read, a refusal."""
    try:
        return np.asarray(read.result())
    except ValueError as err:
        raise _damaged(f"{items}: leaf {leaf_name} is damaged: {_first_line(err, 300)}", err) from None


def open_leaf_checked(items: str, path: tuple[str, ...]):
    """:func:`open_items_leaf`, with a leaf whose array metadata is missing or damaged in one line."""
    try:
        return open_items_leaf(items, path)
    except ValueError as err:
        raise _damaged(f"{items}: leaf {'/'.join(path)} cannot be opened (damaged, or the metadata of another "
                       f"checkpoint): {_first_line(err, 300)}", err) from None


def decode_problems(items: str, leaves: list[StoredLeaf], skip: frozenset[str] = frozenset(),
                    ahead: int = 1) -> list[str]:
    """One line per leaf with a stored chunk that does not decode (read one chunk at a time, ``ahead`` of them in
    flight: tensorstore decodes those on its own threads; the lines are the same, in the same order, whatever it is).

    Reading a chunk's raw bytes proves little: a flipped byte in a zstd frame, or in the shard
    index whose crc32c Orbax writes, reads fine and fails only when decoded, as an export or a
    restore decodes it. ``skip``: array names already reported unreadable.
    """
    problems: dict[int, str] = {}  # by leaf, its first problem

    def reads():
        for n, leaf in enumerate(leaves):
            name = ".".join(leaf.path)
            if name in skip or leaf.chunk_shape is None or not leaf.shape:
                continue
            try:
                store = open_items_leaf(items, leaf.path)
            except Exception as err:  # noqa: BLE001 - its array metadata is damaged
                raise_refusal(err)
                problems[n] = f"{leaf.name}: cannot open ({_first_line(err)})"
                continue
            chunk = tuple(store.chunk_layout.read_chunk.shape or leaf.chunk_shape)
            for corner in np.ndindex(*(-(-d // c) for d, c in zip(leaf.shape, chunk))):
                if n in problems:
                    break  # one line per leaf: the rest of it is suspect anyway
                box = tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(corner, chunk, leaf.shape))
                yield n, corner, store[box].read()

    for n, corner, reading in read_ahead(reads(), ahead):
        try:
            reading.result()
        except Exception as err:  # noqa: BLE001 - tensorstore's decode failures are ValueErrors
            raise_refusal(err)
            problems.setdefault(n, f"{leaves[n].name}: chunk {list(corner)} does not decode ({_first_line(err)})")
    return [problems[n] for n in sorted(problems)]


def raise_refusal(err: BaseException) -> None:
    """Raise the storage's refusal of a read as such: it is no problem of the checkpoint to list."""
    refused = storage_failures.as_storage_error(err, work="read")
    if refused is not None:
        raise refused from None


def read_ahead(started: Iterable[tuple], ahead: int) -> Iterator[tuple]:
    """Tuples whose last member is a started read (a tensorstore future), in their order, up to ``ahead`` of them
    started and not yet handed over: the reads overlap, their results come in order."""
    window: collections.deque = collections.deque()
    for item in started:
        window.append(item)
        if len(window) >= max(1, ahead):
            yield window.popleft()
    while window:
        yield window.popleft()


def _first_line(err: BaseException, limit: int = 200) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


def read_back(checkpoint: str, action: Callable[[], T]) -> T:
    """Run ``action()``, which reads the checkpoint at ``checkpoint``: a storage refusal is a
    :class:`StorageError`, anything else Orbax, tensorstore or JSON raise on a damaged file is one
    line naming the checkpoint (``CKPTCONV_TRACEBACK=1`` keeps the traceback, for a bug report)."""
    try:
        with storage_failures.translated(work="read"):
            if _backends_may_fail():  # a backend that cannot start (the chip held elsewhere) is said so, not damage
                from ckptconv.accelerator import open_backends

                open_backends()
            return action()
    except CkptConvError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever Orbax/tensorstore/json raise on damaged files
        if os.environ.get("CKPTCONV_TRACEBACK"):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise DamagedCheckpointError(f"{checkpoint}: cannot read the checkpoint (damaged or not a MaxText "
                                     f"checkpoint): {type(err).__name__}: {first}") from None


def _backends_may_fail() -> bool:
    """Whether JAX's backends are worth opening before a read: not where this process is pinned to the CPU before
    JAX loaded (the CLI's file commands, :func:`ckptconv.accelerator.use_cpu_only`), whose CPU backend cannot be
    held elsewhere, and whose reads (:mod:`ckptconv.read.pytree_metadata`) need no JAX: importing it alone took
    0.6-1.0 s of a 1.1 s ``inspect``. A library caller that chose its own devices still has them opened first."""
    import sys

    from ckptconv.accelerator import PLATFORMS_ENV

    return os.environ.get(PLATFORMS_ENV) != "cpu" or "jax" in sys.modules
