"""Mixtral (``model_type: mixtral``; 8x7B, 8x22B): MaxText ``decoder_block: mixtral``.

Mistral's attention (query kernel pre-scaled by 1/sqrt(head_dim), HF's half-split RoPE, as
MaxText 0.2.5's converter writes it) with a sparse MoE block: router
``block_sparse_moe.gate`` and experts ``w1`` (gate), ``w3`` (up), ``w2`` (down), which
MaxText names ``MoeBlock_0/{gate, wi_0, wi_1, wo}``.
"""

from ckptconv.families.base import GIB, Example, Family, MemoryExample, Synthetic
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, LAYER_NORM_ROWS, Q_KERNEL, attention_rows, decoder_config, decoder_values, make_spec,
    read_dense_dims,
)
from ckptconv.families.moe import moe_rows, read_experts
from ckptconv.families.transforms import SCALE_QUERY
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.runtime("sliding_window", "num_experts_per_tok")
    dims = read_dense_dims(cfg)
    dims["experts"] = read_experts(cfg, ("num_local_experts", "num_experts"))
    dims["moe_mlp"] = dims["mlp"]
    return make_spec(cfg, "mixtral", dims, decoder_values(cfg, scale_query=True, head_dim=dims["hd"]))


SYNTHETIC = Synthetic(
    config=lambda m: decoder_config(m, "MixtralForCausalLM", num_local_experts=m.num_experts or 8,
                                    num_experts_per_tok=2, sliding_window=None, output_router_logits=False,
                                    router_aux_loss_coef=0.02),
    round_trip=(Example("mixtral", {"tie_word_embeddings": False, "num_experts": 4}),),
    logits=(Example("mixtral", {"tie_word_embeddings": False, "num_experts": 4}, devices=4),),
    # Mixtral-8x7B widths (hidden 4096, expert MLP 14336, 32 query / 8 KV heads), one layer of two experts
    memory=(MemoryExample("mixtral-8x7b-widths", {
        "vocab_size": 32000, "hidden_size": 4096, "num_layers": 1, "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "num_experts": 2, "tie_word_embeddings": False},
        bound=GIB, source_bytes=GIB),),
)

FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    decoder_block="mixtral",
    rules=attention_rows(Q_KERNEL + (SCALE_QUERY,), KV_KERNEL) + LAYER_NORM_ROWS
    + moe_rows("MoeBlock_0", "block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2"))
    + GLOBAL_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
)
