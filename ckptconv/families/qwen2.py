"""Qwen2 / Qwen2.5 (``model_type: qwen2``): MaxText ``decoder_block: qwen2``.

Qwen2 has q/k/v biases (reshaped to (heads, head_dim)) and no output bias. MaxText scales
queries at run time and uses HF's half-split RoPE, so q/k kernels are only reshaped.
"""

from ckptconv.families.base import GIB, MIB, Example, Family, MemoryExample, Synthetic, rule
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, L, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, decoder_config, decoder_values, make_spec,
    read_dense_dims,
)
from ckptconv.families.transforms import split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

BIAS_ROWS = (
    rule(L + "self_attn.q_proj.bias", ("self_attention", "query", "bias"), ("q",), (split_last("heads"),)),
    rule(L + "self_attn.k_proj.bias", ("self_attention", "key", "bias"), ("kv",), (split_last("kv_heads"),)),
    rule(L + "self_attn.v_proj.bias", ("self_attention", "value", "bias"), ("kv",), (split_last("kv_heads"),)),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.runtime("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    return make_spec(cfg, "qwen2", read_dense_dims(cfg), decoder_values(cfg))


SYNTHETIC = Synthetic(
    config=lambda m: decoder_config(m, "Qwen2ForCausalLM"),
    round_trip=(Example("qwen2", {"tie_word_embeddings": False}),),
    logits=(Example("qwen2", {"tie_word_embeddings": False}, scan=False, devices=4),),
    # Qwen2.5-1.5B widths (hidden 1536, MLP 8960, 12 query / 2 KV heads, q/k/v biases, tied vocab 151936)
    memory=(MemoryExample("qwen2.5-1.5b-widths", {
        "vocab_size": 151936, "hidden_size": 1536, "num_layers": 2, "num_heads": 12, "num_kv_heads": 2,
        "head_dim": 128, "intermediate_size": 8960, "tie_word_embeddings": True}, bound=GIB,
        source_bytes=500 * MIB),),
)

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    decoder_block="qwen2",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + BIAS_ROWS + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
)
