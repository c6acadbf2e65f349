"""The family registry: complete, consistent, and producing exactly MaxText's leaf names and shapes.

The expected trees are restated here from MaxText 0.2.5's own model (its abstract parameter
tree, printed by building the model for each decoder block), not from ckptconv's tables.
"""

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from ckptconv.commands import synth
from ckptconv.families import olmo3
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE, FAMILIES, family_for
from ckptconv.families.base import MIB, LayoutError, UnscannedOnly, always, applies
from ckptconv.plan.conversion import make_plan, read_spec, with_encoders
from ckptconv.read.sources import LocalSource

MODEL_TYPES = [model_type for family in FAMILIES for model_type in family.model_types]  # every registered one


def layer_tree(mt: str, m: synth.SynthModel) -> dict[str, tuple]:
    """One MaxText decoder layer of family ``mt`` (unstacked shapes)."""
    emb, nq, nkv, hd, mlp = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size
    attention = {
        "self_attention/query/kernel": (emb, nq, hd),
        "self_attention/key/kernel": (emb, nkv, hd),
        "self_attention/value/kernel": (emb, nkv, hd),
        "self_attention/out/kernel": (nq, hd, emb),
    }
    dense_mlp = {"mlp/wi_0/kernel": (emb, mlp), "mlp/wi_1/kernel": (emb, mlp), "mlp/wo/kernel": (mlp, emb)}
    norms = {"pre_self_attention_layer_norm/scale": (emb,), "post_self_attention_layer_norm/scale": (emb,)}
    qk_norms = {"self_attention/query_norm/scale": (hd,), "self_attention/key_norm/scale": (hd,)}
    gemma_norms = {"pre_self_attention_norm/scale": (emb,), "post_self_attention_norm/scale": (emb,),
                   "pre_ffw_norm/scale": (emb,), "post_ffw_norm/scale": (emb,)}
    if mt in ("llama", "mistral"):
        return attention | norms | dense_mlp
    if mt == "qwen2":
        return attention | norms | dense_mlp | {"self_attention/query/bias": (nq, hd), "self_attention/key/bias": (nkv, hd),
                                                "self_attention/value/bias": (nkv, hd)}
    if mt == "qwen3":
        return attention | norms | dense_mlp | qk_norms
    if mt in ("qwen3_moe", "mixtral"):
        block = "moe_block" if mt == "qwen3_moe" else "MoeBlock_0"
        experts = m.config().get("num_experts", m.config().get("num_local_experts"))
        moe = m.moe_intermediate_size or m.intermediate_size // 2 if mt == "qwen3_moe" else mlp
        return attention | norms | (qk_norms if mt == "qwen3_moe" else {}) | {
            f"{block}/gate/kernel": (emb, experts), f"{block}/wi_0": (experts, emb, moe),
            f"{block}/wi_1": (experts, emb, moe), f"{block}/wo": (experts, moe, emb)}
    if mt == "gemma2":
        return attention | gemma_norms | dense_mlp
    return attention | gemma_norms | dense_mlp | qk_norms  # gemma3


def stacked(shape: tuple, n: int) -> tuple:
    """MaxText's scan: layers on axis 1; experts stay leading, so (experts, layers, ...)."""
    return (shape[0], n, *shape[1:])


def deepseek_leaves(m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's deepseek3 tree (printed from its model): dense_layers then moe_layers; the router bias
    (a MoEBiasVar in the model) under params/params, where from_pretrained restores it, its layers
    stacked on axis 0 as the model stacks it. deepseek2 (q_lora_rank 0): one query kernel, no router bias
    (routed_bias false); deepseek3.2 (use_indexer): the Indexer's wq_b, wk, k_norm (a LayerNorm) and
    weights_proj in every layer's self_attention."""
    c = m.config()
    c = c.get("text_config", c)  # Kimi-K2.5's wrapper: Kimi-K2's decoder in text_config
    emb, heads, L, dense, E = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], \
        c["first_k_dense_replace"], c["n_routed_experts"]
    qk, kv_lora, rope = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    if c.get("q_lora_rank"):
        query = {"self_attention/wq_a/kernel": (emb, c["q_lora_rank"]),
                 "self_attention/q_norm/scale": (c["q_lora_rank"],),
                 "self_attention/wq_b/kernel": (c["q_lora_rank"], heads, qk)}
    else:
        query = {"self_attention/query/kernel": (emb, heads, qk)}
    attention = {"pre_self_attention_layer_norm/scale": (emb,), "post_self_attention_layer_norm/scale": (emb,),
                 **query,
                 "self_attention/wkv_a/kernel": (emb, kv_lora + rope), "self_attention/kv_norm/scale": (kv_lora,),
                 "self_attention/wkv_b/kernel": (kv_lora, heads, c["qk_nope_head_dim"] + c["v_head_dim"]),
                 "self_attention/out/kernel": (heads, c["v_head_dim"], emb)}
    if m.model_type == "deepseek_v32":
        index_heads, index_hd = c["index_n_heads"], c["index_head_dim"]
        attention |= {"self_attention/indexer/wq_b/kernel": (c["q_lora_rank"], index_heads, index_hd),
                      "self_attention/indexer/wk/kernel": (emb, index_hd),
                      "self_attention/indexer/k_norm/scale": (index_hd,),
                      "self_attention/indexer/k_norm/bias": (index_hd,),
                      "self_attention/indexer/weights_proj/kernel": (emb, index_heads)}
    mlp, moe = c["intermediate_size"], c["moe_intermediate_size"]
    dense_layer = attention | {"mlp/wi_0/kernel": (emb, mlp), "mlp/wi_1/kernel": (emb, mlp), "mlp/wo/kernel": (mlp, emb)}
    b = "DeepSeekMoeBlock_0"
    shared = c["n_shared_experts"] * moe
    moe_layer = attention | {f"{b}/shared_experts/wi_0/kernel": (emb, shared),
                             f"{b}/shared_experts/wi_1/kernel": (emb, shared),
                             f"{b}/shared_experts/wo/kernel": (shared, emb), f"{b}/MoeBlock_0/gate/kernel": (emb, E),
                             f"{b}/MoeBlock_0/wi_0": (E, emb, moe), f"{b}/MoeBlock_0/wi_1": (E, emb, moe),
                             f"{b}/MoeBlock_0/wo": (E, moe, emb)}
    leaves = {"params/params/token_embedder/embedding": (c["vocab_size"], emb),
              "params/params/decoder/decoder_norm/scale": (emb,),
              "params/params/decoder/logits_dense/kernel": (emb, c["vocab_size"])}
    for stack, tree, n in (("dense_layers", dense_layer, dense), ("moe_layers", moe_layer, L - dense)):
        for name, shape in tree.items():
            if scan:
                leaves[f"params/params/decoder/{stack}/{name}"] = stacked(shape, n)
            else:
                leaves |= {f"params/params/decoder/{stack}_{i}/{name}": shape for i in range(n)}
        if stack == "moe_layers" and m.model_type != "deepseek_v2":
            bias = f"decoder/{{}}/{b}/MoeBlock_0/gate/bias"
            if scan:
                leaves["params/params/" + bias.format(stack)] = (n, E)
            else:
                leaves |= {"params/params/" + bias.format(f"{stack}_{i}"): (E,) for i in range(n)}
    return leaves


def gpt_oss_leaves(m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's gpt_oss tree (printed from its model): blocks of (sliding, full) scanned as layers_0/1."""
    c = m.config()
    emb, nq, nkv, hd, E, mlp = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], \
        c["num_local_experts"], c["intermediate_size"]
    a, p = "GptOssAttention", "GptOssMlp"
    layer = {"pre_self_attention_layer_norm/scale": (emb,), "post_self_attention_layer_norm/scale": (emb,),
             f"{a}/query/kernel": (emb, nq, hd), f"{a}/query/bias": (nq, hd), f"{a}/key/kernel": (emb, nkv, hd),
             f"{a}/key/bias": (nkv, hd), f"{a}/value/kernel": (emb, nkv, hd), f"{a}/value/bias": (nkv, hd),
             f"{a}/out/kernel": (nq, hd, emb), f"{a}/out/bias": (emb,), f"{a}/sinks": (nq,),
             f"{p}/gate/kernel": (emb, E), f"{p}/gate/bias": (E,), f"{p}/wi_0": (E, emb, mlp), f"{p}/wi_1": (E, emb, mlp),
             f"{p}/wi_0_bias": (E, mlp), f"{p}/wi_1_bias": (E, mlp), f"{p}/wo": (E, mlp, emb), f"{p}/wo_bias": (E, emb)}
    leaves = {"params/params/token_embedder/embedding": (c["vocab_size"], emb),
              "params/params/decoder/decoder_norm/scale": (emb,),
              "params/params/decoder/logits_dense/kernel": (emb, c["vocab_size"])}
    for name, shape in layer.items():
        if scan:
            leaves |= {f"params/params/decoder/layers/layers_{b}/{name}": stacked(shape, m.num_layers // 2) for b in (0, 1)}
        else:
            leaves |= {f"params/params/decoder/layers_{i}/{name}": shape for i in range(m.num_layers)}
    return leaves


def olmo3_leaves(m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's olmo3 tree (its Olmo3DecoderLayer): post-norm, module ``attention``, q/k norms over all heads;
    scanned as blocks of (3 sliding, 1 full) layers, ``layers_0..3``, with no remainder."""
    emb, nq, nkv, hd, mlp = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size
    layer = {"attention/query/kernel": (emb, nq, hd), "attention/key/kernel": (emb, nkv, hd),
             "attention/value/kernel": (emb, nkv, hd), "attention/out/kernel": (nq, hd, emb),
             "attention/query_norm/scale": (nq * hd,), "attention/key_norm/scale": (nkv * hd,),
             "post_self_attention_layer_norm/scale": (emb,), "post_mlp_layer_norm/scale": (emb,),
             "mlp/wi_0/kernel": (emb, mlp), "mlp/wi_1/kernel": (emb, mlp), "mlp/wo/kernel": (mlp, emb)}
    leaves = {"params/params/token_embedder/embedding": (m.vocab_size, emb),
              "params/params/decoder/decoder_norm/scale": (emb,),
              "params/params/decoder/logits_dense/kernel": (emb, m.vocab_size)}
    for name, shape in layer.items():
        if scan:
            leaves |= {f"params/params/decoder/layers/layers_{b}/{name}": stacked(shape, m.num_layers // 4)
                       for b in range(4)}
        else:
            leaves |= {f"params/params/decoder/layers_{i}/{name}": shape for i in range(m.num_layers)}
    return leaves


def decoder_leaves(mt: str, m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """The Llama-style decoders' trees (Llama, Mistral, Qwen, Mixtral, Gemma 2 and 3)."""
    layer, L = layer_tree(mt, m), m.num_layers
    vocab = {"gemma2": 256128, "gemma3": 262144, "gemma3_text": 262144}.get(mt, m.vocab_size)
    leaves = {"params/params/token_embedder/embedding": (vocab, m.hidden_size),
              "params/params/decoder/decoder_norm/scale": (m.hidden_size,)}
    if not m.tie_word_embeddings and not mt.startswith("gemma"):
        leaves["params/params/decoder/logits_dense/kernel"] = (m.hidden_size, m.vocab_size)
    decoder = "params/params/decoder"
    if mt == "gemma2":  # MaxText layer i = HF layers 2i (local) and 2i+1 (global)
        for name, shape in layer.items():
            head, rest = name.split("/", 1)
            for half in ("local", "global"):
                if scan:
                    leaves[f"{decoder}/layers/{head}_{half}/{rest}"] = stacked(shape, L // 2)
                else:
                    leaves |= {f"{decoder}/layers_{i}/{head}_{half}/{rest}": shape for i in range(L // 2)}
        return leaves
    if mt.startswith("gemma3") and scan:  # whole blocks of 6 scanned, the rest unscanned
        blocks, rest = divmod(L, 6)
        for name, shape in layer.items():
            if blocks:
                leaves |= {f"{decoder}/layers/layers_{b}/{name}": stacked(shape, blocks) for b in range(6)}
            leaves |= {f"{decoder}/layers_remainder/layers_{r}/{name}": shape for r in range(rest)}
        return leaves
    for name, shape in layer.items():
        if scan:
            leaves[f"{decoder}/layers/{name}"] = stacked(shape, L)
        else:
            leaves |= {f"{decoder}/layers_{i}/{name}": shape for i in range(L)}
    return leaves


def hybrid_leaves(config: dict, scan: bool) -> dict[str, tuple]:
    """MaxText's qwen3_next / qwen3_5 trees (Qwen3NextDecoderLayer; Qwen3NextScannableBlock's nested scans:
    local_layers on axes (1, 2), global_layer, a remainder; Qwen3_5ScannableBlock's layer_{p} over the periods)."""
    t = config.get("text_config", config)
    emb, heads, kv, hd = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    kh, vh, kd, vd = (t[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    experts, moe, taps = t["num_experts"], t["moe_intermediate_size"], t["linear_conv_kernel_dim"]
    period = t.get("full_attention_interval", 4)
    common = {"input_layernorm/scale": (emb,), "post_attention_layernorm/scale": (emb,),
              "mlp/routed_experts/gate/kernel": (emb, experts), "mlp/shared_expert/wi_0/kernel": (emb, moe),
              "mlp/shared_expert/wi_1/kernel": (emb, moe), "mlp/shared_expert/wo/kernel": (moe, emb),
              "mlp/shared_expert_gate/kernel": (emb, 1)}
    experts_tree = {"mlp/routed_experts/wi_0": (experts, emb, moe), "mlp/routed_experts/wi_1": (experts, emb, moe),
                    "mlp/routed_experts/wo": (experts, moe, emb)}
    linear = common | {"attention/in_proj_qkvz/kernel": (emb, 2 * kh * kd + 2 * vh * vd),
                       "attention/in_proj_ba/kernel": (emb, 2 * vh),
                       "attention/conv1d/kernel": (taps, 1, 2 * kh * kd + vh * vd), "attention/A_log": (vh,),
                       "attention/dt_bias": (vh,), "attention/norm/rms_norm/scale": (vd,),
                       "attention/out_proj/kernel": (vh * vd, emb)}
    full = common | {"attention/attention/query/kernel": (emb, heads, 2 * hd),
                     "attention/attention/key/kernel": (emb, kv, hd), "attention/attention/value/kernel": (emb, kv, hd),
                     "attention/attention/out/kernel": (heads * hd, emb),
                     "attention/attention/query_norm/scale": (hd,), "attention/attention/key_norm/scale": (hd,)}
    layers = t["num_hidden_layers"]
    tree = {"token_embedder/embedding": (t["vocab_size"], emb), "decoder/decoder_norm/scale": (emb,)}
    if not config.get("tie_word_embeddings", False):
        tree["decoder/logits_dense/kernel"] = (emb, t["vocab_size"])

    def stacked(shape: tuple, axes: tuple, expert: bool) -> tuple:  # expert leaves keep the expert axis first
        return (shape[0], *axes, *shape[1:]) if expert or len(shape) > 1 else (*shape, *axes)

    if not scan:
        for i in range(layers):
            kind = full if (i + 1) % period == 0 else linear
            tree |= {f"decoder/layers_{i}/{k}": v for k, v in (kind | experts_tree).items()}
        return {f"params/params/{k}": v for k, v in tree.items()}
    blocks, rest = divmod(layers, period)
    if config["model_type"] == "qwen3_5_moe":  # Qwen3_5ScannableBlock: layer_{p} over the periods
        for p in range(period):
            kind = full if p == period - 1 else linear
            tree |= {f"decoder/layers/layer_{p}/{k}": stacked(v, (blocks,), False) for k, v in kind.items()}
            tree |= {f"decoder/layers/layer_{p}/{k}": stacked(v, (blocks,), True) for k, v in experts_tree.items()}
        return {f"params/params/{k}": v for k, v in tree.items()}
    for prefix, kind, axes in (("decoder/layers/local_layers", linear, (blocks, period - 1)),
                               ("decoder/layers/global_layer", full, (blocks,)),
                               ("decoder/layers_remainder/local_layers", linear, (rest,))):
        if all(axes):
            tree |= {f"{prefix}/{k}": stacked(v, axes, False) for k, v in kind.items()}
            tree |= {f"{prefix}/{k}": stacked(v, axes, True) for k, v in experts_tree.items()}
    return {f"params/params/{k}": v for k, v in tree.items()}



def llama4_leaves(m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's llama4 tree (Llama4DecoderLayer; Llama4ScannableBlock): every ``interleave_moe_layer_step``-th
    layer holds Llama4MoEBlock_0 (MoeBlock_0 and shared_experts), the others a dense mlp; scanned, cycles of 4
    layers (NoPE every 4th) as ``layers/layers_{p}`` over the cycles on axis 1."""
    t = m.config().get("text_config", m.config())
    emb, nq, nkv, hd, E = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], \
        t["num_local_experts"]
    mlp, moe, step, L = t["intermediate_size_mlp"], t["intermediate_size"], t["interleave_moe_layer_step"], \
        t["num_hidden_layers"]
    common = {"self_attention/query/kernel": (emb, nq, hd), "self_attention/key/kernel": (emb, nkv, hd),
              "self_attention/value/kernel": (emb, nkv, hd), "self_attention/out/kernel": (nq, hd, emb),
              "pre_self_attention_layer_norm/scale": (emb,), "post_self_attention_layer_norm/scale": (emb,)}
    dense = common | {"mlp/wi_0/kernel": (emb, mlp), "mlp/wi_1/kernel": (emb, mlp), "mlp/wo/kernel": (mlp, emb)}
    b = "Llama4MoEBlock_0"
    sparse = common | {f"{b}/MoeBlock_0/gate/kernel": (emb, E), f"{b}/MoeBlock_0/wi_0": (E, emb, moe),
                       f"{b}/MoeBlock_0/wi_1": (E, emb, moe), f"{b}/MoeBlock_0/wo": (E, moe, emb),
                       f"{b}/shared_experts/wi_0/kernel": (emb, moe), f"{b}/shared_experts/wi_1/kernel": (emb, moe),
                       f"{b}/shared_experts/wo/kernel": (moe, emb)}
    leaves = {"params/params/token_embedder/embedding": (t["vocab_size"], emb),
              "params/params/decoder/decoder_norm/scale": (emb,)}
    if not m.tie_word_embeddings:
        leaves["params/params/decoder/logits_dense/kernel"] = (emb, t["vocab_size"])
    kind = lambda i: sparse if (i + 1) % step == 0 else dense  # noqa: E731
    for i in range(4 if scan else L):
        for name, shape in kind(i).items():
            if scan:
                leaves[f"params/params/decoder/layers/layers_{i}/{name}"] = stacked(shape, L // 4)
            else:
                leaves[f"params/params/decoder/layers_{i}/{name}"] = shape
    return leaves


def gemma4_leaves(m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's gemma4 tree (Gemma4DecoderLayer; Gemma4ScannableBlock's nested scan: local_layers on axes (1, 2)
    as (blocks, 5), global_layer on axis 1): global layers with their own head dim and KV heads and no value
    kernel (share_kv_projections); MoE layers (Gemma4MoE) with the dense MLP as the shared expert."""
    t = m.config().get("text_config", m.config())
    emb, heads, mlp = t["hidden_size"], t["num_attention_heads"], t["intermediate_size"]

    def layer(hd: int, kv: int, value: bool) -> dict[str, tuple]:
        tree = {"self_attention/query/kernel": (emb, heads, hd), "self_attention/key/kernel": (emb, kv, hd),
                "self_attention/out/kernel": (heads, hd, emb), "self_attention/query_norm/scale": (hd,),
                "self_attention/key_norm/scale": (hd,), "pre_self_attention_norm/scale": (emb,),
                "post_self_attention_norm/scale": (emb,), "pre_ffw_norm/scale": (emb,), "post_ffw_norm/scale": (emb,),
                "layer_scalar": (1,)}
        if value:
            tree["self_attention/value/kernel"] = (emb, kv, hd)
        dense = {"wi_0/kernel": (emb, mlp), "wi_1/kernel": (emb, mlp), "wo/kernel": (mlp, emb)}
        if not t.get("enable_moe_block"):
            return tree | {f"mlp/{k}": v for k, v in dense.items()}
        experts, moe = t["num_experts"], t["moe_intermediate_size"]
        tree |= {f"mlp/moe_block/shared_experts/{k}": v for k, v in dense.items()}
        routed = {"gate/kernel": (emb, experts), "wi_0": (experts, emb, moe), "wi_1": (experts, emb, moe),
                  "wo": (experts, moe, emb), "per_expert_scale": (experts,)}
        tree |= {f"mlp/moe_block/MoeBlock_0/{k}": v for k, v in routed.items()} | {"mlp/pre_forward_scale_2": (emb,)}
        return tree | {f"mlp/{n}/scale": (emb,) for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                                                            "post_feedforward_layernorm_2")}

    layers = t["num_hidden_layers"]
    tree = {"token_embedder/embedding": (262144, emb), "decoder/decoder_norm/scale": (emb,)}
    if t.get("hidden_size_per_layer_input"):
        return {f"params/params/{k}": v for k, v in (tree | gemma4_small_leaves(t, layer)).items()}
    local = layer(t["head_dim"], t["num_key_value_heads"], True)
    full = layer(t["global_head_dim"], t["num_global_key_value_heads"], False)
    if not scan:
        for i in range(layers):
            tree |= {f"decoder/layers_{i}/{k}": v for k, v in (full if i % 6 == 5 else local).items()}
    else:
        blocks = layers // 6
        tree |= {f"decoder/scanned_blocks/local_layers/{k}": (v[0], blocks, 5, *v[1:]) for k, v in local.items()}
        tree |= {f"decoder/scanned_blocks/global_layer/{k}": stacked(v, blocks) for k, v in full.items()}
    return {f"params/params/{k}": v for k, v in tree.items()}


def gemma4_small_leaves(t: dict, layer: Callable) -> dict[str, tuple]:
    """MaxText's gemma4_small tree (E2B / E4B; unscanned only): Gemma4SmallPLE under decoder/per_layer_embedder;
    layers of 4 (E2B) or 5 sliding + 1 full, global ones with the local KV heads and a value kernel; the last
    num_kv_shared_layers without key, value or key norm, their MLP doubled with use_double_wide_mlp; every layer
    with its per-layer input gate, projection and norm."""
    emb, ple, layers = t["hidden_size"], t["hidden_size_per_layer_input"], t["num_hidden_layers"]
    period = t["layer_types"].index("full_attention") + 1
    first_shared = layers - t["num_kv_shared_layers"]
    tree = {"decoder/per_layer_embedder/embed_tokens_per_layer": (t["vocab_size_per_layer_input"], layers * ple),
            "decoder/per_layer_embedder/per_layer_model_projection/kernel": (emb, layers * ple),
            "decoder/per_layer_embedder/per_layer_projection_norm/scale": (ple,)}
    for i in range(layers):
        hd = t["global_head_dim"] if i % period == period - 1 else t["head_dim"]
        leaves = layer(hd, t["num_key_value_heads"], True)
        if i >= first_shared:
            leaves = {k: v for k, v in leaves.items() if k.split("/")[1:2] not in (["key"], ["value"], ["key_norm"])}
            if t["use_double_wide_mlp"]:
                mlp = 2 * t["intermediate_size"]
                leaves |= {"mlp/wi_0/kernel": (emb, mlp), "mlp/wi_1/kernel": (emb, mlp), "mlp/wo/kernel": (mlp, emb)}
        leaves |= {"per_layer_input_gate/kernel": (emb, ple), "per_layer_projection/kernel": (ple, emb),
                   "post_per_layer_input_norm/scale": (emb,)}
        tree |= {f"decoder/layers_{i}/{k}": v for k, v in leaves.items()}
    return tree


def unscanned_only(model: synth.SynthModel, multimodal: bool = False) -> bool:
    """A model MaxText's code runs unscanned only (Gemma 4 E2B / E4B; Qwen3-VL with its vision tower): its
    scanned conversion is refused."""
    family = BY_MODEL_TYPE[model.model_type]
    try:
        family.layout(with_encoders("config.json", family, read_spec(family, model.config(), "config.json"),
                                    multimodal), True)
    except UnscannedOnly:
        return True
    return False


# MaxText's tree per family, restated: a family added to the registry needs its own here (the registry test checks).
def deepseek_v4_leaves(m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    """MaxText's deepseek4 tree, as its to_maxtext wrote it for a 5-layer model (bench/compare_deepseek_v4.py):
    every layer's attention, mHC (pre/post/res parts and a float32 mhc_norm of k * emb), shared expert and routed
    MoE; CSA layers a csa_compressor with its indexer, HCA layers an hca_compressor; the hash layers' tid2eid and
    the others' router bias under params/params (MaxText's own converter: Tid2EidVar, MoEBiasVar). Scanned: the
    hash layers unscanned, scanned_blocks/layers_0 the HCA layers and layers_1 the CSA ones, on axis 1 (the bias
    and tid2eid on axis 0)."""
    c = m.config()
    emb, heads, hd, k = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["hc_mult"]
    E, moe, V, ql = c["n_routed_experts"], c["moe_intermediate_size"], c["vocab_size"], c["q_lora_rank"]
    og, ol, ih, ihd = c["o_groups"], c["o_lora_rank"], c["index_n_heads"], c["index_head_dim"]

    def layer(ratio: int, hashed: bool) -> dict[str, tuple]:
        out = {"pre_self_attention_layer_norm/scale": (emb,), "post_self_attention_layer_norm/scale": (emb,),
               "self_attention/wq_a/kernel": (emb, ql), "self_attention/q_norm/scale": (ql,),
               "self_attention/wq_b/kernel": (ql, heads, hd), "self_attention/wkv/kernel": (emb, 1, hd),
               "self_attention/kv_norm/scale": (hd,), "self_attention/sinks": (heads,),
               "self_attention/o_a_proj/kernel": (og, heads * hd // og, ol), "self_attention/o_b_proj/kernel": (og * ol, emb),
               "mlp/MoeBlock_0/gate/kernel": (emb, E), "mlp/MoeBlock_0/wi_0": (E, emb, moe),
               "mlp/MoeBlock_0/wi_1": (E, emb, moe), "mlp/MoeBlock_0/wo": (E, moe, emb),
               "mlp/shared_experts/wi_0/kernel": (emb, moe), "mlp/shared_experts/wi_1/kernel": (emb, moe),
               "mlp/shared_experts/wo/kernel": (moe, emb)}
        for mod in ("mhc_attention", "mhc_mlp"):
            out |= {f"{mod}/mhc_norm/scale": (k * emb,), f"{mod}/pre_alpha": (k * emb, k), f"{mod}/post_alpha": (k * emb, k),
                    f"{mod}/res_alpha": (k * emb, k * k), f"{mod}/pre_beta": (k,), f"{mod}/post_beta": (k,),
                    f"{mod}/res_beta": (k, k), **{f"{mod}/{p}_alpha_scale": (1,) for p in ("pre", "post", "res")}}
        comp = {4: ("self_attention/csa_compressor", 2 * hd), 128: ("self_attention/hca_compressor", hd)}.get(ratio)
        if comp:
            out |= {f"{comp[0]}/gate_proj/kernel": (emb, comp[1]), f"{comp[0]}/kv_proj/kernel": (emb, comp[1]),
                    f"{comp[0]}/kv_norm/scale": (hd,), f"{comp[0]}/position_bias": (ratio, comp[1])}
        if ratio == 4:
            i = "self_attention/csa_compressor/indexer"
            out |= {f"{i}/gate_proj/kernel": (emb, 2 * ihd), f"{i}/kv_proj/kernel": (emb, 2 * ihd),
                    f"{i}/kv_norm/scale": (ihd,), f"{i}/position_bias": (4, 2 * ihd),
                    f"{i}/weights_proj/kernel": (emb, ih), f"{i}/q_proj/kernel": (ql, ih * ihd)}
        return {f"params/params/{name}": shape for name, shape in out.items()} | (
            {"params/params/mlp/MoeBlock_0/tid2eid": (V, c["num_experts_per_tok"])} if hashed
            else {"params/params/mlp/MoeBlock_0/gate/bias": (E,)})

    def place(prefix: str, leaves: dict[str, tuple], count: int = 0) -> dict[str, tuple]:
        out = {}
        for name, shape in leaves.items():
            collection, rest = name.split("/", 2)[1], name.split("/", 2)[2]
            if count:
                axis = 0 if rest.endswith(("gate/bias", "tid2eid")) else 1
                shape = (*shape[:axis], count, *shape[axis:])
            out[f"params/{collection}/decoder/{prefix}/{rest}"] = shape
        return out

    ratios, hashed = c["compress_ratios"], c["num_hash_layers"]
    leaves = {"params/params/token_embedder/embedding": (V, emb), "params/params/decoder/decoder_norm/scale": (emb,),
              "params/params/decoder/logits_dense/kernel": (emb, V), "params/params/decoder/hc_head/hc_fn": (k * emb, k),
              "params/params/decoder/hc_head/hc_base": (k,), "params/params/decoder/hc_head/hc_scale": (1,)}
    for i in range(len(ratios) if not scan else hashed):
        leaves |= place(f"layers_{i}", layer(ratios[i], i < hashed))
    if scan:
        rest = len(ratios) - hashed
        leaves |= place("scanned_blocks/layers_0", layer(128, False), rest // 2)
        leaves |= place("scanned_blocks/layers_1", layer(4, False), rest // 2)
    return leaves


MAXTEXT_TREES: dict[str, Callable[[str, synth.SynthModel, bool], dict[str, tuple]]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3"), decoder_leaves),
    "deepseek": lambda mt, m, scan: deepseek_leaves(m, scan),
    "kimi_k25": lambda mt, m, scan: deepseek_leaves(m, scan),
    "gpt_oss": lambda mt, m, scan: gpt_oss_leaves(m, scan),
    "deepseek_v4": lambda mt, m, scan: deepseek_v4_leaves(m, scan),
    "olmo3": lambda mt, m, scan: olmo3_leaves(m, scan),
    "qwen3_next": lambda mt, m, scan: hybrid_leaves(m.config(), scan),
    "qwen3_5_moe": lambda mt, m, scan: hybrid_leaves(m.config(), scan),
    "llama4": lambda mt, m, scan: llama4_leaves(m, scan),
    "gemma4": lambda mt, m, scan: gemma4_leaves(m, scan),
    # the multimodal wrappers' text decoders: MaxText's qwen3 / qwen3_moe decoder blocks (configs/models/qwen3-vl-*,
    # qwen3-omni-30b-a3b.yml), the same tree as the text-only model of the same sizes
    "qwen3_vl": lambda mt, m, scan: decoder_leaves("qwen3", replace(m, model_type="qwen3"), scan),
    "qwen3_vl_moe": lambda mt, m, scan: decoder_leaves("qwen3_moe", replace(m, model_type="qwen3_moe"), scan),
    "qwen3_omni_moe": lambda mt, m, scan: decoder_leaves("qwen3_moe", replace(m, model_type="qwen3_moe"), scan),
}


def maxtext_leaves(mt: str, m: synth.SynthModel, scan: bool) -> dict[str, tuple]:
    return MAXTEXT_TREES[BY_MODEL_TYPE[mt].name](mt, m, scan)


def model_for(mt: str, tied: bool, layers: int = 3) -> synth.SynthModel:
    if mt in ("deepseek_v3", "kimi_k2", "deepseek_v32"):
        return synth.SynthModel(model_type=mt, num_layers=layers, num_experts=6, moe_intermediate_size=48,
                                quantization="fp8" if tied else None)
    if mt == "deepseek_v2":  # no FP8 release: "tied" picks a model with a query LoRA (DeepSeek-V2's 236B)
        return synth.SynthModel(model_type=mt, num_layers=layers, num_experts=6, moe_intermediate_size=48,
                                config_overrides={"q_lora_rank": 24} if tied else {})
    if mt == "deepseek_v4":  # 3 hash layers, then an HCA and a CSA layer ("tied": 7 layers, two scanned pairs)
        return synth.SynthModel(model_type=mt, num_layers=7 if tied else 5, hidden_size=128, num_heads=4, head_dim=64,
                                num_experts=8, moe_intermediate_size=64, vocab_size=256)
    if mt == "gpt_oss":
        return synth.SynthModel(model_type=mt, num_layers=4, num_experts=6, quantization="mxfp4" if tied else None)
    if mt == "olmo3":  # ("tied" picks an Instruct release's YaRN; OLMo 3 is never tied)
        return synth.SynthModel(model_type=mt, num_layers=8, num_kv_heads=1,
                                config_overrides={"rope_scaling": olmo3.YARN} if tied else {})
    if mt.startswith("gemma4"):  # one block of 6; gemma4: 26B-A4B's MoE layers, gemma4_text: 31B's dense ones
        return synth.SynthModel(model_type=mt, num_layers=6, vocab_size=96, num_experts=4 if mt == "gemma4" else 0,
                                moe_intermediate_size=32)
    if mt.startswith("gemma"):
        return synth.SynthModel(model_type=mt, num_layers={"gemma2": 4}.get(mt, 8), vocab_size=96)
    if mt.startswith("llama4"):  # whole cycles of 4, Maverick's pattern (dense and MoE layers alternate)
        return synth.SynthModel(model_type=mt, tie_word_embeddings=tied, num_layers=8, num_experts=4,
                                moe_intermediate_size=32, config_overrides={"interleave_moe_layer_step": 2})
    if mt in ("qwen3_next", "qwen3_5_moe"):  # whole periods of 4 (Qwen3-Next: and a remainder of 2)
        return synth.SynthModel(model_type=mt, tie_word_embeddings=tied, num_layers=6 if mt == "qwen3_next" else 8,
                                num_experts=4, moe_intermediate_size=32)
    return synth.SynthModel(model_type=mt, tie_word_embeddings=tied, num_layers=layers,
                            num_experts=6 if mt in ("qwen3_moe", "mixtral", "qwen3_vl_moe", "qwen3_omni_moe") else 0, moe_intermediate_size=48)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_plan_matches_maxtext_tree(tmp_path, model_type, tied, scan):
    if model_type.startswith("gemma") and not tied:
        pytest.skip("Gemma is always tied")  # (for DeepSeek and gpt-oss, "tied" picks the quantised release)
    model = model_for(model_type, tied)
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=scan, devices=4)
    assert {leaf.name: leaf.shape for leaf in plan.leaves} == maxtext_leaves(model_type, model, scan)
    assert plan.tensor_count == len(synth.tensor_shapes(model))


# Every example a family declares (its round-trip, logit and memory models, and the whole releases those stand
# for), planned from header-only files: the same tree as MaxText's, scanned and not. A memory example's whole
# release (``-full``) is checked by test_whole_release_plans_like_its_example, which plans it anyway.
EXAMPLES = {f"{kind}-{example.name}" + suffix: (family, fields)
            for family in FAMILIES
            for kind, examples in (("round_trip", family.synthetic.round_trip), ("logits", family.synthetic.logits),
                                   ("memory", family.synthetic.memory))
            for example in examples
            for suffix, fields in (("", example.model), ("-fewer", getattr(example, "fewer", None)),
                                   ("-full", getattr(example, "full", None)))
            if fields and not (kind == "memory" and suffix == "-full")}


@pytest.fixture(scope="module")
def header_only(tmp_path_factory) -> Callable:
    """Header-only files of a family's model, written once per module: each is planned scanned and not, and a
    memory example again beside its whole release (Kimi-K2.6's 208 000 headers take seconds to write)."""
    written: dict[tuple[str, str], Path] = {}

    def write(family, fields) -> Path:
        key = (family.name, repr(fields))
        if key not in written:
            path = tmp_path_factory.mktemp("header-only")
            synth.write_checkpoint(synth.for_family(family, fields), str(path), max_shard_bytes=5 * 10**9,
                                   header_only=True)
            written[key] = path
        return written[key]
    return write


def _assert_maxtexts_tree(path: Path, model: synth.SynthModel, scan: bool, plan=None) -> None:
    """Planned on 16 devices (or ``plan``, made so), ``model``'s files give MaxText's tree; scanned, a model MaxText
    runs unscanned only is refused."""
    if plan is None:
        if scan and unscanned_only(model):
            with pytest.raises(BadInputError, match="unscanned only"):
                make_plan(LocalSource(str(path)), scan_layers=scan, devices=16)
            return
        plan = make_plan(LocalSource(str(path)), scan_layers=scan, devices=16)
    assert (plan.devices, plan.scan_layers) == (16, scan)
    assert {leaf.name: leaf.shape for leaf in plan.leaves} == maxtext_leaves(model.model_type, model, scan)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_plans_maxtexts_tree(header_only, name, scan):
    family, fields = EXAMPLES[name]
    _assert_maxtexts_tree(header_only(family, fields), synth.for_family(family, fields), scan)


def test_every_registered_family_is_complete():
    """What a family's tests are derived from is there for every registered family: its synthetic config.json
    (for each of its model types), at least one round-trip, logit and memory example (names unique per kind;
    a family with encoders, a round trip with them: ``Example.multimodal``),
    MaxText's run-time semantics for the reference forward pass, MaxText's tree restated here, and a row in the
    README's table of supported families and a section in docs/families.md, what is written for it."""
    from tests.test_logits import SEMANTICS

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    sections = [line.split(":")[0] for line in (root / "docs" / "families.md").read_text().splitlines()
                if line.startswith("### `")]
    missing = []
    for family in FAMILIES:
        for kind in ("round_trip", "logits", "memory"):
            if not getattr(family.synthetic, kind):
                missing.append(f"{family.name}: no {kind} example")
        for mt in family.model_types:
            config = synth.SynthModel(model_type=mt).config()
            if config["model_type"] != mt:
                missing.append(f"{family.name}: its synthetic config.json for {mt!r} says {config['model_type']!r}")
            if not any(f"`{mt}`" in row.split("|")[1] for row in rows):
                missing.append(f"{family.name}: no README row for {mt!r}")
            if not any(f"`{mt}`" in section for section in sections):
                missing.append(f"{family.name}: no section for {mt!r} in docs/families.md")
        if family.encoders and not any(example.multimodal for example in family.synthetic.round_trip):
            missing.append(f"{family.name}: encoders {family.encoders} but no --multimodal round-trip example")
        by_logits = any(example.reference == "transformers" for example in family.synthetic.logits)
        if by_logits and family.name not in SEMANTICS:
            missing.append(f"{family.name}: no entry in tests/test_logits.py SEMANTICS")
        if family.name not in MAXTEXT_TREES:
            missing.append(f"{family.name}: no MaxText tree in tests/test_families.py MAXTEXT_TREES")
    for kind in ("round_trip", "logits", "memory"):
        names = [example.name for family in FAMILIES for example in getattr(family.synthetic, kind)]
        missing += [f"{kind} example {name!r} named twice" for name in sorted(set(names)) if names.count(name) > 1]
    assert missing == []


def test_gemma3_scan_with_fewer_layers_than_a_block(tmp_path):
    model = synth.SynthModel(model_type="gemma3", num_layers=4, vocab_size=96)
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=True, devices=1)
    assert {leaf.name: leaf.shape for leaf in plan.leaves} == maxtext_leaves("gemma3", model, True)
    assert not any("/layers/layers_" in leaf.name for leaf in plan.leaves)


def test_registry_is_consistent():
    assert len(BY_MODEL_TYPE) == sum(len(f.model_types) for f in FAMILIES), "a model_type is claimed twice"
    for family in FAMILIES:
        # one active rule per name and per target in every layer kind, for every example the family declares (with
        # and without its encoders): rules of disjoint kinds may share them (Gemma 4's q_proj, read by a local and
        # a global rule, each in its own layers' shape), and so may rules never active together (Llama 4's fused
        # bf16 experts and its FP8 release's per-expert ones both write wi_0)
        examples = [e.model for kind in ("round_trip", "logits", "memory") for e in getattr(family.synthetic, kind)]
        for fields, encoders in itertools.product(examples, (False, True) if family.encoders else (False,)):
            model = synth.for_family(family, fields)
            spec = with_encoders("example", family, read_spec(family, model.config(), "example"), encoders)
            # each kind of stack the layout holds (a decoder's kinds, an encoder's), with the rules that read it
            try:
                layout = family.layout(spec, False)
            except LayoutError:  # refused (--multimodal for a text-only checkpoint: gemma3_text)
                continue
            stacks = {(stack.kind, stack.encoder): stack for stack in layout}.values()
            for stack in stacks:
                kind = stack.kind
                rules = [rule for rule in family.active_rules(spec) if not rule.per_layer or applies(rule, stack)]
                hf_names = [rule.hf for rule in rules]
                assert len(hf_names) == len(set(hf_names)), (family.name, kind, fields)
                targets = [(rule.per_layer, output.path) for rule in rules for output in rule.outputs]
                assert len(targets) == len(set(targets)), (family.name, kind, fields)
        for rule in family.rules:
            assert rule.outputs and rule.hf_shape and all(isinstance(d, str) for d in rule.hf_shape)
            assert rule.when is always or rule.note, f"{rule.hf}: a conditional rule must say why it may be skipped"
        assert family.decoder_block and family.model_types


TRANSFORMERS_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                        "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
                        "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "gpt_oss": "GptOssConfig",
                        "deepseek_v3": "DeepseekV3Config", "olmo3": "Olmo3Config", "deepseek_v2": "DeepseekV2Config",
                        "deepseek_v32": "DeepseekV32Config"}


@pytest.mark.parametrize("model_type", TRANSFORMERS_CONFIGS)
def test_configs_written_by_transformers_parse(model_type):
    transformers = pytest.importorskip("transformers")
    # DeepSeek's multi-head latent attention: as many KV heads as query heads
    mla = {"num_key_value_heads": 4, "first_k_dense_replace": 1} if model_type.startswith("deepseek") else {}
    config = getattr(transformers, TRANSFORMERS_CONFIGS[model_type])(  # OLMo 3: whole blocks of 4 layers
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4 if model_type == "olmo3" else 2,
        num_attention_heads=4, **{"num_key_value_heads": 2, "head_dim": 16, **mla})
    data = json.loads(config.to_json_string())
    spec = read_spec(family_for(data["model_type"], "config.json"), data, "config.json")
    assert (spec.dim("emb"), spec.dim("heads")) == (64, 4)
    if not model_type.startswith("deepseek"):
        assert (spec.dim("kv_heads"), spec.dim("hd")) == (2, 16)


def test_gemma3_hub_config_relies_on_transformers_defaults():
    """gemma-3-4b-it's config.json as published: text_config gives only a few fields."""
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
              "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
              "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
              "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    spec = read_spec(BY_MODEL_TYPE["gemma3"], config, "config.json")
    assert spec.num_layers == 34
    assert {k: spec.dim(k) for k in ("vocab", "emb", "heads", "kv_heads", "hd", "mlp", "maxtext_vocab")} == {
        "vocab": 262208, "emb": 2560, "heads": 8, "kv_heads": 4, "hd": 256, "mlp": 10240, "maxtext_vocab": 262144}
    assert spec.value("embed_scale") == 50.5  # sqrt(2560) = 50.596 rounded to bfloat16, as MaxText computes it


def test_llama3_rope_scaling_turns_on_interleave():
    llama31 = synth.SynthModel(model_type="llama", config_overrides={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert read_spec(BY_MODEL_TYPE["llama"], llama31.config(), "c").value("interleave_rope")
    llama2 = synth.SynthModel(model_type="llama")
    assert not read_spec(BY_MODEL_TYPE["llama"], llama2.config(), "c").value("interleave_rope")


@pytest.mark.parametrize("model_type, field, value, message", [
    ("llama", "quantization_config", {"bits": 4}, "unknown field(s) 'quantization_config'"),
    ("llama", "hidden_act", "gelu", "'hidden_act' = 'gelu' is not supported"),
    ("llama", "attention_bias", True, "'attention_bias' = True is not supported"),
    ("llama", "num_hidden_layers", 0, "'num_hidden_layers' must be an integer >= 1"),
    ("llama", "sliding_window", 4096, "unknown field(s) 'sliding_window'"),  # fields are per family now
    ("llama", "attn_logit_softcapping", 50.0, "unknown field(s) 'attn_logit_softcapping'"),
    ("qwen3_moe", "mlp_only_layers", [1], "'mlp_only_layers' = [1] is not supported"),
    ("qwen3_moe", "decoder_sparse_step", 2, "'decoder_sparse_step' = 2 is not supported"),
    ("gemma2", "num_hidden_layers", 3, "num_hidden_layers=3 is odd"),
    ("gemma2", "hidden_activation", "silu", "'hidden_activation' = 'silu' is not supported"),
    ("gemma2", "layer_types", ["full_attention", "sliding_attention"] * 2, "not the pattern MaxText runs"),
    ("gemma2", "tie_word_embeddings", False, "'tie_word_embeddings' = False is not supported"),
    ("gemma2", "sliding_window_size", 32, "sliding_window_size=32 differs from sliding_window=64"),
    ("gemma2", "sliding_window_size", 64, None),  # gemma-2-9b's config.json repeats the window: accepted
    ("mixtral", "num_experts", 3, r"expert counts disagree"),
    ("gemma3", "sliding_window_pattern", 4, "'sliding_window_pattern' = 4 is not supported"),
    ("gemma3", "rms_norm_eps", float("nan"), None),
    ("olmo3", "num_hidden_layers", 6, "num_hidden_layers=6 is not a multiple of 4"),
    ("olmo3", "layer_types", ["sliding_attention", "full_attention"] * 2, "not the pattern MaxText runs"),
    ("olmo3", "tie_word_embeddings", True, "'tie_word_embeddings' = True is not supported"),
    ("olmo3", "attention_bias", True, "'attention_bias' = True is not supported"),
    ("olmo3", "hidden_act", "gelu", "'hidden_act' = 'gelu' is not supported"),
    ("olmo3", "sliding_window", 4096, None),
])
def test_config_errors_name_the_field(model_type, field, value, message):
    model = synth.SynthModel(model_type=model_type, num_layers=4, config_overrides={field: value})
    family = BY_MODEL_TYPE[model_type]
    if message is None:  # accepted as a runtime setting: recorded, not refused
        spec = read_spec(family, model.config(), "config.json")
        assert field in str(spec.runtime) or field == "sliding_window_size"
        return
    pattern = message if message.startswith("expert") else (
        message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"))
    with pytest.raises(BadInputError, match=pattern):
        read_spec(family, model.config(), "config.json")


def test_gemma3_nested_config_errors_name_text_config():
    config = synth.SynthModel(model_type="gemma3", num_layers=6).config()
    config["text_config"]["mystery"] = 1
    with pytest.raises(BadInputError, match=r"config.json: text_config: unknown field\(s\) 'mystery'"):
        read_spec(BY_MODEL_TYPE["gemma3"], config, "config.json")


def test_unconverted_tensors_are_reported(tmp_path):
    """A vision tower and a tied head are named in the plan, not silently dropped or refused."""
    model = synth.SynthModel(model_type="gemma3", num_layers=6, vocab_size=262210, hidden_size=16, head_dim=4,
                             intermediate_size=32, extra_tensors={
                                 "vision_tower.vision_model.embeddings.patch_embedding.weight": (8, 3, 14, 14),
                                 "multi_modal_projector.mm_input_projection_weight": (8, 16)})
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), devices=1)
    whats = {entry["what"]: entry for entry in plan.not_converted}
    assert whats["vision tower"]["tensors"] == 1 and whats["multimodal projector"]["tensors"] == 1
    dropped = [w for w in whats if w.startswith("rows 262144..262209")]
    assert dropped and whats[dropped[0]]["bytes"] == 66 * 16 * 2
    tied = synth.SynthModel(model_type="qwen3", extra_tensors={"lm_head.weight": (512, 64)})
    synth.write_checkpoint(tied, str(tmp_path / "tied"))
    plan = make_plan(LocalSource(str(tmp_path / "tied")), devices=1)
    assert [e["tensors"] for e in plan.not_converted] == [["lm_head.weight"]]


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Kimi-K2", "Kimi-K2-Thinking", "gpt-oss-20b", "gpt-oss-120b",
                                  "DeepSeek-V3.2"])
def test_published_giant_configs_parse(name):
    from tests.published_configs import PUBLISHED

    config = PUBLISHED[name]
    spec = read_spec(family_for(config["model_type"], "config.json"), config, "config.json")
    assert spec.num_layers == config["num_hidden_layers"]
    expected = {"gpt_oss": "mxfp4"}.get(config["model_type"], "fp8-block-128")
    assert spec.value("quantization") == ("int4-group-32" if name == "Kimi-K2-Thinking" else expected)


@pytest.mark.parametrize("name, hidden, heads, kv_heads, layers", [
    ("Olmo-3-7B-Instruct", 4096, 32, 32, 32), ("Olmo-3.1-32B-Instruct", 5120, 40, 8, 64)])
def test_olmo3_published_configs_parse(name, hidden, heads, kv_heads, layers):
    """The releases' config.json (transformers 4.57's form: rope_scaling YaRN, layer_types, no head_dim)."""
    from tests.published_configs import PUBLISHED

    spec = read_spec(BY_MODEL_TYPE["olmo3"], PUBLISHED[name], "config.json")
    assert spec.num_layers == layers
    assert {k: spec.dim(k) for k in ("emb", "heads", "kv_heads", "hd", "q", "kv", "mlp", "vocab")} == {
        "emb": hidden, "heads": heads, "kv_heads": kv_heads, "hd": 128, "q": heads * 128, "kv": kv_heads * 128,
        "mlp": PUBLISHED[name]["intermediate_size"], "vocab": 100278}
    assert spec.runtime["rope_scaling"]["rope_type"] == "yarn" and spec.runtime["sliding_window"] == 4096


@pytest.mark.parametrize("field, value, message", [
    ("rope_interleave", False, "'rope_interleave' = False is not supported"),
    ("num_nextn_predict_layers", "1", "must be an integer >= 0"),
    ("n_shared_experts", 0, "always has shared experts"),
    ("first_k_dense_replace", 62, "first_k_dense_replace=62 exceeds num_hidden_layers=61"),
])
def test_deepseek_config_errors(field, value, message):
    from tests.published_configs import DEEPSEEK_V3

    with pytest.raises(BadInputError, match=message):
        read_spec(BY_MODEL_TYPE["deepseek_v3"], {**DEEPSEEK_V3, field: value}, "config.json")


def test_deepseek_without_query_lora_and_dense_layers():
    """q_lora_rank 0 or null (DeepSeek-V2-Lite style queries) and first_k_dense_replace 0 are valid."""
    from tests.published_configs import DEEPSEEK_V3

    for q_lora in (0, None):
        spec = read_spec(BY_MODEL_TYPE["deepseek_v3"], {**DEEPSEEK_V3, "q_lora_rank": q_lora,
                                                        "first_k_dense_replace": 0}, "config.json")
        assert not spec.value("q_lora") and spec.value("dense_layers") == 0


def test_deepseek_v2_lite_published_config_parses():
    """DeepSeek-V2-Lite: queries without LoRA (q_lora_rank null), 2 shared experts, softmax routing: no router
    bias and no MTP layer expected; its 27 layers are 1 dense + 26 MoE."""
    from tests.published_configs import DEEPSEEK_V2_LITE

    spec = read_spec(BY_MODEL_TYPE["deepseek_v2"], DEEPSEEK_V2_LITE, "config.json")
    assert spec.num_layers == 27 and spec.value("dense_layers") == 1 and spec.value("mtp_layers") == 0
    assert not spec.value("q_lora") and not spec.value("router_bias") and not spec.value("indexer")
    assert (spec.dim("q"), spec.dim("shared_mlp"), spec.dim("experts")) == (16 * 192, 2 * 1408, 64)
    assert spec.value("quantization") is None


def test_deepseek_v32_indexer_needs_the_query_latent():
    from tests.published_configs import DEEPSEEK_V32

    spec = read_spec(BY_MODEL_TYPE["deepseek_v32"], DEEPSEEK_V32, "config.json")
    assert (spec.dim("index_heads"), spec.dim("index_hd"), spec.dim("index_q")) == (64, 128, 8192)
    assert spec.value("indexer") and spec.value("router_bias") and spec.value("mtp_layers") == 1
    with pytest.raises(BadInputError, match="the indexer reads the query latent"):
        read_spec(BY_MODEL_TYPE["deepseek_v32"], {**DEEPSEEK_V32, "q_lora_rank": None}, "config.json")


def test_deepseek_v32_layer_kinds_transformers_writes_must_agree():
    """transformers 5's DeepseekV32Config writes mlp_layer_types and layer_types: read as the layout assumes them,
    refused in one line naming the field when they say otherwise."""
    from tests.published_configs import DEEPSEEK_V32

    kinds = {"mlp_layer_types": ["dense"] * 3 + ["sparse"] * 58, "layer_types": ["indexed_attention"] * 61}
    read_spec(BY_MODEL_TYPE["deepseek_v32"], {**DEEPSEEK_V32, **kinds}, "config.json")
    with pytest.raises(BadInputError, match="mlp_layer_types must be 3 'dense' then 'sparse'"):
        read_spec(BY_MODEL_TYPE["deepseek_v32"], {**DEEPSEEK_V32, **kinds, "mlp_layer_types": ["sparse"] * 61},
                  "config.json")
    with pytest.raises(BadInputError, match="layer_types must be 'indexed_attention' in every layer"):
        read_spec(BY_MODEL_TYPE["deepseek_v32"], {**DEEPSEEK_V32, **kinds, "layer_types": ["full_attention"] * 61},
                  "config.json")


MEMORY_FULL = {example.name: (family, example) for family in FAMILIES for example in family.synthetic.memory
               if example.full}


@pytest.mark.parametrize("name", MEMORY_FULL)
def test_whole_release_plans_like_its_example(header_only, name):
    """The whole release (``full``'s config.json, header-only files) is predicted no higher than the example the
    memory test (tests/test_memory.py) converts (+64 MiB: the OCDBT node cache grows with the chunk count, full by then), on each device
    count: what holds at the example's widths holds for the release. Planning only, so it runs with the rest.
    On 16 devices the release also gives MaxText's tree, scanned and not (the ``-full`` cases of
    test_every_example_plans_maxtexts_tree, from the plan made here: a giant release's plan takes seconds)."""
    from ckptconv.plan.estimate import predicted_peak_bytes

    family, example = MEMORY_FULL[name]
    paths = {kind: header_only(family, fields) for kind, fields in (("example", example.model), ("full", example.full))}
    assert 16 in example.devices
    for devices in example.devices:
        case = predicted_peak_bytes(make_plan(LocalSource(str(paths["example"])), devices=devices))
        plan = make_plan(LocalSource(str(paths["full"])), devices=devices)
        full = predicted_peak_bytes(plan)
        print(f"{name} on {devices} devices: example predicted {case / MIB:.0f} MiB, whole release {full / MIB:.0f} MiB")
        assert full <= case + 64 * MIB
        if devices == 16:
            model = synth.for_family(family, example.full)
            for scan in (True, False):
                _assert_maxtexts_tree(paths["full"], model, scan, plan if scan == plan.scan_layers else None)
        del plan
