"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 (``model_type: llama``): MaxText ``decoder_block: llama2``.

MaxText's Llama attention has no runtime query scaling, so 1/sqrt(head_dim) is folded into
the query kernel. Llama 3.1+ (``rope_type: llama3``) runs MaxText's interleaved-pair RoPE,
so q and k are permuted from HF's half-split layout; older Llamas keep HF's layout.
"""

from ckptconv.families.base import GIB, Example, Family, MemoryExample, Synthetic
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, decoder_config, decoder_values, make_spec,
    read_dense_dims,
)
from ckptconv.families.transforms import ROPE_TO_MAXTEXT, SCALE_QUERY
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    dims = read_dense_dims(cfg)
    _, rope_type, _ = cfg.rope()
    values = decoder_values(cfg, interleave_rope=rope_type == "llama3", scale_query=True, head_dim=dims["hd"])
    return make_spec(cfg, "llama", dims, values)


# Llama 3.1's RoPE scaling with a short original context, so tiny models' positions reach the scaled band
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
SYNTHETIC = Synthetic(
    config=lambda m: decoder_config(m, "LlamaForCausalLM"),
    round_trip=(Example("llama", {"tie_word_embeddings": False}),
                Example("llama3.1", {"config_overrides": {"rope_scaling": LLAMA31_ROPE}})),
    # Llama 3.1+: interleaved RoPE, scaled q; Llama 2/3.0: half-split RoPE, scaled q, tied (like Llama 3.2 1B)
    logits=(Example("llama3.1", {"tie_word_embeddings": False, "config_overrides": {"rope_scaling": LLAMA31_ROPE}},
                    devices=4),
            Example("llama", {"tie_word_embeddings": True}, devices=4)),
    # Two layers at Llama-3-70B widths (tied, to keep the suite's disk and time small: the widths set the
    # memory). With 1 device no axis is sharded: tiles are cut from the bytes budget alone.
    memory=(MemoryExample("llama-70b-widths", {
        "vocab_size": 128256, "hidden_size": 8192, "num_layers": 2, "num_heads": 64, "num_kv_heads": 8,
        "head_dim": 128, "intermediate_size": 28672, "tie_word_embeddings": True,
        "config_overrides": {"rope_theta": 500000.0}}, devices=(1, 16), bound=GIB, source_bytes=int(4.5 * GIB),
        max_shard_bytes=5 * 10**9),),
)

FAMILY = Family(
    name="llama",
    model_types=("llama",),
    decoder_block="llama2",
    rules=attention_rows(Q_KERNEL + (ROPE_TO_MAXTEXT, SCALE_QUERY), KV_KERNEL + (ROPE_TO_MAXTEXT,))
    + NORM_AND_MLP_ROWS
    + GLOBAL_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
)
