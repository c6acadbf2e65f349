"""Reading a written checkpoint back: its leaf metadata, and any leaf's slices via tensorstore.

``inspect`` and ``verify`` share this. Leaves are read slice by slice straight from the
OCDBT/zarr3 store (never by restoring the tree), so checking a 70B checkpoint needs about one
layer of memory, not 2-3x the model as an Orbax restore would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np

from ckptconv import layout, storage_failures
from ckptconv.errors import BadInputError, CkptConvError, DamagedCheckpointError

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
    """Leaves (sorted by name) of the Orbax PyTree at ``items`` (``DST/0/items``), from its metadata alone."""
    import jax
    import orbax.checkpoint as ocp

    try:
        list_keys(items)  # a damaged database fails here, in one call, before Orbax's concurrent reads
    except ValueError as err:  # tensorstore names the damaged file (the manifest, a b-tree node)
        raise DamagedCheckpointError(f"{items}: damaged OCDBT database: {_first_line(err, 300)}") from None
    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(layout.path(absolute(items)))
    except (ValueError, TypeError, AttributeError, KeyError) as err:  # not JSON, not UTF-8, another layout
        raise DamagedCheckpointError(f"{items}/_METADATA: not readable as this checkpoint's metadata (damaged, or another "
                            f"checkpoint's): {type(err).__name__}: {_first_line(err, 200)}") from None
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


def absolute(location: str) -> str:
    """A URL as it is, a local path made absolute: Orbax refuses a relative checkpoint path, and after ``file://`` a
    relative one names a host (``file://out/0/items``), where the CLI takes paths relative to where it runs."""
    location = str(location)
    return location if "://" in location else os.path.abspath(location)


def kvstore_url(location: str) -> str:
    """``location`` as a tensorstore kvstore URL (a local path as an absolute ``file://`` one)."""
    location = absolute(location)
    return location if "://" in location else "file://" + location


def open_database(items: str):
    """The OCDBT database at ``items`` (a local path or a URL) as a tensorstore KvStore."""
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": kvstore_url(items)}).result()


def _is_meta(node: Any) -> bool:
    return hasattr(node, "shape") and hasattr(node, "dtype")


def _stored_leaf(path: tuple[str, ...], meta: Any) -> StoredLeaf:
    sharding = getattr(meta, "sharding", None)
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
    """A tensorstore handle on one leaf of the Orbax PyTree at ``items``."""
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    kvstore = ts_utils.build_kvstore_tspec(absolute(items), name=".".join(path), use_ocdbt=True)
    spec = {"driver": "zarr3", "kvstore": kvstore, "recheck_cached_data": False, "recheck_cached_metadata": False}
    context = ts_utils.get_ts_context(use_ocdbt=True)
    return ts.open(spec, open=True, read=True, context=context).result()


def read_region(store, index: tuple[slice, ...]) -> np.ndarray:
    return np.asarray(store[index].read().result())


def read_leaf_region(items: str, leaf_name: str, store, index: tuple[slice, ...]) -> np.ndarray:
    """:func:`read_region` for a reader that trusts the checkpoint: a chunk that is missing, cut
    short or does not decode is one line naming the leaf and the file (tensorstore's words)."""
    try:
        return read_region(store, index)
    except ValueError as err:
        raise DamagedCheckpointError(f"{items}: leaf {leaf_name} is damaged: {_first_line(err, 300)}") from None


def open_leaf_checked(items: str, path: tuple[str, ...]):
    """:func:`open_items_leaf`, with a leaf whose array metadata is missing or damaged in one line."""
    try:
        return open_items_leaf(items, path)
    except ValueError as err:
        raise DamagedCheckpointError(f"{items}: leaf {'/'.join(path)} cannot be opened (damaged, or the metadata of "
                            f"another checkpoint): {_first_line(err, 300)}") from None


def decode_problems(items: str, leaves: list[StoredLeaf], skip: frozenset[str] = frozenset()) -> list[str]:
    """One line per leaf with a stored chunk that does not decode (read one chunk at a time).

    Reading a chunk's raw bytes proves little: a flipped byte in a zstd frame, or in the shard
    index whose crc32c Orbax writes, reads fine and fails only when decoded, as an export or a
    restore decodes it. ``skip``: array names already reported unreadable.
    """
    problems = []
    for leaf in leaves:
        name = ".".join(leaf.path)
        if name in skip or leaf.chunk_shape is None or not leaf.shape:
            continue
        try:
            store = open_items_leaf(items, leaf.path)
            chunk = tuple(store.chunk_layout.read_chunk.shape or leaf.chunk_shape)
            for corner in np.ndindex(*(-(-d // c) for d, c in zip(leaf.shape, chunk))):
                box = tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(corner, chunk, leaf.shape))
                try:
                    store[box].read().result()
                except Exception as err:  # noqa: BLE001 - tensorstore's decode failures are ValueErrors
                    problems.append(f"{leaf.name}: chunk {list(corner)} does not decode ({_first_line(err)})")
                    break  # one line per leaf: the rest of it is suspect anyway
        except Exception as err:  # noqa: BLE001 - its array metadata is damaged
            problems.append(f"{leaf.name}: cannot open ({_first_line(err)})")
    return problems


def _first_line(err: BaseException, limit: int = 200) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


def read_back(checkpoint: str, action: Callable[[], T]) -> T:
    """Run ``action()``, which reads the checkpoint at ``checkpoint``: a storage refusal is a
    :class:`StorageError`, anything else Orbax, tensorstore or JSON raise on a damaged file is one
    line naming the checkpoint (``CKPTCONV_TRACEBACK=1`` keeps the traceback, for a bug report)."""
    from ckptconv.accelerator import open_backends

    try:
        with storage_failures.translated():
            open_backends()  # a backend that cannot start (the chip held elsewhere) is said so, not called damage
            return action()
    except CkptConvError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever Orbax/tensorstore/json raise on damaged files
        if os.environ.get("CKPTCONV_TRACEBACK"):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise DamagedCheckpointError(f"{checkpoint}: cannot read the checkpoint (damaged or not a MaxText "
                                     f"checkpoint): {type(err).__name__}: {first}") from None
