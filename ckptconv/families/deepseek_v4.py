"""DeepSeek-V4-Flash / -Pro (``model_type: deepseek_v4``): MaxText ``decoder_block: deepseek4``.

The release keeps the reference implementation's names (``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
``layers.{i}.ffn.experts.{e}.w1.weight``, ``hc_head_fn``; transformers renames them on load). Every layer has:

- multi-query attention with a low-rank query (``wq_a``, ``q_norm``, ``wq_b`` to heads x head_dim), one shared
  key/value head (``wkv``, ``kv_norm``), per-head attention sinks and the grouped output projection
  (``wo_a``: ``o_groups`` blocks of ``o_lora_rank`` rows -> MaxText ``o_a_proj`` (groups, in, rank); ``wo_b``);
- by its ``compress_ratios`` entry, sliding-window attention only (0), a compressed-sparse-attention compressor with
  the lightning indexer (4: ``csa_compressor``, kv and gate twice head_dim wide) or a heavily compressed one (128:
  ``hca_compressor``);
- manifold-constrained hyper-connections around attention and MLP (``hc_attn_*``, ``hc_ffn_*``): each fused
  ``fn`` (2k + k^2 rows), ``base`` and 3-element ``scale`` split into MaxText's ``pre``, ``post`` and ``res`` parts
  (k = ``hc_mult``), and one ``hc_head`` before the final norm. MaxText's ``mhc_norm`` scales have no tensor in
  the release: its converter writes them as float32 ones, and so does this family (``ONES``);
- a routed MoE with one shared expert: the first ``num_hash_layers`` route by a fixed token -> experts table
  (``ffn.gate.tid2eid``, a ``Tid2EidVar`` in MaxText's model, float32 there, written in --dtype as its converter
  does), the others by ``sqrtsoftplus`` scores with a correction bias (``ffn.gate.bias``).

Layout (MaxText 0.2.5's mapping): unscanned, ``decoder/layers_{i}``; scanned, the hash layers stay unscanned
(``decoder/layers_{i}``) and the rest must alternate heavily compressed and compressed-sparse attention,
HCA first (the release's ``[.., 128, 4, 128, 4]``): ``decoder/scanned_blocks/layers_0`` stacks the HCA layers,
``layers_1`` the CSA ones.

The router bias and ``tid2eid``: MaxText's model declares them a ``MoEBiasVar`` and a ``Tid2EidVar`` and MaxText's
converter writes them in those collections (``items/params/MoEBiasVar/...``, ``items/params/Tid2EidVar/...``),
where its ``from_pretrained`` (which restores ``params/params`` only) leaves them deleted and the first forward pass
crashes. Here both go under ``params/params`` (same shapes; see deepseek.py for DeepSeek-V3's bias), where every
MaxText 0.2.5 loader finds them: its training loader looks a collection the checkpoint lacks up there
(docs/bench/LOADERS.md).

The release is FP8 (e4m3, one ue8m0 scale per 128x128 block, stored as ``<module>.scale``) for its linear layers
and FP4 (e2m1, two per byte, one ue8m0 scale per 32 values of a row) for its routed experts: decoded per read
unit as MaxText's ``deepseek_dequantize.py`` does (:mod:`ckptconv.families.inputs`).
"""

from __future__ import annotations

from ckptconv.families.base import (
    GIB, Example, Family, LayerStack, LayoutError, MemoryExample, Output, Rule, Sizes, Synthetic, rule,
)
from ckptconv.families.decoder import KERNEL, make_spec
from ckptconv.families.moe import read_experts
from ckptconv.families.quantized import read_quantization
from ckptconv.families.transforms import TRANSPOSE, Fill, Permute, Split, TakeRanges, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

L = "layers.{layer}."
ATTENTION_KINDS = {0: "swa", 4: "csa", 128: "hca"}  # compress ratio -> MaxText's attention of the layer


def _kinds(attention: tuple[str, ...] = tuple(ATTENTION_KINDS.values()), mlp: tuple[str, ...] = ("hash", "moe")):
    return frozenset(f"{a}-{m}" for a in attention for m in mlp)


HASH, ROUTED = _kinds(mlp=("hash",)), _kinds(mlp=("moe",))
CSA, HCA = _kinds(("csa",)), _kinds(("hca",))

# One fused hyper-connection tensor -> MaxText's pre, post and res parts (k = hc_mult): ``fn`` (2k + k^2, k*emb)
# its rows [0, k), [k, 2k), [2k, 2k + k^2), each transposed; ``base`` (2k + k^2,) the same ranges, res as (k, k);
# ``scale`` (3,) one element each.
PARTS = (("pre", 0, "hc"), ("post", "hc", "hc"), ("res", "hc2", "hc_sq"))


def _hyper_connection(hf: str, module: str) -> tuple[Rule, ...]:
    fn = Rule(L + f"{hf}_fn", ("hc_dim", "hc_emb"), tuple(
        Output((module, f"{part}_alpha"), (TakeRanges(f"{part}_alpha", 0, "hc_dim", start, width), TRANSPOSE))
        for part, start, width in PARTS))
    base = Rule(L + f"{hf}_base", ("hc_dim",), tuple(
        Output((module, f"{part}_beta"), (TakeRanges(f"{part}_beta", 0, "hc_dim", start, width),)
               + ((Split("split_res_beta", 0, "hc"),) if part == "res" else ()))
        for part, start, width in PARTS))
    scale = Rule(L + f"{hf}_scale", ("three",), tuple(
        Output((module, f"{part}_alpha_scale"), (TakeRanges(f"{part}_alpha_scale", 0, 3, i, 1),))
        for i, (part, _, _) in enumerate(PARTS)))
    return fn, base, scale


# MaxText's mhc_norm scales, which the release does not have: float32 ones of (k * emb,), written beside the layer
# norm they sit next to (the rule reads that norm's tensor only for its place in the layer)
ONES = Fill("mhc_norm_ones", "hc_emb", 1.0)


def _compressor(hf: str, path: tuple[str, ...], width: str, norm: str, ratio: str, kinds: frozenset) -> tuple[Rule, ...]:
    return (
        rule(L + hf + ".wgate.weight", (*path, "gate_proj", "kernel"), (width, "emb"), KERNEL, kinds=kinds),
        rule(L + hf + ".wkv.weight", (*path, "kv_proj", "kernel"), (width, "emb"), KERNEL, kinds=kinds),
        rule(L + hf + ".norm.weight", (*path, "kv_norm", "scale"), (norm,), kinds=kinds),
        rule(L + hf + ".ape", (*path, "position_bias"), (ratio, width), kinds=kinds),
    )


ATTENTION = "self_attention"
CSA_PATH, HCA_PATH = (ATTENTION, "csa_compressor"), (ATTENTION, "hca_compressor")
MOE = ("mlp", "MoeBlock_0")
ROWS = (
    Rule(L + "attn_norm.weight", ("emb",), (Output(("pre_self_attention_layer_norm", "scale")),
                                           Output(("mhc_attention", "mhc_norm", "scale"), (ONES,), dtype="float32"))),
    Rule(L + "ffn_norm.weight", ("emb",), (Output(("post_self_attention_layer_norm", "scale")),
                                          Output(("mhc_mlp", "mhc_norm", "scale"), (ONES,), dtype="float32"))),
    *_hyper_connection("hc_attn", "mhc_attention"),
    *_hyper_connection("hc_ffn", "mhc_mlp"),
    rule(L + "attn.wq_a.weight", (ATTENTION, "wq_a", "kernel"), ("q_lora", "emb"), KERNEL),
    rule(L + "attn.q_norm.weight", (ATTENTION, "q_norm", "scale"), ("q_lora",)),
    rule(L + "attn.wq_b.weight", (ATTENTION, "wq_b", "kernel"), ("q", "q_lora"), (TRANSPOSE, split_last("heads"))),
    rule(L + "attn.wkv.weight", (ATTENTION, "wkv", "kernel"), ("head_dim", "emb"), (TRANSPOSE, split_last("kv_heads"))),
    rule(L + "attn.kv_norm.weight", (ATTENTION, "kv_norm", "scale"), ("head_dim",)),
    rule(L + "attn.attn_sink", (ATTENTION, "sinks"), ("heads",)),
    # (groups * rank, in) -> (groups, rank, in) -> (groups, in, rank)
    rule(L + "attn.wo_a.weight", (ATTENTION, "o_a_proj", "kernel"), ("o_a", "o_in"),
         (split_first("o_groups"), Permute("group_in_rank", (0, 2, 1)))),
    rule(L + "attn.wo_b.weight", (ATTENTION, "o_b_proj", "kernel"), ("emb", "o_a"), KERNEL),
    *_compressor("attn.compressor", CSA_PATH, "csa_dim", "head_dim", "csa_ratio", CSA),
    *_compressor("attn.compressor", HCA_PATH, "head_dim", "head_dim", "hca_ratio", HCA),
    *_compressor("attn.indexer.compressor", (*CSA_PATH, "indexer"), "index_c", "index_hd", "csa_ratio", CSA),
    rule(L + "attn.indexer.weights_proj.weight", (*CSA_PATH, "indexer", "weights_proj", "kernel"),
         ("index_heads", "emb"), KERNEL, kinds=CSA),
    rule(L + "attn.indexer.wq_b.weight", (*CSA_PATH, "indexer", "q_proj", "kernel"), ("index_q", "q_lora"), KERNEL,
         kinds=CSA),
    rule(L + "ffn.gate.weight", (*MOE, "gate", "kernel"), ("experts", "emb"), KERNEL),
    # these two under params/params, not MaxText's Tid2EidVar / MoEBiasVar collections (module docstring); layers on
    # axis 0 as its model stacks them
    Rule(L + "ffn.gate.tid2eid", ("vocab", "topk"), (Output((*MOE, "tid2eid"), layer_axis=0),), kinds=HASH,
         integer=True),
    Rule(L + "ffn.gate.bias", ("experts",), (Output((*MOE, "gate", "bias"), layer_axis=0),), kinds=ROUTED),
    rule(L + "ffn.shared_experts.w1.weight", ("mlp", "shared_experts", "wi_0", "kernel"), ("moe_mlp", "emb"), KERNEL),
    rule(L + "ffn.shared_experts.w3.weight", ("mlp", "shared_experts", "wi_1", "kernel"), ("moe_mlp", "emb"), KERNEL),
    rule(L + "ffn.shared_experts.w2.weight", ("mlp", "shared_experts", "wo", "kernel"), ("emb", "moe_mlp"), KERNEL),
    rule(L + "ffn.experts.{expert}.w1.weight", (*MOE, "wi_0"), ("moe_mlp", "emb"), KERNEL),
    rule(L + "ffn.experts.{expert}.w3.weight", (*MOE, "wi_1"), ("moe_mlp", "emb"), KERNEL),
    rule(L + "ffn.experts.{expert}.w2.weight", (*MOE, "wo"), ("emb", "moe_mlp"), KERNEL),
    rule("embed.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
    rule("norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    rule("head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL),
    rule("hc_head_fn", ("decoder", "hc_head", "hc_fn"), ("hc", "hc_emb"), KERNEL),
    rule("hc_head_base", ("decoder", "hc_head", "hc_base"), ("hc",)),
    rule("hc_head_scale", ("decoder", "hc_head", "hc_scale"), ("one",)),
)

LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("hidden_act", ("silu",), "silu")
    cfg.require("attention_bias", (False,), False)
    cfg.require("mlp_bias", (False,), False)
    cfg.require("tie_word_embeddings", (False,), False)
    cfg.require("num_key_value_heads", (1,), 1)  # one shared key/value head (MaxText's wkv)
    cfg.require("n_shared_experts", (1,), 1)
    cfg.runtime("rms_norm_eps", "max_position_embeddings", "num_experts_per_tok", "routed_scaling_factor",
                "scoring_func", "norm_topk_prob", "topk_method", "swiglu_limit", "sliding_window", "hc_eps",
                "hc_sinkhorn_iters", "index_topk", "rope_theta", "compress_rope_theta", "rope_scaling",
                "rope_parameters", "qk_rope_head_dim", "partial_rotary_factor", "expert_dtype", "compress_rates",
                "router_aux_loss_coef", "router_jitter_noise", "output_router_logits", "attention_dropout",
                "initializer_range")
    layers = cfg.int("num_hidden_layers")
    ratios = _compress_ratios(cfg, layers)
    hashed = _hash_layers(cfg, layers)
    heads, hd, hc = cfg.int("num_attention_heads"), cfg.int("head_dim"), cfg.int("hc_mult", 4)
    groups, rank = cfg.int("o_groups"), cfg.int("o_lora_rank")
    if heads * hd % groups:
        cfg.fail(f"o_groups={groups} does not divide num_attention_heads * head_dim = {heads * hd}")
    index_heads, index_hd = cfg.int("index_n_heads"), cfg.int("index_head_dim")
    dims = {"vocab": cfg.int("vocab_size"), "emb": cfg.int("hidden_size"), "heads": heads, "head_dim": hd,
            "kv_heads": 1, "q_lora": cfg.int("q_lora_rank"), "q": heads * hd, "o_groups": groups, "o_a": groups * rank,
            "o_in": heads * hd // groups, "hc": hc, "hc2": 2 * hc, "hc_sq": hc * hc, "hc_dim": 2 * hc + hc * hc,
            "three": 3, "one": 1, "experts": read_experts(cfg, ("n_routed_experts",)),
            "moe_mlp": cfg.int("moe_intermediate_size"), "topk": cfg.int("num_experts_per_tok"),
            "csa_dim": 2 * hd, "index_heads": index_heads, "index_hd": index_hd, "index_q": index_heads * index_hd,
            "index_c": 2 * index_hd, "csa_ratio": 4, "hca_ratio": 128}
    dims["hc_emb"] = hc * dims["emb"]
    kinds = tuple(f"{ATTENTION_KINDS[r]}-{'hash' if i < hashed else 'moe'}" for i, r in enumerate(ratios))
    values = {"tie_word_embeddings": False, "layer_kinds": kinds, "hash_layers": hashed,
              "mtp_layers": cfg.count("num_nextn_predict_layers", 1),
              "quantization": read_quantization(cfg, ("fp8",))}
    return make_spec(cfg, "deepseek_v4", dims, values, layers)


def _compress_ratios(cfg: ConfigReader, layers: int) -> list[int]:
    """Each layer's compress ratio: the release's ``compress_ratios`` or transformers' ``layer_types``."""
    if cfg.has("compress_ratios"):
        ratios = cfg.config["compress_ratios"]
        cfg.runtime("compress_ratios")
        if not isinstance(ratios, list) or len(ratios) < layers or any(r not in ATTENTION_KINDS for r in ratios):
            cfg.fail(f"compress_ratios must hold one of 0, 4, 128 for each of the {layers} layers")
        if cfg.has("layer_types"):
            cfg.runtime("layer_types")
        return ratios[:layers]
    if not cfg.has("layer_types"):
        cfg.fail("compress_ratios (or layer_types) must say each layer's attention")
    types = cfg.config["layer_types"]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        cfg.fail(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the {layers} layers")
    cfg.runtime("layer_types", "compress_rates")
    return [LAYER_TYPES[t] for t in types]


def _hash_layers(cfg: ConfigReader, layers: int) -> int:
    """How many layers route by the token table: ``num_hash_layers`` (the release) or transformers'
    ``mlp_layer_types`` (its first layers ``hash_moe``, the rest ``moe``)."""
    if cfg.has("mlp_layer_types"):
        types = cfg.config["mlp_layer_types"]
        hashed = sum(1 for t in types if t == "hash_moe") if isinstance(types, list) else -1
        if not isinstance(types, list) or types != ["hash_moe"] * hashed + ["moe"] * (layers - hashed):
            cfg.fail(f"mlp_layer_types must be 'hash_moe' layers then 'moe' ones for {layers} layers")
        cfg.runtime("mlp_layer_types")
        if cfg.has("num_hash_layers") and cfg.config["num_hash_layers"] != hashed:
            cfg.fail(f"num_hash_layers={cfg.config['num_hash_layers']} but mlp_layer_types has {hashed}")
        cfg.runtime("num_hash_layers")
        return hashed
    hashed = cfg.count("num_hash_layers", 3)
    if hashed > layers:
        cfg.fail(f"num_hash_layers={hashed} exceeds num_hidden_layers={layers}")
    return hashed


def layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """Unscanned: ``decoder/layers_{i}``. Scanned (MaxText's mapping): the hash layers unscanned, then
    ``scanned_blocks/layers_0`` over the HCA layers and ``layers_1`` over the CSA ones, which must alternate."""
    kinds = spec.value("layer_kinds")
    hashed = spec.value("hash_layers")
    if not scan:
        return tuple(LayerStack(("decoder", f"layers_{i}"), (i,), False, kind=k) for i, k in enumerate(kinds))
    rest = kinds[hashed:]
    expected = tuple(("hca-moe", "csa-moe")[j % 2] for j in range(len(rest)))
    if rest != expected or len(rest) % 2:
        raise LayoutError(f"config.json: MaxText scans DeepSeek-V4's layers after the {hashed} hash layers in "
                          f"(heavily compressed, compressed sparse) pairs; these are {[k.split('-')[0] for k in rest]} "
                          "(convert with --no-scan)")
    stacks = [LayerStack(("decoder", f"layers_{i}"), (i,), False, kind=kinds[i]) for i in range(hashed)]
    for b, kind in enumerate(("hca-moe", "csa-moe")):
        stacks.append(LayerStack(("decoder", "scanned_blocks", f"layers_{b}"),
                                 tuple(range(hashed + b, len(kinds), 2)), True, kind=kind))
    return tuple(stacks)


def not_converted(spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """The MTP layer(s), named ``mtp.{i}.`` or stored as the layers after the last (MaxText's deepseek4 notes "the
    44th layer (MTP module)"): the hub's naming is not known offline, so both are reported, neither converted."""
    what = "multi-token prediction (MTP) layer"
    return tuple(prefix for i in range(spec.value("mtp_layers"))
                 for prefix in ((f"mtp.{i}.", what), (f"layers.{spec.num_layers + i}.", what)))


def synthetic_config(m: Sizes) -> dict:
    """DeepSeek-V4-Flash's config.json (MaxText's ``deepseek4_284b`` copy of it) with small sizes: the layers'
    compress ratios as the release's (two sliding-window layers, then CSA / HCA alternating), three hash layers."""
    layers = m.num_layers
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, layers)]
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-6, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "head_dim": m.head_dim, "hidden_act": "silu", "hidden_size": m.hidden_size, "index_head_dim": 32,
        "index_n_heads": 2, "index_topk": 4, "max_position_embeddings": 4096,
        "moe_intermediate_size": m.moe_intermediate_size or 64, "n_routed_experts": m.num_experts or 8,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": m.num_heads,
        "num_experts_per_tok": 2, "num_hidden_layers": layers, "num_hash_layers": min(3, layers),
        "num_key_value_heads": 1, "num_nextn_predict_layers": 0, "o_groups": 2, "o_lora_rank": 32,
        "q_lora_rank": 64, "qk_rope_head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 8,
        "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": m.dtype,
        "vocab_size": m.vocab_size, "compress_rope_theta": 160000, "compress_ratios": ratios,
    }
    if m.quantization == "fp8":
        config["expert_dtype"] = "fp4"
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    return config


SMALL = {"num_layers": 5, "hidden_size": 128, "num_heads": 4, "head_dim": 64, "num_experts": 8,
         "moe_intermediate_size": 64, "vocab_size": 256}

# DeepSeek-V4-Flash's FP8/FP4 release at its layer widths (hidden 4096, 64 heads of 512, q_lora 1024, 8 output groups
# of 1024, the indexer's 64 heads of 128, experts of 2048; a smaller vocabulary): its 3 hash layers, an HCA and a CSA
# layer with 8 of its 256 routed experts; ``full``: the whole release (43 layers, 256 experts, vocab 129280, its MTP
# layer) planned from headers
V4_WIDTHS = {"quantization": "fp8", "vocab_size": 16384, "hidden_size": 4096, "num_heads": 64, "head_dim": 512,
             "num_experts": 8, "moe_intermediate_size": 2048, "num_layers": 5,
             "config_overrides": {"q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
                                  "index_head_dim": 128, "index_topk": 512, "num_experts_per_tok": 6,
                                  "qk_rope_head_dim": 64, "sliding_window": 128}}
V4_FULL = {**V4_WIDTHS, "vocab_size": 129280, "num_layers": 43, "num_experts": 256,
           "config_overrides": {**V4_WIDTHS["config_overrides"], "num_nextn_predict_layers": 1,
                                "max_position_embeddings": 1048576}}

SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("deepseek_v4", SMALL),),
    # MaxText 0.2.5's forward pass on its own V4 conversion drifts from transformers' logits (the top token agrees):
    # the check is leaf equality with MaxText's conversion of the same checkpoint, scanned on 16 devices
    logits=(Example("deepseek_v4-maxtext", SMALL, devices=16, reference="maxtext"),),
    memory=(MemoryExample("deepseek-v4-flash", V4_WIDTHS, bound=int(1.5 * GIB), source_bytes=GIB, full=V4_FULL,
                          max_shard_bytes=5 * 10**9),),
)

FAMILY = Family(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    decoder_block="deepseek4",
    rules=ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=layout,
    not_converted=not_converted,
)
