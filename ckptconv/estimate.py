"""Predict a conversion's peak memory from its plan, before any weights are read.

The Prefect flow holds this many GB of a concurrency limit while a conversion runs, so the
prediction must be an upper bound that does not grow with the number of layers: the runtime
baseline plus the slabs that can be alive at once (being read, queued, being written).
"""

from __future__ import annotations

import numpy as np

from ckptconv.plan import ConversionPlan, LeafPlan
from ckptconv.slabs import SLAB_BYTES, layers_per_slab
from ckptconv.transforms import column_sliceable

# Python + JAX + Orbax + tensorstore after start-up: ~0.2 GiB measured, plus tensorstore's
# caches and compression buffers under load; generous so the prediction stays an upper bound.
BASELINE_BYTES = 512 * 1024**2
# Output slabs alive at once: 2 queued by the prefetch thread, 1 it holds while the queue is
# full, 1 the writer is handing over, and the writer's 2 writes in flight (tensorstore copies).
SLABS_ALIVE = 2 + 1 + 1 + 2


def output_slab_bytes(leaf: LeafPlan) -> int:
    """The largest converted array one pipeline step holds for ``leaf``.

    A layer group, a layer, or (for layers bigger than a slab, cut from source column blocks)
    a piece of ~``SLAB_BYTES``; a row block of a big 2-D tensor; otherwise the whole leaf.
    """
    if leaf.stacked:
        layer = leaf.nbytes // leaf.shape[1]
        if layer <= SLAB_BYTES or not column_sliceable(leaf.steps):
            return layer * layers_per_slab(leaf)
        return SLAB_BYTES
    return leaf.nbytes if leaf.row_axis is None else min(leaf.nbytes, SLAB_BYTES)


def work_bytes(leaf: LeafPlan) -> int:
    """What producing one source tensor needs besides its output: the raw read and a float32 copy."""
    info = max(leaf.sources, key=lambda t: t.nbytes)
    raw = info.nbytes if leaf.row_axis is None else min(info.nbytes, SLAB_BYTES)
    exact = all(step.exact for step in leaf.steps)
    return raw + (0 if exact else 2 * raw // info.dtype.itemsize * np.dtype(np.float32).itemsize)


def predicted_peak_bytes(plan: ConversionPlan) -> int:
    """Baseline + the output slabs in flight + one tensor being produced, for the worst leaf."""
    return BASELINE_BYTES + max(SLABS_ALIVE * output_slab_bytes(leaf) + work_bytes(leaf) for leaf in plan.leaves)


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
        "largest_slab_bytes": max(output_slab_bytes(leaf) for leaf in plan.leaves),
        "predicted_peak_rss_bytes": (predicted := predicted_peak_bytes(plan)),
        "predicted_peak_rss_gib": round(predicted / 1024**3, 2),
        "devices": plan.devices,
        "scan_layers": plan.scan_layers,
        "dtype": str(plan.dtype),
        "tied_embeddings": plan.spec.tie_word_embeddings,
    }
