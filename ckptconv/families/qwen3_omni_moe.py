"""Qwen3-Omni-MoE's thinker (``model_type: qwen3_omni_moe``; Qwen3-Omni-30B-A3B): MaxText ``decoder_block:
qwen3_moe``, text decoder only.

The thinker's text decoder (``thinker.model.*``, ``thinker.lm_head.weight``; its config in
``thinker_config.text_config``) is Qwen3-MoE's, its experts stored one by one, so the rules are
:mod:`ckptconv.families.qwen3_moe`'s, read through aliases. The thinker's ``tie_word_embeddings`` decides the
head (a PEFT adapter of transformers 5's model names the decoder ``thinker.model.language_model.*``, also read).
Not converted, and named in the report: the thinker's vision and audio towers (MaxText's
``use_multimodal`` / ``use_audio``), and the talker and code2wav (speech output, which MaxText does not hold).
"""

from __future__ import annotations

from ckptconv.families.base import MIB, Example, Family, MemoryExample, Sizes, Synthetic
from ckptconv.families.decoder import decoder_config, make_spec
from ckptconv.families.qwen3_moe import FAMILY as QWEN3_MOE, moe_config, read_moe_dims, widths_30b_a3b
from ckptconv.families.qwen3_vl import mrope_scaling
from ckptconv.read.spec import ConfigReader, ModelSpec

VISION, AUDIO = "vision tower (MaxText use_multimodal; not converted yet)", "audio tower (MaxText use_audio; not converted yet)"
# as stored, and as transformers 5 names the modules in memory (what a PEFT adapter of its model is saved with)
NOT_CONVERTED = (("thinker.visual.", VISION), ("thinker.model.visual.", VISION),
                 ("thinker.audio_tower.", AUDIO), ("thinker.model.audio_tower.", AUDIO),
                 ("talker.", "talker (speech output: not in MaxText)"),
                 ("code2wav.", "code2wav vocoder (speech output: not in MaxText)"))
TOP_RUNTIME = ("enable_audio_output", "im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id",
               "tts_eos_token_id", "system_token_id", "user_token_id", "assistant_token_id", "talker_config",
               "code2wav_config")
THINKER_RUNTIME = ("audio_token_id", "image_token_id", "video_token_id", "audio_start_token_id", "audio_end_token_id",
                   "vision_start_token_id", "vision_end_token_id", "user_token_id", "position_id_per_seconds",
                   "seconds_per_chunk", "vision_config", "audio_config")


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.runtime(*TOP_RUNTIME)
    thinker = cfg.nested("thinker_config")
    thinker.require("model_type", ("qwen3_omni_moe_thinker",), "qwen3_omni_moe_thinker")
    thinker.runtime(*THINKER_RUNTIME)
    tied = thinker.bool("tie_word_embeddings", False)
    text = thinker.nested("text_config")
    text.require("model_type", ("qwen3_omni_moe_text",), "qwen3_omni_moe_text")
    text.runtime("tie_word_embeddings", "sliding_window", "num_experts_per_tok", "norm_topk_prob")
    text.require("attention_bias", (False,), False)
    dims = read_moe_dims(text)
    return make_spec(cfg, "qwen3_omni_moe", dims, {"tie_word_embeddings": tied, "interleave_rope": False},
                     text.int("num_hidden_layers"))


def synthetic_config(m: Sizes) -> dict:
    """The release's ``config.json`` shape: the thinker's decoder in ``thinker_config.text_config`` (mRoPE
    sections), small vision and audio towers' settings beside it, no talker (``enable_audio_output`` false)."""
    text = decoder_config(m, "", **moe_config(m), attention_bias=False, sliding_window=None, tie_word_embeddings=None,
                          architectures=None, torch_dtype=None)
    text.update(model_type="qwen3_omni_moe_text", rope_theta=1000000, rope_scaling=mrope_scaling(m.head_dim))
    thinker = {"model_type": "qwen3_omni_moe_thinker", "text_config": text,
               "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                 "out_hidden_size": m.hidden_size, "deepstack_visual_indexes": [0]},
               "audio_config": {"encoder_layers": 1, "d_model": 32, "encoder_attention_heads": 2,
                                "encoder_ffn_dim": 64, "output_dim": m.hidden_size, "downsample_hidden_size": 16,
                                "num_mel_bins": 16},
               "audio_token_id": 151646, "image_token_id": 151655, "video_token_id": 151656,
               "audio_start_token_id": 151647, "position_id_per_seconds": 25, "user_token_id": 872,
               "tie_word_embeddings": m.tie_word_embeddings}
    return {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
            "thinker_config": thinker, "enable_audio_output": False, "im_start_token_id": 151644,
            "im_end_token_id": 151645, "system_token_id": 8948, "user_token_id": 872, "assistant_token_id": 77091,
            "torch_dtype": m.dtype}


SMALL = {"tie_word_embeddings": False, "num_experts": 4, "moe_intermediate_size": 32}
SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("qwen3_omni_moe", {**SMALL, "num_layers": 3}),),
    logits=(Example("qwen3_omni_moe", {**SMALL, "num_layers": 3}, devices=4),
            Example("qwen3_omni_moe-noscan", SMALL, scan=False, devices=4)),
    # 4x the experts at the same widths: the same peak, with 16 devices and with 1
    memory=(MemoryExample("qwen3_omni_moe-experts", widths_30b_a3b(32), devices=(16, 1), fewer=widths_30b_a3b(8),
                          more_bytes=400 * MIB),),
    hub_prefixes={"qwen3_omni_moe": ("", "thinker.")},
)

FAMILY = Family(
    name="qwen3_omni_moe",
    model_types=("qwen3_omni_moe",),
    decoder_block="qwen3_moe",
    rules=QWEN3_MOE.rules,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    # the hub's names; transformers 5 holds the decoder as thinker.model.language_model (a PEFT adapter's names)
    aliases=(("thinker.model.language_model.", "model."), ("thinker.model.", "model."), ("thinker.lm_head.", "lm_head.")),
    not_converted=lambda spec: NOT_CONVERTED,
)
