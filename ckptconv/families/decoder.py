"""Rules shared by the Llama-style decoders (Llama, Mistral, Qwen2, Qwen3).

They differ only in a few rows (q/k steps, biases, q/k norms), so families compose these
rows instead of copying them. Reading: ``hf_shape`` is HF's ``(out_features, in_features)``.
"""

from __future__ import annotations

from ckptconv.families.base import Rule, untied
from ckptconv.spec import ConfigReader, ModelSpec
from ckptconv.transforms import TRANSPOSE, Step, kv_heads, q_heads, split_first, split_last

L = "model.layers.{layer}."

Q_KERNEL = (TRANSPOSE, split_last(q_heads))  # (q, emb) -> (emb, nq, hd)
KV_KERNEL = (TRANSPOSE, split_last(kv_heads))  # (kv, emb) -> (emb, nkv, hd)
OUT_KERNEL = (TRANSPOSE, split_first(q_heads))  # (emb, q) -> (nq, hd, emb)


def attention_rows(q_steps: tuple[Step, ...], k_steps: tuple[Step, ...]) -> tuple[Rule, ...]:
    return (
        Rule(L + "self_attn.q_proj.weight", ("self_attention", "query", "kernel"), ("q", "emb"), q_steps),
        Rule(L + "self_attn.k_proj.weight", ("self_attention", "key", "kernel"), ("kv", "emb"), k_steps),
        Rule(L + "self_attn.v_proj.weight", ("self_attention", "value", "kernel"), ("kv", "emb"), KV_KERNEL),
        Rule(L + "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), ("emb", "q"), OUT_KERNEL),
    )


NORM_AND_MLP_ROWS = (
    Rule(L + "input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), ("emb",)),
    Rule(L + "post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), ("emb",)),
    Rule(L + "mlp.gate_proj.weight", ("mlp", "wi_0", "kernel"), ("mlp", "emb"), (TRANSPOSE,)),
    Rule(L + "mlp.up_proj.weight", ("mlp", "wi_1", "kernel"), ("mlp", "emb"), (TRANSPOSE,)),
    Rule(L + "mlp.down_proj.weight", ("mlp", "wo", "kernel"), ("emb", "mlp"), (TRANSPOSE,)),
)

GLOBAL_ROWS = (
    Rule("model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
    Rule("model.norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    # Tied models compute logits from the embedding (MaxText: logits_via_embedding).
    Rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), (TRANSPOSE,), when=untied),
)

def read_dense_spec(cfg: ConfigReader, family: str, interleave_rope: bool) -> ModelSpec:
    """The fields every Llama-style dense decoder shares, validated."""
    cfg.require("hidden_act", ("silu",), "silu")
    cfg.require("mlp_bias", (False,), False)
    cfg.require("pretraining_tp", (1,), 1)
    heads = cfg.int("num_attention_heads")
    hidden = cfg.int("hidden_size")
    head_dim = cfg.optional_int("head_dim") or hidden // heads
    kv = cfg.optional_int("num_key_value_heads") or heads
    if heads % kv:
        raise_bad(cfg, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    theta, rope_type, rope_scaling = cfg.rope()
    return ModelSpec(
        family=family,
        model_type=cfg.config["model_type"],
        vocab_size=cfg.int("vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(head_dim),
        intermediate_size=cfg.int("intermediate_size"),
        tie_word_embeddings=cfg.bool("tie_word_embeddings", False),
        rms_norm_eps=cfg.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_type=rope_type,
        interleave_rope=interleave_rope,
        max_position_embeddings=cfg.optional_int("max_position_embeddings"),
        extra={"rope_scaling": rope_scaling, "sliding_window": cfg.config.get("sliding_window")},
    )


def raise_bad(cfg: ConfigReader, message: str) -> None:
    from ckptconv.errors import BadInputError

    raise BadInputError(f"{cfg.where}: {message}")
