"""Mistral (``model_type: mistral``): Llama's layout, MaxText ``decoder_block: mistral``.

Like Llama 2, MaxText's Mistral runs HF's half-split RoPE and no runtime query scaling: the
query kernel is pre-scaled by 1/sqrt(head_dim), nothing is permuted. The sliding window is
an inference setting (recorded in the report), not a weight.
"""

from ckptconv.families.base import Family
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, decoder_values, make_spec, read_dense_dims,
)
from ckptconv.families.transforms import SCALE_QUERY
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.runtime("sliding_window")
    dims = read_dense_dims(cfg)
    return make_spec(cfg, "mistral", dims, decoder_values(cfg, scale_query=True, head_dim=dims["hd"]))


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    decoder_block="mistral",
    rules=attention_rows(Q_KERNEL + (SCALE_QUERY,), KV_KERNEL) + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
)
