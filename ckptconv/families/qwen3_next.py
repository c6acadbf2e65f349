"""Qwen3-Next (``model_type: qwen3_next``; Qwen3-Next-80B-A3B): MaxText ``decoder_block: qwen3_next``.

A hybrid stack: in every period of ``full_attention_interval`` layers, the first ones are Gated
DeltaNet linear attention (``linear_attn``: the fused projections ``in_proj_qkvz``, grouped per
key head as [q|k|v|z], and ``in_proj_ba``; a depthwise ``conv1d``; ``A_log``, ``dt_bias``; a
gated RMSNorm over the value head dim; ``out_proj``) and the last is full attention whose
``q_proj`` also carries the output gate (per head [query|gate]: MaxText's query kernel is
(emb, heads, 2 * head_dim); its output kernel stays flat, (heads * head_dim, emb)) with q/k
norms. Every layer has a sparse MoE with one shared expert scaled by a sigmoid gate
(``shared_expert_gate``, a (1, emb) linear).

MaxText keeps HF's layouts (its converter only transposes kernels, turns the conv kernel
(channels, 1, taps) into (taps, 1, channels) and splits the heads of the full attention), and
its norms use the stored weights as they are (both sides compute ``1 + w`` at run time).

Scanned, MaxText scans whole periods (``Qwen3NextScannableBlock``): the linear layers of all
periods are ``decoder/layers/local_layers``, an inner scan nested in the period scan, so their
leaves hold (periods, linear layers per period) on axes 1 and 2 (experts still leading); the
full-attention layers are ``decoder/layers/global_layer`` with the periods on axis 1; layers after
the last whole period are ``decoder/layers_remainder/local_layers`` (MaxText's model holds them
so; its converter maps whole periods only). The multi-token-prediction weights the
hub files carry (``mtp.*``) are not part of MaxText's decoder and are named in the report.
"""

from __future__ import annotations

from typing import Callable

from ckptconv.families.base import (
    GIB, EXPERT, Example, Family, LayerStack, MemoryExample, Rule, Sizes, Synthetic, always, rule, untied,
)
from ckptconv.families.decoder import KERNEL, KV_KERNEL, Q_KERNEL, TIED_NOTE, decoder_config, make_spec, read_attention
from ckptconv.families.gemma import check_layer_types
from ckptconv.families.moe import read_experts
from ckptconv.families.transforms import Permute
from ckptconv.read.spec import ConfigReader, ModelSpec

LINEAR_KIND, FULL_KIND = "linear attention", "full attention"
LINEAR, FULL = frozenset({LINEAR_KIND}), frozenset({FULL_KIND})
LINEAR_TYPE, FULL_TYPE = "linear_attention", "full_attention"
CONV_KERNEL = (Permute("conv_taps_first", (2, 1, 0)),)  # HF (channels, 1, taps) -> MaxText (taps, 1, channels)
MTP_NOTE = "multi-token prediction (MTP) layer"


def layer_rows(prefix: str, experts: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """One hybrid layer (``prefix``: the HF layer prefix with ``{layer}``); ``experts``: the routed
    experts' rows, stored per expert (Qwen3-Next) or fused (Qwen3.5)."""
    p, mlp = prefix, ("mlp",)
    return (
        rule(p + "input_layernorm.weight", ("input_layernorm", "scale"), ("emb",)),
        rule(p + "post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), ("emb",)),
        # Gated DeltaNet (linear attention) layers
        rule(p + "linear_attn.in_proj_qkvz.weight", ("attention", "in_proj_qkvz", "kernel"), ("qkvz", "emb"),
             KERNEL, kinds=LINEAR),
        rule(p + "linear_attn.in_proj_ba.weight", ("attention", "in_proj_ba", "kernel"), ("ba", "emb"), KERNEL,
             kinds=LINEAR),
        rule(p + "linear_attn.conv1d.weight", ("attention", "conv1d", "kernel"), ("conv_dim", "one", "conv_taps"),
             CONV_KERNEL, kinds=LINEAR),
        rule(p + "linear_attn.A_log", ("attention", "A_log"), ("v_heads",), kinds=LINEAR),
        rule(p + "linear_attn.dt_bias", ("attention", "dt_bias"), ("v_heads",), kinds=LINEAR),
        rule(p + "linear_attn.norm.weight", ("attention", "norm", "rms_norm", "scale"), ("v_hd",), kinds=LINEAR),
        rule(p + "linear_attn.out_proj.weight", ("attention", "out_proj", "kernel"), ("emb", "v_dim"), KERNEL,
             kinds=LINEAR),
        # gated full attention layers
        rule(p + "self_attn.q_proj.weight", ("attention", "attention", "query", "kernel"), ("q_gate", "emb"),
             Q_KERNEL, kinds=FULL),
        rule(p + "self_attn.k_proj.weight", ("attention", "attention", "key", "kernel"), ("kv", "emb"), KV_KERNEL,
             kinds=FULL),
        rule(p + "self_attn.v_proj.weight", ("attention", "attention", "value", "kernel"), ("kv", "emb"), KV_KERNEL,
             kinds=FULL),
        # MaxText's hybrid attention keeps its output kernel flat: (heads * head_dim, emb)
        rule(p + "self_attn.o_proj.weight", ("attention", "attention", "out", "kernel"), ("emb", "q"), KERNEL,
             kinds=FULL),
        rule(p + "self_attn.q_norm.weight", ("attention", "attention", "query_norm", "scale"), ("hd",), kinds=FULL),
        rule(p + "self_attn.k_norm.weight", ("attention", "attention", "key_norm", "scale"), ("hd",), kinds=FULL),
        # sparse MoE with one gated shared expert, in every layer
        rule(p + "mlp.gate.weight", (*mlp, "routed_experts", "gate", "kernel"), ("experts", "emb"), KERNEL),
        rule(p + "mlp.shared_expert.gate_proj.weight", (*mlp, "shared_expert", "wi_0", "kernel"),
             ("shared_mlp", "emb"), KERNEL),
        rule(p + "mlp.shared_expert.up_proj.weight", (*mlp, "shared_expert", "wi_1", "kernel"),
             ("shared_mlp", "emb"), KERNEL),
        rule(p + "mlp.shared_expert.down_proj.weight", (*mlp, "shared_expert", "wo", "kernel"),
             ("emb", "shared_mlp"), KERNEL),
        rule(p + "mlp.shared_expert_gate.weight", (*mlp, "shared_expert_gate", "kernel"), ("one", "emb"), KERNEL),
    ) + experts


EXPERT_PROJECTIONS = (("gate_proj", "wi_0", ("moe_mlp", "emb")), ("up_proj", "wi_1", ("moe_mlp", "emb")),
                      ("down_proj", "wo", ("emb", "moe_mlp")))


def expert_rows(prefix: str, when: Callable[[ModelSpec], bool] = always, note: str = "") -> tuple[Rule, ...]:
    """Routed experts stored one by one (``mlp.experts.{expert}.*``), stacked on a leading axis."""
    experts = prefix + f"mlp.experts.{EXPERT}."
    return tuple(rule(experts + f"{hf}.weight", ("mlp", "routed_experts", mt), shape, KERNEL, when=when, note=note)
                 for hf, mt, shape in EXPERT_PROJECTIONS)


def global_rows(prefix: str) -> tuple[Rule, ...]:
    """Embedding, final norm and head; ``prefix`` is the decoder's (``model.`` or ``model.language_model.``)."""
    return (
        rule(prefix + "embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
        rule(prefix + "norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
        rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL, when=untied,
             note=TIED_NOTE),
    )


def read_hybrid(cfg: ConfigReader) -> tuple[dict[str, int], int, int]:
    """The dims, layer count and period of a Qwen3-Next-style hybrid decoder config.

    Refused: what MaxText's qwen3_next / qwen3_5 blocks do not run (dense MLP layers, attention
    biases, an ungated attention output, a layer pattern other than ``period - 1`` linear layers
    then one full one).
    """
    cfg.require("hidden_act", ("silu",), "silu")
    cfg.require("attention_bias", (False,), False)
    cfg.require("decoder_sparse_step", (1,), 1)
    refuse_quantized(cfg)
    cfg.require("mlp_only_layers", ([],), [])
    cfg.require("attn_output_gate", (True,), True)
    _, rope_type, _ = cfg.rope()
    if rope_type != "default":
        cfg.fail(f"rope type {rope_type!r} is not supported (MaxText's qwen3_next runs plain partial RoPE)")
    cfg.runtime("rms_norm_eps", "max_position_embeddings", "num_experts_per_tok", "norm_topk_prob",
                "partial_rotary_factor", "intermediate_size", "mamba_ssm_dtype", "mtp_num_hidden_layers",
                "mtp_use_dedicated_embeddings")
    dims = read_attention(cfg)
    layers = cfg.int("num_hidden_layers")
    period = _period(cfg, layers)
    check_layer_types(cfg, layers, (LINEAR_TYPE,) * (period - 1) + (FULL_TYPE,))
    k_heads, v_heads = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    k_hd, v_hd = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    if v_heads % k_heads:
        cfg.fail(f"linear_num_value_heads={v_heads} is not a multiple of linear_num_key_heads={k_heads}")
    moe_mlp, shared_mlp = cfg.int("moe_intermediate_size"), cfg.int("shared_expert_intermediate_size")
    if shared_mlp != moe_mlp:  # MaxText builds the shared expert with moe_mlp_dim
        cfg.fail(f"shared_expert_intermediate_size={shared_mlp} differs from moe_intermediate_size={moe_mlp}: "
                 "MaxText's shared expert has the routed experts' width")
    dims |= {"vocab": cfg.int("vocab_size"), "q_gate": 2 * dims["q"], "one": 1,
             "k_heads": k_heads, "v_heads": v_heads, "k_hd": k_hd, "v_hd": v_hd,
             "k_dim": k_heads * k_hd, "v_dim": v_heads * v_hd,
             "qkvz": 2 * k_heads * k_hd + 2 * v_heads * v_hd, "ba": 2 * v_heads,
             "conv_dim": 2 * k_heads * k_hd + v_heads * v_hd, "conv_taps": cfg.int("linear_conv_kernel_dim"),
             "experts": read_experts(cfg, ("num_experts",)), "moe_mlp": moe_mlp, "shared_mlp": shared_mlp}
    return dims, layers, period


def refuse_quantized(cfg: ConfigReader) -> None:
    """The FP8 releases (e4m3 weights with 128x128 block scales, kept quantised in MaxText's ``-fp8``
    models) are not converted yet: say so, rather than 'unknown field'."""
    if cfg.has("quantization_config"):
        cfg.fail("quantised releases of this family (quantization_config) are not supported yet; convert the "
                 "bfloat16 release")


def _period(cfg: ConfigReader, layers: int) -> int:
    """``full_attention_interval``; configs written by transformers 5 give only ``layer_types``, whose
    first full-attention layer ends the first period."""
    if cfg.has("full_attention_interval") or not isinstance(cfg.config.get("layer_types"), list):
        return cfg.int("full_attention_interval", 4)
    cfg.read.add("full_attention_interval")
    types = cfg.config["layer_types"]
    return types.index(FULL_TYPE) + 1 if FULL_TYPE in types else layers + 1


def read_spec(cfg: ConfigReader) -> ModelSpec:
    dims, layers, period = read_hybrid(cfg)
    # transformers 5's Qwen3NextConfig writes it (false): no layer of the release slides its window
    cfg.require("use_sliding_window", (False,), False)
    values = {"tie_word_embeddings": cfg.bool("tie_word_embeddings", False), "period": period}
    return make_spec(cfg, "qwen3_next", dims, values, layers)


def hybrid_layout(spec: ModelSpec, scan: bool) -> tuple[LayerStack, ...]:
    """Qwen3-Next: ``local_layers`` (periods x linear layers) and ``global_layer``, or one layer each.

    Layers after the last whole period (all linear: the full one ends a period) are MaxText's
    ``decoder/layers_remainder``, a block of its own with only ``local_layers``.
    """
    if not scan:
        return unscanned_layout(spec)
    period, layers = spec.value("period"), spec.num_layers
    blocks = layers // period
    local = tuple(b * period + p for b in range(blocks) for p in range(period - 1))
    stacks = (
        LayerStack(("decoder", "layers", "local_layers"), local, True, kind=LINEAR_KIND, grid=(blocks, period - 1)),
        LayerStack(("decoder", "layers", "global_layer"), tuple(range(period - 1, blocks * period, period)), True,
                   kind=FULL_KIND),
        LayerStack(("decoder", "layers_remainder", "local_layers"), tuple(range(blocks * period, layers)), True,
                   kind=LINEAR_KIND),
    )
    return tuple(s for s in stacks if s.layers)


def unscanned_layout(spec: ModelSpec) -> tuple[LayerStack, ...]:
    """``decoder/layers_{i}``, each of the kind its place in the period gives it."""
    period = spec.value("period")
    return tuple(LayerStack(("decoder", f"layers_{i}"), (i,), False,
                            kind=FULL_KIND if (i + 1) % period == 0 else LINEAR_KIND)
                 for i in range(spec.num_layers))


def synthetic_config(m: Sizes) -> dict:
    """Qwen3-Next's config.json as the hub ships it (transformers 4's spelling): linear attention with as
    many key / value heads as the full attention's KV / query heads, of its head_dim; a full-attention
    layer every 4; the shared expert as wide as the routed ones (as MaxText requires)."""
    moe = m.moe_intermediate_size or m.intermediate_size // 2
    return decoder_config(m, "Qwen3NextForCausalLM", num_experts=m.num_experts or 8, moe_intermediate_size=moe,
                          shared_expert_intermediate_size=moe, num_experts_per_tok=2, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4,
                          linear_conv_kernel_dim=4, linear_key_head_dim=m.head_dim, linear_value_head_dim=m.head_dim,
                          linear_num_key_heads=m.num_kv_heads, linear_num_value_heads=m.num_heads,
                          partial_rotary_factor=0.25, output_router_logits=False, router_aux_loss_coef=0.001)


# Qwen3-Next-80B-A3B's widths (its published config.json), as SynthModel fields
WIDTHS_80B = {"vocab_size": 151936, "hidden_size": 2048, "num_heads": 16, "num_kv_heads": 2, "head_dim": 256,
              "intermediate_size": 5120, "moe_intermediate_size": 512, "tie_word_embeddings": False,
              "config_overrides": {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts_per_tok": 10,
                                   "rope_theta": 10000000}}
SMALL = {"num_experts": 4, "moe_intermediate_size": 32, "tie_word_embeddings": False}

SYNTHETIC = Synthetic(
    config=synthetic_config,
    # 6 layers: scanned, a period of local_layers / global_layer and a remainder block of 2
    round_trip=(Example("qwen3_next", {**SMALL, "num_layers": 6}),),
    logits=(Example("qwen3_next", {**SMALL, "num_layers": 8}, devices=4),
            Example("qwen3_next-remainder", {**SMALL, "num_layers": 6}, devices=4),
            Example("qwen3_next-noscan", {**SMALL, "num_layers": 5}, scan=False, devices=4)),
    # one period at the 80B's widths with 32 of its 512 experts; the whole 48-layer release planned header-only. Over
    # two spill windows on 16 devices, as the release: a smaller output is written after its stream (test_spill)
    memory=(MemoryExample("qwen3-next-80b-period", {**WIDTHS_80B, "num_layers": 4, "num_experts": 32},
                          devices=(16, 1), bound=int(1.5 * GIB), source_bytes=int(1.3 * GIB),
                          full={**WIDTHS_80B, "num_layers": 48, "num_experts": 512}, max_shard_bytes=5 * 10**9),),
)

PREFIX = "model.layers.{layer}."

FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    decoder_block="qwen3_next",
    rules=layer_rows(PREFIX, expert_rows(PREFIX)) + global_rows("model."),
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=hybrid_layout,
    not_converted=lambda spec: (("mtp.", MTP_NOTE),),
)
