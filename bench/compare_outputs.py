"""Compare two MaxText Orbax checkpoints leaf by leaf: values bit for bit, and leaf metadata.

    python bench/compare_outputs.py CKPT_A CKPT_B [--json OUT.json]

CKPT_* is a conversion's output directory (the one holding ``0/items``). Only Orbax's public
API is used, so this runs in MaxText's own venv and is independent of ckptconv's code:
metadata from ``PyTreeCheckpointHandler.metadata``, values by restoring one leaf at a time to
NumPy (``RestoreArgs(restore_type=np.ndarray)``, ``partial_restore=True``), so the peak is about
2-3x the largest leaf, never the model. Exit status 0 when every leaf is present in both with
the same shape, dtype and bits; metadata differences (sharding, chunk shape) are reported but
do not fail the comparison, since MaxText reads any chunking.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def items_dir(ckpt: str) -> Path:
    path = Path(ckpt).resolve() / "0" / "items"
    if not (path / "_METADATA").exists():
        raise SystemExit(f"compare_outputs: {ckpt}: no Orbax checkpoint at {path}")
    return path


def leaf_metadata(items: Path) -> dict[tuple[str, ...], object]:
    """Flat {path: ArrayMetadata-like} of a checkpoint, from its _METADATA and array_metadatas."""
    import jax
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointHandler().metadata(items)
    tree = getattr(tree, "tree", tree)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: hasattr(n, "shape") and hasattr(n, "dtype"))[0]
    return {tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path): meta for key_path, meta in flat}


def describe(meta) -> dict:
    """The metadata fields a MaxText loader cares about, as plain JSON."""
    sharding = getattr(meta, "sharding", None)
    storage = getattr(meta, "storage", None)
    spec = getattr(sharding, "partition_spec", None)
    return {
        "shape": [int(d) for d in (getattr(meta, "shape", ()) or ())],
        "dtype": str(getattr(meta, "dtype", "")),
        "sharding": None if sharding is None else {
            "type": type(sharding).__name__,
            "mesh_shape": [int(d) for d in getattr(sharding, "shape", ()) or ()],
            "axis_names": [str(a) for a in getattr(sharding, "axis_names", ()) or ()],
            "partition_spec": None if spec is None else [None if p is None else str(p) for p in spec],
        },
        "chunk_shape": None if storage is None or getattr(storage, "chunk_shape", None) is None
        else [int(d) for d in storage.chunk_shape],
    }


def restore_leaf(items: Path, path: tuple[str, ...], meta) -> np.ndarray:
    """One leaf as a NumPy array (no devices needed), via Orbax's partial restore."""
    import orbax.checkpoint as ocp

    def nest(value):
        for key in reversed(path):
            value = {key: value}
        return value

    item = nest(_abstract(meta))
    restore_args = nest(ocp.RestoreArgs(restore_type=np.ndarray))
    restored = ocp.PyTreeCheckpointHandler().restore(
        items, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
    for key in path:
        restored = restored[key]
    return np.asarray(restored)


def _abstract(meta):
    import jax

    return jax.ShapeDtypeStruct(tuple(getattr(meta, "shape", ()) or ()), np.dtype(meta.dtype))


def same_bits(a: np.ndarray, b: np.ndarray) -> tuple[bool, str]:
    """Bit-for-bit equality (NaN payloads and -0.0 included), and where the first difference is."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"restored as {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.size == 0:
        return True, ""
    as_int = np.dtype(f"u{a.dtype.itemsize}")
    ia, ib = np.ascontiguousarray(a).view(as_int), np.ascontiguousarray(b).view(as_int)
    if np.array_equal(ia, ib):
        return True, ""
    diff = np.flatnonzero(ia.reshape(-1) != ib.reshape(-1))
    first = tuple(int(i) for i in np.unravel_index(int(diff[0]), a.shape))
    return False, (f"{diff.size} of {a.size} elements differ; first at {list(first)}: "
                   f"{a.reshape(-1)[diff[0]]!r} vs {b.reshape(-1)[diff[0]]!r}")


def stacked_view(meta: dict, cycle: int = 0) -> dict:
    """B's unscanned leaves ``decoder/<stack>_{i}/X`` seen as scanned ``decoder/<stack>/X``, stacked as
    MaxText scans (parameters on axis 1, its param_scan_axis; other collections such as DeepSeek's
    MoEBiasVar on axis 0): for comparing with a layout MaxText's converter cannot write itself.
    ``cycle`` > 0: MaxText scans whole cycles of that many layers (Llama 4): layer ``i`` is position
    ``i % cycle`` of cycle ``i // cycle``, seen as ``decoder/<stack>/<stack>_{i % cycle}/X``."""
    import re

    groups: dict[tuple, dict[int, tuple]] = {}
    rest = {}
    for path, m in meta.items():
        layer = next((n for n, key in enumerate(path) if n and path[n - 1] == "decoder"
                      and re.fullmatch(r"[a-z_]+_\d+", key)), None)
        if layer is None:
            rest[path] = m
            continue
        name, index = path[layer].rsplit("_", 1)
        position, index = (int(index) % cycle, int(index) // cycle) if cycle else (None, int(index))
        inner = (f"{name}_{position}",) if cycle else ()
        stacked = path[:layer] + (name, *inner) + path[layer + 1:]
        groups.setdefault(stacked, {})[index] = path
    for stacked, layers in groups.items():
        axis = 1 if stacked[:2] == ("params", "params") else 0
        rest[stacked] = ("stack", [layers[i] for i in sorted(layers)], axis)
    return rest


def moved_view(meta: dict, moves: dict[tuple, tuple]) -> dict:
    """B's leaves under a moved prefix seen where A keeps them (``("params", "MoEBiasVar")`` ->
    ``("params", "params")``: where ckptconv writes the router bias so every MaxText loader finds it);
    read from where B has them, compared by value."""
    out = {}
    for path, m in meta.items():
        prefix = next((p for p in moves if path[:len(p)] == p), None)
        if prefix is None:
            out[path] = m
        elif isinstance(m, tuple):  # a stack of B's layers: it keeps the axis B's collection stacks on
            out[moves[prefix] + path[len(prefix):]] = m
        else:
            out[moves[prefix] + path[len(prefix):]] = ("at", path, m)
    return out


def load(items: Path, path: tuple, meta, raw: dict) -> np.ndarray:
    if isinstance(meta, tuple) and meta[0] == "stack":
        return np.stack([restore_leaf(items, p, raw[p]) for p in meta[1]], axis=meta[2])
    if isinstance(meta, tuple) and meta[0] == "at":
        return restore_leaf(items, meta[1], meta[2])
    return restore_leaf(items, path, meta)


def compare(ckpt_a: str, ckpt_b: str, stack_b: bool = False, moves: dict[tuple, tuple] | None = None,
            cycle: int = 0, ignore_b: tuple[str, ...] = ()) -> dict:
    start = time.perf_counter()
    items_a, items_b = items_dir(ckpt_a), items_dir(ckpt_b)
    meta_a, raw_b = leaf_metadata(items_a), leaf_metadata(items_b)
    ignored = sorted("/".join(p) for p in raw_b if any("/".join(p).startswith(i) for i in ignore_b))
    raw_b = {p: m for p, m in raw_b.items() if "/".join(p) not in ignored}
    meta_b = moved_view(stacked_view(raw_b, cycle) if stack_b else raw_b, moves or {})
    result = {"a": ckpt_a, "b": ckpt_b, "leaves_a": len(meta_a), "leaves_b": len(meta_b),
              "ignored_in_b": ignored,
              "only_in_a": ["/".join(p) for p in sorted(set(meta_a) - set(meta_b))],
              "only_in_b": ["/".join(p) for p in sorted(set(meta_b) - set(meta_a))],
              "leaves_compared": 0, "bytes_compared": 0, "value_mismatches": [], "metadata_differences": [],
              "leaves": []}
    for path in sorted(set(meta_a) & set(meta_b)):
        name = "/".join(path)
        if isinstance(meta_b[path], tuple):  # B's layers stacked, or a leaf B keeps elsewhere: values only
            a, b = restore_leaf(items_a, path, meta_a[path]), load(items_b, path, meta_b[path], raw_b)
            equal, why = same_bits(a, b)
            result["leaves_compared"] += 1
            result["bytes_compared"] += int(a.nbytes)
            if not equal:
                result["value_mismatches"].append({"leaf": name, "why": why})
            result["leaves"].append({"leaf": name, "a": describe(meta_a[path]), "identical": equal})
            continue
        da, db = describe(meta_a[path]), describe(meta_b[path])
        row = {"leaf": name, "a": da, "b": db}
        for field in ("shape", "dtype", "sharding", "chunk_shape"):
            if da[field] != db[field]:
                result["metadata_differences"].append({"leaf": name, "field": field, "a": da[field], "b": db[field]})
        if da["shape"] != db["shape"] or da["dtype"] != db["dtype"]:
            result["value_mismatches"].append({"leaf": name, "why": "shape or dtype differs"})
            row["identical"] = False
        else:
            a = restore_leaf(items_a, path, meta_a[path])
            b = restore_leaf(items_b, path, meta_b[path])
            equal, why = same_bits(a, b)
            row["identical"] = equal
            result["leaves_compared"] += 1
            result["bytes_compared"] += int(a.nbytes)
            if not equal:
                result["value_mismatches"].append({"leaf": name, "why": why})
            del a, b
        result["leaves"].append(row)
    result["identical"] = not (result["value_mismatches"] or result["only_in_a"] or result["only_in_b"])
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--json", help="write the full result here")
    parser.add_argument("--moved-in-b", action="append", default=[], metavar="FROM=TO",
                        help="compare B's leaves under prefix FROM (a/b) as if they were under TO")
    parser.add_argument("--stack-layers-of-b", action="store_true",
                        help="B is unscanned: stack its layers_{i} leaves on axis 1 before comparing")
    parser.add_argument("--cycle", type=int, default=0,
                        help="with --stack-layers-of-b: MaxText scans cycles of this many layers (layers/layers_{p})")
    parser.add_argument("--ignore-in-b", action="append", default=[], metavar="PREFIX",
                        help="leave B's leaves under PREFIX (a/b) out (listed in the JSON as ignored_in_b)")
    args = parser.parse_args(argv)
    moves = {tuple(old.split("/")): tuple(new.split("/")) for old, new in (m.split("=") for m in args.moved_in_b)}
    result = compare(args.a, args.b, args.stack_layers_of_b, moves, args.cycle, tuple(args.ignore_in_b))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    for row in result["leaves"]:
        print(f"{'same' if row['identical'] else 'DIFF'}  {row['leaf']:<60} {row['a']['dtype']}{row['a']['shape']}")
    for diff in result["metadata_differences"]:
        print(f"metadata  {diff['leaf']}: {diff['field']} {diff['a']} vs {diff['b']}")
    for name in result["only_in_a"] + result["only_in_b"]:
        print(f"missing  {name} (in one checkpoint only)")
    if result["ignored_in_b"]:
        print(f"ignored  {len(result['ignored_in_b'])} leaves of B under {', '.join(args.ignore_in_b)}")
    print(f"compare_outputs: {'IDENTICAL' if result['identical'] else 'DIFFERENT'}: {result['leaves_compared']} leaves, "
          f"{result['bytes_compared'] / 2**20:.1f} MiB compared bit for bit in {result['seconds']:.1f} s")
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
