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

from ckptconv.families.base import GIB, Example, Family, MemoryExample, Sizes, Synthetic, block_layout, rule
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, L, MLP_ROWS, Q_KERNEL, attention_rows, decoder_config, decoder_values, make_spec,
    read_dense_dims,
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


def synthetic_config(m: Sizes) -> dict:
    """Olmo-3's config.json with small sizes: 3 sliding + 1 full layers, untied; no ``head_dim`` field unless it
    differs from hidden / heads (the releases have none). The Instruct releases' YaRN: ``YARN`` as an override."""
    head_dim = None if m.head_dim * m.num_heads == m.hidden_size else m.head_dim
    return decoder_config(m, "Olmo3ForCausalLM", head_dim=head_dim, attention_bias=False, sliding_window=4096,
                          rope_theta=500000.0, tie_word_embeddings=False,
                          layer_types=[PATTERN[i % PERIOD] for i in range(m.num_layers)])


# The Instruct releases' rope_scaling (on the full-attention layers); base releases of the early stages have none.
YARN = {"attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0, "factor": 8.0,
        "original_max_position_embeddings": 8192, "rope_type": "yarn"}
# Olmo-3.1-32B: hidden 5120, MLP 27648, 40 query / 8 KV heads, vocab 100278, 64 layers
WIDTHS_32B = {"vocab_size": 100278, "hidden_size": 5120, "intermediate_size": 27648, "num_heads": 40,
              "num_kv_heads": 8, "head_dim": 128,
              "config_overrides": {"rope_scaling": YARN, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6}}
SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("olmo3", {"num_layers": 8, "num_kv_heads": 1, "config_overrides": {"rope_scaling": YARN}}),),
    # two blocks of 3 sliding + 1 full layers; a window shorter than the test's 12 tokens, so sliding layers mask
    logits=(Example("olmo3", {"num_layers": 8, "num_kv_heads": 2, "config_overrides": {"sliding_window": 5}},
                    devices=4),
            Example("olmo3-noscan", {"num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 8,
                                     "config_overrides": {"sliding_window": 3}}, scan=False, devices=4)),
    # one block at 32B widths (6 GB); the whole 64-layer model planned from header-only files
    memory=(MemoryExample("olmo3-32b-block", {**WIDTHS_32B, "num_layers": 4}, devices=(16, 1), bound=int(1.5 * GIB),
                          source_bytes=int(5.5 * GIB), full={**WIDTHS_32B, "num_layers": 64},
                          max_shard_bytes=5 * 10**9),),
)

FAMILY = Family(
    name="olmo3",
    model_types=("olmo3",),
    decoder_block="olmo3",
    rules=ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=block_layout(PERIOD),
)
