"""Qwen2 / Qwen2.5 (``model_type: qwen2``): MaxText ``decoder_block: qwen2``.

Qwen2 has q/k/v biases (reshaped to (heads, head_dim)) and no output bias. MaxText scales
queries at run time and uses HF's half-split RoPE, so q/k kernels are only reshaped.
"""

from ckptconv.families.base import Family, rule
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, L, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, decoder_values, make_spec, read_dense_dims,
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


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    decoder_block="qwen2",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + BIAS_ROWS + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
)
