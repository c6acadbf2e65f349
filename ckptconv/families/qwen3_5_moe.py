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
  with its last two axes swapped.

Scanned, MaxText scans whole periods as ``decoder/layers/layer_{position}`` over the periods (axis 1);
its scan holds only whole periods (the layers after the last would be dropped), so such a model
converts unscanned only. mRoPE sections and the vision settings are recorded, not used (text
positions make mRoPE plain RoPE). The vision tower (``model.visual.*``) and the multi-token-prediction
layer (``mtp.*``) are not part of MaxText's text decoder and are named in the report.
"""

from __future__ import annotations

from ckptconv.families.base import Family, LayerStack, LayoutError, Output, Rule, rule
from ckptconv.families.decoder import make_spec
from ckptconv.families.inputs import Join
from ckptconv.families.qwen3_next import (
    FULL_KIND, LINEAR_KIND, MTP_NOTE, global_rows, layer_rows, read_hybrid, refuse_quantized, unscanned_layout,
)
from ckptconv.families.transforms import Permute, TakePart
from ckptconv.read.spec import ConfigReader, ModelSpec

PREFIX = "model.language_model.layers.{layer}."
SWAP_LAST = Permute("swap_last_two", (0, 2, 1))  # HF (experts, out, in) -> MaxText (experts, in, out)
GATE, UP = TakePart("gate_part", 1, 0, 2), TakePart("up_part", 1, 1, 2)

FUSED_EXPERTS = (
    Rule(PREFIX + "mlp.experts.gate_up_proj", ("experts", "moe_mlp2", "emb"),
         (Output(("mlp", "routed_experts", "wi_0"), (GATE, SWAP_LAST)),
          Output(("mlp", "routed_experts", "wi_1"), (UP, SWAP_LAST)))),
    rule(PREFIX + "mlp.experts.down_proj", ("mlp", "routed_experts", "wo"), ("experts", "emb", "moe_mlp"),
         (SWAP_LAST,)),
)
JOINS = (
    Join("linear_attn.in_proj_qkvz.weight", (("linear_attn.in_proj_qkv.weight", ("k_dim", "k_dim", "v_dim")),
                                             ("linear_attn.in_proj_z.weight", ("v_dim",))), "k_heads"),
    Join("linear_attn.in_proj_ba.weight", (("linear_attn.in_proj_b.weight", ("v_heads",)),
                                           ("linear_attn.in_proj_a.weight", ("v_heads",))), "k_heads"),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    refuse_quantized(cfg)  # the release's quantization_config sits beside text_config
    cfg.runtime("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_config")
    tied = cfg.bool("tie_word_embeddings", False)
    text = cfg.nested("text_config")
    text.require("model_type", ("qwen3_5_moe_text",), "qwen3_5_moe_text")
    if text.bool("tie_word_embeddings", tied) != tied:
        text.fail(f"tie_word_embeddings={not tied} differs from the model's tie_word_embeddings={tied}")
    dims, layers, period = read_hybrid(text)
    dims["moe_mlp2"] = 2 * dims["moe_mlp"]
    return make_spec(cfg, "qwen3_5_moe", dims, {"tie_word_embeddings": tied, "period": period}, layers)


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """``decoder/layers/layer_{p}`` over the periods (scanned), else ``decoder/layers_{i}``."""
    if not scan:
        return unscanned_layout(spec)
    period, layers = spec.value("period"), spec.num_layers
    if layers % period:
        raise LayoutError(f"num_hidden_layers={layers} is not a multiple of full_attention_interval={period}: "
                          "MaxText's qwen3_5 scan holds whole periods only (convert with --no-scan-layers)")
    return tuple(LayerStack(("decoder", "layers", f"layer_{p}"), tuple(range(p, layers, period)), True,
                            kind=FULL_KIND if p == period - 1 else LINEAR_KIND) for p in range(period))


FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe",),
    decoder_block="qwen3_5",
    rules=layer_rows(PREFIX, FUSED_EXPERTS) + global_rows("model.language_model."),
    read_spec=read_spec,
    layout=layout,
    not_converted=lambda spec: (("model.visual.", "vision tower"), ("mtp.", MTP_NOTE)),
    joins=JOINS,
)
