"""Rows and config fields shared by the Llama-style decoders (Llama, Mistral, Qwen, Mixtral, Gemma).

They differ only in a few rows (q/k steps, biases, q/k norms, the MLP or MoE block), so
families compose these rows instead of copying them. Reading: ``hf_shape`` is HF's
``(out_features, in_features)``; MaxText kernels are ``(in, ..., out)``.
"""

from __future__ import annotations

from typing import Any

from ckptconv.families.base import Rule, Sizes, rule, untied
from ckptconv.families.transforms import TRANSPOSE, Step, query_scale, split_first, split_last
from ckptconv.read.spec import ConfigReader, ModelSpec

L = "model.layers.{layer}."

Q_KERNEL = (TRANSPOSE, split_last("heads"))  # (q, emb) -> (emb, heads, hd)
KV_KERNEL = (TRANSPOSE, split_last("kv_heads"))  # (kv, emb) -> (emb, kv_heads, hd)
OUT_KERNEL = (TRANSPOSE, split_first("heads"))  # (emb, q) -> (heads, hd, emb)
KERNEL = (TRANSPOSE,)  # (out, in) -> (in, out)


def attention_rows(q_steps: tuple[Step, ...], k_steps: tuple[Step, ...], attention: str = "self_attention",
                   v_steps: tuple[Step, ...] = KV_KERNEL) -> tuple[Rule, ...]:
    return (
        rule(L + "self_attn.q_proj.weight", (attention, "query", "kernel"), ("q", "emb"), q_steps),
        rule(L + "self_attn.k_proj.weight", (attention, "key", "kernel"), ("kv", "emb"), k_steps),
        rule(L + "self_attn.v_proj.weight", (attention, "value", "kernel"), ("kv", "emb"), v_steps),
        rule(L + "self_attn.o_proj.weight", (attention, "out", "kernel"), ("emb", "q"), OUT_KERNEL),
    )


LAYER_NORM_ROWS = (
    rule(L + "input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), ("emb",)),
    rule(L + "post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), ("emb",)),
)

MLP_ROWS = (
    rule(L + "mlp.gate_proj.weight", ("mlp", "wi_0", "kernel"), ("mlp", "emb"), KERNEL),
    rule(L + "mlp.up_proj.weight", ("mlp", "wi_1", "kernel"), ("mlp", "emb"), KERNEL),
    rule(L + "mlp.down_proj.weight", ("mlp", "wo", "kernel"), ("emb", "mlp"), KERNEL),
)

NORM_AND_MLP_ROWS = LAYER_NORM_ROWS + MLP_ROWS

QK_NORM_ROWS = (
    rule(L + "self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), ("hd",)),
    rule(L + "self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), ("hd",)),
)

TIED_NOTE = "tied embeddings: MaxText computes logits from token_embedder/embedding"

GLOBAL_ROWS = (
    rule("model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb")),
    rule("model.norm.weight", ("decoder", "decoder_norm", "scale"), ("emb",)),
    # Tied models compute logits from the embedding (MaxText: logits_via_embedding).
    rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL, when=untied,
         note=TIED_NOTE),
)


def read_attention(cfg: ConfigReader, defaults: dict[str, int] | None = None) -> dict[str, int]:
    """Heads, KV heads and head_dim as named dimensions.

    Missing fields take the values transformers' config class would: ``defaults`` (a family's
    documented defaults), else head_dim = hidden / heads and as many KV heads as heads.
    """
    defaults = defaults or {}
    heads = cfg.int("num_attention_heads", defaults.get("num_attention_heads"))
    hidden = cfg.int("hidden_size", defaults.get("hidden_size"))
    head_dim = cfg.int("head_dim", defaults.get("head_dim", hidden // heads))
    kv = cfg.int("num_key_value_heads", defaults.get("num_key_value_heads", heads))
    if heads % kv:
        cfg.fail(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return {"emb": hidden, "heads": heads, "kv_heads": kv, "hd": head_dim, "q": heads * head_dim,
            "kv": kv * head_dim}


def read_dense_dims(cfg: ConfigReader, activation: tuple[str, str] = ("hidden_act", "silu")) -> dict[str, int]:
    """The dimensions every Llama-style decoder shares, validated; RoPE and eps as runtime settings."""
    cfg.require(activation[0], (activation[1],), activation[1])
    cfg.require("mlp_bias", (False,), False)
    cfg.require("pretraining_tp", (1,), 1)
    cfg.rope()
    cfg.runtime("rms_norm_eps", "max_position_embeddings")
    dims = read_attention(cfg)
    dims["vocab"] = cfg.int("vocab_size")
    dims["mlp"] = cfg.int("intermediate_size")
    return dims


def make_spec(cfg: ConfigReader, family: str, dims: dict[str, int], values: dict[str, Any],
              num_layers: int | None = None) -> ModelSpec:
    """Assemble the spec: layers, dims, values, and every runtime setting the readers accepted."""
    runtime: dict[str, Any] = dict(cfg.runtime_values)
    for child in cfg.children:
        runtime.update({f"{child.name}.{k}": v for k, v in child.runtime_values.items()})
    layers = num_layers if num_layers is not None else cfg.int("num_hidden_layers")
    return ModelSpec(family=family, model_type=str(cfg.config.get("model_type")), num_layers=layers,
                     dims=dims, values=values, runtime=runtime)


def decoder_values(cfg: ConfigReader, *, interleave_rope: bool = False, scale_query: bool = False,
                   head_dim: int | None = None) -> dict[str, Any]:
    """Values the shared steps read: tied embeddings, RoPE layout, query pre-scaling."""
    values: dict[str, Any] = {"tie_word_embeddings": cfg.bool("tie_word_embeddings", False),
                              "interleave_rope": interleave_rope}
    if scale_query:
        values["query_scale"] = query_scale(head_dim or 1)
    return values


def decoder_config(m: Sizes, architecture: str, **extra: Any) -> dict:
    """A Llama-style decoder's ``config.json`` for synthetic checkpoints, as the hub writes it; ``extra``
    adds or replaces fields (None: left out)."""
    return {
        "architectures": [architecture],
        "model_type": m.model_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size,
        "tie_word_embeddings": m.tie_word_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "torch_dtype": m.dtype,
        **extra,
    }
