"""Qwen3-MoE (``model_type: qwen3_moe``; Qwen3-30B-A3B, 235B-A22B): MaxText ``decoder_block: qwen3_moe``.

Qwen3's attention (q/k norms, run-time query scaling, half-split RoPE) with a sparse MoE
block in every layer: the router ``mlp.gate`` and ``num_experts`` experts. MaxText's
qwen3_moe decoder makes every layer sparse, so configs with dense layers
(``mlp_only_layers``, ``decoder_sparse_step`` != 1) are refused rather than converted wrong.
"""

from ckptconv.families.base import MIB, Example, Family, MemoryExample, Sizes, Synthetic
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, LAYER_NORM_ROWS, Q_KERNEL, QK_NORM_ROWS, attention_rows, decoder_config, decoder_values,
    make_spec, read_dense_dims,
)
from ckptconv.families.moe import moe_rows, read_experts
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_moe_dims(cfg: ConfigReader) -> dict:
    """The decoder's dims with every layer sparse (refusing dense layers): Qwen3-MoE's, and its text decoder
    inside Qwen3-VL-MoE's and Qwen3-Omni's wrappers."""
    cfg.require("decoder_sparse_step", (1,), 1)
    cfg.require("mlp_only_layers", ([],), [])
    dims = read_dense_dims(cfg)
    dims["experts"] = read_experts(cfg, ("num_experts", "num_local_experts"))
    dims["moe_mlp"] = cfg.int("moe_intermediate_size")
    return dims


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    cfg.runtime("use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                "num_experts_per_tok", "norm_topk_prob")
    return make_spec(cfg, "qwen3_moe", read_moe_dims(cfg), decoder_values(cfg))


def moe_config(m: Sizes) -> dict:
    """The MoE fields of a Qwen3-MoE decoder's config (also in the wrappers' ``text_config``)."""
    return {"num_experts": m.num_experts or 8, "moe_intermediate_size": m.moe_intermediate_size
            or m.intermediate_size // 2, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "router_aux_loss_coef": 0.001}


def synthetic_config(m: Sizes) -> dict:
    return decoder_config(m, "Qwen3MoeForCausalLM", **moe_config(m), attention_bias=False, use_sliding_window=False,
                          sliding_window=None, max_window_layers=m.num_layers, output_router_logits=False)


def widths_30b_a3b(experts: int) -> dict:
    """Qwen3-30B-A3B widths (hidden 2048, expert MLP 768), 2 layers: also Qwen3-VL-30B-A3B's and
    Qwen3-Omni-30B-A3B's thinker's."""
    return {"vocab_size": 32000, "hidden_size": 2048, "num_layers": 2, "num_heads": 32, "num_kv_heads": 4,
            "head_dim": 128, "intermediate_size": 6144, "num_experts": experts, "moe_intermediate_size": 768,
            "tie_word_embeddings": False}


SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("qwen3_moe", {"tie_word_embeddings": False, "num_layers": 3, "num_experts": 4,
                                      "moe_intermediate_size": 32}),),
    logits=(Example("qwen3_moe", {"tie_word_embeddings": False, "num_experts": 8, "moe_intermediate_size": 48,
                                  "num_layers": 3}, devices=4),
            Example("qwen3_moe-noscan", {"tie_word_embeddings": True, "num_experts": 4, "moe_intermediate_size": 32},
                    scan=False, devices=4)),
    # 4x the experts at the same widths: the same peak, with 16 devices and with 1
    memory=(MemoryExample("experts", widths_30b_a3b(32), devices=(16, 1), fewer=widths_30b_a3b(8),
                          more_bytes=400 * MIB),),
)

FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    decoder_block="qwen3_moe",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + QK_NORM_ROWS + LAYER_NORM_ROWS
    + moe_rows("moe_block", "mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    + GLOBAL_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
)
