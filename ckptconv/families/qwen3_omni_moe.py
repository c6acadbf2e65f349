"""Qwen3-Omni-MoE's thinker (``model_type: qwen3_omni_moe``; Qwen3-Omni-30B-A3B): MaxText ``decoder_block:
qwen3_moe``; the text decoder, and with ``--multimodal`` the vision and audio towers.

The thinker's text decoder (``thinker.model.*``, ``thinker.lm_head.weight``; its config in
``thinker_config.text_config``) is Qwen3-MoE's, its experts stored one by one, so the rules are
:mod:`ckptconv.families.qwen3_moe`'s, read through aliases. The thinker's ``tie_word_embeddings`` decides the
head (a PEFT adapter of transformers 5's model names the decoder ``thinker.model.language_model.*``, also read).

With ``--multimodal`` (MaxText 0.2.5's ``use_multimodal=true``; its qwen3-omni model also sets ``use_audio``, and
its converter writes both towers) the towers become leaves as MaxText's QWEN3_OMNI_MOE mapping and hooks write them:
- the vision tower (``thinker.visual.*``) is Qwen3-VL's (:func:`ckptconv.families.qwen3_vl.vision_rules`) under
  ``vision_encoder/Qwen3OmniMoeVisionEncoder_0`` and ``Qwen3OmniMoeVisionProjector_0``, its mergers stored as
  ``ln_q``, ``mlp.0``, ``mlp.2`` and the deepstack ones as ``merger_list.{j}``;
- the audio tower (``thinker.audio_tower.*``) under ``audio_encoder/Qwen3OmniAudioEncoder_0`` (three 2-D
  convolutions as (kh, kw, in, out) kernels, ``conv_out``, ``layers_{i}`` with per-head query/key/value, the post
  LayerNorm) and ``Qwen3OmniAudioProjector_0`` (``proj1``, ``proj2``).
MaxText runs the vision path (deepstack injection) unscanned only, so with ``--multimodal`` the layout is unscanned
(:class:`UnscannedOnly`). Never converted, and named in the report: the talker and code2wav (speech output, which
MaxText does not hold).
"""

from __future__ import annotations

from ckptconv.families.base import (
    MIB, Example, Family, LayerStack, MemoryExample, Rule, Sizes, Synthetic, UnscannedOnly, multimodal, rule,
    uniform_layout,
)
from ckptconv.families.decoder import KERNEL, decoder_config, make_spec
from ckptconv.families.qwen3_moe import FAMILY as QWEN3_MOE, moe_config, read_moe_dims, widths_30b_a3b
from ckptconv.families.qwen3_vl import mrope_scaling, read_vision_dims, vision_rules, vision_stacks
from ckptconv.families.transforms import TRANSPOSE, Permute, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

VISION, AUDIO = "vision tower", "audio tower"
SPEECH = (("talker.", "talker (speech output: not in MaxText)"),
          ("code2wav.", "code2wav vocoder (speech output: not in MaxText)"))
# as transformers 5 names the towers in memory (what a PEFT adapter of its model is saved with): never converted
IN_MEMORY = (("thinker.model.visual.", VISION), ("thinker.model.audio_tower.", AUDIO))
TOWERS = (("thinker.visual.", VISION), ("thinker.audio_tower.", AUDIO))  # converted with --multimodal
TOP_RUNTIME = ("enable_audio_output", "im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id",
               "tts_eos_token_id", "system_token_id", "user_token_id", "assistant_token_id", "talker_config",
               "code2wav_config")
THINKER_RUNTIME = ("audio_token_id", "image_token_id", "video_token_id", "audio_start_token_id", "audio_end_token_id",
                   "vision_start_token_id", "vision_end_token_id", "user_token_id", "position_id_per_seconds",
                   "seconds_per_chunk")
# transformers' Qwen3OmniMoeAudioEncoderConfig defaults (the release gives every field)
AUDIO_DEFAULTS = {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
                  "num_mel_bins": 128, "downsample_hidden_size": 480, "output_dim": 3584}
AUDIO_RUNTIME = ("dropout", "activation_function", "activation_dropout", "scale_embedding", "max_source_positions",
                 "n_window", "n_window_infer", "conv_chunksize", "encoder_layerdrop", "init_std", "num_hidden_layers")


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
    # fields transformers 5.7 prints into the thinker's text_config, at the values the release's layers have: no
    # shared expert, q/k norms in every layer, no sliding window (any other value would change the weights or how
    # they run, and is refused)
    text.require("shared_expert_intermediate_size", (0,), 0)
    text.require("use_qk_norm", (True,), True)
    text.require("use_sliding_window", (False,), False)
    dims = read_moe_dims(text) | read_omni_vision_dims(thinker.nested("vision_config"))
    dims |= read_audio_dims(thinker.nested("audio_config"))
    return make_spec(cfg, "qwen3_omni_moe", dims, {"tie_word_embeddings": tied, "interleave_rope": False},
                     text.int("num_hidden_layers"))


def read_omni_vision_dims(vision: ConfigReader) -> dict[str, int]:
    """Qwen3-VL's tower sizes, and the fields the release's ``vision_config`` adds: run-time ones, and two older
    spellings of the channel count and patch size, which must agree with the fields read."""
    dims = read_vision_dims(vision, ("qwen3_omni_moe_vision_encoder",))
    # tie_word_embeddings: transformers' generic default, printed into the tower's config; a tower ties no head
    vision.runtime("image_size", "tokens_per_second", "apply_vit_abs_pos_embed", "tie_word_embeddings")
    for alias, dim, field in (("in_chans", "v_channels", "in_channels"), ("spatial_patch_size", "v_patch",
                                                                          "patch_size")):
        if vision.int(alias, dims[dim]) != dims[dim]:
            vision.fail(f"{alias}={vision.raw(alias)} disagrees with {field}={dims[dim]}")
    return dims


def read_audio_dims(audio: ConfigReader) -> dict[str, int]:
    """The audio tower's sizes (``a_*`` dims), read whether or not ``--multimodal`` asks for it."""
    audio.require("model_type", ("qwen3_omni_moe_audio_encoder",), "qwen3_omni_moe_audio_encoder")
    audio.runtime(*AUDIO_RUNTIME, "tie_word_embeddings")  # transformers' generic default: a tower ties no head
    dims = {f"a_{key}": audio.int(field, AUDIO_DEFAULTS[field]) for key, field in (
        ("emb", "d_model"), ("layers", "encoder_layers"), ("heads", "encoder_attention_heads"),
        ("ffn", "encoder_ffn_dim"), ("mel", "num_mel_bins"), ("down", "downsample_hidden_size"),
        ("out", "output_dim"))}
    if dims["a_emb"] % dims["a_heads"]:
        audio.fail(f"d_model={dims['a_emb']} is not a multiple of encoder_attention_heads={dims['a_heads']}")
    frequencies = dims["a_mel"]
    for _ in range(3):  # each 3x3 convolution halves the mel bins (stride 2, padding 1)
        frequencies = (frequencies + 1) // 2
    return dims | {"a_conv_in": dims["a_down"] * frequencies, "a_in": 1, "a_kernel": 3}


# --- the towers (--multimodal), as MaxText 0.2.5's QWEN3_OMNI_MOE mapping and hooks write them
NOTE = "{} (convert --multimodal: MaxText use_multimodal=true)"
V_ENCODER = ("vision_encoder", "Qwen3OmniMoeVisionEncoder_0")
V_PROJECTOR = ("vision_encoder", "Qwen3OmniMoeVisionProjector_0")
VISION_RULES = vision_rules("thinker.visual.", V_ENCODER, V_PROJECTOR, NOTE.format(VISION),
                            merger_names=("ln_q", "mlp.0", "mlp.2"), deepstack="merger_list.")
A_ENCODER = ("audio_encoder", "Qwen3OmniAudioEncoder_0")
A_PROJECTOR = ("audio_encoder", "Qwen3OmniAudioProjector_0")
AUDIO_KIND = "audio"
A = "thinker.audio_tower."
CONV2D = (Permute("conv2d_to_hwio", (2, 3, 1, 0)),)  # (out, in, kh, kw) -> (kh, kw, in, out)


def _audio(hf: str, maxtext: tuple[str, ...], hf_shape: tuple[str, ...], steps=(), layer: bool = False) -> Rule:
    return rule(A + hf, maxtext, hf_shape, steps, when=multimodal, kinds=frozenset({AUDIO_KIND}) if layer else None,
                note=NOTE.format(AUDIO))


def _linear(hf: str, maxtext: tuple[str, ...], out: str, into: str, weight=KERNEL, bias=(), layer=False):
    return (_audio(hf + ".weight", (*maxtext, "kernel"), (out, into), weight, layer),
            _audio(hf + ".bias", (*maxtext, "bias"), (out,), bias, layer))


def _norm(hf: str, maxtext: tuple[str, ...], layer: bool = False) -> tuple[Rule, ...]:
    return (_audio(hf + ".weight", (*maxtext, "scale"), ("a_emb",), layer=layer),
            _audio(hf + ".bias", (*maxtext, "bias"), ("a_emb",), layer=layer))


L = "layers.{layer}."
ATTENTION = ("self_attention_audio",)
AUDIO_RULES = (
    *(rule for i, into in ((1, "a_in"), (2, "a_down"), (3, "a_down")) for rule in (
        _audio(f"conv2d{i}.weight", (*A_ENCODER, f"conv2d{i}", "kernel"), ("a_down", into, "a_kernel", "a_kernel"),
               CONV2D),
        _audio(f"conv2d{i}.bias", (*A_ENCODER, f"conv2d{i}", "bias"), ("a_down",)))),
    _audio("conv_out.weight", (*A_ENCODER, "conv_out", "kernel"), ("a_emb", "a_conv_in"), KERNEL),  # no bias
    *_norm("ln_post", (*A_ENCODER, "layernorm_post")),
    *_linear("proj1", (*A_PROJECTOR, "proj1"), "a_emb", "a_emb"),
    *_linear("proj2", (*A_PROJECTOR, "proj2"), "a_out", "a_emb"),
    *_norm(L + "self_attn_layer_norm", ("input_layer_norm",), True),
    *_norm(L + "final_layer_norm", ("post_attention_layer_norm",), True),
    *(rule for name, part in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
      for rule in _linear(L + f"self_attn.{name}", (*ATTENTION, part), "a_emb", "a_emb",
                          (TRANSPOSE, split_last("a_heads")), (split_last("a_heads"),), True)),
    *_linear(L + "self_attn.out_proj", (*ATTENTION, "out"), "a_emb", "a_emb", (TRANSPOSE, split_first("a_heads")),
             layer=True),
    *_linear(L + "fc1", ("AudioMLP", "wi"), "a_ffn", "a_emb", layer=True),
    *_linear(L + "fc2", ("AudioMLP", "wo"), "a_emb", "a_ffn", layer=True),
)


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """The decoder's layers, and with ``--multimodal`` the vision tower's blocks and deepstack mergers and the
    audio tower's layers (``layers_{i}``), unscanned only."""
    if not multimodal(spec):
        return uniform_layout(spec, scan)
    if scan:
        raise UnscannedOnly("--multimodal: MaxText 0.2.5 runs Qwen3-Omni's vision path (deepstack features "
                            "injected into decoder layers) unscanned only (it refuses scan_layers with deepstack "
                            "indexes); convert with --no-scan-layers")
    return (uniform_layout(spec, False) + vision_stacks(spec, V_ENCODER)
            + tuple(LayerStack((*A_ENCODER, f"layers_{i}"), (i,), False, kind=AUDIO_KIND, encoder=True)
                    for i in range(spec.dim("a_layers"))))


def not_converted(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """The towers without ``--multimodal`` (as stored, and under transformers 5's in-memory names); the speech
    output always. With it, towers under the in-memory names are not read: the stored names are missing."""
    return (() if multimodal(spec) else TOWERS + IN_MEMORY) + SPEECH


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
    round_trip=(Example("qwen3_omni_moe", {**SMALL, "num_layers": 3}),
                # both towers (unscanned only), every tensor back bit for bit
                Example("qwen3_omni_moe-multimodal", {**SMALL, "num_layers": 3}, devices=16, multimodal=True)),
    logits=(Example("qwen3_omni_moe", {**SMALL, "num_layers": 3}, devices=4),
            Example("qwen3_omni_moe-noscan", SMALL, scan=False, devices=4),
            Example("qwen3_omni_moe-multimodal", SMALL, scan=False, devices=4, multimodal=True)),
    # 4x the experts at the same widths: the same peak, with 16 devices and with 1
    memory=(MemoryExample("qwen3_omni_moe-experts", widths_30b_a3b(32), devices=(16, 1), fewer=widths_30b_a3b(8),
                          more_bytes=400 * MIB),),
    hub_prefixes={"qwen3_omni_moe": ("", "thinker.")},
)

FAMILY = Family(
    name="qwen3_omni_moe",
    model_types=("qwen3_omni_moe",),
    decoder_block="qwen3_moe",
    rules=QWEN3_MOE.rules + VISION_RULES + AUDIO_RULES,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    # the hub's names; transformers 5 holds the decoder as thinker.model.language_model (a PEFT adapter's names)
    aliases=(("thinker.model.language_model.", "model."), ("thinker.model.", "model."), ("thinker.lm_head.", "lm_head.")),
    layout=layout,
    not_converted=not_converted,
    encoders=(VISION, AUDIO),
)
