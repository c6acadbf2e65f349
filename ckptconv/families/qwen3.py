"""Qwen3 dense (``model_type: qwen3``): MaxText ``decoder_block: qwen3``.

Qwen3 adds per-head RMSNorms on q and k (``query_norm``/``key_norm``, shape (head_dim,)).
MaxText scales queries at run time and uses HF's half-split RoPE: kernels are only reshaped.
"""

from ckptconv.families.base import Family
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, QK_NORM_ROWS, attention_rows, decoder_values, make_spec,
    read_dense_dims,
)
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    cfg.runtime("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    return make_spec(cfg, "qwen3", read_dense_dims(cfg), decoder_values(cfg))


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    decoder_block="qwen3",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + QK_NORM_ROWS + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
)
