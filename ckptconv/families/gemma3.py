"""Gemma 3 text decoder (``model_type: gemma3`` with ``text_config``, or ``gemma3_text``):
MaxText ``decoder_block: gemma3``.

Gemma 2's layer (four +1 norms) plus q/k RMSNorms (also +1); queries are scaled at run time
(MaxText's ``query_pre_attn_scalar``), so kernels are only reshaped. MaxText scans whole
blocks of the 5-local-1-global pattern: ``decoder/layers/layers_{0..5}`` over ``L // 6``
blocks and ``decoder/layers_remainder/layers_{r}`` for the rest. The embedding is scaled by
sqrt(hidden) rounded to bfloat16 (as MaxText's converter computes it) and cut to MaxText's
262144 rows (HF has 262208: the 64 extra rows are reported as not converted).

Hub checkpoints of ``Gemma3ForConditionalGeneration`` name the decoder
``language_model.model.*``, transformers >= 4.52 saves ``model.language_model.*``; the vision
tower and projector are not part of MaxText's text decoder and are named in the report.
"""

import ml_dtypes

from ckptconv.families.base import GIB, Example, Family, MemoryExample, Sizes, Synthetic, block_layout
from ckptconv.families.decoder import Q_KERNEL, make_spec
from ckptconv.families.gemma import (
    GEMMA3_EMBEDDING, check_layer_types, global_rows, layer_rows, read_gemma_dims, synthetic_text_config,
)
from ckptconv.read.spec import ConfigReader, ModelSpec

MAXTEXT_VOCAB = 262144  # configs/models/gemma3-*.yml: vocab_size
PERIOD = 6
PATTERN = ("sliding_attention",) * 5 + ("full_attention",)
# transformers' Gemma3TextConfig defaults: hub configs rely on them (gemma-3-4b's text_config
# gives only hidden/intermediate sizes and the layer count).
TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}


def read_spec(cfg: ConfigReader) -> ModelSpec:
    if cfg.config.get("model_type") == "gemma3":
        cfg.runtime("boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image",
                    "vision_config")
        cfg.require("tie_word_embeddings", (True,), True)
        text = cfg.nested("text_config")
        text.require("model_type", ("gemma3_text",), "gemma3_text")
    else:
        text = cfg
    dims = read_gemma_dims(text, TEXT_DEFAULTS)
    layers = text.int("num_hidden_layers", TEXT_DEFAULTS["num_hidden_layers"])
    text.require("sliding_window_pattern", (PERIOD,), PERIOD)
    text.require("_sliding_window_pattern", (PERIOD,), PERIOD)
    text.runtime("rope_local_base_freq", "query_pre_attn_scalar")  # Gemma 3 scales queries at run time
    check_layer_types(text, layers, PATTERN)
    dims["maxtext_vocab"] = MAXTEXT_VOCAB
    values = {"tie_word_embeddings": True,
              "embed_scale": float(ml_dtypes.bfloat16(dims["emb"] ** 0.5))}
    return make_spec(cfg, "gemma3", dims, values, layers)


def synthetic_config(m: Sizes) -> dict:
    """``gemma3_text``: the decoder's own config; ``gemma3``: Gemma3ForConditionalGeneration's, the decoder
    in ``text_config`` beside a small vision tower's config."""
    text = synthetic_text_config(m, "gemma3_text")
    if m.model_type == "gemma3_text":
        return text
    for key in ("architectures", "torch_dtype"):
        text.pop(key)
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": {"hidden_size": 32, "image_size": 28, "intermediate_size": 64,
                              "model_type": "siglip_vision_model", "num_attention_heads": 2, "num_hidden_layers": 1,
                              "patch_size": 14, "vision_use_head": False},
            "boi_token_index": 3, "eoi_token_index": 4, "image_token_index": 5, "mm_tokens_per_image": 4,
            "torch_dtype": m.dtype}


# One RoPE for every layer in the tiny logit models (HF uses a local and a global one).
ONE_ROPE = {"rope_theta": 10000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None}
NORMS = ("norm.weight",)  # 1 + w, rounded to bfloat16 in the checkpoint: back within one bfloat16 step
SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("gemma3", {"num_layers": 8, "vocab_size": 96}, rounded=NORMS),),  # a 6-layer block + 2
    logits=(Example("gemma3_text", {"model_type": "gemma3_text", "num_layers": 8, "vocab_size": 96,
                                    "config_overrides": ONE_ROPE}, devices=4),
            Example("gemma3_text-noscan", {"model_type": "gemma3_text", "num_layers": 7, "vocab_size": 96,
                                           "config_overrides": ONE_ROPE}, scan=False, devices=4)),
    # Gemma 3 4B widths in the hub's form (hidden 2560, MLP 10240, head_dim 256, vocab 262208 scaled and cut)
    memory=(MemoryExample("gemma3-4b-widths", {
        "vocab_size": 262208, "hidden_size": 2560, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 256, "intermediate_size": 10240}, bound=GIB, source_bytes=GIB),),
    hub_prefixes={"gemma3": ("model.", "language_model.model.")},
)

FAMILY = Family(
    name="gemma3",
    model_types=("gemma3", "gemma3_text"),
    decoder_block="gemma3",
    rules=layer_rows("model.layers.{layer}.", Q_KERNEL, qk_norms=True) + global_rows(GEMMA3_EMBEDDING),
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=block_layout(PERIOD),
    aliases=(("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head.")),
    not_converted=lambda spec: (("vision_tower.", "vision tower"), ("model.vision_tower.", "vision tower"),
                                ("multi_modal_projector.", "multimodal projector"),
                                ("model.multi_modal_projector.", "multimodal projector")),
)
