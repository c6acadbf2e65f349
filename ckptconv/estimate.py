"""Predict a conversion's peak memory from its plan, before any weights are read.

The Prefect flow holds this many GB of a concurrency limit while a conversion runs, so the
prediction must be an upper bound that does not grow with the number of layers: the runtime
baseline plus the slabs that can be alive at once (being read, queued, being written).
"""

from __future__ import annotations


import numpy as np

from ckptconv.plan import ConversionPlan, LeafPlan
from ckptconv.slabs import ROW_BLOCK_BYTES

BASELINE_BYTES = 700 * 1024**2  # Python + JAX + Orbax + tensorstore, measured ~0.45-0.55 GiB
SLABS_ALIVE = 6  # 2 queued + 1 being made + 2 writes in flight + 1 spare for tensorstore's copy


def slab_bytes(leaf: LeafPlan) -> int:
    """Peak bytes to produce one slab of ``leaf``: raw read, float32 work copy, output."""
    info = max(leaf.sources, key=lambda t: t.nbytes)
    raw = info.nbytes if leaf.row_axis is None else min(info.nbytes, ROW_BLOCK_BYTES)
    elements = raw // info.dtype.itemsize
    work = 0 if all(step.exact for step in leaf.steps) else elements * np.dtype(np.float32).itemsize
    return raw + work + elements * leaf.dtype.itemsize


def predicted_peak_bytes(plan: ConversionPlan) -> int:
    return BASELINE_BYTES + SLABS_ALIVE * max(slab_bytes(leaf) for leaf in plan.leaves)


def plan_summary(plan: ConversionPlan) -> dict:
    return {
        "source": plan.source_uri,
        "family": plan.family.name,
        "maxtext_decoder_block": plan.family.decoder_block,
        "layers": plan.spec.num_layers,
        "tensors": plan.tensor_count,
        "leaves": len(plan.leaves),
        "source_bytes": plan.source_bytes,
        "output_bytes": plan.output_bytes,
        "largest_shard_bytes": plan.largest_shard_bytes,
        "largest_slab_bytes": max(slab_bytes(leaf) for leaf in plan.leaves),
        "predicted_peak_rss_bytes": predicted_peak_bytes(plan),
        "predicted_peak_rss_gib": round(predicted_peak_bytes(plan) / 1024**3, 2),
        "devices": plan.devices,
        "scan_layers": plan.scan_layers,
        "dtype": str(plan.dtype),
        "tied_embeddings": plan.spec.tie_word_embeddings,
    }
