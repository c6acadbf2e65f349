"""Rows and config fields shared by Gemma 2 and Gemma 3 (MaxText ``decoder_block: gemma2 / gemma3``).

What MaxText's Gemma layout changes against Llama's (its converter, 0.2.5):
- RMSNorm scales: HF stores ``w`` and computes ``x * (1 + w)``; MaxText stores ``1 + w``;
- four norms per layer (before/after attention, before/after the MLP);
- the embedding is stored multiplied by sqrt(hidden) (MaxText does not scale at run time) and
  sized to MaxText's own vocabulary (zero rows added, or rows dropped: see the report);
- logits always come from the embedding (tied), divided by sqrt(hidden) at run time.
"""

from __future__ import annotations

from ckptconv.families.base import Rule, Sizes, never, rule
from ckptconv.families.decoder import KERNEL, KV_KERNEL, OUT_KERNEL, TIED_NOTE, decoder_config, read_attention
from ckptconv.families.transforms import NORM_PLUS_ONE, RESIZE_VOCAB, SCALE_EMBEDDING, Step
from ckptconv.read.spec import ConfigReader

ACTIVATION = "gelu_pytorch_tanh"  # MaxText: mlp_activations ["gelu", "linear"] (tanh approximation)


def norm(hf: str, maxtext: tuple[str, ...], dim: str = "emb") -> Rule:
    return rule(hf, (*maxtext, "scale"), (dim,), (NORM_PLUS_ONE,))


def layer_rows(prefix: str, q_steps: tuple[Step, ...], qk_norms: bool) -> tuple[Rule, ...]:
    """One Gemma decoder layer; ``prefix`` is the HF layer prefix with ``{layer}``."""
    rows = (
        norm(prefix + "input_layernorm.weight", ("pre_self_attention_norm",)),
        norm(prefix + "post_attention_layernorm.weight", ("post_self_attention_norm",)),
        norm(prefix + "pre_feedforward_layernorm.weight", ("pre_ffw_norm",)),
        norm(prefix + "post_feedforward_layernorm.weight", ("post_ffw_norm",)),
        rule(prefix + "self_attn.q_proj.weight", ("self_attention", "query", "kernel"), ("q", "emb"), q_steps),
        rule(prefix + "self_attn.k_proj.weight", ("self_attention", "key", "kernel"), ("kv", "emb"), KV_KERNEL),
        rule(prefix + "self_attn.v_proj.weight", ("self_attention", "value", "kernel"), ("kv", "emb"), KV_KERNEL),
        rule(prefix + "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), ("emb", "q"), OUT_KERNEL),
        rule(prefix + "mlp.gate_proj.weight", ("mlp", "wi_0", "kernel"), ("mlp", "emb"), KERNEL),
        rule(prefix + "mlp.up_proj.weight", ("mlp", "wi_1", "kernel"), ("mlp", "emb"), KERNEL),
        rule(prefix + "mlp.down_proj.weight", ("mlp", "wo", "kernel"), ("emb", "mlp"), KERNEL),
    )
    if qk_norms:
        rows += (norm(prefix + "self_attn.q_norm.weight", ("self_attention", "query_norm"), "hd"),
                 norm(prefix + "self_attn.k_norm.weight", ("self_attention", "key_norm"), "hd"))
    return rows


def global_rows(embedding_steps: tuple[Step, ...]) -> tuple[Rule, ...]:
    return (
        rule("model.embed_tokens.weight", ("token_embedder", "embedding"), ("vocab", "emb"), embedding_steps),
        norm("model.norm.weight", ("decoder", "decoder_norm")),
        # Gemma always computes logits from the embedding; a stored head is the same tensor.
        rule("lm_head.weight", ("decoder", "logits_dense", "kernel"), ("vocab", "emb"), KERNEL,
             when=never, note=TIED_NOTE),
    )


GEMMA2_EMBEDDING = (RESIZE_VOCAB, SCALE_EMBEDDING)  # MaxText pads, then scales
GEMMA3_EMBEDDING = (SCALE_EMBEDDING, RESIZE_VOCAB)  # MaxText scales, then pads or truncates


def read_gemma_dims(cfg: ConfigReader, defaults: dict[str, int] | None = None) -> dict[str, int]:
    """Sizes, activation and the fields Gemma runs with (recorded as runtime settings)."""
    defaults = defaults or {}
    for field in ("hidden_activation", "hidden_act"):
        cfg.require(field, (ACTIVATION,), ACTIVATION)
    cfg.require("attention_bias", (False,), False)
    cfg.require("tie_word_embeddings", (True,), True)  # MaxText's Gemma decoders: logits_via_embedding
    cfg.rope()
    cfg.runtime("rms_norm_eps", "max_position_embeddings", "sliding_window", "attn_logit_softcapping",
                "final_logit_softcapping", "cache_implementation", "use_bidirectional_attention")
    if cfg.has("sliding_window_size") and cfg.raw("sliding_window_size") != cfg.raw("sliding_window"):
        cfg.fail(f"sliding_window_size={cfg.raw('sliding_window_size')!r} differs from "
                 f"sliding_window={cfg.raw('sliding_window')!r}")  # gemma-2-9b's config.json has both
    dims = read_attention(cfg, defaults)
    dims["vocab"] = cfg.int("vocab_size", defaults.get("vocab_size"))
    dims["mlp"] = cfg.int("intermediate_size", defaults.get("intermediate_size"))
    return dims


def check_layer_types(cfg: ConfigReader, layers: int, pattern: tuple[str, ...]) -> None:
    """MaxText fixes the local/global pattern; a config with another pattern would run wrong."""
    types = cfg.raw("layer_types")
    if types is None:
        return
    # compared item by item: a config claiming 10**9 layers must not make us build a list that long
    if (not isinstance(types, list) or len(types) != layers
            or any(kind != pattern[i % len(pattern)] for i, kind in enumerate(types))):
        cfg.fail(f"field 'layer_types' = {repr(types)[:120]} is not the pattern MaxText runs for this family "
                 f"({list(pattern)} repeated)")


def synthetic_text_config(m: Sizes, model_type: str) -> dict:
    """A Gemma 2 / Gemma 3 decoder's ``config.json`` for synthetic checkpoints (Gemma 3's ``text_config``)."""
    config = decoder_config(m, "Gemma2ForCausalLM" if model_type == "gemma2" else "Gemma3ForCausalLM",
                            model_type=model_type, hidden_act=None, hidden_activation=ACTIVATION,
                            query_pre_attn_scalar=m.head_dim, sliding_window=64, attention_bias=False,
                            tie_word_embeddings=True)
    if model_type == "gemma2":
        config.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    else:
        config.update(rope_local_base_freq=10000.0, rope_theta=1000000.0, sliding_window_pattern=6,
                      rope_scaling={"factor": 8.0, "rope_type": "linear"})
    return config
