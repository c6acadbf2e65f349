"""``inspect``: what a checkpoint holds, leaf by leaf, and whether it is complete.

One row per leaf: name, shape, dtype, sharding (mesh shape, axis names, partition spec) and
the storage chunk shape, which is what decides how much a TPU host reads to load its shard.

"Complete" also needs the storage to hold what the metadata promises: every OCDBT data file
non-empty, and every chunk of every leaf a key of the database (listing reads only the
b-tree). ``deep`` reads and decodes every stored chunk too, so a truncated data file, a chunk
that no longer decompresses or a shard index whose crc32c fails is found.
"""

from __future__ import annotations

import collections
import math

import ml_dtypes  # noqa: F401 - names its dtypes to NumPy: np.dtype("bfloat16")
import numpy as np

from ckptconv import layout
from ckptconv.errors import BadInputError
from ckptconv.read.stored import (StoredLeaf, decode_problems, list_keys, open_database, raise_refusal, read_ahead,
                                  read_metadata)
from ckptconv.write import destination


def inspect_checkpoint(dst: str, deep: bool = False, ahead: int = 1, budget_bytes: int | None = None) -> dict:
    """What the checkpoint at ``dst`` holds and whether it is complete; ``deep``: every stored chunk read and decoded
    too, ``ahead`` reads in flight at most (tensorstore's threads read and decode them; the result is the same), as
    many as fit in ``budget_bytes`` (:func:`chunks_in_flight`)."""
    dst = layout.absolute(dst)
    state = destination.inspect_state(dst)
    if state.empty:  # "INCOMPLETE" would suggest a conversion that stopped half way
        raise BadInputError(f"{dst}: no checkpoint there (no {layout.STEP}/ step and no "
                            f"{layout.REPORT_NAME}; inspect reads what `ckptconv convert` wrote)")
    result = {"destination": dst, "complete": state.complete, "leftovers": list(state.leftovers),
              "report": state.report, "custom_metadata": {}, "leaves": [], "problems": []}
    if state.checkpoint:
        leaves, custom = read_metadata(dst)
        result["custom_metadata"] = custom
        result["leaves"] = [leaf.to_json() for leaf in leaves]
        result["problems"] = storage_problems(dst, leaves, deep, chunks_in_flight(leaves, ahead, budget_bytes))
        result["complete"] = state.complete and not result["problems"]
    return result


def chunks_in_flight(leaves: list[StoredLeaf], ahead: int, budget_bytes: int | None) -> int:
    """``ahead``, or fewer: as many stored chunks as fit in ``budget_bytes`` at once, each counted as the largest
    chunk held twice (read and decoded). A chunk is a whole shard up to MaxText's chunk_byte_size (2 GiB), so on a
    200-core host ``ahead`` chunks of a 1-device checkpoint could otherwise ask for hundreds of GiB; one at least."""
    if budget_bytes is None:
        return ahead
    largest = max((math.prod(leaf.chunk_shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves
                   if leaf.chunk_shape is not None and leaf.shape), default=0)
    return max(1, min(ahead, budget_bytes // (2 * largest))) if largest else ahead


def storage_problems(dst: str, leaves: list[StoredLeaf], deep: bool, ahead: int = 1) -> list[str]:
    """One line per thing the metadata promises that the storage does not hold."""
    items = layout.items_path(dst)
    problems = []
    processes = sorted(items.glob("ocdbt.process_*"))
    if not processes:
        problems.append(f"{items}: no ocdbt.process_* directory (no data)")
    for process in processes:
        data = process / "d"
        for file in sorted(data.iterdir()) if data.exists() else []:
            if file.stat().length == 0:
                problems.append(f"{file}: empty data file")
    keys = list_keys(items.as_posix())
    chunks = collections.Counter(key.split("/c/", 1)[0] for key in keys if "/c/" in key)  # per array name
    for leaf in leaves:
        if leaf.chunk_shape is None or not leaf.shape:
            continue  # scalars (the step) live in their own small arrays
        name = ".".join(leaf.path)
        grid = [math.ceil(d / c) for d, c in zip(leaf.shape, leaf.chunk_shape)]
        present = chunks[name]
        if f"{name}/zarr.json" not in keys:
            problems.append(f"{leaf.name}: its array metadata (zarr.json) is missing")
        elif present < math.prod(grid):
            problems.append(f"{leaf.name}: {math.prod(grid) - present} of {math.prod(grid)} chunks missing")
    if deep:
        kvstore = open_database(items.as_posix())
        unreadable = set()
        for key, reading in read_ahead(((key, kvstore.read(key)) for key in sorted(keys)), ahead):
            try:
                reading.result()
            except ValueError as err:
                raise_refusal(err)  # the bucket refused the read: nothing in the checkpoint to list
                problems.append(f"{key}: unreadable ({str(err).splitlines()[0][:200]})")
                unreadable.add(key.split("/", 1)[0])
        problems += decode_problems(items.as_posix(), leaves, frozenset(unreadable), ahead)  # deep means decoded
    return problems


def render_table(result: dict) -> str:
    rows = [("leaf", "shape", "dtype", "mesh", "axes", "partition", "chunk")]
    for leaf in result["leaves"]:
        rows.append((
            leaf["name"], _dims(leaf["shape"]), leaf["dtype"], _dims(leaf["mesh_shape"]),
            ",".join(leaf["axis_names"] or []) or "-", _spec(leaf["partition_spec"]), _dims(leaf["chunk_shape"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += [f"problem: {problem}" for problem in result.get("problems", [])]
    status = "complete" if result["complete"] else "INCOMPLETE"
    lines.append(f"{result['destination']}: {status}; {len(result['leaves'])} leaves; "
                 f"custom metadata {result['custom_metadata']}"
                 + (f"; leftovers {result['leftovers']}" if result["leftovers"] else ""))
    return "\n".join(lines)


def _dims(dims: list | None) -> str:
    return "-" if dims is None else "(" + ", ".join(map(str, dims)) + ")"


def _spec(spec: list | None) -> str:
    return "-" if spec is None else "P(" + ", ".join("None" if s is None else repr(s) for s in spec) + ")"
