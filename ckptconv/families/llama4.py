"""Llama 4 (``model_type: llama4``; Scout 17B-16E, Maverick 17B-128E): MaxText ``decoder_block: llama4``.

(``llama4_text``: the text model alone, as ``Llama4ForCausalLM`` saves it: ``model.*`` and ``lm_head.weight``,
its config flat; read through aliases onto the same rules. MaxText's scripts take only the wrapper's names.)

The text decoder of ``Llama4ForConditionalGeneration``, stored as the hub ships it (``language_model.model.*``,
``language_model.lm_head.weight``; its config in ``text_config``). As MaxText 0.2.5's Llama 4 scripts write
it from hub files (``llama4_ckpt_unscanned.py``; scanned, ``llama_or_mistral_ckpt.py --huggingface-checkpoint``):

- attention kernels are only reshaped: HF's Llama 4 already rotates interleaved pairs (MaxText's RoPE), and
  MaxText scales queries at run time (``scale_query: False`` for llama4), so no permutation and no scaling;
- MoE layers (every ``interleave_moe_layer_step``-th: Scout all, Maverick every second) hold
  ``Llama4MoEBlock_0/MoeBlock_0`` (router ``gate``; experts ``wi_0``, ``wi_1``, ``wo``) and
  ``Llama4MoEBlock_0/shared_experts``; the others a dense ``mlp`` of ``intermediate_size_mlp``;
- the experts are stored fused, (experts, in, out) as MaxText holds them: ``experts.gate_up_proj``
  (experts, emb, 2 * mlp), gate first, is cut into ``wi_0`` and ``wi_1``; ``experts.down_proj`` is ``wo``.

Layers without RoPE (``no_rope_layers``: every ``no_rope_layer_interval``-th), the L2 q/k norm, chunked
attention and attention temperature tuning are run-time settings (no weights); the patterns of NoPE and MoE
layers must be the ones MaxText derives from its two intervals. Scanned, MaxText scans whole cycles of
``inhomogeneous_layer_cycle_interval`` layers (the least common multiple of the two intervals: 4 for both
releases) as ``decoder/layers/layers_{position}``, over the cycles (axis 1); a model whose layers are not
whole cycles converts unscanned only. The vision model and the projector are reported, not converted, unless
``--multimodal`` asks for them: then they convert as MaxText's unscanned script converts them (see VISION_RULES).

Meta's FP8 release (Llama-4-Maverick-17B-128E-Instruct-FP8) is read from its files and dequantised: compressed-
tensors FP8 with one scale per row (:class:`~ckptconv.families.inputs.FP8Channel`), its routed experts stored one
by one (see JOINS); MaxText 0.2.5 has no route for it.
"""

from __future__ import annotations

import math

from ckptconv.families.base import (
    GIB, JSON_NULL, Example, Family, LayerStack, LayoutError, MemoryExample, Output, Rule, Sizes, Synthetic, multimodal,
    rule, untied,
)
from ckptconv.families.decoder import KERNEL, KV_KERNEL, OUT_KERNEL, Q_KERNEL, TIED_NOTE, make_spec, read_attention
from ckptconv.families.inputs import FP8_CHANNEL, ExpertJoin
from ckptconv.families.quantized import read_quantization
from ckptconv.families.transforms import TakeRanges, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

TEXT = "language_model."
P = TEXT + "model.layers.{layer}."
DENSE, MOE = frozenset({"dense"}), frozenset({"moe"})
DECODER = DENSE | MOE  # the decoder's layer rules (the vision encoder's layers are stacks of their own)
BLOCK = "Llama4MoEBlock_0"
FP8_ONLY = "the FP8 release's experts, stored apart (not in a bf16 release)"
# experts.gate_up_proj (experts, emb, 2 * moe_mlp): gate the first half of the last axis, up the second
GATE = TakeRanges("gate_half", 2, "moe_mlp2", 0, "moe_mlp")
UP = TakeRanges("up_half", 2, "moe_mlp2", "moe_mlp", "moe_mlp")

RULES = (
    rule(P + "self_attn.q_proj.weight", ("self_attention", "query", "kernel"), ("q", "emb"), Q_KERNEL,
         kinds=DECODER),
    rule(P + "self_attn.k_proj.weight", ("self_attention", "key", "kernel"), ("kv", "emb"), KV_KERNEL,
         kinds=DECODER),
    rule(P + "self_attn.v_proj.weight", ("self_attention", "value", "kernel"), ("kv", "emb"), KV_KERNEL,
         kinds=DECODER),
    rule(P + "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), ("emb", "q"), OUT_KERNEL,
         kinds=DECODER),
    rule(P + "input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), ("emb",),
         kinds=DECODER),
    rule(P + "post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), ("emb",),
         kinds=DECODER),
    # dense layers
    rule(P + "feed_forward.gate_proj.weight", ("mlp", "wi_0", "kernel"), ("mlp", "emb"), KERNEL, kinds=DENSE),
    rule(P + "feed_forward.up_proj.weight", ("mlp", "wi_1", "kernel"), ("mlp", "emb"), KERNEL, kinds=DENSE),
    rule(P + "feed_forward.down_proj.weight", ("mlp", "wo", "kernel"), ("emb", "mlp"), KERNEL, kinds=DENSE),
    # MoE layers: router, fused routed experts, the shared expert (as wide as one routed expert)
    rule(P + "feed_forward.router.weight", (BLOCK, "MoeBlock_0", "gate", "kernel"), ("experts", "emb"), KERNEL,
         kinds=MOE),
    Rule(P + "feed_forward.experts.gate_up_proj", ("experts", "emb", "moe_mlp2"),
         (Output((BLOCK, "MoeBlock_0", "wi_0"), (GATE,)), Output((BLOCK, "MoeBlock_0", "wi_1"), (UP,))),
         when=lambda spec: not fp8(spec), kinds=MOE, note="the bf16 release's fused experts (not in an FP8 release)"),
    # the FP8 release: gate and up of each expert stored apart (JOINS), read as two (experts, emb, mlp) tensors
    rule(P + "feed_forward.experts.gate_proj", (BLOCK, "MoeBlock_0", "wi_0"), ("experts", "emb", "moe_mlp"),
         when=lambda spec: fp8(spec), kinds=MOE, note=FP8_ONLY),
    rule(P + "feed_forward.experts.up_proj", (BLOCK, "MoeBlock_0", "wi_1"), ("experts", "emb", "moe_mlp"),
         when=lambda spec: fp8(spec), kinds=MOE, note=FP8_ONLY),
    rule(P + "feed_forward.experts.down_proj", (BLOCK, "MoeBlock_0", "wo"), ("experts", "moe_mlp", "emb"),
         kinds=MOE),
    rule(P + "feed_forward.shared_expert.gate_proj.weight", (BLOCK, "shared_experts", "wi_0", "kernel"),
         ("moe_mlp", "emb"), KERNEL, kinds=MOE),
    rule(P + "feed_forward.shared_expert.up_proj.weight", (BLOCK, "shared_experts", "wi_1", "kernel"),
         ("moe_mlp", "emb"), KERNEL, kinds=MOE),
    rule(P + "feed_forward.shared_expert.down_proj.weight", (BLOCK, "shared_experts", "wo", "kernel"),
         ("emb", "moe_mlp"), KERNEL, kinds=MOE),
    rule(TEXT + "model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
    rule(TEXT + "model.norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    rule(TEXT + "lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL, when=untied,
         note=TIED_NOTE),
)

# --multimodal: the vision model and the projector, as MaxText's llama4_ckpt_unscanned.py converts them (its
# scanned script skips them; MaxText's Llama4VisionEncoder holds its layers unscanned either way): every
# linear transposed to (in, out), the attention kernels split by head, LayerNorm weight and bias as scale, bias
V, ENC = "vision_model.", ("vision_encoder", "Llama4VisionModel_0")
VL = V + "model.layers.{layer}."
VISION = frozenset({"vision"})
V_Q = (KERNEL[0], split_last("v_heads"))  # (v_emb, v_emb) -> (v_emb, v_heads, v_hd)
V_OUT = (KERNEL[0], split_first("v_heads"))  # (v_emb, v_emb) -> (v_heads, v_hd, v_emb)
V_BIAS = (split_last("v_heads"),)  # (v_emb,) -> (v_heads, v_hd)
ATTENTION = "self_attention_vision"
PIXEL_SHUFFLE = (*ENC, "Llama4VisionPixelShuffleMLP_0", "pixel_shuffle_mlp")


def _vision(hf: str, path: tuple[str, ...], shape: tuple[str, ...], steps: tuple = ()) -> Rule:
    return rule(hf, path, shape, steps, when=multimodal, kinds=VISION if "{layer}" in hf else None,
                note="vision model and projector (convert with --multimodal)")


def _vision_layer_rows() -> tuple[Rule, ...]:
    rows = []
    for proj, leaf in (("q", "query"), ("k", "key"), ("v", "value")):
        rows += [_vision(VL + f"self_attn.{proj}_proj.weight", (ATTENTION, leaf, "kernel"), ("v_emb", "v_emb"), V_Q),
                 _vision(VL + f"self_attn.{proj}_proj.bias", (ATTENTION, leaf, "bias"), ("v_emb",), V_BIAS)]
    rows += [_vision(VL + "self_attn.o_proj.weight", (ATTENTION, "out", "kernel"), ("v_emb", "v_emb"), V_OUT),
             _vision(VL + "self_attn.o_proj.bias", (ATTENTION, "out", "bias"), ("v_emb",))]
    for fc, shape in (("fc1", ("v_mlp", "v_emb")), ("fc2", ("v_emb", "v_mlp"))):
        mlp = ("Llama4VisionMLP_0", f"vit_encoder_layer_mlp_{fc}")
        rows += [_vision(VL + f"mlp.{fc}.weight", (*mlp, "kernel"), shape, KERNEL),
                 _vision(VL + f"mlp.{fc}.bias", (*mlp, "bias"), shape[:1])]
    for hf, leaf in (("input_layernorm", "input_layer_norm"), ("post_attention_layernorm", "post_attention_layer_norm")):
        rows += [_vision(VL + f"{hf}.weight", (leaf, "scale"), ("v_emb",)),
                 _vision(VL + f"{hf}.bias", (leaf, "bias"), ("v_emb",))]
    return tuple(rows)


VISION_RULES = (
    _vision(V + "class_embedding", (*ENC, "class_embedding"), ("v_emb",)),
    _vision(V + "positional_embedding_vlm", (*ENC, "positional_embedding_vlm"), ("v_pos", "v_emb")),
    _vision(V + "patch_embedding.linear.weight", (*ENC, "Llama4UnfoldConvolution_0", "vit_unfold_linear", "kernel"),
            ("v_emb", "v_patch"), KERNEL),
    _vision(V + "layernorm_pre.weight", (*ENC, "layernorm_pre", "scale"), ("v_emb",)),
    _vision(V + "layernorm_pre.bias", (*ENC, "layernorm_pre", "bias"), ("v_emb",)),
    _vision(V + "layernorm_post.weight", (*ENC, "layernorm_post", "scale"), ("v_emb",)),
    _vision(V + "layernorm_post.bias", (*ENC, "layernorm_post", "bias"), ("v_emb",)),
    *_vision_layer_rows(),
    _vision(V + "vision_adapter.mlp.fc1.weight", (*PIXEL_SHUFFLE, "vit_pixel_shuffle_mlp_fc1", "kernel"),
            ("v_proj_in", "v_mlp"), KERNEL),
    _vision(V + "vision_adapter.mlp.fc2.weight", (*PIXEL_SHUFFLE, "vit_pixel_shuffle_mlp_fc2", "kernel"),
            ("v_proj_out", "v_proj_in"), KERNEL),
    _vision("multi_modal_projector.linear_1.weight",
            ("vision_encoder", "Llama4MultiModalProjector_0", "vit_multi_modal_projector", "kernel"),
            ("emb", "v_out"), KERNEL),
)


VISION_DIMS = ("v_emb", "v_heads", "v_mlp", "v_layers", "v_patch", "v_pos", "v_proj_in", "v_proj_out", "v_out")


def read_vision(cfg: ConfigReader) -> dict[str, int]:
    """The vision model's dimensions (``vision_config``), which ``--multimodal`` converts; the rest run-time."""
    vision = cfg.nested("vision_config")
    vision.require("model_type", ("llama4_vision_model",), "llama4_vision_model")
    vision.require("hidden_act", ("gelu",), "gelu")
    vision.require("num_channels", (3,), 3)
    vision.require("multi_modal_projector_bias", (False,), False)  # a bias would be a tensor of its own
    vision.runtime("norm_eps", "pixel_shuffle_ratio", "vision_feature_layer", "vision_feature_select_strategy",
                   "initializer_range", "attention_dropout", "projector_dropout", "rope_theta", "rope_parameters")
    heads, hidden = vision.int("num_attention_heads", 16), vision.int("hidden_size", 768)
    if hidden % heads:
        vision.fail(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    patch, image = vision.int("patch_size", 14), vision.int("image_size", 448)
    return {"v_emb": hidden, "v_heads": heads, "v_mlp": vision.int("intermediate_size", 5632),
            "v_layers": vision.int("num_hidden_layers", 34), "v_patch": 3 * patch * patch,
            "v_pos": (image // patch) ** 2 + 1, "v_proj_in": vision.int("projector_input_dim", 4096),
            "v_proj_out": vision.int("projector_output_dim", 4096), "v_out": vision.int("vision_output_dim", 7680)}


def fp8(spec: ModelSpec) -> bool:
    """Meta's FP8 release (Llama-4-Maverick-17B-128E-Instruct-FP8): compressed-tensors FP8, one scale per row."""
    return spec.values.get("quantization") == FP8_CHANNEL


# The FP8 release stores the routed experts one by one, as nn.Linear weights (out, in) with their row scales
# (transformers swaps Llama4TextExperts for a list of Llama4TextMLP to quantise them): the (experts, in, out)
# tensors the rules read are read from them, transposed. Gate and up are read as two tensors, not as the bf16
# release's fused gate_up_proj cut in halves: a read of the fused tensor could not cut its last axis (the halves'
# split needs it whole), so it would take a whole expert (160 MiB at Maverick's widths) at once
JOINS = (
    ExpertJoin("feed_forward.experts.gate_proj", ("gate_proj.weight",), inner="feed_forward.experts.",
               transposed=True),
    ExpertJoin("feed_forward.experts.up_proj", ("up_proj.weight",), inner="feed_forward.experts.", transposed=True),
    ExpertJoin("feed_forward.experts.down_proj", ("down_proj.weight",), inner="feed_forward.experts.",
               in_parts=fp8, transposed=True),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    tied = cfg.bool("tie_word_embeddings", False)
    quantization = read_quantization(cfg, ("compressed-tensors",))
    if quantization not in (None, FP8_CHANNEL):
        cfg.nested("quantization_config").fail("only float-quantized FP8 (Meta's Maverick FP8 release) is "
                                               "supported for llama4")
    vision = dict.fromkeys(VISION_DIMS, 0)  # the text model alone: no vision model (--multimodal refused)
    if cfg.config.get("model_type") == "llama4":  # the multimodal wrapper: the decoder's config in text_config
        cfg.runtime("boi_token_index", "eoi_token_index", "image_token_index")
        vision = read_vision(cfg)
        text = cfg.nested("text_config")
        text.require("model_type", ("llama4_text",), "llama4_text")
        if text.bool("tie_word_embeddings", tied) != tied:
            text.fail(f"tie_word_embeddings={not tied} differs from the model's tie_word_embeddings={tied}")
    else:
        text = cfg
    text.require("hidden_act", ("silu",), "silu")
    text.require("attention_bias", (False,), False)
    text.rope()
    text.runtime("rms_norm_eps", "max_position_embeddings", "num_experts_per_tok", "use_qk_norm",
                 "attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale",
                 "cache_implementation", "for_llm_compressor", "layer_types")
    dims = read_attention(text)
    layers = text.int("num_hidden_layers")
    dims |= {"vocab": text.int("vocab_size"), "mlp": text.int("intermediate_size_mlp"),
             "moe_mlp": text.int("intermediate_size"), "experts": text.int("num_local_experts")}
    dims["moe_mlp2"] = 2 * dims["moe_mlp"]
    dims |= vision
    step, nope = text.int("interleave_moe_layer_step", 1), text.int("no_rope_layer_interval", 4)
    moe = [i for i in range(layers) if (i + 1) % step == 0]  # MaxText: determine_is_moe_layer
    if text.raw("moe_layers") is not None and text.raw("moe_layers") != moe:
        text.fail(f"moe_layers={_short(text.raw('moe_layers'))} is not every {step}-th layer "
                  f"(interleave_moe_layer_step={step}), the only pattern MaxText's llama4 decoder runs")
    ropes = [int((i + 1) % nope != 0) for i in range(layers)]  # MaxText: determine_is_nope_layer
    if text.raw("no_rope_layers") not in (None, [], ropes):
        text.fail(f"no_rope_layers={_short(text.raw('no_rope_layers'))} is not a NoPE layer every {nope} "
                  f"(no_rope_layer_interval={nope}), the only pattern MaxText's llama4 decoder runs")
    values = {"tie_word_embeddings": tied, "moe_layers": tuple(moe), "cycle": math.lcm(step, nope)}
    if quantization:
        values["quantization"] = quantization
    return make_spec(cfg, "llama4", dims, values, layers)


def _short(value: object) -> str:
    s = str(value)
    return s if len(s) <= 60 else s[:57] + "..."


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """``decoder/layers/layers_{p}`` over the cycles (scanned), else ``decoder/layers_{i}``; each layer dense
    or MoE by its index."""
    return _decoder_layout(spec, scan) + _vision_layout(spec)


def _vision_layout(spec: ModelSpec) -> tuple[LayerStack, ...]:
    """--multimodal: the vision encoder's layers, ``Llama4VisionEncoder_0/layers_{i}``, unscanned either way."""
    if not multimodal(spec):
        return ()
    if not spec.dim("v_layers"):
        raise LayoutError(f"model_type {spec.model_type} is the text model alone (no vision_config): "
                          "there is no vision model to convert (convert without --multimodal)")
    return tuple(LayerStack((*ENC, "Llama4VisionEncoder_0", f"layers_{i}"), (i,), False, kind="vision")
                 for i in range(spec.dim("v_layers")))


def _decoder_layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    moe, layers = spec.value("moe_layers"), spec.num_layers
    if not scan:
        return tuple(LayerStack(("decoder", f"layers_{i}"), (i,), False, kind="moe" if i in moe else "dense")
                     for i in range(layers))
    cycle = spec.value("cycle")
    if layers % cycle:
        raise LayoutError(f"num_hidden_layers={layers} is not a multiple of {cycle} (MaxText's "
                          "inhomogeneous_layer_cycle_interval for these NoPE and MoE intervals): its llama4 scan "
                          "holds whole cycles only (convert with --no-scan-layers)")
    return tuple(LayerStack(("decoder", "layers", f"layers_{p}"), tuple(range(p, layers, cycle)), True,
                            kind="moe" if p in moe else "dense") for p in range(cycle))


def synthetic_config(m: Sizes) -> dict:
    """Llama4ForConditionalGeneration's config.json as transformers writes it, with Scout's run-time settings
    (Llama 3.1 RoPE scaling, NoPE every 4th layer, L2 q/k norm); ``num_experts`` > 0 sets the experts,
    ``config_overrides`` e.g. Maverick's ``interleave_moe_layer_step: 2``. A two-layer vision model's config
    rides along (its tensors, written by transformers, convert with ``--multimodal``, else are reported);
    its widths differ from one another (hidden 32, MLP 128 = 4 x hidden as the pixel shuffle needs, projector
    48) so that a swapped axis cannot pass a shape check."""
    text = {"model_type": "llama4_text", "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "intermediate_size": m.moe_intermediate_size or m.intermediate_size // 2,
            "intermediate_size_mlp": m.intermediate_size, "num_local_experts": m.num_experts or 4,
            "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "no_rope_layer_interval": 4,
            "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": 1e-5, "use_qk_norm": True,
            "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
            "max_position_embeddings": 4096, "tie_word_embeddings": m.tie_word_embeddings,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                "original_max_position_embeddings": 64}}
    vision = {"model_type": "llama4_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 128, "image_size": 28, "patch_size": 14,
              "vision_output_dim": 48, "projector_input_dim": 48, "projector_output_dim": 48,
              "pixel_shuffle_ratio": 0.5, "hidden_act": "gelu", "norm_eps": 1e-5, "rope_theta": 10000}
    quantization = FP8_CONFIG if m.quantization == "fp8" else None
    if m.model_type == "llama4_text":
        return {**text, "architectures": ["Llama4ForCausalLM"], "torch_dtype": m.dtype,
                "quantization_config": quantization}
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
            "vision_config": vision, "boi_token_index": 3, "eoi_token_index": 4, "image_token_index": 5,
            "tie_word_embeddings": m.tie_word_embeddings, "torch_dtype": m.dtype, "quantization_config": quantization}


# quantization_config of Meta's Llama-4-Maverick-17B-128E-Instruct-FP8 (compressed-tensors): every nn.Linear in
# e4m3 with one scale per output row, activations quantised on the fly; attention, routers, the vision tower,
# the projector and lm_head left in bfloat16
FP8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": JSON_NULL,
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": JSON_NULL, "actorder": JSON_NULL, "block_structure": JSON_NULL,
                              "observer": JSON_NULL, "observer_kwargs": {}},
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": JSON_NULL, "actorder": JSON_NULL, "block_structure": JSON_NULL, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": ["re:.*self_attn.*", "re:.*router", "re:vision_model.*", "re:multi_modal_projector.*",
               "language_model.lm_head"],
    "kv_cache_scheme": JSON_NULL, "sparsity_config": {}, "global_compression_ratio": JSON_NULL, "version": "0.9.3",
}


MAVERICK = {"interleave_moe_layer_step": 2}
SMALL = {"num_experts": 4, "moe_intermediate_size": 32, "intermediate_size": 96, "tie_word_embeddings": False}
# Scout's widths (hidden 5120, 40 query / 8 KV heads of 128, expert MLP 8192, dense MLP 16384; a smaller vocabulary
# to keep the suite's disk use down), one cycle of Maverick's pattern (2 dense + 2 MoE layers) with 2 experts
WIDTHS = {"vocab_size": 32000, "hidden_size": 5120, "num_heads": 40, "num_kv_heads": 8, "head_dim": 128,
          "intermediate_size": 16384, "moe_intermediate_size": 8192, "tie_word_embeddings": False}
# the whole Scout release (48 layers of 16 experts, vocabulary 202048), planned from header-only files
SCOUT = {**WIDTHS, "vocab_size": 202048, "num_layers": 48, "num_experts": 16}
# Maverick's FP8 release at its widths (Scout's but 128 experts, MoE every second layer): one cycle with 2 experts
# stored one by one in e4m3 with row scales; and the whole release (48 layers, 128 experts) planned from headers
MAVERICK_FP8 = {**WIDTHS, "num_layers": 4, "num_experts": 2, "quantization": "fp8", "config_overrides": MAVERICK}
MAVERICK_FP8_FULL = {**SCOUT, "num_experts": 128, "quantization": "fp8", "config_overrides": MAVERICK}

SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("llama4-scout", {**SMALL, "num_layers": 4}),
                Example("llama4-maverick", {**SMALL, "num_layers": 8, "config_overrides": MAVERICK}),
                Example("llama4_text", {**SMALL, "model_type": "llama4_text", "num_layers": 4,
                                        "config_overrides": MAVERICK}),
                Example("llama4-scout-multimodal", {**SMALL, "num_layers": 4}, devices=16, multimodal=True)),
    logits=(Example("llama4-maverick", {**SMALL, "num_layers": 8, "config_overrides": MAVERICK}, devices=4),
            Example("llama4-scout-noscan", {**SMALL, "num_layers": 4}, scan=False, devices=4),
            Example("llama4-scout-multimodal", {**SMALL, "num_layers": 4}, devices=4, multimodal=True),
            Example("llama4_text", {**SMALL, "model_type": "llama4_text", "num_layers": 4,
                                    "config_overrides": MAVERICK}, devices=4)),
    hub_prefixes={"llama4_text": (TEXT, "")},
    memory=(MemoryExample("llama4-scout-widths", {**WIDTHS, "num_layers": 4, "num_experts": 2,
                                                  "config_overrides": MAVERICK},
                          devices=(16, 1), bound=int(1.5 * GIB), source_bytes=3 * GIB, full=SCOUT,
                          max_shard_bytes=5 * 10**9),
            MemoryExample("llama4-maverick-fp8-widths", MAVERICK_FP8, devices=(16, 1), bound=int(1.5 * GIB),
                          source_bytes=2 * GIB, full=MAVERICK_FP8_FULL, max_shard_bytes=5 * 10**9)),
)

FAMILY = Family(
    name="llama4",
    model_types=("llama4", "llama4_text"),
    decoder_block="llama4",
    rules=RULES + VISION_RULES,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    aliases=(("model.", TEXT + "model."), ("lm_head.", TEXT + "lm_head.")),  # llama4_text: Llama4ForCausalLM's names
    not_converted=lambda spec: () if multimodal(spec) else (("vision_model.", "vision tower"),
                                                               ("multi_modal_projector.", "multimodal projector")),
    joins=JOINS,
    encoders=("vision tower (vision_model.*)", "multimodal projector (multi_modal_projector.*)"),
)
