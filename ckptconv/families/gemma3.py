"""Gemma 3 text decoder (``model_type: gemma3`` with ``text_config``, or ``gemma3_text``):
MaxText ``decoder_block: gemma3``.

Gemma 2's layer (four +1 norms) plus q/k RMSNorms (also +1); queries are scaled at run time
(MaxText's ``query_pre_attn_scalar``), so kernels are only reshaped. MaxText scans whole
blocks of the 5-local-1-global pattern: ``decoder/layers/layers_{0..5}`` over ``L // 6``
blocks and ``decoder/layers_remainder/layers_{r}`` for the rest. The embedding is scaled by
sqrt(hidden) rounded to bfloat16 (as MaxText's converter computes it) and cut to MaxText's
262144 rows (HF has 262208: the 64 extra rows are reported as not converted).

Hub checkpoints of ``Gemma3ForConditionalGeneration`` name the decoder
``language_model.model.*``, transformers >= 4.52 saves ``model.language_model.*``. The SigLIP vision
tower and the multimodal projector are not part of MaxText's text decoder: named in the report, or, with
``--multimodal`` (MaxText's ``use_multimodal=true``), converted as MaxText 0.2.5 does under
``vision_encoder/``: ``Gemma3VisionEncoderLayer_0`` (patch embedding as a (kh, kw, in, out) convolution,
positions with a leading axis of 1, every ``encoderblock_{i}`` unscanned whatever ``--scan-layers``, as
MaxText's vision encoder has no scan) and ``VisionEmbedder_0`` (the projector; its RMSNorm stored ``1 + w``).
The tower's names: the hub's ``vision_tower.vision_model.*``, transformers 4's ``model.vision_tower.vision_model.*``
and transformers >= 5.8's ``[model.]vision_tower.*`` (no ``vision_model``) are one tensor each.
"""

import ml_dtypes

from ckptconv.families.base import (
    GIB, Example, Family, LayerStack, LayoutError, MemoryExample, Output, Rule, Sizes, Synthetic, block_layout,
    multimodal, rule,
)
from ckptconv.families.decoder import KERNEL, Q_KERNEL, make_spec
from ckptconv.families.gemma import (
    GEMMA3_EMBEDDING, check_layer_types, global_rows, layer_rows, read_gemma_dims, synthetic_text_config,
)
from ckptconv.families.transforms import NORM_PLUS_ONE, TRANSPOSE, Permute, Split, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

MAXTEXT_VOCAB = 262144  # configs/models/gemma3-*.yml: vocab_size
PERIOD = 6
PATTERN = ("sliding_attention",) * 5 + ("full_attention",)
# transformers' Gemma3TextConfig defaults: hub configs rely on them (gemma-3-4b's text_config
# gives only hidden/intermediate sizes and the layer count).
TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}


def read_spec(cfg: ConfigReader) -> ModelSpec:
    if cfg.config.get("model_type") == "gemma3":
        cfg.runtime("boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image")
        cfg.require("tie_word_embeddings", (True,), True)
        text = cfg.nested("text_config")
        text.require("model_type", ("gemma3_text",), "gemma3_text")
        vision = read_vision_dims(cfg.nested("vision_config"))
    else:
        text, vision = cfg, {}
    dims = read_gemma_dims(text, TEXT_DEFAULTS)
    layers = text.int("num_hidden_layers", TEXT_DEFAULTS["num_hidden_layers"])
    text.require("sliding_window_pattern", (PERIOD,), PERIOD)
    text.require("_sliding_window_pattern", (PERIOD,), PERIOD)
    text.runtime("rope_local_base_freq", "query_pre_attn_scalar")  # Gemma 3 scales queries at run time
    check_layer_types(text, layers, PATTERN)
    dims["maxtext_vocab"] = MAXTEXT_VOCAB
    dims.update(vision)
    values = {"tie_word_embeddings": True,
              "embed_scale": float(ml_dtypes.bfloat16(dims["emb"] ** 0.5))}
    return make_spec(cfg, "gemma3", dims, values, layers)


# transformers' SiglipVisionConfig defaults (Gemma 3's releases give sizes, layers, heads, image and patch size)
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16}


def read_vision_dims(vision: ConfigReader) -> dict[str, int]:
    """The SigLIP tower's sizes (``v_*`` dims) from ``vision_config``: read whether or not ``--multimodal`` asks
    for the tower, so its tensors are checked against them when it does."""
    vision.require("model_type", ("siglip_vision_model",), "siglip_vision_model")
    vision.runtime("hidden_act", "layer_norm_eps", "vision_use_head")  # a head's tensors would be unexpected
    dims = {f"v_{key}": vision.int(field, VISION_DEFAULTS[field]) for key, field in (
        ("emb", "hidden_size"), ("mlp", "intermediate_size"), ("layers", "num_hidden_layers"),
        ("heads", "num_attention_heads"), ("channels", "num_channels"), ("patch", "patch_size"))}
    image = vision.int("image_size", VISION_DEFAULTS["image_size"])
    if dims["v_emb"] % dims["v_heads"]:
        vision.fail(f"hidden_size={dims['v_emb']} is not a multiple of num_attention_heads={dims['v_heads']}")
    if image % dims["v_patch"]:
        vision.fail(f"image_size={image} is not a multiple of patch_size={dims['v_patch']}")
    dims["v_positions"] = (image // dims["v_patch"]) ** 2  # one learned position per patch
    dims["one"] = 1  # MaxText's pos_embedding has a leading axis of 1 (broadcast over images)
    return dims


def synthetic_config(m: Sizes) -> dict:
    """``gemma3_text``: the decoder's own config; ``gemma3``: Gemma3ForConditionalGeneration's, the decoder
    in ``text_config`` beside a small vision tower's config."""
    text = synthetic_text_config(m, "gemma3_text")
    if m.model_type == "gemma3_text":
        return text
    for key in ("architectures", "torch_dtype"):
        text.pop(key)
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": {"hidden_size": 32, "image_size": 28, "intermediate_size": 64,
                              "model_type": "siglip_vision_model", "num_attention_heads": 2, "num_hidden_layers": 2,
                              "patch_size": 14, "vision_use_head": False},
            "boi_token_index": 3, "eoi_token_index": 4, "image_token_index": 5, "mm_tokens_per_image": 4,
            "torch_dtype": m.dtype}


# One RoPE for every layer in the tiny logit models (HF uses a local and a global one).
ONE_ROPE = {"rope_theta": 10000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None}
NORMS = ("norm.weight",)  # 1 + w, rounded to bfloat16 in the checkpoint: back within one bfloat16 step
SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("gemma3", {"num_layers": 8, "vocab_size": 96}, rounded=NORMS),  # a 6-layer block + 2
                Example("gemma3-multimodal", {"num_layers": 8, "vocab_size": 96}, rounded=NORMS, devices=16,
                        multimodal=True)),
    logits=(Example("gemma3_text", {"model_type": "gemma3_text", "num_layers": 8, "vocab_size": 96,
                                    "config_overrides": ONE_ROPE}, devices=4),
            Example("gemma3_text-noscan", {"model_type": "gemma3_text", "num_layers": 7, "vocab_size": 96,
                                           "config_overrides": ONE_ROPE}, scan=False, devices=4),
            Example("gemma3-multimodal", {"num_layers": 8, "vocab_size": 96, "config_overrides": ONE_ROPE},
                    devices=4, multimodal=True)),
    # Gemma 3 4B widths in the hub's form (hidden 2560, MLP 10240, head_dim 256, vocab 262208 scaled and cut)
    memory=(MemoryExample("gemma3-4b-widths", {
        "vocab_size": 262208, "hidden_size": 2560, "num_layers": 2, "num_heads": 8, "num_kv_heads": 4,
        "head_dim": 256, "intermediate_size": 10240}, bound=GIB, source_bytes=GIB),),
    hub_prefixes={"gemma3": ("model.", "language_model.model.")},
)

# --- the vision tower and projector (--multimodal), as MaxText 0.2.5's GEMMA3 mapping and hooks with use_multimodal
VISION_KIND = "vision"
VISION = frozenset({VISION_KIND})
VISION_ROOT = ("vision_encoder", "Gemma3VisionEncoderLayer_0")
V = "vision_tower.embeddings."
VL = "vision_tower.encoder.layers.{layer}."
VISION_QKV = (TRANSPOSE, split_last("v_heads"))  # (v_emb, v_emb) -> (v_emb, v_heads, head_dim)
VISION_BIAS = (split_last("v_heads"),)  # (v_emb,) -> (v_heads, head_dim)
PATCH_KERNEL = (Permute("conv_to_hwio", (2, 3, 1, 0)),)  # torch (out, in, kh, kw) -> flax (kh, kw, in, out)
ADD_IMAGE_AXIS = (Split("add_image_axis", 0, "one"),)  # (positions, v_emb) -> (1, positions, v_emb)
PROJECTOR_NOTE = "multimodal projector (convert --multimodal: MaxText use_multimodal=true)"
TOWER_NOTE = "vision tower (convert --multimodal: MaxText use_multimodal=true)"


def _vision(hf: str, maxtext: tuple[str, ...], hf_shape: tuple[str, ...], steps=(), note: str = TOWER_NOTE) -> Rule:
    per_layer = "{layer}" in hf
    return rule(hf, maxtext if per_layer else (*VISION_ROOT, *maxtext), hf_shape, steps, when=multimodal,
                kinds=VISION if per_layer else None, note=note)


def _vision_layer_rows() -> tuple[Rule, ...]:
    rows = [_vision(VL + f"{hf}.{part}", (f"LayerNorm_{i}", mx), ("v_emb",)) for i, hf in
            enumerate(("layer_norm1", "layer_norm2")) for part, mx in (("weight", "scale"), ("bias", "bias"))]
    for hf, mx in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        rows += [_vision(VL + f"self_attn.{hf}.weight", ("MultiHeadDotProductAttention_0", mx, "kernel"),
                         ("v_emb", "v_emb"), VISION_QKV),
                 _vision(VL + f"self_attn.{hf}.bias", ("MultiHeadDotProductAttention_0", mx, "bias"), ("v_emb",),
                         VISION_BIAS)]
    rows += [_vision(VL + "self_attn.out_proj.weight", ("MultiHeadDotProductAttention_0", "out", "kernel"),
                     ("v_emb", "v_emb"), (TRANSPOSE, split_first("v_heads"))),
             _vision(VL + "self_attn.out_proj.bias", ("MultiHeadDotProductAttention_0", "out", "bias"), ("v_emb",))]
    for hf, mx, shape in (("fc1", "Dense_0", ("v_mlp", "v_emb")), ("fc2", "Dense_1", ("v_emb", "v_mlp"))):
        rows += [_vision(VL + f"mlp.{hf}.weight", ("MlpBlockViT_0", mx, "kernel"), shape, KERNEL),
                 _vision(VL + f"mlp.{hf}.bias", ("MlpBlockViT_0", mx, "bias"), shape[:1])]
    return tuple(rows)


VISION_RULES = (
    _vision(V + "patch_embedding.weight", ("embedding", "kernel"), ("v_emb", "v_channels", "v_patch", "v_patch"),
            PATCH_KERNEL),
    _vision(V + "patch_embedding.bias", ("embedding", "bias"), ("v_emb",)),
    _vision(V + "position_embedding.weight", ("pos_embedding",), ("v_positions", "v_emb"), ADD_IMAGE_AXIS),
    _vision("vision_tower.post_layernorm.weight", ("Transformer", "encoder_norm", "scale"), ("v_emb",)),
    _vision("vision_tower.post_layernorm.bias", ("Transformer", "encoder_norm", "bias"), ("v_emb",)),
    Rule("multi_modal_projector.mm_input_projection_weight", ("v_emb", "emb"),
         (Output(("vision_encoder", "VisionEmbedder_0", "mm_input_projection", "w")),), multimodal,
         note=PROJECTOR_NOTE),
    Rule("multi_modal_projector.mm_soft_emb_norm.weight", ("v_emb",),
         (Output(("vision_encoder", "VisionEmbedder_0", "mm_soft_embedding_norm", "scale"), (NORM_PLUS_ONE,)),),
         multimodal, note=PROJECTOR_NOTE),
) + _vision_layer_rows()


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """The decoder's blocks (:func:`block_layout`), and with ``--multimodal`` the tower's layers, each its own
    ``encoderblock_{i}`` (MaxText's vision encoder is a plain loop, scanned or not)."""
    stacks = block_layout(PERIOD)(spec, scan)
    if not multimodal(spec):
        return stacks
    if "v_layers" not in spec.dims:
        raise LayoutError("--multimodal: a gemma3_text checkpoint (Gemma3ForCausalLM) has no vision tower; convert "
                          "without --multimodal")
    return stacks + tuple(LayerStack((*VISION_ROOT, "Transformer", f"encoderblock_{i}"), (i,), False,
                                     kind=VISION_KIND, encoder=True) for i in range(spec.dim("v_layers")))


def not_converted(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    if multimodal(spec):  # the rules read them
        return ()
    return tuple((prefix, what) for what, prefixes in (
        ("vision tower", ("vision_tower.", "model.vision_tower.")),
        ("multimodal projector", ("multi_modal_projector.", "model.multi_modal_projector."))) for prefix in prefixes)


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3", "gemma3_text"),
    decoder_block="gemma3",
    rules=layer_rows("model.layers.{layer}.", Q_KERNEL, qk_norms=True) + global_rows(GEMMA3_EMBEDDING) + VISION_RULES,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    # the tower's names with and without ``vision_model.`` (transformers >= 5.8 drops it) are one tensor
    aliases=(("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("vision_tower.vision_model.", "vision_tower."),
             ("model.vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector.")),
    not_converted=not_converted,
    encoders=("vision tower", "multimodal projector"),
)
