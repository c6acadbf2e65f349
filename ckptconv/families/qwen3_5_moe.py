"""Qwen3.5-MoE (``model_type: qwen3_5_moe``; Qwen3.5-35B-A3B, -397B-A17B): MaxText ``decoder_block: qwen3_5``.

The text decoder of a multimodal checkpoint (``model.language_model.*``, its config in
``text_config``): Qwen3-Next's hybrid layers (:mod:`ckptconv.families.qwen3_next`) with two storage
differences the rules absorb:

- the linear attention's input projections are stored separately (``in_proj_qkv``, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``); MaxText holds them fused and regrouped per key head, as Qwen3-Next
  stores them ([q|k|v|z] and [b|a]): each fused leaf is read from its parts (an
  :class:`~ckptconv.families.inputs.Join`), and export splits it back;
- each layer's routed experts are stored fused: ``experts.gate_up_proj`` (experts, 2 * mlp, emb),
  gate first, feeds ``wi_0`` and ``wi_1``; ``experts.down_proj`` (experts, emb, mlp) is ``wo``
  with its last two axes swapped (checkpoints that store them one by one, as the FP8 releases and
  transformers' ``save_pretrained`` do, are read stacked: an :class:`~ckptconv.families.inputs.ExpertJoin`).

The FP8 releases (``-FP8``: e4m3 linear layers, bfloat16 ``weight_scale_inv`` per 128x128 block) are
kept quantised, as MaxText's ``qwen3.5-*-fp8`` models hold them: the e4m3 values as shipped (exact
in bfloat16) and each block-scale grid, by rules of its own, as the weight's ``kernel_scale`` (experts:
``wi_0_scale``, ``wi_1_scale``, ``wo_scale``), through the steps MaxText's hooks give it (a transpose,
heads split out; in_proj_qkvz's joined and regrouped per key head like its weights). Export writes
the release's own files back. With ``--dtype float8_e4m3fn`` (MaxText's ``--save_dtype float8_e4m3fn``) the
weights are written e4m3 and every other leaf in the release's own dtype (:data:`ckptconv.dtypes.KEPT`).

Scanned, MaxText scans whole periods as ``decoder/layers/layer_{position}`` over the periods (axis 1);
its scan holds only whole periods (the layers after the last would be dropped), so such a model
converts unscanned only. mRoPE sections are recorded, not used (text positions make mRoPE plain RoPE). The
multi-token-prediction layer (``mtp.*``) is not part of MaxText's model and is named in the report.

The vision tower (``model.visual.*``) is Qwen3-VL's without the deepstack mergers (``deepstack_visual_indexes``
is empty). Without ``--multimodal`` it is named in the report; with it (MaxText's ``use_multimodal=true``) it is
converted by :mod:`ckptconv.families.qwen3_vl`'s tower rules under MaxText's own names for this model,
``vision_encoder/Qwen3_5MoeVisionEncoder_0`` and ``Qwen3_5MoeVisionProjector_0``. With no deepstack injection
MaxText runs this vision path scanned as well as unscanned, so both layouts stay; the tower's blocks are
``blocks_{i}`` in both (MaxText's tower is a plain loop).
"""

from __future__ import annotations

from ckptconv.families.base import (
    GIB, EXPERT, Example, Family, LayerStack, LayoutError, MemoryExample, Output, Rule, Sizes, Synthetic, multimodal,
    rule,
)
from ckptconv.families.decoder import KERNEL, KV_KERNEL, Q_KERNEL, make_spec
from ckptconv.families.inputs import FP8_KEPT, ExpertJoin, Join
from ckptconv.families.qwen3_next import (
    EXPERT_PROJECTIONS, FULL, FULL_KIND, LINEAR, LINEAR_KIND, MTP_NOTE, global_rows, layer_rows,
    read_hybrid, unscanned_layout,
)
from ckptconv.families.qwen3_next import synthetic_config as qwen3_next_config
from ckptconv.families.qwen3_vl import TOWER_NOTE, read_vision_dims, vision_rules, vision_stacks
from ckptconv.families.transforms import Permute, Step, TakeRanges
from ckptconv.read.spec import ConfigReader, ModelSpec

PREFIX = "model.language_model.layers.{layer}."
SWAP_LAST = Permute("swap_last_two", (0, 2, 1))  # HF (experts, out, in) -> MaxText (experts, in, out)
# gate_up_proj (experts, 2 * mlp, emb): gate the first half of axis 1, up the second (one period: read whole)
GATE = TakeRanges("gate_half", 1, "moe_mlp2", 0, "moe_mlp")
UP = TakeRanges("up_half", 1, "moe_mlp2", "moe_mlp", "moe_mlp")
BLOCK = 128  # the FP8 releases' weight_block_size, both axes
# MaxText 0.2.5's module names for Qwen3.5's tower (its QWEN3_5 mapping with use_multimodal)
ENCODER = ("vision_encoder", "Qwen3_5MoeVisionEncoder_0")
PROJECTOR = ("vision_encoder", "Qwen3_5MoeVisionProjector_0")
TOWER = ("model.visual.", "vision tower")
VISION_HEADS = "v_attn_heads"  # the tower's heads (v_heads: the linear attention's value heads)


def fp8(spec: ModelSpec) -> bool:
    return spec.values.get("quantization") == FP8_KEPT


FP8_ONLY = "block scales of an FP8 release, in a bfloat16 one"

# Read fused (the bfloat16 releases store them so; the FP8 ones one by one: ExpertJoin below)
FUSED_EXPERTS = (
    Rule(PREFIX + "mlp.experts.gate_up_proj", ("experts", "moe_mlp2", "emb"),
         (Output(("mlp", "routed_experts", "wi_0"), (GATE, SWAP_LAST)),
          Output(("mlp", "routed_experts", "wi_1"), (UP, SWAP_LAST)))),
    rule(PREFIX + "mlp.experts.down_proj", ("mlp", "routed_experts", "wo"), ("experts", "emb", "moe_mlp"),
         (SWAP_LAST,)),
)


def scale(weight: str, path: tuple[str, ...], blocks: tuple[str, ...], steps: tuple[Step, ...] = KERNEL,
          kinds: frozenset[str] | None = None) -> Rule:
    """The block scales of an FP8 weight (``weight_scale_inv``, (out / 128, in / 128)) -> its MaxText scale
    leaf, through the steps MaxText's hooks give the weight's scales (a transpose, heads split out)."""
    return rule(PREFIX + weight + "_scale_inv", path, blocks, steps, when=fp8, kinds=kinds, note=FP8_ONLY)


A, ATT, MLP = ("attention",), ("attention", "attention"), ("mlp",)
FP8_ROWS = (
    scale("linear_attn.in_proj_qkvz.weight", (*A, "in_proj_qkvz", "kernel_scale"), ("qkvz_b", "emb_b"), kinds=LINEAR),
    scale("linear_attn.out_proj.weight", (*A, "out_proj", "kernel_scale"), ("emb_b", "v_dim_b"), kinds=LINEAR),
    scale("self_attn.q_proj.weight", (*ATT, "query", "kernel_scale"), ("q_gate_b", "emb_b"), Q_KERNEL, FULL),
    scale("self_attn.k_proj.weight", (*ATT, "key", "kernel_scale"), ("kv_b", "emb_b"), KV_KERNEL, FULL),
    scale("self_attn.v_proj.weight", (*ATT, "value", "kernel_scale"), ("kv_b", "emb_b"), KV_KERNEL, FULL),
    scale("self_attn.o_proj.weight", (*ATT, "out", "kernel_scale"), ("emb_b", "q_b"), KERNEL, FULL),
    scale("mlp.shared_expert.gate_proj.weight", (*MLP, "shared_expert", "wi_0", "kernel_scale"),
          ("shared_mlp_b", "emb_b")),
    scale("mlp.shared_expert.up_proj.weight", (*MLP, "shared_expert", "wi_1", "kernel_scale"),
          ("shared_mlp_b", "emb_b")),
    scale("mlp.shared_expert.down_proj.weight", (*MLP, "shared_expert", "wo", "kernel_scale"),
          ("emb_b", "shared_mlp_b")),
) + tuple(scale(f"mlp.experts.{EXPERT}.{hf}.weight", (*MLP, "routed_experts", f"{mt}_scale"),
                tuple(f"{d}_b" for d in shape)) for hf, mt, shape in EXPERT_PROJECTIONS)

JOINS = (
    Join("linear_attn.in_proj_qkvz.weight", (("linear_attn.in_proj_qkv.weight", ("k_dim", "k_dim", "v_dim")),
                                             ("linear_attn.in_proj_z.weight", ("v_dim",))), "k_heads"),
    Join("linear_attn.in_proj_ba.weight", (("linear_attn.in_proj_b.weight", ("v_heads",)),
                                           ("linear_attn.in_proj_a.weight", ("v_heads",))), "k_heads"),
    # an FP8 release's scales, regrouped as the weights they scale (MaxText's concat_qkvz_scales_and_transpose)
    Join("linear_attn.in_proj_qkvz.weight_scale_inv",
         (("linear_attn.in_proj_qkv.weight_scale_inv", ("k_dim_b", "k_dim_b", "v_dim_b")),
          ("linear_attn.in_proj_z.weight_scale_inv", ("v_dim_b",))), "k_heads"),
    # the FP8 releases store the experts one by one (each with its scale: the expert scale rules)
    ExpertJoin("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), in_parts=fp8),
    ExpertJoin("mlp.experts.down_proj", ("down_proj.weight",), in_parts=fp8),
)
# the kernels an FP8 release quantises, by their dims: each must hold whole 128-blocks
BLOCKED = ("emb", "q_gate", "q", "kv", "k_dim", "v_dim", "shared_mlp", "moe_mlp")


def read_spec(cfg: ConfigReader) -> ModelSpec:
    quantization = read_fp8(cfg)
    cfg.runtime("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    tied = cfg.bool("tie_word_embeddings", False)
    text = cfg.nested("text_config")
    text.require("model_type", ("qwen3_5_moe_text",), "qwen3_5_moe_text")
    if text.bool("tie_word_embeddings", tied) != tied:
        text.fail(f"tie_word_embeddings={not tied} differs from the model's tie_word_embeddings={tied}")
    dims, layers, period = read_hybrid(text)
    if cfg.has("vision_config"):  # the tower's sizes, checked against its tensors under --multimodal
        vision = cfg.nested("vision_config")
        dims |= read_vision_dims(vision, ("qwen3_5_moe_vision", "qwen3_5_moe"), deepstack_default=(),
                                 heads=VISION_HEADS)
        if dims["v_deepstack"]:
            vision.fail("deepstack_visual_indexes must be empty: Qwen3.5's tower has no deepstack mergers "
                        "(MaxText 0.2.5 maps none)")
    dims["moe_mlp2"] = 2 * dims["moe_mlp"]
    dims |= {f"{d}_b": dims[d] // BLOCK for d in BLOCKED}
    dims["qkvz_b"] = dims["qkvz"] // BLOCK
    if quantization:
        uneven = [f"{d}={dims[d]}" for d in BLOCKED if dims[d] % BLOCK]
        per_group = (dims["k_dim"] // dims["k_heads"], dims["v_dim"] // dims["k_heads"])
        if uneven or any(size % BLOCK for size in per_group):
            cfg.fail(f"an FP8 release whose quantised kernels do not hold whole {BLOCK}-blocks "
                     f"({', '.join(uneven) or f'a key head group of {per_group}'}) is not supported")
    return make_spec(cfg, "qwen3_5_moe", dims, {"tie_word_embeddings": tied, "period": period,
                                                 "quantization": quantization}, layers)


def read_fp8(cfg: ConfigReader) -> str | None:
    """An FP8 release (128x128 block-scaled e4m3, as Qwen3.5-*-FP8 ship): kept quantised, as MaxText's
    ``qwen3.5-*-fp8`` models hold it; which modules it quantises is read from the tensors' dtypes."""
    if not cfg.has("quantization_config"):
        return None
    q = cfg.nested("quantization_config")
    q.require("quant_method", ("fp8",), None)
    q.require("fmt", ("e4m3",), "e4m3")
    q.require("weight_block_size", ([BLOCK, BLOCK],), None)
    q.runtime("activation_scheme", "modules_to_not_convert")
    return FP8_KEPT


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """The decoder's layers, and with ``--multimodal`` the tower's blocks (unscanned in both layouts)."""
    if not multimodal(spec):
        return decoder_layout(spec, scan)
    if "v_layers" not in spec.dims:
        raise LayoutError("--multimodal: this checkpoint's config.json has no vision_config; convert without "
                          "--multimodal")
    return decoder_layout(spec, scan) + vision_stacks(spec, ENCODER)


def decoder_layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """``decoder/layers/layer_{p}`` over the periods (scanned), else ``decoder/layers_{i}``."""
    if not scan:
        return unscanned_layout(spec)
    period, layers = spec.value("period"), spec.num_layers
    if layers % period:
        raise LayoutError(f"num_hidden_layers={layers} is not a multiple of full_attention_interval={period}: "
                          "MaxText's qwen3_5 scan holds whole periods only (convert with --no-scan-layers)")
    return tuple(LayerStack(("decoder", "layers", f"layer_{p}"), tuple(range(p, layers, period)), True,
                            kind=FULL_KIND if p == period - 1 else LINEAR_KIND) for p in range(period))


def synthetic_config(m: Sizes) -> dict:
    """Qwen3.5-MoE's config.json: Qwen3-Next's text decoder in ``text_config`` (transformers 5's spelling,
    mRoPE sections), a vision tower's settings beside it; ``quantization="fp8"``: its FP8 release."""
    text = qwen3_next_config(m)
    for key in ("architectures", "torch_dtype", "rope_theta", "partial_rotary_factor", "decoder_sparse_step",
                "intermediate_size", "tie_word_embeddings"):
        text.pop(key)
    text.update(model_type="qwen3_5_moe_text", attn_output_gate=True, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_interleaved": True, "mrope_section": [1, 1, 0]})
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": text,
              "vision_config": {"deepstack_visual_indexes": [], "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                "model_type": "qwen3_5_moe", "num_heads": 2, "num_position_embeddings": 64,
                                "out_hidden_size": m.hidden_size, "patch_size": 4},
              "tie_word_embeddings": m.tie_word_embeddings, "torch_dtype": m.dtype}
    if m.quantization == "fp8":  # the -FP8 release: e4m3 linear layers with bfloat16 128x128 block scales
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [BLOCK, BLOCK]}
    return config


# Qwen3.5-397B-A17B's widths (its published config.json), as SynthModel fields
WIDTHS_397B = {"vocab_size": 248320, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 2, "head_dim": 256,
               "moe_intermediate_size": 1024, "tie_word_embeddings": False,
               "config_overrides": {"linear_num_key_heads": 16, "linear_num_value_heads": 64,
                                    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                    "num_experts_per_tok": 10}}
SMALL = {"num_experts": 4, "moe_intermediate_size": 32, "tie_word_embeddings": False}

SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("qwen3_5_moe", {**SMALL, "num_layers": 8}),
                Example("qwen3_5_moe-multimodal", {**SMALL, "num_layers": 4}, devices=16, multimodal=True)),
    logits=(Example("qwen3_5_moe", {**SMALL, "num_layers": 8}, devices=4),
            Example("qwen3_5_moe-noscan", {**SMALL, "num_layers": 4}, scan=False, devices=4),
            Example("qwen3_5_moe-multimodal", {**SMALL, "num_layers": 4}, devices=4, multimodal=True)),
    # one period at the 397B's widths with 16 of its 512 experts; the whole 60-layer release planned header-only
    memory=(MemoryExample("qwen3.5-397b-period", {**WIDTHS_397B, "num_layers": 4, "num_experts": 16},
                          devices=(16, 1), bound=int(1.5 * GIB), source_bytes=int(4.5 * GIB),
                          full={**WIDTHS_397B, "num_layers": 60, "num_experts": 512}, max_shard_bytes=5 * 10**9),),
)

FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe",),
    decoder_block="qwen3_5",
    rules=layer_rows(PREFIX, FUSED_EXPERTS + FP8_ROWS) + global_rows("model.language_model.")
    + vision_rules("model.visual.", ENCODER, PROJECTOR, TOWER_NOTE, deepstack=None, heads=VISION_HEADS),
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    not_converted=lambda spec: (("mtp.", MTP_NOTE),) if multimodal(spec) else (TOWER, ("mtp.", MTP_NOTE)),
    joins=JOINS,
    encoders=("vision tower",),
)
