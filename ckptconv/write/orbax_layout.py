"""The files Orbax 0.12.8 writes beside a PyTree's arrays, and the tensorstore specs it writes them with, as data.

A conversion writes its arrays with tensorstore itself (:mod:`ckptconv.write.orbax`: one tile stream, lanes, spill,
transactions); Orbax's own save would only have laid out the documents around them, yet importing Orbax and the
JAX under it cost every conversion process about 1 CPU-second and 185 MB. So the layout is built here, as Orbax
0.12.8's ``PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)`` under a ``CheckpointManager`` builds it, from
the places named below (``orbax/checkpoint/_src/...``), with no Orbax or JAX import:

- ``_METADATA`` (``metadata/tree.py``, ``InternalTreeMetadata``): each leaf's key path and value type;
- ``_sharding`` (``serialization/jax_array_handlers._async_serialize_shardings``, ``metadata/sharding.py``): each
  sharded array's ``NamedSharding`` on the 1-D mesh of device ids ``0..N-1``, as a JSON string, under the urlsafe
  base64 of its name;
- ``array_metadatas/process_0`` (``metadata/array_metadata_store.py``): each sharded array's write and chunk shape;
- ``_CHECKPOINT_METADATA`` (``metadata/step_metadata_serialization.py``): the handler's name, times, custom metadata;
- each array's zarr3 spec in OCDBT (``serialization/tensorstore_utils.ArrayWriteSpec``, ``build_kvstore_tspec``), and
  the merge of the per-process databases into the root manifest (``serialization/ocdbt_utils``).

``tests/test_writer.py`` holds every one of them equal to a plain Orbax save and to Orbax's own spec builders.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any, Iterable, Sequence

import numpy as np

from ckptconv import layout
from ckptconv.families.sharding import MESH_AXIS, partition_spec
from ckptconv.read.pytree_metadata import CONTEXT, DICT_KEY, REMOTE_COALESCING

ORBAX_VERSION = "0.12.8"  # the version whose layout this reproduces (the venv's, the tests' reference)
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # path/atomicity_types.TMP_DIR_SUFFIX
ITEMS = "items"
PROCESS_PREFIX = "ocdbt.process_"  # serialization/ocdbt_process_spec.PROCESS_PREFIX
METADATA_FILE = "_METADATA"
SHARDING_FILE = "_sharding"
ARRAY_METADATAS = "array_metadatas"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
# MaxText's DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE: its save passes it both as the OCDBT data file size and as every
# leaf's chunk_byte_size, so we do too (same data files).
TARGET_FILE_BYTES = 2 * 1024**3
# What Orbax's merge writes the root manifest with (no target given: by backend, _get_backend_ocdbt_target_data_file_size).
MERGE_FILE_BYTES = 2**31
MERGE_FILE_BYTES_GCS = 400 * 2**20
OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000, "manifest_kind": "single"}
ZSTD_LEVEL = 3  # Orbax's zarr3 zstd level (the standard handlers' chain: the ``step`` scalar)
# Value types as _METADATA names them (metadata/value.py, tree.py's empty containers)
SHARDED, NUMPY, SCALAR, EMPTY_DICT = "jax.Array", "np.ndarray", "scalar", "Dict"


def context(cache_bytes: int):
    """The tensorstore context of one save, as Orbax's ``get_ts_context(use_ocdbt=True)`` makes it, with an OCDBT
    node cache of ``cache_bytes`` (settings.IN_FLIGHT.ocdbt_cache_bytes: the memory estimate counts it). Every array
    of a save shares it: one OCDBT writer per database."""
    import tensorstore as ts

    return ts.Context({**CONTEXT, "cache_pool#ocdbt": {"total_bytes_limit": int(cache_bytes)}})


def _normalize(directory: str) -> str:
    return os.path.normpath(str(directory)).replace("gs:/", "gs://")


def _base(directory: str) -> dict[str, Any]:
    """The kvstore under an OCDBT database at ``directory`` (gcs_utils.get_kvstore_for_gcs, or a file path)."""
    if layout.is_gcs(directory):
        bucket, _, inside = directory[len("gs://"):].partition("/")
        return {"driver": os.environ.get("TENSORSTORE_GCS_BACKEND", "gcs"), "bucket": bucket, "path": inside}
    if not os.path.isabs(directory):
        raise ValueError(f"Checkpoint path should be absolute. Got {directory}")
    return {"driver": "file", "path": directory + "/"}


def kvstore_spec(directory: str, *, process_id: str | None = None, path: str | None = None,
                 target_file_bytes: int | None = None, merge: bool = False) -> dict[str, Any]:
    """Orbax's ``build_kvstore_tspec(use_ocdbt=True)``: the OCDBT database at ``directory`` (its
    ``ocdbt.process_<process_id>`` with a process id), opened to write arrays (``target_file_bytes``), to merge into
    (``merge``: the backend's default data file size) or to read (neither)."""
    directory = _normalize(directory)
    if process_id is not None:
        directory = f"{directory}/{PROCESS_PREFIX}{process_id}"
    base = _base(directory)
    spec: dict[str, Any] = {"driver": "ocdbt", "base": base}
    if base["driver"] == "file":
        spec["base"] = {**base, "file_io_locking": {"mode": "non_atomic"}}
        spec["manifest"] = base
    if merge:
        target_file_bytes = MERGE_FILE_BYTES_GCS if layout.is_gcs(directory) else MERGE_FILE_BYTES
    if target_file_bytes is not None:
        spec.update(target_data_file_size=target_file_bytes, config=dict(OCDBT_CONFIG), assume_config=True)
    if path is not None:
        spec["path"] = path
    spec["cache_pool"] = "cache_pool#ocdbt"
    if layout.is_gcs(directory):
        spec.update(REMOTE_COALESCING)
    return spec


def array_write_spec(items_dir: str, name: str, *, shape: Sequence[int], dtype: np.dtype, chunk_shape: Sequence[int],
                     compress: bool, process_id: str) -> dict[str, Any]:
    """Orbax's ``ArrayWriteSpec(use_zarr3=True, use_ocdbt=True).json`` for the array ``name`` with ``chunk_shape``
    chunks: zarr3 in the process's OCDBT database, each chunk a ``sharding_indexed`` inner chunk (``bytes``, then
    Orbax's zstd when ``compress``; :mod:`ckptconv.write.codecs` may put another codec there)."""
    chunk = [int(c) for c in chunk_shape]
    inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compress:
        inner.append({"name": "zstd", "configuration": {"level": ZSTD_LEVEL}})
    metadata = {
        "shape": [int(d) for d in shape],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": chunk, "codecs": inner,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}],
    }
    return {"driver": "zarr3",
            "kvstore": kvstore_spec(items_dir, process_id=process_id, path=name, target_file_bytes=TARGET_FILE_BYTES),
            "recheck_cached_data": False, "recheck_cached_metadata": False, "store_data_equal_to_fill_value": True,
            "metadata": metadata, "dtype": np.dtype(dtype).name}


def param_name(path: Sequence[str]) -> str:
    """The array's name in the checkpoint (Orbax's ParamInfo.name): its keys joined by dots."""
    return ".".join(path)


def extra_value_type(key: str, value: Any) -> str:
    """How Orbax's standard handlers store one of the small extra items: a Python number as a ``scalar`` array
    (ScalarHandler), an empty dict as nothing but its place in the tree (MaxText's ``opt_state``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return SCALAR
    if isinstance(value, dict) and not value:
        return EMPTY_DICT
    raise ValueError(f"extra item {key!r}: {type(value).__name__} is not a number or an empty dict")


def tree_metadata(entries: Iterable[tuple[tuple[str, ...], str, Sequence[int] | None]]) -> str:
    """``_METADATA``'s text for ``(key path, value type, write shape or None)`` entries, in the tree's order (JAX
    flattens dicts by sorted keys)."""
    tree = {}
    for path, value_type, shape in sorted(entries, key=lambda entry: entry[0]):
        value: dict[str, Any] = {"value_type": value_type, "skip_deserialize": value_type == EMPTY_DICT}
        if shape is not None:
            value["write_shape"] = [int(d) for d in shape]
        tree[str(tuple(path))] = {"key_metadata": [{"key": key, "key_type": DICT_KEY} for key in path],
                                  "value_metadata": value}
    return json.dumps({"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": True,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None})


def named_sharding(shape: Sequence[int], devices: int) -> str:
    """One array's ``NamedSharding`` as Orbax's ``NamedShardingMetadata.to_serialized_string`` writes it: the 1-D
    mesh of device ids ``0..devices-1`` on MaxText's axis, the array's partition spec."""
    return json.dumps({"sharding_type": "NamedSharding", "shape": [devices], "axis_names": [MESH_AXIS],
                       "axis_types": ["AxisType.Auto"],
                       "partition_spec": list(partition_spec(tuple(int(d) for d in shape), devices)),
                       "device_mesh": {"mesh": [{"id": device} for device in range(devices)]}})


def shardings(arrays: Iterable[tuple[str, Sequence[int]]], devices: int) -> str:
    """``_sharding``'s text: ``{urlsafe base64 of the name: named_sharding}`` for ``(name, shape)`` arrays, as
    tensorstore's json driver stores it (compact)."""
    return json.dumps({base64.urlsafe_b64encode(name.encode()).decode(): named_sharding(shape, devices)
                       for name, shape in arrays}, separators=(",", ":"))


def array_metadatas(arrays: Iterable[tuple[str, Sequence[int], Sequence[int]]]) -> str:
    """``array_metadatas/process_0``'s text for ``(name, write shape, chunk shape)`` arrays."""
    return json.dumps({"array_metadatas": [
        {"array_metadata": {"param_name": name, "write_shape": [int(d) for d in write],
                            "chunk_shape": [int(c) for c in chunk], "ext_metadata": None}}
        for name, write, chunk in arrays]})


def step_metadata(custom_metadata: dict, init_ns: int, commit_ns: int | None) -> str:
    """``_CHECKPOINT_METADATA``'s text: the one item's handler, the save's start and commit times, the custom
    metadata (MaxText reads ``scan_layers`` there)."""
    return json.dumps({"item_handlers": {ITEMS: HANDLER}, "metrics": {}, "performance_metrics": {},
                       "init_timestamp_nsecs": init_ns, "commit_timestamp_nsecs": commit_ns,
                       "custom_metadata": custom_metadata})


async def merge_process_databases(items_dir: str, context) -> None:
    """Orbax's ``merge_ocdbt_per_process_files``: every ``ocdbt.process_*`` database under ``items_dir`` copied into
    the root manifest in one atomic transaction (the process databases stay: the root refers to their data files)."""
    import asyncio

    import tensorstore as ts

    children = sorted(p.name for p in layout.path(items_dir).iterdir() if p.name.startswith(PROCESS_PREFIX))
    if not children:
        raise ValueError(f"{items_dir}: no {PROCESS_PREFIX}* database to merge: nothing was written")
    opened = await asyncio.gather(
        *(ts.KvStore.open(kvstore_spec(f"{_normalize(items_dir)}/{child}"), context=context) for child in children),
        ts.KvStore.open(kvstore_spec(items_dir, merge=True), context=context))
    parent, sources = opened[-1], opened[:-1]
    txn = ts.Transaction(atomic=True)
    await asyncio.gather(*(source.experimental_copy_range_to(parent.with_transaction(txn)) for source in sources))
    await txn.commit_async()


async def missing_arrays(items_dir: str, names: Iterable[str], context) -> list[str]:
    """Of the arrays ``names``, those whose ``zarr.json`` the merged root database at ``items_dir`` does not list:
    the last check before a step may commit (one listing of the manifest, no data read), so a step whose arrays were
    not all written (partitions adopted short of one, a lane's database lost) is never marked complete."""
    import tensorstore as ts

    root = await ts.KvStore.open(kvstore_spec(items_dir), context=context)
    listed = {key.decode() for key in await root.list()}
    return [name for name in names if f"{name}/zarr.json" not in listed]
