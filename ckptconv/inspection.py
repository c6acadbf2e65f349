"""``inspect``: what a checkpoint holds, leaf by leaf, and whether it is complete.

One row per leaf: name, shape, dtype, sharding (mesh shape, axis names, partition spec) and
the storage chunk shape, which is what decides how much a TPU host reads to load its shard.
"""

from __future__ import annotations

from ckptconv import destination
from ckptconv.stored import read_metadata


def inspect_checkpoint(dst: str) -> dict:
    dst = destination.absolute(dst)
    state = destination.inspect_state(dst)
    result = {"destination": dst, "complete": state.complete, "leftovers": list(state.leftovers),
              "report": state.report, "custom_metadata": {}, "leaves": []}
    if state.checkpoint:
        leaves, custom = read_metadata(dst)
        result["custom_metadata"] = custom
        result["leaves"] = [leaf.to_json() for leaf in leaves]
    return result


def render_table(result: dict) -> str:
    rows = [("leaf", "shape", "dtype", "mesh", "axes", "partition", "chunk")]
    for leaf in result["leaves"]:
        rows.append((
            leaf["name"], _dims(leaf["shape"]), leaf["dtype"], _dims(leaf["mesh_shape"]),
            ",".join(leaf["axis_names"] or []) or "-", _spec(leaf["partition_spec"]), _dims(leaf["chunk_shape"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    status = "complete" if result["complete"] else "INCOMPLETE"
    lines.append(f"{result['destination']}: {status}; {len(result['leaves'])} leaves; "
                 f"custom metadata {result['custom_metadata']}"
                 + (f"; leftovers {result['leftovers']}" if result["leftovers"] else ""))
    return "\n".join(lines)


def _dims(dims: list | None) -> str:
    return "-" if dims is None else "(" + ", ".join(map(str, dims)) + ")"


def _spec(spec: list | None) -> str:
    return "-" if spec is None else "P(" + ", ".join("None" if s is None else repr(s) for s in spec) + ")"
