"""An Orbax PyTree's leaf metadata and leaf handles, read with tensorstore alone: no Orbax, no JAX.

``inspect``, ``verify`` and ``export`` only read stored bytes, yet importing Orbax (and the JAX it imports, and
JAX's CPU backend its metadata call starts) was most of their time on a small model: 0.9 of ``inspect``'s 1.1 s
on 2 cores. What Orbax 0.12's ``PyTreeCheckpointHandler.metadata`` reads is three plain files (Orbax's own
layout, which MaxText's checkpoints share): ``_METADATA`` (the tree: each leaf's key path and value type),
``_sharding`` (a JSON object, the base64 of each array's name to its sharding) and each array's ``zarr.json``
inside the OCDBT database (shape, dtype, chunk grid). This module reads the same files, and
:func:`ckptconv.read.stored.read_items_metadata` makes the same :class:`~ckptconv.read.stored.StoredLeaf` values of
them (``tests/test_pytree_metadata.py`` compares the two readers). For a layout it does not know (a value type other
than arrays and scalars, a list in the tree, no OCDBT, zarr v2) :func:`tree_leaves` returns None, and that caller
falls back to Orbax.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from ckptconv import layout

ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")  # Orbax's value types stored as zarr arrays
DICT_KEY = 2  # Orbax's KeyType.DICT; sequence keys (1) are left to Orbax
# Orbax's read context (tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT) and its remote read coalescing.
CONTEXT = {"file_io_concurrency": {"limit": 128}, "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}}
REMOTE_COALESCING = {"experimental_read_coalescing_threshold_bytes": 1_000_000,
                     "experimental_read_coalescing_merged_bytes": 500_000_000_000,
                     "experimental_read_coalescing_interval": "1ms"}


def tree_leaves(items: str) -> list[tuple[tuple[str, ...], str]] | None:
    """``(key path, value type)`` of every stored array of the PyTree at ``items``, from ``_METADATA``; None for a
    layout left to Orbax. Raises ValueError (or KeyError, TypeError) for a file that is not such metadata."""
    meta = json.loads((layout.path(items) / "_METADATA").read_text())
    if not (meta.get("use_ocdbt") and meta.get("use_zarr3")):
        return None
    leaves = []
    for entry in meta["tree_metadata"].values():
        keys, value = entry["key_metadata"], entry["value_metadata"]
        if any(key["key_type"] != DICT_KEY for key in keys):
            return None
        if value["value_type"] in ARRAY_TYPES:
            leaves.append((tuple(str(key["key"]) for key in keys), value["value_type"]))
        elif not value.get("skip_deserialize"):  # an empty container is skipped; anything else is Orbax's
            return None
    return leaves


def shardings(items: str) -> dict[str, dict]:
    """Each array's recorded sharding by its name (``params.params.decoder...``); empty without a ``_sharding``."""
    file = layout.path(items) / "_sharding"
    if not file.exists():
        return {}
    recorded = json.loads(file.read_text())
    return {base64.urlsafe_b64decode(key).decode(): json.loads(value) for key, value in recorded.items() if value}


def sharding_fields(sharding: dict | None) -> tuple[Any, Any, Any]:
    """(mesh shape, axis names, partition spec) of a recorded NamedSharding, as Orbax's metadata gives them;
    ``(None, None, None)`` for none or another kind (a single device's)."""
    if not sharding or sharding.get("sharding_type") != "NamedSharding":
        return None, None, None
    spec = tuple(sharding["partition_spec"])  # an entry of several axes stays a list, as Orbax leaves it
    return tuple(int(d) for d in sharding["shape"]), tuple(str(a) for a in sharding["axis_names"]), spec


def kvstore_url(location: str) -> str:
    """``location`` as a tensorstore kvstore URL: a URL as it is, a local path as an absolute ``file://`` one (after
    ``file://`` a relative path names a host, ``file://out/0/items``, where the CLI takes paths relative to where it
    runs)."""
    location = layout.absolute(str(location))
    return location if "://" in location else "file://" + location


def context():
    """A tensorstore context for one reader's opens, as Orbax makes one per call: the OCDBT manifest and b-tree nodes
    it caches are never re-checked, so a process-wide one would read a checkpoint rewritten since (``--overwrite``
    in the same process) through the old one's nodes."""
    import tensorstore as ts

    return ts.Context(CONTEXT)


def leaf_spec(items: str, name: str) -> dict:
    """The tensorstore spec Orbax reads the array ``name`` of the PyTree at ``items`` with (its OCDBT database)."""
    kvstore = {"driver": "ocdbt", "base": kvstore_url(items), "path": name, "cache_pool": "cache_pool#ocdbt"}
    if layout.is_gcs(items):
        kvstore.update(REMOTE_COALESCING)
    return {"driver": "zarr3", "kvstore": kvstore, "recheck_cached_data": False, "recheck_cached_metadata": False}


def open_leaf(items: str, name: str, shared=None):
    """A future of the tensorstore handle on the array ``name`` (opened for reading, its metadata read), in the
    context ``shared`` (else a new one)."""
    import tensorstore as ts

    return ts.open(leaf_spec(items, name), open=True, read=True, context=shared or context())
