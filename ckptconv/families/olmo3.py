"""OLMo 3 (``model_type: olmo3``; Olmo-3 7B, 32B, base and Instruct): MaxText ``decoder_block: olmo3``.

Post-norm blocks: no norm before attention or the MLP; ``post_attention_layernorm`` and
``post_feedforward_layernorm`` normalise each branch's output before the residual add (MaxText:
``post_self_attention_layer_norm``, ``post_mlp_layer_norm``). The q/k RMSNorms span the whole
projection (heads x head_dim), not one head: MaxText's ``GlobalRMSNorm`` keeps them as one
``(heads * head_dim,)`` scale, so they are copied as stored. The attention module is
``attention`` (not ``self_attention``); queries are scaled at run time and RoPE keeps HF's
half-split layout, so kernels are only transposed and reshaped, as MaxText 0.2.5's hooks do.

Layers repeat 3 sliding-window + 1 full-attention; MaxText scans whole blocks of 4
(``decoder/layers/layers_{0..3}`` over ``L / 4`` blocks) and has no remainder stack, so a layer
count that is not a multiple of 4 is refused. YaRN (the Instruct releases) or plain RoPE (base)
is a run-time setting: no weight changes.
"""

from ckptconv.families.base import Family, block_layout, rule
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, L, MLP_ROWS, Q_KERNEL, attention_rows, decoder_values, make_spec, read_dense_dims,
)
from ckptconv.families.gemma import check_layer_types
from ckptconv.read.spec import ConfigReader, ModelSpec

PERIOD = 4
PATTERN = ("sliding_attention",) * 3 + ("full_attention",)
ATTENTION = "attention"

ROWS = attention_rows(Q_KERNEL, KV_KERNEL, attention=ATTENTION) + (
    rule(L + "self_attn.q_norm.weight", (ATTENTION, "query_norm", "scale"), ("q",)),
    rule(L + "self_attn.k_norm.weight", (ATTENTION, "key_norm", "scale"), ("kv",)),
    rule(L + "post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), ("emb",)),
    rule(L + "post_feedforward_layernorm.weight", ("post_mlp_layer_norm", "scale"), ("emb",)),
) + MLP_ROWS + GLOBAL_ROWS


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    cfg.require("tie_word_embeddings", (False,), False)  # MaxText's olmo3: logits_via_embedding false
    cfg.runtime("sliding_window")
    dims = read_dense_dims(cfg)
    layers = cfg.int("num_hidden_layers")
    if layers % PERIOD:
        cfg.fail(f"num_hidden_layers={layers} is not a multiple of {PERIOD}; MaxText scans olmo3 in whole blocks "
                 "of 3 sliding + 1 full layers and has no remainder")
    check_layer_types(cfg, layers, PATTERN)
    return make_spec(cfg, "olmo3", dims, decoder_values(cfg), layers)


FAMILY = Family(
    name="olmo3",
    model_types=("olmo3",),
    decoder_block="olmo3",
    rules=ROWS,
    read_spec=read_spec,
    layout=block_layout(PERIOD),
)
