"""Qwen3-MoE (``model_type: qwen3_moe``; Qwen3-30B-A3B, 235B-A22B): MaxText ``decoder_block: qwen3_moe``.

Qwen3's attention (q/k norms, run-time query scaling, half-split RoPE) with a sparse MoE
block in every layer: the router ``mlp.gate`` and ``num_experts`` experts. MaxText's
qwen3_moe decoder makes every layer sparse, so configs with dense layers
(``mlp_only_layers``, ``decoder_sparse_step`` != 1) are refused rather than converted wrong.
"""

from ckptconv.families.base import Family
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, LAYER_NORM_ROWS, Q_KERNEL, QK_NORM_ROWS, attention_rows, decoder_values, make_spec,
    read_dense_dims,
)
from ckptconv.families.moe import moe_rows, read_experts
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    cfg.require("decoder_sparse_step", (1,), 1)
    cfg.require("mlp_only_layers", ([],), [])
    cfg.runtime("use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                "num_experts_per_tok", "norm_topk_prob")
    dims = read_dense_dims(cfg)
    dims["experts"] = read_experts(cfg, ("num_experts", "num_local_experts"))
    dims["moe_mlp"] = cfg.int("moe_intermediate_size")
    return make_spec(cfg, "qwen3_moe", dims, decoder_values(cfg))


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    decoder_block="qwen3_moe",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + QK_NORM_ROWS + LAYER_NORM_ROWS
    + moe_rows("moe_block", "mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    + GLOBAL_ROWS,
    read_spec=read_spec,
)
