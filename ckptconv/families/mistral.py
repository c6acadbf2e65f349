"""Mistral (``model_type: mistral``): Llama's layout, MaxText ``decoder_block: mistral``.

Like Llama 2, MaxText's Mistral runs HF's half-split RoPE and no runtime query scaling: the
query kernel is pre-scaled by 1/sqrt(head_dim), nothing is permuted. The sliding window is
an inference setting (recorded in the report), not a weight.
"""

from ckptconv.families.base import Family
from ckptconv.families.decoder import GLOBAL_ROWS, KV_KERNEL, NORM_AND_MLP_ROWS, Q_KERNEL, attention_rows, read_dense_spec
from ckptconv.spec import ConfigReader, ModelSpec
from ckptconv.transforms import SCALE_QUERY


def read_spec(cfg: ConfigReader) -> ModelSpec:
    return read_dense_spec(cfg, "mistral", interleave_rope=False)


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    decoder_block="mistral",
    rules=attention_rows(Q_KERNEL + (SCALE_QUERY,), KV_KERNEL) + NORM_AND_MLP_ROWS + GLOBAL_ROWS,
    read_spec=read_spec,
)
