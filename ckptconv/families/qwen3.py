"""Qwen3 dense (``model_type: qwen3``): MaxText ``decoder_block: qwen3``.

Qwen3 adds per-head RMSNorms on q and k (``query_norm``/``key_norm``, shape (head_dim,)).
MaxText scales queries at run time and uses HF's half-split RoPE: kernels are only reshaped.
"""

from ckptconv.families.base import Family, Rule
from ckptconv.families.decoder import GLOBAL_ROWS, KV_KERNEL, L, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, read_dense_spec
from ckptconv.spec import ConfigReader, ModelSpec

QK_NORM_ROWS = (
    Rule(L + "self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), ("hd",)),
    Rule(L + "self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), ("hd",)),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    return read_dense_spec(cfg, "qwen3", interleave_rope=False)


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    decoder_block="qwen3",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + QK_NORM_ROWS + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
)
