"""Qwen3 dense (``model_type: qwen3``): MaxText ``decoder_block: qwen3``.

Qwen3 adds per-head RMSNorms on q and k (``query_norm``/``key_norm``, shape (head_dim,)).
MaxText scales queries at run time and uses HF's half-split RoPE: kernels are only reshaped.
"""

from ckptconv.families.base import MIB, Example, Family, MemoryExample, Synthetic
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, QK_NORM_ROWS, attention_rows, decoder_config, decoder_values,
    make_spec, read_dense_dims,
)
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    cfg.runtime("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    return make_spec(cfg, "qwen3", read_dense_dims(cfg), decoder_values(cfg))


SYNTHETIC = Synthetic(
    config=lambda m: decoder_config(m, "Qwen3ForCausalLM"),
    round_trip=(Example("qwen3", devices=16),),
    logits=(Example("qwen3", {"tie_word_embeddings": True}, devices=4),),
    # 4x the layers (4x the bytes) at the same widths: the same peak
    memory=(MemoryExample("layers", {
        "vocab_size": 8192, "hidden_size": 1024, "num_layers": 24, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 128, "intermediate_size": 4096}, fewer={
        "vocab_size": 8192, "hidden_size": 1024, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 128, "intermediate_size": 4096}, more_bytes=500 * MIB),),
)

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    decoder_block="qwen3",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + QK_NORM_ROWS + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
)
