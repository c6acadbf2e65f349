"""MaxText's forward pass on a converted checkpoint, as the forward benchmarks run it in MaxText's venv.

The run-time settings they share (the CPU, float32 weights and activations, exact matmuls, dot-product attention,
one sequence, no dropout, no checkpointing), MaxText's config from them, one forward pass on a token sequence, and
the logits against a reference (transformers' float32 logits, or MaxText's own). MaxText is imported only inside
the functions: the drivers import this module in the project's venv too.
"""

from __future__ import annotations

import os

# MoE layers run every token through its experts: no capacity drop, the dense matmul path (what a reference that
# never drops a token computes)
EXACT_MOE = {"sparse_matmul": False, "capacity_factor": -1}


def settings(model_name: str, work: str, run_name: str, n_tokens: int, scan: bool, ckpt: str = "",
             attention: str | None = "dot_product", **overrides) -> dict:
    """MaxText's config overrides for one forward pass of ``n_tokens`` on ``ckpt`` (none: random weights);
    ``overrides`` last (the checkpoint's sizes, run-time settings)."""
    values = {"model_name": model_name, "override_model_config": True, "hardware": "cpu",
              "skip_jax_distributed_system": True, "base_output_directory": work, "run_name": run_name,
              **({"load_parameters_path": ckpt} if ckpt else {}), "scan_layers": scan,
              **({"attention": attention} if attention else {}), "dtype": "float32", "weight_dtype": "float32",
              "matmul_precision": "highest", "per_device_batch_size": 1, "max_target_length": n_tokens,
              "max_prefill_predict_length": n_tokens, "enable_checkpointing": False, "enable_dropout": False}
    return {**values, **overrides}


def config(values: dict, run_name: str):
    """MaxText's config: its base.yml with ``values`` as ``key=value`` overrides."""
    import maxtext
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    return pyconfig.initialize([run_name, base, *(f"{k}={v}" for k, v in values.items())])


def logits(model, tokens):
    """One forward pass on one sequence: float32 logits, (tokens, vocabulary)."""
    import jax.numpy as jnp
    import numpy as np

    ids = jnp.asarray([list(tokens)], jnp.int32)
    positions = jnp.arange(len(tokens), dtype=jnp.int32)[None]
    return np.asarray(model(ids, positions, jnp.ones_like(ids), enable_dropout=False), np.float32)[0]


def against(got, reference, tolerance: float) -> dict:
    """Logits against a reference over its vocabulary (MaxText may pad it): max abs difference and the verdict."""
    import numpy as np

    diff = float(np.abs(got[:, : reference.shape[-1]] - reference).max())
    return {"max_abs_logits_diff": diff, "max_abs_logit": float(np.abs(reference).max()), "ok": diff <= tolerance}


def loaded_leaves(loaded) -> dict:
    """What a MaxText loader restored (an nnx state or a plain tree), by leaf path."""
    import jax
    import numpy as np

    pure = loaded.to_pure_dict() if hasattr(loaded, "to_pure_dict") else loaded
    return {"/".join(str(k.key) for k in path): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def written_leaves(ckpt: str) -> dict:
    """Every leaf of a checkpoint as written, restored with Orbax's public API: {path under its collection:
    (collection, array)} (the collections of ``params`` merged by leaf path, as the model addresses them)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(ckpt)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    written = checkpointer.restore(ckpt, args=ocp.args.PyTreeRestore(restore_args=args))
    return {"/".join(str(k.key) for k in path): (collection, np.asarray(v))
            for collection, tree in written["params"].items() for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def mismatched(got: dict, want: dict) -> list[str]:
    """The written leaves (``want``: path -> array) a loader did not restore bit for bit (in its dtype)."""
    return sorted(k for k in want if k not in got or got[k].shape != want[k].shape
                  or got[k].tobytes() != want[k].astype(got[k].dtype).tobytes())
