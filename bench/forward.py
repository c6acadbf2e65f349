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
