"""DeepSeek-V3 / R1 (``model_type: deepseek_v3``) and Kimi-K2 (``kimi_k2``): MaxText ``decoder_block: deepseek``.

Multi-head latent attention: queries through a low-rank pair (``wq_a``, RMSNorm ``q_norm``,
``wq_b`` to (heads, nope + rope)); keys and values through ``wkv_a`` (to kv_lora + rope), RMSNorm
``kv_norm`` and ``wkv_b`` to (heads, nope + v). MaxText keeps the HF RoPE layout (its
``rope_interleave`` matches HF's), so kernels are only transposed and reshaped. The first
``first_k_dense_replace`` layers are dense (``decoder/dense_layers``), the rest MoE
(``decoder/moe_layers``: a sigmoid router with ``e_score_correction_bias`` as ``gate/bias``,
routed experts, and ``n_shared_experts`` shared ones as one wider MLP). The router bias is written
in the ``params`` collection, where every MaxText 0.2.5 loader finds it, not in the ``MoEBiasVar``
collection the model declares it in (see the rule).

The hub releases are FP8 with 128x128 block scales; they are dequantised per read unit as
MaxText's ``deepseek_dequantize.py`` does. Kimi-K2-Thinking ships its routed experts as
compressed-tensors INT4 (everything its ``ignore`` list names stays bfloat16), decoded per read
unit as compressed-tensors' decompressor does. The multi-token-prediction layers stored after the
last layer (``model.layers.{num_hidden_layers}.*``) are not part of MaxText's decoder (its
converter skips them too) and are named in the report.
"""

from __future__ import annotations

import json

from ckptconv.families.base import (
    MIB, Example, Family, LayerStack, MemoryExample, Output, Rule, Sizes, Synthetic, rule,
)
from ckptconv.families.decoder import KERNEL, L, LAYER_NORM_ROWS, OUT_KERNEL, make_spec
from ckptconv.families.moe import read_experts
from ckptconv.families.quantized import read_quantization
from ckptconv.families.transforms import TRANSPOSE, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

DENSE, MOE = frozenset({"dense"}), frozenset({"moe"})


def _lora_query(spec: ModelSpec) -> bool:
    return spec.value("q_lora")


def _plain_query(spec: ModelSpec) -> bool:
    return not spec.value("q_lora")


ATTENTION = "self_attention"
ROWS = LAYER_NORM_ROWS + (
    rule(L + "self_attn.q_a_proj.weight", (ATTENTION, "wq_a", "kernel"), ("q_lora", "emb"), KERNEL, when=_lora_query,
         note="query projection of a model without q_lora_rank"),
    rule(L + "self_attn.q_a_layernorm.weight", (ATTENTION, "q_norm", "scale"), ("q_lora",), when=_lora_query,
         note="query norm of a model without q_lora_rank"),
    rule(L + "self_attn.q_b_proj.weight", (ATTENTION, "wq_b", "kernel"), ("q", "q_lora"),
         (TRANSPOSE, split_last("heads")), when=_lora_query, note="query projection of a model without q_lora_rank"),
    rule(L + "self_attn.q_proj.weight", (ATTENTION, "query", "kernel"), ("q", "emb"), (TRANSPOSE, split_last("heads")),
         when=_plain_query, note="query projection of a model with q_lora_rank"),
    rule(L + "self_attn.kv_a_proj_with_mqa.weight", (ATTENTION, "wkv_a", "kernel"), ("kv_a", "emb"), KERNEL),
    rule(L + "self_attn.kv_a_layernorm.weight", (ATTENTION, "kv_norm", "scale"), ("kv_lora",)),
    rule(L + "self_attn.kv_b_proj.weight", (ATTENTION, "wkv_b", "kernel"), ("kv_b", "kv_lora"),
         (TRANSPOSE, split_last("heads"))),
    rule(L + "self_attn.o_proj.weight", (ATTENTION, "out", "kernel"), ("emb", "o"), OUT_KERNEL),
    # dense layers
    rule(L + "mlp.gate_proj.weight", ("mlp", "wi_0", "kernel"), ("mlp", "emb"), KERNEL, kinds=DENSE),
    rule(L + "mlp.up_proj.weight", ("mlp", "wi_1", "kernel"), ("mlp", "emb"), KERNEL, kinds=DENSE),
    rule(L + "mlp.down_proj.weight", ("mlp", "wo", "kernel"), ("emb", "mlp"), KERNEL, kinds=DENSE),
    # MoE layers
    rule(L + "mlp.shared_experts.gate_proj.weight", ("DeepSeekMoeBlock_0", "shared_experts", "wi_0", "kernel"),
         ("shared_mlp", "emb"), KERNEL, kinds=MOE),
    rule(L + "mlp.shared_experts.up_proj.weight", ("DeepSeekMoeBlock_0", "shared_experts", "wi_1", "kernel"),
         ("shared_mlp", "emb"), KERNEL, kinds=MOE),
    rule(L + "mlp.shared_experts.down_proj.weight", ("DeepSeekMoeBlock_0", "shared_experts", "wo", "kernel"),
         ("emb", "shared_mlp"), KERNEL, kinds=MOE),
    rule(L + "mlp.gate.weight", ("DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "kernel"), ("experts", "emb"), KERNEL,
         kinds=MOE),
    # MaxText's model declares the router bias a MoEBiasVar, but only its training loader looks in
    # that collection (and falls back to params); from_pretrained restores params/params only. So
    # it goes where both find it: under params, its layers stacked on axis 0 as the model stacks
    # a MoEBiasVar (not on param_scan_axis 1).
    Rule(L + "mlp.gate.e_score_correction_bias", ("experts",),
         (Output(("DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"), layer_axis=0),), kinds=MOE),
    rule(L + "mlp.experts.{expert}.gate_proj.weight", ("DeepSeekMoeBlock_0", "MoeBlock_0", "wi_0"), ("moe_mlp", "emb"),
         KERNEL, kinds=MOE),
    rule(L + "mlp.experts.{expert}.up_proj.weight", ("DeepSeekMoeBlock_0", "MoeBlock_0", "wi_1"), ("moe_mlp", "emb"),
         KERNEL, kinds=MOE),
    rule(L + "mlp.experts.{expert}.down_proj.weight", ("DeepSeekMoeBlock_0", "MoeBlock_0", "wo"), ("emb", "moe_mlp"),
         KERNEL, kinds=MOE),
    rule("model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
    rule("model.norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("hidden_act", ("silu",), "silu")
    cfg.require("attention_bias", (False,), False)
    cfg.require("tie_word_embeddings", (False,), False)  # MaxText's deepseek decoder has its own logits_dense
    cfg.require("moe_layer_freq", (1,), 1)
    cfg.require("pretraining_tp", (1,), 1)
    cfg.rope()
    cfg.require("rope_interleave", (True,), True)  # MaxText's MLA keeps HF's interleaved q/k RoPE layout
    cfg.runtime("rms_norm_eps", "max_position_embeddings", "num_experts_per_tok", "n_group", "topk_group",
                "topk_method", "routed_scaling_factor", "scoring_func", "norm_topk_prob", "seq_aux", "aux_loss_alpha",
                "ep_size", "head_dim", "qk_head_dim")
    heads = cfg.int("num_attention_heads")
    if cfg.int("num_key_value_heads", heads) != heads:
        cfg.fail("num_key_value_heads must equal num_attention_heads (multi-head latent attention)")
    nope, rope, v = cfg.int("qk_nope_head_dim"), cfg.int("qk_rope_head_dim"), cfg.int("v_head_dim")
    kv_lora = cfg.int("kv_lora_rank")
    # null or 0: queries without LoRA (DeepSeek-V2-Lite style); absent: transformers' default rank
    q_lora = cfg.count("q_lora_rank", 0) if "q_lora_rank" in cfg.config else cfg.count("q_lora_rank", 1536)
    moe_mlp = cfg.int("moe_intermediate_size")
    shared = cfg.count("n_shared_experts", 1)
    if not shared:
        cfg.fail("n_shared_experts=0: MaxText's deepseek decoder always has shared experts")
    dims = {"vocab": cfg.int("vocab_size"), "emb": cfg.int("hidden_size"), "heads": heads, "mlp": cfg.int("intermediate_size"),
            "q": heads * (nope + rope), "kv_a": kv_lora + rope, "kv_lora": kv_lora, "kv_b": heads * (nope + v),
            "o": heads * v, "moe_mlp": moe_mlp, "shared_mlp": shared * moe_mlp,
            "experts": read_experts(cfg, ("n_routed_experts",)), "q_lora": q_lora}
    layers = cfg.int("num_hidden_layers")
    dense = cfg.count("first_k_dense_replace", 3)  # transformers' defaults, as for every missing field
    if dense > layers:
        cfg.fail(f"first_k_dense_replace={dense} exceeds num_hidden_layers={layers}")
    mtp = cfg.count("num_nextn_predict_layers", 1)
    values = {"tie_word_embeddings": False, "q_lora": bool(q_lora), "dense_layers": dense, "mtp_layers": mtp,
              "quantization": read_quantization(cfg, ("fp8", "compressed-tensors"))}
    return make_spec(cfg, cfg.config["model_type"], dims, values, layers)


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """The dense layers, then the MoE layers, each stacked on its own (MaxText: dense_layers, moe_layers)."""
    dense, layers = spec.value("dense_layers"), spec.num_layers
    groups = (("dense_layers", "dense", range(dense)), ("moe_layers", "moe", range(dense, layers)))
    if scan:
        return tuple(LayerStack(("decoder", name), tuple(hf), True, kind=kind) for name, kind, hf in groups if hf)
    return tuple(LayerStack(("decoder", f"{name}_{n}"), (layer,), False, kind=kind)
                 for name, kind, hf in groups for n, layer in enumerate(hf))


def not_converted(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    return tuple((f"model.layers.{spec.num_layers + i}.", "multi-token prediction (MTP) layer")
                 for i in range(spec.value("mtp_layers")))


def synthetic_config(m: Sizes) -> dict:
    """DeepSeek-V3's config.json with small sizes (MLA ranks scaled down; one dense layer first); ``fp8``: its
    release's quantization_config; ``int4``: Kimi-K2-Thinking's."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": m.model_type, "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "moe_intermediate_size": m.moe_intermediate_size or m.intermediate_size // 2,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "n_routed_experts": m.num_experts or 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": m.head_dim, "qk_rope_head_dim": 8, "v_head_dim": m.head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 0, "torch_dtype": m.dtype,
    }
    if m.quantization == "fp8":
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128]}
    if m.quantization == "int4":
        config["quantization_config"] = json.loads(json.dumps(INT4_QUANTIZATION_CONFIG))
    return config


# Kimi-K2-Thinking's quantization_config: its routed experts in compressed-tensors INT4, the
# modules ``ignore`` names (attention, shared experts, dense MLPs, lm_head) in bfloat16.
INT4_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
MOE = {"num_experts": 4, "moe_intermediate_size": 32}


def _release_widths(model_type: str, quantization: str, experts: int) -> dict:
    """A DeepSeek-V3-shaped release (hidden 2048, MLA ranks 512/256, 1 dense + 2 MoE layers) as the hub stores it."""
    return {"model_type": model_type, "quantization": quantization, "vocab_size": 16384, "hidden_size": 2048,
            "num_layers": 3, "num_heads": 16, "head_dim": 128, "intermediate_size": 5632,
            "moe_intermediate_size": 1024, "num_experts": experts,
            "config_overrides": {"q_lora_rank": 512, "kv_lora_rank": 256, "qk_rope_head_dim": 64}}


SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("deepseek_v3", {"num_layers": 3, **MOE}),),  # 1 dense, 2 MoE layers
    logits=(Example("deepseek_v3", {"num_layers": 3, **MOE}, devices=4),
            Example("deepseek_v3-noscan", {"num_layers": 4, "num_experts": 8, "moe_intermediate_size": 32},
                    scan=False, devices=4)),
    # 8 vs 32 routed experts: the FP8 release's experts decoded read unit by read unit (FP8 bytes: 24 more
    # experts x 3 kernels x 2 layers x 2 MiB); Kimi-K2-Thinking's INT4 experts likewise (1.1 MiB each)
    memory=(MemoryExample("fp8-experts", _release_widths("deepseek_v3", "fp8", 32),
                          fewer=_release_widths("deepseek_v3", "fp8", 8), more_bytes=250 * MIB),
            MemoryExample("int4-experts", _release_widths("kimi_k2", "int4", 32),
                          fewer=_release_widths("kimi_k2", "int4", 8), more_bytes=140 * MIB)),
)

FAMILY = Family(
    name="deepseek",
    model_types=("deepseek_v3", "kimi_k2"),
    decoder_block="deepseek",
    rules=ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    not_converted=not_converted,
)
