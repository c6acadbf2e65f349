"""Qwen3-VL dense (``model_type: qwen3_vl``; Qwen3-VL-2B, -4B): MaxText ``decoder_block: qwen3``, text decoder only.

The text decoder of a multimodal checkpoint (``model.language_model.*``, its config in ``text_config``,
the head ``lm_head.weight`` at the top) is Qwen3's: q/k norms, run-time query scaling, half-split RoPE,
so the rules are :mod:`ckptconv.families.qwen3`'s, read through an alias. mRoPE sections are recorded,
not used (text positions make interleaved mRoPE plain RoPE). The wrapper's ``tie_word_embeddings``
decides the head, as in transformers (the ``text_config`` copy transformers writes is recorded).
The vision tower (``model.visual.*``, MaxText's ``use_multimodal``) is not converted: it is named in the report.
"""

from __future__ import annotations

from ckptconv.families.qwen3 import FAMILY as QWEN3
from ckptconv.families.base import MIB, Example, Family, MemoryExample, Sizes, Synthetic
from ckptconv.families.decoder import decoder_config, make_spec, read_dense_dims
from ckptconv.read.spec import ConfigReader, ModelSpec

TEXT = "model.language_model."  # where the hub and transformers store the decoder (the rules say ``model.``)
ALIASES = ((TEXT, "model."),)
VISION = (("model.visual.", "vision tower (MaxText use_multimodal; not converted yet)"),)


def read_text(cfg: ConfigReader, text_type: str) -> tuple[ConfigReader, bool]:
    """The wrapper's ``text_config`` (of ``text_type``) and whether the head is tied (the wrapper's flag)."""
    cfg.runtime("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_config")
    tied = cfg.bool("tie_word_embeddings", False)
    text = cfg.nested("text_config")
    text.require("model_type", (text_type,), text_type)
    text.runtime("tie_word_embeddings")  # transformers writes its text config's default here; unused
    text.require("attention_bias", (False,), False)
    return text, tied


def read_spec(cfg: ConfigReader) -> ModelSpec:
    text, tied = read_text(cfg, "qwen3_vl_text")
    return make_spec(cfg, "qwen3_vl", read_dense_dims(text), {"tie_word_embeddings": tied, "interleave_rope": False},
                     text.int("num_hidden_layers"))


def mrope_scaling(head_dim: int) -> dict:
    """Interleaved mRoPE over half the head dim (time, height, width), as the Qwen3-VL and Omni releases set it."""
    half = head_dim // 2
    return {"mrope_interleaved": True, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            "rope_type": "default"}


def wrapper_config(m: Sizes, architecture: str, text: dict, **top: object) -> dict:
    """A Qwen3-VL ``config.json`` as the hub publishes it: the decoder in ``text_config`` (mRoPE sections over
    half the head dim, transformers 4's spelling), a small vision tower's settings beside it."""
    for key in ("architectures", "torch_dtype"):
        text.pop(key)
    text.update(model_type=f"{m.model_type}_text", rope_theta=5000000, attention_bias=False,
                rope_scaling=mrope_scaling(m.head_dim))
    return {"architectures": [architecture], "model_type": m.model_type, "text_config": text,
            "vision_config": {"deepstack_visual_indexes": [0], "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                              "model_type": f"{m.model_type}_vision", "num_heads": 2, "out_hidden_size": m.hidden_size},
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "tie_word_embeddings": m.tie_word_embeddings, "torch_dtype": m.dtype, **top}


def synthetic_config(m: Sizes) -> dict:
    return wrapper_config(m, "Qwen3VLForConditionalGeneration", decoder_config(m, ""))


SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("qwen3_vl", {"num_layers": 3}, devices=16),
                Example("qwen3_vl-untied", {"num_layers": 2, "tie_word_embeddings": False})),
    logits=(Example("qwen3_vl", {"tie_word_embeddings": True}, devices=4),),
    # 4x the layers (4x the bytes) at the same widths: the same peak
    memory=(MemoryExample("qwen3_vl-layers", {
        "vocab_size": 8192, "hidden_size": 1024, "num_layers": 24, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 128, "intermediate_size": 4096}, fewer={
        "vocab_size": 8192, "hidden_size": 1024, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 128, "intermediate_size": 4096}, more_bytes=500 * MIB),),
    hub_prefixes={"qwen3_vl": ("model.", TEXT)},
)

FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    decoder_block="qwen3",
    rules=QWEN3.rules,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    aliases=ALIASES,
    not_converted=lambda spec: VISION,
)
