"""Qwen3-VL-MoE (``model_type: qwen3_vl_moe``; Qwen3-VL-30B-A3B, -235B-A22B): MaxText ``decoder_block: qwen3_moe``,
the text decoder, and with ``--multimodal`` the vision tower.

Qwen3-MoE's layer (:mod:`ckptconv.families.qwen3_moe`) inside Qwen3-VL's wrapper (:mod:`ckptconv.families.qwen3_vl`:
``model.language_model.*``, ``text_config``). The vision tower (``model.visual.*``) is Qwen3-VL's, tensor for tensor,
and MaxText 0.2.5 converts it with the same mapping and hooks (``QWEN3_VL``'s, for ``qwen3-vl-30b-a3b`` too): with
``--multimodal`` it takes :mod:`ckptconv.families.qwen3_vl`'s tower rules and its layout (unscanned only, as MaxText
runs the deepstack path); without, the tower is named in the report, not converted. The routed
experts are stored fused, as the releases ship them: ``experts.gate_up_proj`` (experts, emb, 2 * mlp), gate
first along the last axis, feeds ``wi_0`` and ``wi_1`` as they are; ``experts.down_proj`` (experts, mlp, emb)
is ``wo``. (transformers 5 holds them the other way round, (experts, 2 * mlp, emb) and (experts, emb, mlp),
and its ``save_pretrained`` writes that layout: such a checkpoint is refused by the shape check, naming the
tensor; MaxText 0.2.5 reads it wrong or not at all.)

MaxText's converter writes this model unscanned only (its scanned mapping names the experts one by one);
its model runs the text decoder scanned too, so ckptconv writes both, the scanned one MaxText's unscanned
output stacked on the scan axis. With ``--multimodal`` the layout is unscanned (:class:`UnscannedOnly`).
"""

from __future__ import annotations

from ckptconv.families.base import (
    MIB, Example, Family, MemoryExample, Output, Rule, Sizes, Synthetic, multimodal, rule,
)
from ckptconv.families.decoder import (
    GLOBAL_ROWS, KV_KERNEL, LAYER_NORM_ROWS, Q_KERNEL, QK_NORM_ROWS, L, attention_rows, decoder_config, make_spec,
)
from ckptconv.families.moe import moe_rows
from ckptconv.families.qwen3_moe import moe_config, read_moe_dims, widths_30b_a3b
from ckptconv.families.qwen3_vl import (
    ALIASES, TEXT, TOWER, VISION_RULES, layout, read_text, read_vision_dims, wrapper_config,
)
from ckptconv.families.transforms import TakeRanges
from ckptconv.read.spec import ConfigReader, ModelSpec

ROUTER = moe_rows("moe_block", "mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))[0]
FUSED_EXPERTS = (
    Rule(L + "mlp.experts.gate_up_proj", ("experts", "emb", "moe_mlp2"),
         (Output(("moe_block", "wi_0"), (TakeRanges("gate_half", 2, "moe_mlp2", 0, "moe_mlp"),)),
          Output(("moe_block", "wi_1"), (TakeRanges("up_half", 2, "moe_mlp2", "moe_mlp", "moe_mlp"),)))),
    rule(L + "mlp.experts.down_proj", ("moe_block", "wo"), ("experts", "moe_mlp", "emb")),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    text, tied = read_text(cfg, "qwen3_vl_moe_text")
    text.runtime("sliding_window", "num_experts_per_tok", "norm_topk_prob")
    dims = read_moe_dims(text) | read_vision_dims(cfg.nested("vision_config"), ("qwen3_vl_moe_vision", "qwen3_vl_moe"))
    dims["moe_mlp2"] = 2 * dims["moe_mlp"]
    return make_spec(cfg, "qwen3_vl_moe", dims, {"tie_word_embeddings": tied, "interleave_rope": False},
                     text.int("num_hidden_layers"))


def synthetic_config(m: Sizes) -> dict:
    return wrapper_config(m, "Qwen3VLMoeForConditionalGeneration", decoder_config(m, "", **moe_config(m)))


SMALL = {"tie_word_embeddings": False, "num_experts": 4, "moe_intermediate_size": 48}
SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("qwen3_vl_moe", {**SMALL, "num_layers": 3}, devices=16),
                Example("qwen3_vl_moe-multimodal", {**SMALL, "num_layers": 3}, devices=16, multimodal=True)),
    logits=(Example("qwen3_vl_moe", {**SMALL, "num_layers": 3}, devices=4),
            Example("qwen3_vl_moe-noscan", SMALL, scan=False, devices=4),
            Example("qwen3_vl_moe-multimodal", {**SMALL, "num_layers": 2}, scan=False, devices=4, multimodal=True)),
    # 4x the experts at the same widths: the same peak, with 16 devices and with 1
    memory=(MemoryExample("qwen3_vl_moe-experts", widths_30b_a3b(32), devices=(16, 1), fewer=widths_30b_a3b(8),
                          more_bytes=400 * MIB),),
    hub_prefixes={"qwen3_vl_moe": ("model.", TEXT)},
)

FAMILY = Family(
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe",),
    decoder_block="qwen3_moe",
    rules=attention_rows(Q_KERNEL, KV_KERNEL) + QK_NORM_ROWS + LAYER_NORM_ROWS + (ROUTER,) + FUSED_EXPERTS
    + GLOBAL_ROWS + VISION_RULES,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    aliases=ALIASES,
    not_converted=lambda spec: () if multimodal(spec) else TOWER,
    encoders=("vision tower",),
)
