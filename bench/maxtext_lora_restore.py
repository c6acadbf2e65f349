"""Does MaxText 0.2.5's own LoRA restore (``lora.lora_restore_path``) read an adapter checkpoint? (MaxText's venv.)

    <maxtext-venv>/bin/python bench/maxtext_lora_restore.py ITEMS_DIR

``maxtext.utils.lora_utils.restore_lora_from_path`` is called exactly as ``train_sft.py`` calls it, on a
stand-in model: an ``nnx.Module`` whose ``nnx.LoRAParam`` s sit at the paths of MaxText's LoRA parameters
(``decoder/layers/<block>/<proj>/kernel_lora_{a,b}``, the names qwix gives them) with the checkpoint's shapes,
initialised to zeros. Building MaxText's whole model with qwix's LoRA is not needed for the question asked: where
in the tree the restore looks, and whether it syncs rank and alpha from the checkpoint's metadata. Prints one JSON
line: restored (every parameter equal to the stored leaf), or the error MaxText raised.
"""

from __future__ import annotations

import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx


def stored_adapter(items: str) -> dict[tuple[str, ...], np.ndarray]:
    """The checkpoint's LoRA leaves, by their path below any ``params/params`` root and without ``value``."""
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(items)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", getattr(meta, "item_metadata", meta))
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = checkpointer.restore(items, args=ocp.args.PyTreeRestore(restore_args=args))
    leaves = {}
    for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = tuple(str(k.key) for k in path)
        if keys[-2:-1] and keys[-2] in ("kernel_lora_a", "kernel_lora_b"):
            leaves[keys[2:-1] if keys[:2] == ("params", "params") else keys[:-1]] = np.asarray(value)
    return leaves


class Node(nnx.Module):
    pass


def stand_in(leaves: dict[tuple[str, ...], np.ndarray]) -> Node:
    root = Node()
    for keys, value in leaves.items():
        node = root
        for key in keys[:-1]:
            if not hasattr(node, key):
                setattr(node, key, Node())
            node = getattr(node, key)
        setattr(node, keys[-1], nnx.LoRAParam(jnp.zeros(value.shape, value.dtype)))
    return root


def main() -> None:
    from maxtext.utils import lora_utils

    items = sys.argv[1]
    leaves = stored_adapter(items)
    model = stand_in(leaves)
    config = types.SimpleNamespace(lora=types.SimpleNamespace(
        lora_restore_path=items, enable_lora=True, lora_rank=0, lora_alpha=0.0, lora_module_path=""))
    try:
        lora_utils.restore_lora_from_path(model, config)
    except Exception as err:  # noqa: BLE001 (the result is what MaxText raised)
        print(json.dumps({"restored": False, "error": f"{type(err).__name__}: {err}"}))
        return
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
    equal = all(np.array_equal(np.asarray(state[keys].get_value()), value) for keys, value in leaves.items())
    print(json.dumps({"restored": bool(equal), "parameters": len(leaves), "rank": config.lora.lora_rank,
                      "alpha": config.lora.lora_alpha}))


if __name__ == "__main__":
    main()
