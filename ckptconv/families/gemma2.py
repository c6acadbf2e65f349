"""Gemma 2 (``model_type: gemma2``; 2B, 9B, 27B): MaxText ``decoder_block: gemma2``.

MaxText pairs HF's alternating layers: its layer ``i`` holds HF layer ``2i`` (local,
sliding-window attention) as ``*_local`` modules and ``2i + 1`` (global) as ``*_global``;
scanned, the local and global modules are each stacked over the ``L / 2`` pairs. Queries are
pre-scaled by 1/sqrt(head_dim) in the weights; the embedding is padded to MaxText's 256128
rows and scaled by sqrt(hidden) in float32.

The query scale is ``query_pre_attn_scalar ** -0.5`` (what HF computes; MaxText's gemma2 attention
adds none at run time). For 2B and 9B that is 1/sqrt(head_dim), bit for bit what MaxText's
``to_maxtext`` writes; for 27B (head_dim 128, scalar 144 = hidden / heads) ``to_maxtext``'s
1/sqrt(head_dim) would give wrong logits, and MaxText's own Gemma 2 script uses 1/sqrt(144) too.
"""

import numpy as np

from ckptconv.families.base import GIB, Example, Family, LayerStack, MemoryExample, Synthetic
from ckptconv.families.decoder import Q_KERNEL, make_spec
from ckptconv.families.gemma import (
    GEMMA2_EMBEDDING, check_layer_types, global_rows, layer_rows, read_gemma_dims, synthetic_text_config,
)
from ckptconv.families.transforms import SCALE_QUERY, query_scale
from ckptconv.read.spec import ConfigReader, ModelSpec

MAXTEXT_VOCAB = 256128  # configs/models/gemma2-*.yml: vocab_size
PATTERN = ("sliding_attention", "full_attention")
HALVES = (("_local", 0), ("_global", 1))


def read_spec(cfg: ConfigReader) -> ModelSpec:
    dims = read_gemma_dims(cfg)
    layers = cfg.int("num_hidden_layers")
    if layers % 2:
        cfg.fail(f"num_hidden_layers={layers} is odd; MaxText's gemma2 decoder pairs local and global layers")
    check_layer_types(cfg, layers, PATTERN)
    dims["maxtext_vocab"] = MAXTEXT_VOCAB
    hidden = dims["emb"]
    scalar = cfg.int("query_pre_attn_scalar", dims["hd"])
    values = {"tie_word_embeddings": True, "query_scale": query_scale(scalar),
              "embed_scale": float(np.float32(hidden ** 0.5))}
    return make_spec(cfg, "gemma2", dims, values, layers)


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """Local (even) and global (odd) HF layers, as MaxText's paired decoder layers."""
    if scan:
        return tuple(LayerStack(("decoder", "layers"), tuple(range(first, spec.num_layers, 2)), True, suffix)
                     for suffix, first in HALVES)
    return tuple(LayerStack(("decoder", f"layers_{i // 2}"), (i,), False, HALVES[i % 2][0])
                 for i in range(spec.num_layers))


NORMS = ("norm.weight",)  # 1 + w, rounded to bfloat16 in the checkpoint: back within one bfloat16 step
SYNTHETIC = Synthetic(
    config=lambda m: synthetic_text_config(m, "gemma2"),
    round_trip=(Example("gemma2", {"num_layers": 4, "vocab_size": 96}, rounded=NORMS),),
    logits=(Example("gemma2", {"num_layers": 4, "vocab_size": 96}, devices=4),
            Example("gemma2-noscan", {"num_layers": 4, "vocab_size": 96}, scan=False, devices=4),
            # like Gemma 2 27B: queries scaled by query_pre_attn_scalar (here 20 = hidden / heads), not head_dim
            Example("gemma2-27b-like", {"num_layers": 2, "vocab_size": 96, "hidden_size": 80,
                                        "config_overrides": {"query_pre_attn_scalar": 20}}, devices=4)),
    # Gemma 2 2B widths (hidden 2304, MLP 9216, head_dim 256, vocab 256000 padded and scaled in float32)
    memory=(MemoryExample("gemma2-2b-widths", {
        "vocab_size": 256000, "hidden_size": 2304, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 256, "intermediate_size": 9216}, bound=GIB, source_bytes=GIB),),
)

FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    decoder_block="gemma2",
    rules=layer_rows("model.layers.{layer}.", Q_KERNEL + (SCALE_QUERY,), qk_norms=False)
    + global_rows(GEMMA2_EMBEDDING),
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
)
