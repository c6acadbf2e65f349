"""Gemma 4 text decoder (``model_type: gemma4`` with ``text_config``, or ``gemma4_text``): MaxText
``decoder_block: gemma4`` (``gemma4-31b`` dense, ``gemma4-26b`` MoE).

What changes against Gemma 3 (MaxText 0.2.5's ``GEMMA4_*`` mapping and hooks):
- the RMSNorm scales are stored as used (Gemma 4 folds the ``1 +`` into its checkpoints): copied, not shifted;
- global (full-attention) layers have their own head dim (``global_head_dim``) and KV heads
  (``num_global_key_value_heads``) and, with ``attention_k_eq_v``, no ``v_proj`` (keys serve as values:
  MaxText's ``share_kv_projections`` holds no value kernel there); q/k norms are per layer's head dim;
- every layer ends with ``layer_scalar`` (1,);
- the embedding is scaled by float32 sqrt(hidden) (not rounded to bfloat16 first) and sized to MaxText's 262144;
- 26B-A4B: every layer has a routed MoE beside its dense MLP, which MaxText holds as the shared expert
  (``mlp/moe_block/shared_experts``); the router is ``router.proj`` (-> ``MoeBlock_0/gate``), ``router.scale``
  (-> ``mlp/pre_forward_scale_2``) and ``router.per_expert_scale`` (-> ``MoeBlock_0/per_expert_scale``); the
  experts are fused (``experts.gate_up_proj`` (experts, 2 * moe_mlp, emb), gate the first half); three more
  norms (``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_1`` / ``_2``) live under ``mlp``.

MaxText scans whole blocks of 5 sliding + 1 full layer as a nested scan: ``decoder/scanned_blocks/local_layers``
holds the local layers on axes (1, 2) as (blocks, 5), ``decoder/scanned_blocks/global_layer`` the global ones
on axis 1. MaxText runs layer ``i`` as global iff ``i % 6 == 5`` while transformers forces the last layer global,
so a layer count that is not a multiple of 6 is refused. The vision (and audio) towers are not part of MaxText's
text decoder and are named in the report; with ``--multimodal`` the vision tower and its projector are converted
as MaxText does (:mod:`ckptconv.families.gemma4_vision`; 26B-A4B and 31B only).

E2B / E4B (per-layer inputs, shared KV layers; MaxText's ``gemma4_small``, unscanned only) share the model type:
their rows, config checks and layout are :mod:`ckptconv.families.gemma4_small`'s, their layer kinds join the sets
below.
"""

import ckptconv.families.gemma4_small as small
import ckptconv.families.gemma4_vision as vision
from ckptconv.families.base import (
    GIB, Example, Family, LayerStack, MemoryExample, Output, Rule, Sizes, Synthetic, never, rule,
)
from ckptconv.families.decoder import KERNEL, KV_KERNEL, OUT_KERNEL, Q_KERNEL, TIED_NOTE, make_spec
from ckptconv.families.gemma import GEMMA3_EMBEDDING, check_layer_types, read_gemma_dims, synthetic_text_config
from ckptconv.families.moe import read_experts
from ckptconv.families.qwen3_5_moe import GATE, SWAP_LAST, UP
from ckptconv.families.transforms import TRANSPOSE, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

MAXTEXT_VOCAB = 262144  # configs/models/gemma4-*.yml: vocab_size
PERIOD = 6
PATTERN = ("sliding_attention",) * 5 + ("full_attention",)
# layer kinds: local or global attention, with a dense MLP (31B) or the MoE block (26B-A4B); E2B / E4B's kinds
# (per-layer inputs, own or shared keys and values, narrow or wide MLP) are gemma4_small's
OWN_KV_LOCAL = frozenset({"local", "local_moe"}) | small.OWN_KV_LOCAL
OWN_KV_GLOBAL = frozenset({"global", "global_moe"}) | small.OWN_KV_GLOBAL
LOCAL, GLOBAL = OWN_KV_LOCAL | small.LOCAL, OWN_KV_GLOBAL | small.GLOBAL
DENSE, MOE_KINDS = frozenset({"local", "global"}) | small.NARROW, frozenset({"local_moe", "global_moe"})
# transformers' Gemma4TextConfig defaults (the releases' configs give every field)
TEXT_DEFAULTS = {"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}
GLOBAL_KV_KERNEL = (TRANSPOSE, split_last("global_kv_heads"))  # (gkv, emb) -> (emb, global_kv_heads, ghd)

P = "model.layers.{layer}."


def _copy(hf: str, maxtext: tuple[str, ...], shape: tuple[str, ...], kinds: frozenset[str] | None = None) -> Rule:
    return rule(P + hf, maxtext, shape, kinds=kinds)


ATTENTION = (
    rule(P + "self_attn.q_proj.weight", ("self_attention", "query", "kernel"), ("q", "emb"), Q_KERNEL, kinds=LOCAL),
    rule(P + "self_attn.k_proj.weight", ("self_attention", "key", "kernel"), ("kv", "emb"), KV_KERNEL,
         kinds=OWN_KV_LOCAL),
    rule(P + "self_attn.v_proj.weight", ("self_attention", "value", "kernel"), ("kv", "emb"), KV_KERNEL,
         kinds=OWN_KV_LOCAL),
    rule(P + "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), ("emb", "q"), OUT_KERNEL, kinds=LOCAL),
    _copy("self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), ("hd",), LOCAL),
    _copy("self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), ("hd",), OWN_KV_LOCAL),
    rule(P + "self_attn.q_proj.weight", ("self_attention", "query", "kernel"), ("gq", "emb"), Q_KERNEL, kinds=GLOBAL),
    rule(P + "self_attn.k_proj.weight", ("self_attention", "key", "kernel"), ("gkv", "emb"), GLOBAL_KV_KERNEL,
         kinds=OWN_KV_GLOBAL),
    rule(P + "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), ("emb", "gq"), OUT_KERNEL, kinds=GLOBAL),
    _copy("self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), ("ghd",), GLOBAL),
    _copy("self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), ("ghd",), OWN_KV_GLOBAL),
)

NORMS = tuple(_copy(hf + ".weight", (maxtext, "scale"), ("emb",)) for hf, maxtext in (
    ("input_layernorm", "pre_self_attention_norm"), ("post_attention_layernorm", "post_self_attention_norm"),
    ("pre_feedforward_layernorm", "pre_ffw_norm"), ("post_feedforward_layernorm", "post_ffw_norm")))

DENSE_MLP = tuple(
    rule(P + f"mlp.{hf}.weight", ("mlp", maxtext, "kernel"), shape, KERNEL, kinds=DENSE)
    for hf, maxtext, shape in (("gate_proj", "wi_0", ("mlp", "emb")), ("up_proj", "wi_1", ("mlp", "emb")),
                               ("down_proj", "wo", ("emb", "mlp"))))

MOE_BLOCK = ("mlp", "moe_block", "MoeBlock_0")
MOE = tuple(
    rule(P + f"mlp.{hf}.weight", ("mlp", "moe_block", "shared_experts", maxtext, "kernel"), shape, KERNEL,
         kinds=MOE_KINDS)
    for hf, maxtext, shape in (("gate_proj", "wi_0", ("mlp", "emb")), ("up_proj", "wi_1", ("mlp", "emb")),
                               ("down_proj", "wo", ("emb", "mlp")))) + (
    rule(P + "router.proj.weight", (*MOE_BLOCK, "gate", "kernel"), ("experts", "emb"), KERNEL, kinds=MOE_KINDS),
    _copy("router.per_expert_scale", (*MOE_BLOCK, "per_expert_scale"), ("experts",), kinds=MOE_KINDS),
    _copy("router.scale", ("mlp", "pre_forward_scale_2"), ("emb",), kinds=MOE_KINDS),
    Rule(P + "experts.gate_up_proj", ("experts", "moe_mlp2", "emb"),
         (Output((*MOE_BLOCK, "wi_0"), (GATE, SWAP_LAST)), Output((*MOE_BLOCK, "wi_1"), (UP, SWAP_LAST))),
         kinds=MOE_KINDS),
    rule(P + "experts.down_proj", (*MOE_BLOCK, "wo"), ("experts", "emb", "moe_mlp"), (SWAP_LAST,), kinds=MOE_KINDS),
) + tuple(_copy(f"{norm}.weight", ("mlp", norm, "scale"), ("emb",), kinds=MOE_KINDS)
          for norm in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"))

ROWS = (ATTENTION + NORMS + DENSE_MLP + MOE + (_copy("layer_scalar", ("layer_scalar",), ("one",)),) + small.ROWS
        + small.UNREAD)

GLOBAL_ROWS = (
    # MaxText pads to its vocabulary, then scales (zero rows stay zero: the same as scaling first)
    rule("model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb"), GEMMA3_EMBEDDING),
    rule("model.norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL, when=never,
         note=TIED_NOTE),
) + small.GLOBAL_ROWS


def read_spec(cfg: ConfigReader) -> ModelSpec:
    if cfg.config.get("model_type") == "gemma4":
        cfg.runtime("audio_config", "audio_token_id", "boa_token_id", "boi_token_id", "eoa_token_id",
                    "eoa_token_index", "eoi_token_id", "image_token_id", "video_token_id",
                    "vision_soft_tokens_per_image")
        cfg.require("tie_word_embeddings", (True,), True)
        text = cfg.nested("text_config")
        text.require("model_type", ("gemma4_text",), "gemma4_text")
        tower, problem = vision.read_dims(cfg, small.is_small(text))
    else:
        text, tower, problem = cfg, {}, "a gemma4_text checkpoint (Gemma4ForCausalLM) has no vision tower"
    dims = read_gemma_dims(text, TEXT_DEFAULTS) | tower
    layers = text.int("num_hidden_layers", TEXT_DEFAULTS["num_hidden_layers"])
    if small.is_small(text):  # E2B / E4B
        values = small.read_small(text, dims, layers) | {vision.PROBLEM: problem}
        dims["ghd"] = _global_sizes(text, layers, values["small_period"], dims["kv_heads"])[0]
        return _finish(cfg, text, dims, layers, values)
    if layers % PERIOD:
        text.fail(f"num_hidden_layers={layers} is not a multiple of {PERIOD}: MaxText's gemma4 decoder runs layer i "
                  f"as full attention iff i % 6 == 5, transformers runs the last layer as full attention")
    check_layer_types(text, layers, PATTERN)
    text.require("attention_k_eq_v", (True,), False)  # the releases' global layers: keys serve as values
    text.require("num_kv_shared_layers", (0,), 0)
    text.require("hidden_size_per_layer_input", (0,), 0)
    text.require("use_double_wide_mlp", (False,), False)
    text.runtime("vocab_size_per_layer_input")  # read only with per-layer inputs (E2B/E4B)
    dims["ghd"], dims["global_kv_heads"] = _global_sizes(text, layers, PERIOD)
    if dims["heads"] % dims["global_kv_heads"]:
        text.fail(f"num_attention_heads={dims['heads']} is not a multiple of "
                  f"num_global_key_value_heads={dims['global_kv_heads']}")
    moe = text.bool("enable_moe_block", False)
    if moe:
        dims["experts"] = read_experts(text, ("num_experts",))
        if dims["experts"] < 2:
            text.fail(f"num_experts={dims['experts']}: MaxText's gemma4 MoE layer needs at least 2 experts")
        dims["moe_mlp"] = text.int("moe_intermediate_size")
        dims["moe_mlp2"] = 2 * dims["moe_mlp"]
        text.runtime("top_k_experts")
        # transformers 5.7 also prints expert_intermediate_size (null in the releases): set, it must agree
        expert = text.raw("expert_intermediate_size")
        if expert is not None and expert != dims["moe_mlp"]:
            text.fail(f"expert_intermediate_size={expert!r} differs from moe_intermediate_size={dims['moe_mlp']}: "
                      f"which one sizes the experts is unclear")
    else:  # transformers builds no MoE block without enable_moe_block, whatever these say (MaxText's copy of the
        # 31B config keeps 26B-A4B's moe_intermediate_size; transformers 5.7 prints expert_intermediate_size)
        text.runtime("num_experts", "top_k_experts", "moe_intermediate_size", "expert_intermediate_size")
    return _finish(cfg, text, dims, layers, {"moe": moe, vision.PROBLEM: problem})


def _finish(cfg: ConfigReader, text: ConfigReader, dims: dict[str, int], layers: int, values: dict) -> ModelSpec:
    dims["gq"], dims["gkv"] = dims["heads"] * dims["ghd"], dims["global_kv_heads"] * dims["ghd"]
    dims["one"] = 1
    dims["maxtext_vocab"] = MAXTEXT_VOCAB
    for name in ("ple", "ple_all", "ple_vocab"):  # the per-layer embedder's rows, inactive without per-layer inputs
        dims.setdefault(name, 0)
    # MaxText's hook: the bfloat16 weights times numpy float32 sqrt(hidden), rounded back
    values = {"tie_word_embeddings": True, "embed_scale": dims["emb"] ** 0.5, "moe": False, **values}
    return make_spec(cfg, "gemma4", dims, values, layers)


def _global_sizes(text: ConfigReader, layers: int, period: int, kv_heads: int | None = None) -> tuple[int, int]:
    """The global layers' head dim and KV heads: the releases' ``global_head_dim`` / ``num_global_key_value_heads``,
    or what transformers >= 5.24 saves instead, ``per_layer_config`` (layer index -> those two, for exactly the
    full-attention layers); both may be present and must agree. E2B / E4B (``kv_heads`` given: their global layers
    keep the local KV heads) hold the head dim alone."""
    sizes = set()
    fields = {"head_dim", "num_key_value_heads"} if kv_heads is None else {"head_dim"}
    if text.has("global_head_dim") or text.has("num_global_key_value_heads") or not text.has("per_layer_config"):
        global_kv = text.int("num_global_key_value_heads") if kv_heads is None else kv_heads
        sizes.add((text.int("global_head_dim", 512), global_kv))
    per_layer = text.raw("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict) or not all(isinstance(v, dict) for v in per_layer.values()):
            text.fail(f"field 'per_layer_config' = {repr(per_layer)[:80]} is not an object of objects")
        globals_ = {str(i) for i in range(period - 1, layers, period)}
        keys = {k.lstrip("0") or "0" for k in per_layer}
        if keys != globals_ or len(per_layer) != len(globals_):
            text.fail(f"field 'per_layer_config' names layers {sorted(per_layer)[:12]}, not the full-attention "
                      f"layers {sorted(globals_, key=int)[:12]}")
        for key, entry in per_layer.items():
            if set(entry) != fields:
                text.fail(f"field 'per_layer_config' [{key!r}] = {entry!r}: expected {' and '.join(sorted(fields))}")
            sizes.add((entry["head_dim"], entry.get("num_key_value_heads", kv_heads)))
    if len(sizes) != 1 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in next(iter(sizes))):
        text.fail(f"the global layers' (head_dim, num_key_value_heads) disagree or are not positive integers: "
                  f"{sorted(map(repr, sizes))}")
    return next(iter(sizes))


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """Unscanned ``decoder/layers_{i}``; scanned, the nested block scan (the layer count is whole blocks). E2B / E4B:
    unscanned only (gemma4_small). With ``--multimodal``, the vision tower's layers (gemma4_vision)."""
    if "small_period" in spec.values:
        return small.layout(spec, scan) + vision.layout(spec)
    return _decoder_layout(spec, scan) + vision.layout(spec)


def _decoder_layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    layers, moe = spec.num_layers, "_moe" if spec.value("moe") else ""
    kind = [("global" if i % PERIOD == PERIOD - 1 else "local") + moe for i in range(layers)]
    if not scan:
        return tuple(LayerStack(("decoder", f"layers_{i}"), (i,), False, kind=kind[i]) for i in range(layers))
    blocks = layers // PERIOD
    local = tuple(b * PERIOD + j for b in range(blocks) for j in range(PERIOD - 1))
    return (LayerStack(("decoder", "scanned_blocks", "local_layers"), local, True, kind="local" + moe,
                       grid=(blocks, PERIOD - 1)),
            LayerStack(("decoder", "scanned_blocks", "global_layer"), tuple(range(PERIOD - 1, layers, PERIOD)), True,
                       kind="global" + moe))


def synthetic_config(m: Sizes) -> dict:
    """``gemma4``: Gemma4ForConditionalGeneration's config.json (the decoder in ``text_config`` beside a small
    vision tower's config); ``gemma4_text``: the decoder's own. MoE (26B-A4B's form) when ``num_experts``."""
    text = synthetic_text_config(m, "gemma3_text")
    for key in ("rope_local_base_freq", "rope_theta", "sliding_window_pattern", "rope_scaling",
                "query_pre_attn_scalar", "max_position_embeddings"):
        text.pop(key, None)
    text.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], attention_k_eq_v=True,
                global_head_dim=2 * m.head_dim, num_global_key_value_heads=max(1, m.num_kv_heads // 2),
                hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                vocab_size_per_layer_input=m.vocab_size, final_logit_softcapping=30.0,
                max_position_embeddings=262144, use_bidirectional_attention="vision",
                layer_types=[PATTERN[i % PERIOD] for i in range(m.num_layers)],
                rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                    "rope_type": "proportional"},
                                 "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
                enable_moe_block=bool(m.num_experts))
    if m.num_experts:
        text.update(num_experts=m.num_experts, top_k_experts=2, moe_intermediate_size=m.moe_intermediate_size)
    if m.model_type == "gemma4_text":
        return text
    for key in ("architectures", "torch_dtype"):
        text.pop(key)
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "model_type": "gemma4_vision",
                              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                              "global_head_dim": 16, "num_hidden_layers": 2, "patch_size": 4,
                              "position_embedding_size": 64, "pooling_kernel_size": 2, "standardize": True,
                              "use_clipped_linears": False},
            # the releases' token ids: outside a tiny vocabulary, so no test token is an image placeholder
            "audio_config": None, "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
            "video_token_id": 258884, "vision_soft_tokens_per_image": 4, "tie_word_embeddings": True,
            "torch_dtype": m.dtype}


DENSE_TINY = {"num_layers": 12, "vocab_size": 96, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 16, "intermediate_size": 96}
WINDOW = {"sliding_window": 5}
MOE_TINY = {**DENSE_TINY, "num_layers": 6, "num_experts": 4, "moe_intermediate_size": 32}
# google/gemma-4-26B-A4B-it's decoder: hidden 2816, 16 heads of 256 / 8 KV; global layers 512 wide with 2 KV heads;
# the dense (shared) MLP 2112, experts 704 wide (30 layers of 128 experts in the release)
WIDTHS_26B = {"vocab_size": 262144, "hidden_size": 2816, "num_heads": 16, "num_kv_heads": 8, "head_dim": 256,
              "intermediate_size": 2112, "moe_intermediate_size": 704,
              "config_overrides": {"num_global_key_value_heads": 2, "global_head_dim": 512, "top_k_experts": 8,
                                   "sliding_window": 1024}}
# E2B's form (4 sliding + 1 full; the last 4 of 10 layers share keys and values, their MLPs twice as wide) and E4B's
# (5 + 1; 4 of 12 shared, narrow); per-layer inputs 16 wide; 2 KV heads, so the kernels' head split is exercised
E2B_TINY = {**DENSE_TINY, "num_layers": 10,
            "config_overrides": small.synthetic_fields(10, 5, shared=4, ple=16, wide=True, vocab=96)}
E4B_TINY = {**DENSE_TINY, "config_overrides": small.synthetic_fields(12, 6, shared=4, ple=16, wide=False, vocab=96)}
# google/gemma-4-E4B-it's decoder: hidden 2560, 8 heads of 256 / 2 KV, global layers 512 wide, MLP 10240, per-layer
# inputs 256 wide over 262144 tokens; 42 layers (7 blocks of 5 + 1), the last 18 sharing keys and values
WIDTHS_E4B = {"vocab_size": 262144, "hidden_size": 2560, "num_heads": 8, "num_kv_heads": 2, "head_dim": 256,
              "intermediate_size": 10240}
E4B_BLOCK = small.synthetic_fields(6, 6, shared=0, ple=256, wide=False, vocab=262144)
E4B_RELEASE = small.synthetic_fields(42, 6, shared=18, ple=256, wide=False, vocab=262144)
SYNTHETIC = Synthetic(
    config=synthetic_config,
    # the text model first (the LoRA test's adapter: PEFT cannot wrap the vision tower's Gemma4ClippableLinear)
    round_trip=(Example("gemma4_text-31b-tiny", {**DENSE_TINY, "model_type": "gemma4_text"}, devices=16),
                Example("gemma4-31b-tiny", DENSE_TINY, devices=16),
                # hidden 80: the embedding's float32 sqrt(80) scale, rounded to bfloat16 in the checkpoint, comes
                # back within one bfloat16 step (through a float32 checkpoint, bit for bit)
                Example("gemma4-26b-a4b-tiny", {**MOE_TINY, "hidden_size": 80}, devices=16,
                        rounded=("embed_tokens.weight",)),
                # E2B / E4B: unscanned only (a scanned round trip is refused)
                Example("gemma4-e2b-tiny", E2B_TINY, scan=False, devices=16),
                Example("gemma4-e4b-tiny", E4B_TINY, scan=False, devices=1),
                Example("gemma4-26b-a4b-multimodal", MOE_TINY, devices=16, multimodal=True)),
    # a sliding window shorter than the tests' 12 tokens, so the sliding layers really mask
    logits=(Example("gemma4_text", {**DENSE_TINY, "model_type": "gemma4_text", "config_overrides": WINDOW}, devices=4),
            Example("gemma4_text-moe-noscan", {**MOE_TINY, "model_type": "gemma4_text", "config_overrides": WINDOW},
                    scan=False, devices=4),
            Example("gemma4-e2b", {**E2B_TINY, "config_overrides": {**E2B_TINY["config_overrides"], **WINDOW}},
                    scan=False, devices=4),
            Example("gemma4-e4b", {**E4B_TINY, "config_overrides": {**E4B_TINY["config_overrides"], **WINDOW}},
                    scan=False, devices=1),
            Example("gemma4-31b-multimodal", {**DENSE_TINY, "config_overrides": WINDOW}, devices=4, multimodal=True)),
    # 26B-A4B widths (hidden 2816, 16 heads of 256 / 8 KV; global: 512 wide, 2 KV; shared MLP 2112, experts 704),
    # one block of six layers with 8 of its 128 experts
    memory=(MemoryExample("gemma4-26b-a4b-widths", {**WIDTHS_26B, "num_layers": 6, "num_experts": 8},
                          bound=GIB, source_bytes=2 * GIB,
                          full={**WIDTHS_26B, "num_layers": 30, "num_experts": 128}, max_shard_bytes=5 * 10**9),
            # E4B widths, one block of 6 with per-layer inputs (shared layers hold less); the release: 42 layers,
            # the last 18 sharing keys and values
            MemoryExample("gemma4-e4b-widths", {**WIDTHS_E4B, "num_layers": 6, "config_overrides": E4B_BLOCK},
                          bound=GIB, source_bytes=2 * GIB,
                          full={**WIDTHS_E4B, "num_layers": 42, "config_overrides": E4B_RELEASE},
                          max_shard_bytes=5 * 10**9)),
    hub_prefixes={"gemma4": ("model.", "model.language_model.")},
)

FAMILY = Family(
    name="gemma4",
    model_types=("gemma4", "gemma4_text"),
    decoder_block="gemma4",
    rules=ROWS + GLOBAL_ROWS + vision.RULES,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    aliases=(("model.language_model.", "model."),),
    not_converted=vision.not_converted,
    encoders=("vision tower", "vision projector"),
)
