"""gpt-oss (``model_type: gpt_oss``; 20B, 120B): MaxText ``decoder_block: gpt_oss``.

Attention with q/k/v/o biases and per-head sinks (``GptOssAttention``); alternating sliding and
full layers, which MaxText scans as two-layer blocks (``decoder/layers/layers_0`` over the
sliding layers, ``layers_1`` over the full ones). Each layer's experts live in fused tensors
with a leading expert axis: ``gate_up_proj`` (experts, emb, 2 * mlp) holds gate and up
interleaved column by column, so one read feeds two leaves (even columns -> ``wi_0``, odd ->
``wi_1``; the same for its bias). The release stores the experts as MXFP4, decoded per read
unit as MaxText's ``dequantize_mxfp4.py`` does; a bfloat16 copy converts the same.
"""

from ckptconv.families.base import (
    GIB, Example, Family, MemoryExample, Output, Rule, Sizes, Synthetic, block_layout, rule,
)
from ckptconv.families.decoder import (
    KERNEL, KV_KERNEL, L, LAYER_NORM_ROWS, OUT_KERNEL, Q_KERNEL, decoder_config, make_spec, read_attention,
)
from ckptconv.families.gemma import check_layer_types
from ckptconv.families.moe import read_experts
from ckptconv.families.quantized import read_quantization
from ckptconv.families.transforms import TakeStrided, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

PERIOD = 2
PATTERN = ("sliding_attention", "full_attention")
ATTENTION, MLP = "GptOssAttention", "GptOssMlp"
GATE, UP = TakeStrided("gate_columns", -1, 0, 2), TakeStrided("up_columns", -1, 1, 2)

ROWS = LAYER_NORM_ROWS + (
    rule(L + "self_attn.q_proj.weight", (ATTENTION, "query", "kernel"), ("q", "emb"), Q_KERNEL),
    rule(L + "self_attn.q_proj.bias", (ATTENTION, "query", "bias"), ("q",), (split_last("heads"),)),
    rule(L + "self_attn.k_proj.weight", (ATTENTION, "key", "kernel"), ("kv", "emb"), KV_KERNEL),
    rule(L + "self_attn.k_proj.bias", (ATTENTION, "key", "bias"), ("kv",), (split_last("kv_heads"),)),
    rule(L + "self_attn.v_proj.weight", (ATTENTION, "value", "kernel"), ("kv", "emb"), KV_KERNEL),
    rule(L + "self_attn.v_proj.bias", (ATTENTION, "value", "bias"), ("kv",), (split_last("kv_heads"),)),
    rule(L + "self_attn.o_proj.weight", (ATTENTION, "out", "kernel"), ("emb", "q"), OUT_KERNEL),
    rule(L + "self_attn.o_proj.bias", (ATTENTION, "out", "bias"), ("emb",)),
    rule(L + "self_attn.sinks", (ATTENTION, "sinks"), ("heads",)),
    rule(L + "mlp.router.weight", (MLP, "gate", "kernel"), ("experts", "emb"), KERNEL),
    rule(L + "mlp.router.bias", (MLP, "gate", "bias"), ("experts",)),
    Rule(L + "mlp.experts.gate_up_proj", ("experts", "emb", "mlp2"),
         (Output((MLP, "wi_0"), (GATE,)), Output((MLP, "wi_1"), (UP,)))),
    Rule(L + "mlp.experts.gate_up_proj_bias", ("experts", "mlp2"),
         (Output((MLP, "wi_0_bias"), (GATE,)), Output((MLP, "wi_1_bias"), (UP,)))),
    rule(L + "mlp.experts.down_proj", (MLP, "wo"), ("experts", "mlp", "emb")),
    rule(L + "mlp.experts.down_proj_bias", (MLP, "wo_bias"), ("experts", "emb")),
    rule("model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
    rule("model.norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL),
)


def read_spec(cfg: ConfigReader) -> ModelSpec:
    cfg.require("attention_bias", (True,), True)
    cfg.require("tie_word_embeddings", (False,), False)
    cfg.require("hidden_act", ("silu",), "silu")  # the config says silu; the experts run MaxText's clamped SwiGLU
    cfg.rope()
    cfg.runtime("rms_norm_eps", "max_position_embeddings", "sliding_window", "num_experts_per_tok",
                "experts_per_token", "swiglu_limit", "swiglu_alpha", "initial_context_length")
    dims = read_attention(cfg)
    dims |= {"vocab": cfg.int("vocab_size"), "experts": read_experts(cfg, ("num_local_experts", "num_experts")),
             "mlp": cfg.int("intermediate_size")}
    dims["mlp2"] = 2 * dims["mlp"]
    layers = cfg.int("num_hidden_layers")
    if layers % PERIOD:
        cfg.fail(f"num_hidden_layers={layers} is odd; MaxText scans gpt-oss in (sliding, full) pairs")
    check_layer_types(cfg, layers, PATTERN)
    values = {"tie_word_embeddings": False, "quantization": read_quantization(cfg, ("mxfp4",))}
    return make_spec(cfg, "gpt_oss", dims, values, layers)


def synthetic_config(m: Sizes) -> dict:
    """gpt-oss's config.json with small sizes; ``quantization="mxfp4"`` stores its experts as released."""
    config = decoder_config(m, "GptOssForCausalLM", attention_bias=True, num_local_experts=m.num_experts or 4,
                            num_experts_per_tok=2, experts_per_token=2, sliding_window=64, swiglu_limit=7.0,
                            initial_context_length=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
                            layer_types=["sliding_attention", "full_attention"] * (m.num_layers // 2))
    if m.quantization == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return config


SYNTHETIC = Synthetic(
    config=synthetic_config,
    round_trip=(Example("gpt_oss", {"num_layers": 4, "num_experts": 4}, devices=16),),
    # bfloat16 experts; plain RoPE (transformers' gpt_oss default is the release's YaRN, which the reference
    # forward does not model; RoPE settles no weight)
    logits=(Example("gpt_oss", {"num_layers": 4, "num_experts": 4, "vocab_size": 128, "intermediate_size": 64,
                                "config_overrides": {"rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}}},
                    devices=4),),
    # gpt-oss-20b widths (hidden 2880, 64 query / 8 KV heads of 64, expert MLP 2880, vocab 201088), two layers of
    # eight MXFP4 experts
    memory=(MemoryExample("gpt-oss-20b-widths", {
        "quantization": "mxfp4", "vocab_size": 201088, "hidden_size": 2880, "num_layers": 2, "num_heads": 64,
        "num_kv_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_experts": 8,
        "config_overrides": {"rope_theta": 150000.0}}, bound=GIB, source_bytes=GIB),),
)

FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    decoder_block="gpt_oss",
    rules=ROWS,
    read_spec=read_spec,
    synthetic=SYNTHETIC,
    layout=block_layout(PERIOD),
)
