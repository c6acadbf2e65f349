"""Qwen2 / Qwen2.5 (``model_type: qwen2``): MaxText ``decoder_block: qwen2``.

Qwen2 has q/k/v biases (reshaped to (heads, head_dim)) and no output bias. MaxText scales
queries at run time and uses HF's half-split RoPE, so q/k kernels are only reshaped.
"""

from ckptconv.families.base import Family, Rule
from ckptconv.families.decoder import GLOBAL_ROWS, KV_KERNEL, L, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, read_dense_spec
from ckptconv.spec import ConfigReader, ModelSpec
from ckptconv.transforms import kv_heads, q_heads, split_last

BIAS_ROWS = (
    Rule(L + "self_attn.q_proj.bias", ("self_attention", "query", "bias"), ("q",), (split_last(q_heads),)),
    Rule(L + "self_attn.k_proj.bias", ("self_attention", "key", "bias"), ("kv",), (split_last(kv_heads),)),
    Rule(L + "self_attn.v_proj.bias", ("self_attention", "value", "bias"), ("kv",), (split_last(kv_heads),)),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    return read_dense_spec(cfg, "qwen2", interleave_rope=False)


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    decoder_block="qwen2",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + BIAS_ROWS + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
)
