"""Mistral (``model_type: mistral``): Llama's layout, MaxText ``decoder_block: mistral``.

Like Llama 2, MaxText's Mistral runs HF's half-split RoPE and no runtime query scaling: the
query kernel is pre-scaled by 1/sqrt(head_dim), nothing is permuted. The sliding window is
an inference setting (recorded in the report), not a weight.
"""

from ckptconv.families.base import GIB, Example, Family, MemoryExample, Synthetic
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, decoder_config, decoder_values, make_spec,
    read_dense_dims,
)
from ckptconv.families.transforms import SCALE_QUERY
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.runtime("sliding_window")
    dims = read_dense_dims(cfg)
    return make_spec(cfg, "mistral", dims, decoder_values(cfg, scale_query=True, head_dim=dims["hd"]))


SYNTHETIC = Synthetic(
    config=lambda m: decoder_config(m, "MistralForCausalLM"),
    round_trip=(Example("mistral", {"tie_word_embeddings": False}),),
    logits=(Example("mistral", {"tie_word_embeddings": False}, devices=4),),
    # Mistral-7B widths (hidden 4096, MLP 14336, 32 query / 8 KV heads, vocab 32768), two layers
    memory=(MemoryExample("mistral-7b-widths", {
        "vocab_size": 32768, "hidden_size": 4096, "num_layers": 2, "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "tie_word_embeddings": False}, bound=GIB,
        source_bytes=GIB),),
)

FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    decoder_block="mistral",
    rules=attention_rows(Q_KERNEL + (SCALE_QUERY,), KV_KERNEL) + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
)
