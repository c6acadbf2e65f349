"""DeepSeek-V3 / R1 (``model_type: deepseek_v3``), Kimi-K2 (``kimi_k2``), DeepSeek-V2 / V2-Lite (``deepseek_v2``)
and DeepSeek-V3.2 (``deepseek_v32``): MaxText ``decoder_block: deepseek``.

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

The releases differ only in what their layers hold (``RELEASES``): DeepSeek-V2 has no query low-rank
path in its Lite size (``q_lora_rank: null``: ``q_proj`` to ``self_attention/query``) and routes by
softmax without a router bias (MaxText ``deepseek2-16b``: ``routed_bias: false``), so there is no
``gate/bias`` leaf; DeepSeek-V3.2 adds the lightning indexer to every layer's attention
(``self_attention/indexer/{wq_b, wk, k_norm, weights_proj}``; its ``wq_b`` and ``wk`` FP8 in the
release, dequantised like every other linear layer, ``k_norm`` a LayerNorm with a bias).
"""

from __future__ import annotations

import json

from ckptconv.families.base import (
    GIB, JSON_NULL, MIB, Example, Family, LayerStack, MemoryExample, Output, Rule, Sizes, Synthetic, rule,
)
from ckptconv.families.decoder import KERNEL, L, LAYER_NORM_ROWS, OUT_KERNEL, make_spec
from ckptconv.families.inputs import FP8_KEPT
from ckptconv.families.moe import read_experts
from ckptconv.families.quantized import read_quantization
from ckptconv.families.transforms import TRANSPOSE, Regroup, Split, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

DENSE, MOE = frozenset({"dense"}), frozenset({"moe"})


def _lora_query(spec: ModelSpec) -> bool:
    return spec.value("q_lora")


def _plain_query(spec: ModelSpec) -> bool:
    return not spec.value("q_lora")


def _router_bias(spec: ModelSpec) -> bool:
    return spec.value("router_bias")


def _indexer(spec: ModelSpec) -> bool:
    return spec.value("indexer")


# What each release's layers hold beyond the common MLA + MoE, and transformers' defaults for the fields
# its config.json may leave out (DeepseekV2Config: no dense layers, 2 shared experts, no MTP layer).
RELEASES: dict[str, dict] = {
    "deepseek_v2": {"router_bias": False, "indexer": False, "first_k_dense_replace": 0, "n_shared_experts": 2,
                    "num_nextn_predict_layers": 0},
    "deepseek_v3": {"router_bias": True, "indexer": False, "first_k_dense_replace": 3, "n_shared_experts": 1,
                    "num_nextn_predict_layers": 1},
    "kimi_k2": {"router_bias": True, "indexer": False, "first_k_dense_replace": 3, "n_shared_experts": 1,
                "num_nextn_predict_layers": 1},
    "deepseek_v32": {"router_bias": True, "indexer": True, "first_k_dense_replace": 3, "n_shared_experts": 1,
                     "num_nextn_predict_layers": 1},
}


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
    # DeepSeek-V3.2's lightning indexer (MaxText's Indexer: wq_b (q_lora, heads, dim), wk, a LayerNorm, weights_proj)
    rule(L + "self_attn.indexer.wq_b.weight", (ATTENTION, "indexer", "wq_b", "kernel"), ("index_q", "q_lora"),
         (TRANSPOSE, split_last("index_heads")), when=_indexer, note="indexer of a model without one"),
    rule(L + "self_attn.indexer.wk.weight", (ATTENTION, "indexer", "wk", "kernel"), ("index_hd", "emb"), KERNEL,
         when=_indexer, note="indexer of a model without one"),
    rule(L + "self_attn.indexer.k_norm.weight", (ATTENTION, "indexer", "k_norm", "scale"), ("index_hd",),
         when=_indexer, note="indexer of a model without one"),
    rule(L + "self_attn.indexer.k_norm.bias", (ATTENTION, "indexer", "k_norm", "bias"), ("index_hd",),
         when=_indexer, note="indexer of a model without one"),
    rule(L + "self_attn.indexer.weights_proj.weight", (ATTENTION, "indexer", "weights_proj", "kernel"),
         ("index_heads", "emb"), KERNEL, when=_indexer, note="indexer of a model without one"),
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
         (Output(("DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"), layer_axis=0),), kinds=MOE,
         when=_router_bias, note="router bias of a model routing without one (DeepSeek-V2: softmax scores)"),
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

# An FP8 release converted with --dtype float8_e4m3fn (the plan makes its scheme FP8_KEPT): its e4m3 weights are
# written as stored, and each weight_scale_inv beside its kernel (kernel -> kernel_scale, an expert's wi_0 ->
# wi_0_scale), where MaxText 0.2.5's training loader (checkpointing.load_params_from_path) restores it and
# dequantises the kernel (maybe_dequantize_restored_params). Its model declares no scale leaves, so this is the
# only loader that reads them; MaxText's own converter writes none (its mapping names no weight_scale_inv).
FP8_WEIGHTS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b",
               "indexer.wk", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "shared_experts.gate_proj",
               "shared_experts.up_proj", "shared_experts.down_proj", "}.gate_proj", "}.up_proj", "}.down_proj")
BLOCK = 128  # the releases' weight_block_size, both axes


def _kept(spec: ModelSpec) -> bool:
    return spec.values.get("quantization") == FP8_KEPT


def _scale_rule(weight: Rule) -> Rule:
    """The block scales of an FP8 weight rule -> the leaf beside its kernel: each axis regrouped onto the grid
    MaxText's loader dequantises by (:class:`~ckptconv.families.transforms.Regroup`; the heads the weight's steps
    split an axis into are that axis' parts), then the weight's own steps."""
    out = weight.outputs[0]
    splits = {s.axis: s.outer for s in out.steps if isinstance(s, Split)}  # on the transposed (MaxText) kernel
    rows, cols = weight.hf_shape
    # HF rows are the kernel's last axis (split_last), HF columns its first (split_first)
    regroup = (Regroup(f"regroup_{rows}", 0, rows, splits.get(-1)), Regroup(f"regroup_{cols}", 1, cols, splits.get(0)))
    leaf = out.path[-1]
    path = (*out.path[:-1], "kernel_scale" if leaf == "kernel" else f"{leaf}_scale")
    return Rule(weight.hf + "_scale_inv", (f"{rows}_blocks", f"{cols}_blocks"), (Output(path, regroup + out.steps),),
                lambda spec, w=weight.when: _kept(spec) and w(spec), weight.kinds,
                "block scales of an FP8 release converted dequantised")


SCALE_ROWS = tuple(_scale_rule(r) for r in ROWS if r.hf.removesuffix(".weight").endswith(FP8_WEIGHTS))
BLOCKED = ("q", "q_lora", "emb", "kv_a", "kv_lora", "kv_b", "o", "mlp", "moe_mlp", "shared_mlp", "index_q", "index_hd")


def read_spec(cfg: ConfigReader) -> ModelSpec:
    release = RELEASES[cfg.config["model_type"]]
    cfg.require("hidden_act", ("silu",), "silu")
    cfg.require("mlp_bias", (False,), False)  # transformers 5's DeepseekV2Config / DeepseekV32Config
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
    shared = cfg.count("n_shared_experts", release["n_shared_experts"])
    if not shared:
        cfg.fail("n_shared_experts=0: MaxText's deepseek decoder always has shared experts")
    dims = {"vocab": cfg.int("vocab_size"), "emb": cfg.int("hidden_size"), "heads": heads, "mlp": cfg.int("intermediate_size"),
            "q": heads * (nope + rope), "kv_a": kv_lora + rope, "kv_lora": kv_lora, "kv_b": heads * (nope + v),
            "o": heads * v, "moe_mlp": moe_mlp, "shared_mlp": shared * moe_mlp,
            "experts": read_experts(cfg, ("n_routed_experts",)), "q_lora": q_lora}
    index_heads = index_hd = 0  # no indexer (the inactive rules' shapes, for the report)
    if release["indexer"]:
        if not q_lora:
            cfg.fail("the indexer reads the query latent: q_lora_rank must be set")
        index_heads, index_hd = cfg.int("index_n_heads", 64), cfg.int("index_head_dim", 128)
        cfg.runtime("index_topk")
    dims |= {"index_heads": index_heads, "index_hd": index_hd, "index_q": index_heads * index_hd}
    dims |= {f"{d}_blocks": -(-dims[d] // BLOCK) for d in BLOCKED}  # an FP8 release's scale grids
    layers = cfg.int("num_hidden_layers")
    # transformers' defaults, as for every missing field
    dense = cfg.count("first_k_dense_replace", release["first_k_dense_replace"])
    if dense > layers:
        cfg.fail(f"first_k_dense_replace={dense} exceeds num_hidden_layers={layers}")
    _check_layer_kinds(cfg, layers, dense, release["indexer"])
    mtp = cfg.count("num_nextn_predict_layers", release["num_nextn_predict_layers"])
    values = {"tie_word_embeddings": False, "q_lora": bool(q_lora), "dense_layers": dense, "mtp_layers": mtp,
              "router_bias": release["router_bias"], "indexer": release["indexer"],
              "quantization": read_quantization(cfg, ("fp8", "compressed-tensors"))}
    return make_spec(cfg, cfg.config["model_type"], dims, values, layers)


def _check_layer_kinds(cfg: ConfigReader, layers: int, dense: int, indexer: bool) -> None:
    """transformers 5's DeepseekV32Config writes what each layer is (``mlp_layer_types``, ``layer_types``): they
    must be what the layout assumes, the first ``first_k_dense_replace`` dense and every one indexed."""
    expected = {"mlp_layer_types": (["dense"] * dense + ["sparse"] * (layers - dense),
                                    f"{dense} 'dense' then 'sparse' (first_k_dense_replace={dense})")}
    if indexer:
        expected["layer_types"] = (["indexed_attention"] * layers, "'indexed_attention' in every layer")
    for name, (kinds, meaning) in expected.items():
        if cfg.has(name) and cfg.config[name] != kinds:
            cfg.fail(f"{name} must be {meaning} for {layers} layers, got {str(cfg.config[name])[:80]}")
        cfg.runtime(name)


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


# How each release's config.json differs from DeepSeek-V3's (the hub's files; MaxText's hf_model_configs copies)
RELEASE_CONFIGS: dict[str, dict] = {
    # DeepSeek-V2-Lite: queries without LoRA (null, as the hub writes it), softmax top-k routing, 2 shared experts
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": JSON_NULL, "n_shared_experts": 2,
                    "topk_method": "greedy", "scoring_func": "softmax", "routed_scaling_factor": 1.0,
                    "norm_topk_prob": False, "seq_aux": True, "aux_loss_alpha": 0.001,
                    "num_nextn_predict_layers": None},
    # DeepSeek-V3.2: the lightning indexer (its head count and width scaled down with the model's)
    "deepseek_v32": {"architectures": ["DeepseekV32ForCausalLM"], "index_n_heads": 4, "index_head_dim": 16,
                     "index_topk": 2048},
}


# DeepSeek-V3.2's release stores power-of-two block scales (still float32 tensors)
FP8_SCALES = {"deepseek_v32": {"scale_fmt": "ue8m0"}}


def synthetic_config(m: Sizes) -> dict:
    """DeepSeek-V3's config.json with small sizes (MLA ranks scaled down; one dense layer first), changed as
    each release's is (``RELEASE_CONFIGS``); ``fp8``: its release's quantization_config; ``int4``:
    Kimi-K2-Thinking's."""
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
        **RELEASE_CONFIGS.get(m.model_type, {}),
    }
    if m.quantization == "fp8":
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128], **FP8_SCALES.get(m.model_type, {})}
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


# DeepSeek-V2-Lite at its released widths (hidden 2048, 16 heads of 128 + 64 RoPE, kv_lora 512, MLP 10944, 64 experts
# of 1408, 2 shared, vocab 102400); the memory case holds its dense layer and three MoE layers (4.2 GiB: enough
# chunks for the OCDBT node cache the whole release fills), ``full`` all 27
V2_LITE = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "num_heads": 16, "head_dim": 128,
           "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_experts": 64,
           "config_overrides": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_experts_per_tok": 6,
                                "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 40.0, "mscale": 0.707,
                                                 "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                                 "type": "yarn"}, "max_position_embeddings": 163840}}
# DeepSeek-V3.2's FP8 release at its layer widths (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, the indexer's
# 64 heads of 128, MLP 18432, experts of 2048; a smaller vocabulary): one dense and one MoE layer with 8 experts;
# ``full``: the whole release (61 layers, 256 experts, vocab 129280, its MTP layer) planned from headers
V32_WIDTHS = {"model_type": "deepseek_v32", "quantization": "fp8", "vocab_size": 16384, "hidden_size": 7168,
              "num_heads": 128, "head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
              "num_experts": 8,
              "config_overrides": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                   "index_n_heads": 64, "index_head_dim": 128, "num_experts_per_tok": 8}}
V32_FULL = {**V32_WIDTHS, "vocab_size": 129280, "num_layers": 61, "num_experts": 256,
            "config_overrides": {**V32_WIDTHS["config_overrides"], "first_k_dense_replace": 3,
                                 "num_nextn_predict_layers": 1}}

SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("deepseek_v3", {"num_layers": 3, **MOE}),  # 1 dense, 2 MoE layers
                Example("deepseek_v2", {"model_type": "deepseek_v2", "num_layers": 3, **MOE}),
                Example("deepseek_v32", {"model_type": "deepseek_v32", "num_layers": 3, **MOE})),
    logits=(Example("deepseek_v3", {"num_layers": 3, **MOE}, devices=4),
            Example("deepseek_v3-noscan", {"num_layers": 4, "num_experts": 8, "moe_intermediate_size": 32},
                    scan=False, devices=4),
            Example("deepseek_v2", {"model_type": "deepseek_v2", "num_layers": 3, **MOE}, devices=4),
            Example("deepseek_v32-noscan", {"model_type": "deepseek_v32", "num_layers": 3, **MOE}, scan=False)),
    # 8 vs 32 routed experts: the FP8 release's experts decoded read unit by read unit (FP8 bytes: 24 more
    # experts x 3 kernels x 2 layers x 2 MiB); Kimi-K2-Thinking's INT4 experts likewise (1.1 MiB each)
    memory=(MemoryExample("fp8-experts", _release_widths("deepseek_v3", "fp8", 32),
                          fewer=_release_widths("deepseek_v3", "fp8", 8), more_bytes=250 * MIB),
            MemoryExample("int4-experts", _release_widths("kimi_k2", "int4", 32),
                          fewer=_release_widths("kimi_k2", "int4", 8), more_bytes=140 * MIB),
            MemoryExample("deepseek-v2-lite", {**V2_LITE, "num_layers": 4}, bound=int(1.5 * GIB),
                          source_bytes=4 * GIB, full={**V2_LITE, "num_layers": 27}, max_shard_bytes=5 * 10**9),
            MemoryExample("deepseek-v3.2-fp8", {**V32_WIDTHS, "num_layers": 2},
                          bound=int(1.5 * GIB), source_bytes=int(1.4 * GIB), full=V32_FULL,
                          max_shard_bytes=5 * 10**9)),
)

FAMILY = Family(
    name="deepseek",
    model_types=("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v32"),
    decoder_block="deepseek",
    rules=ROWS + SCALE_ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    not_converted=not_converted,
)
