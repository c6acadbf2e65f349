"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 (``model_type: llama``): MaxText ``decoder_block: llama2``.

MaxText's Llama attention has no runtime query scaling, so 1/sqrt(head_dim) is folded into
the query kernel. Llama 3.1+ (``rope_type: llama3``) runs MaxText's interleaved-pair RoPE,
so q and k are permuted from HF's half-split layout; older Llamas keep HF's layout.
"""

from ckptconv.families.base import Family
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, decoder_values, make_spec, read_dense_dims,
)
from ckptconv.families.transforms import ROPE_TO_MAXTEXT, SCALE_QUERY
from ckptconv.read.spec import ConfigReader, ModelSpec


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (False,), False)
    dims = read_dense_dims(cfg)
    _, rope_type, _ = cfg.rope()
    values = decoder_values(cfg, interleave_rope=rope_type == "llama3", scale_query=True, head_dim=dims["hd"])
    return make_spec(cfg, "llama", dims, values)


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    decoder_block="llama2",
    rules=attention_rows(Q_KERNEL + (ROPE_TO_MAXTEXT, SCALE_QUERY), KV_KERNEL + (ROPE_TO_MAXTEXT,))
    + NORM_AND_MLP_ROWS
    + GLOBAL_ROWS,
    read_spec=read_spec,
)
