"""A small NumPy forward pass over a MaxText *layout* parameter tree (dense, MoE and Gemma decoders).

It follows MaxText's semantics, not HF's: kernels are (in, ..., out) einsums, heads are
their own axis, queries of Llama/Mistral/Mixtral/Gemma 2 arrive pre-scaled in the weights
while Qwen and Gemma 3 scale at run time, Llama 3.1+ rotates *interleaved* pairs while the
others rotate halves, norm scales are used as stored (Gemma's ``1 + w`` is in the weights),
Gemma's embedding carries sqrt(hidden) and its tied logits are divided by it again, experts
are stacked on a leading axis, and tied models take logits from the embedding. OLMo 3's blocks
are post-norm (each branch's output normalised before the residual add) and its q/k norms span
all heads (a ``(heads * head_dim,)`` scale). DeepSeek's multi-head latent attention runs from its
low-rank kernels (RoPE on the interleaved pairs of the rope dimensions, one rope key shared by all
heads) and its MoE routes by sigmoid scores plus the router bias (stacked on axis 0 when scanned).
Llama 4 skips RoPE on every 4th layer (NoPE; there its queries are temperature-tuned), L2-normalises
q and k after RoPE on the others, and scales each chosen expert's *input* by the sigmoid of its
router logit, beside a shared expert.
If a conversion gets any of that wrong, logits differ from the HF model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Semantics:
    """What a MaxText decoder block does at run time, per family (MaxText 0.2.5)."""

    family: str
    num_layers: int
    eps: float
    theta: float
    rope_scaling: dict | None = None
    interleaved: bool = False
    runtime_query_scale: bool = False  # Qwen, Gemma 3: queries scaled by 1/sqrt(head_dim) at run time
    # "softmax_topk" (Qwen3-MoE), "topk_softmax" (Mixtral), "gpt_oss" (biases, clamped SwiGLU) or "deepseek"
    # (sigmoid scores, biased choice, routed_scaling_factor, shared experts)
    moe: str | None = None
    top_k: int = 2
    gemma: bool = False  # four norms, GELU, embedding scaled, logits divided by sqrt(hidden)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # plain | gemma2 (local/global pairs) | gemma3 (blocks of 6) | gpt_oss, olmo3 (blocks of 2, 4) | deepseek
    # (``dense_layers`` then ``moe_layers``; extra["dense_layers"] of them dense) | llama4 (cycles of
    # extra["cycle"]; extra["nope_interval"], extra["use_qk_norm"], extra["floor_scale"], extra["attn_scale"])
    layout: str = "plain"
    post_norm: bool = False  # OLMo 3: no pre-norms; attention and MLP outputs normalised before the residual add
    sliding_window: int | None = None  # tokens a sliding layer sees (itself included)
    sliding_layers: tuple[bool, ...] = ()  # per position in the layer pattern, repeated: is that layer sliding
    extra: dict = field(default_factory=dict)


def rms_norm(x, scale, eps):
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale.astype(np.float32)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling and scaling.get("rope_type") == "llama3":  # MaxText's LLaMARotaryEmbedding scaling
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        with np.errstate(divide="ignore", invalid="ignore"):  # Llama 4 Scout: high == low, no medium band
            smooth = (old / wavelen - low) / (high - low)
            medium = (wavelen >= old / high) & (wavelen <= old / low)
            inv_freq = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv_freq


def apply_rope(x, positions, inv_freq, interleaved: bool):
    """x: (T, heads, hd). Interleaved rotates (x[2i], x[2i+1]); otherwise (x[i], x[i+hd/2])."""
    angles = positions[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _take(node, index: int, axis: int):
    if isinstance(node, dict):
        return {k: _take(v, index, axis) for k, v in node.items()}
    return np.take(node, index, axis=axis)


def layer_params(params: dict, i: int, sem: Semantics, scan: bool) -> dict:
    """HF layer ``i``'s parameters, wherever the layout put them (experts stay leading)."""
    decoder = params["decoder"]
    if sem.layout == "deepseek":
        dense = sem.extra["dense_layers"]
        stack, n = ("dense_layers", i) if i < dense else ("moe_layers", i - dense)
        return _deepseek_take(decoder[stack], n) if scan else decoder[f"{stack}_{n}"]
    if sem.layout == "gemma2":
        half = "local" if i % 2 == 0 else "global"
        node = _take(decoder["layers"], i // 2, 1) if scan else decoder[f"layers_{i // 2}"]
        return {k[: -len(half) - 1]: v for k, v in node.items() if k.endswith("_" + half)}
    period = {"gemma3": 6, "gpt_oss": 2, "olmo3": 4, "llama4": sem.extra.get("cycle")}.get(sem.layout)
    if period and scan:  # MaxText scans whole blocks: block position i % period, block i // period
        blocks = sem.num_layers // period
        if i < blocks * period:
            return _take(decoder["layers"][f"layers_{i % period}"], i // period, 1)
        return decoder["layers_remainder"][f"layers_{i - blocks * period}"]
    if not scan:
        return decoder[f"layers_{i}"]
    return _stacked_take(decoder["layers"], i)


def _stacked_take(node, i: int):
    """Scanned leaves hold layers on axis 1 (expert leaves: (experts, layers, ...))."""
    if isinstance(node, dict):
        return {k: _stacked_take(v, i) for k, v in node.items()}
    return np.take(node, i, axis=1)


def _deepseek_take(node, i: int, path: tuple[str, ...] = ()):
    """DeepSeek's scanned leaves hold layers on axis 1, except the router bias (a MoEBiasVar in MaxText's
    model, stacked as the model stacks it): axis 0."""
    if isinstance(node, dict):
        return {k: _deepseek_take(v, i, (*path, k)) for k, v in node.items()}
    return np.take(node, i, axis=0 if path[-3:] == ("MoeBlock_0", "gate", "bias") else 1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def _mlp(h, mlp, activation):
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    gate = np.einsum("te,em->tm", h, f32(mlp["wi_0"]["kernel"]))
    up = np.einsum("te,em->tm", h, f32(mlp["wi_1"]["kernel"]))
    return np.einsum("tm,me->te", activation(gate) * up, f32(mlp["wo"]["kernel"]))


def _moe(h, block, sem: Semantics):
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    logits = h @ f32(block["gate"]["kernel"])  # (T, E)
    top = np.argsort(-logits, axis=-1)[:, : sem.top_k]
    chosen = np.take_along_axis(logits, top, axis=-1)
    if sem.moe == "softmax_topk":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        weights = np.take_along_axis(probs, top, axis=-1)
        if sem.extra.get("norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdims=True)
    else:
        weights = np.exp(chosen - chosen.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    wi_0, wi_1, wo = f32(block["wi_0"]), f32(block["wi_1"]), f32(block["wo"])
    for t in range(h.shape[0]):
        for k in range(sem.top_k):
            e = top[t, k]
            hidden = _silu(h[t] @ wi_0[e]) * (h[t] @ wi_1[e])
            out[t] += weights[t, k] * (hidden @ wo[e])
    return out


def _gpt_oss_moe(h, block, sem: Semantics):
    """gpt-oss: router with bias, softmax over the top-k logits; experts with biases and the clamped SwiGLU."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    logits = h @ f32(block["gate"]["kernel"]) + f32(block["gate"]["bias"])
    top = np.argsort(-logits, axis=-1)[:, : sem.top_k]
    chosen = np.take_along_axis(logits, top, axis=-1)
    weights = np.exp(chosen - chosen.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    limit, alpha = sem.extra["swiglu_limit"], sem.extra["swiglu_alpha"]
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for k in range(sem.top_k):
            e = top[t, k]
            gate = np.minimum(h[t] @ f32(block["wi_0"][e]) + f32(block["wi_0_bias"][e]), limit)
            up = np.clip(h[t] @ f32(block["wi_1"][e]) + f32(block["wi_1_bias"][e]), -limit, limit)
            hidden = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[t] += weights[t, k] * (hidden @ f32(block["wo"][e]) + f32(block["wo_bias"][e]))
    return out


def _deepseek_moe(h, block, sem: Semantics):
    """DeepSeek-V3: sigmoid scores; the top k of score + router bias chosen, weighted by their scores
    (normalised, times routed_scaling_factor); plus the shared experts as one MLP. DeepSeek-V2
    (``routed_score_func: softmax``, no bias): the top k softmax scores, not renormalised (MaxText's
    ``deepseek_scale_weights`` normalises sigmoid scores only), times routed_scaling_factor."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    routed = block["MoeBlock_0"]
    logits = h @ f32(routed["gate"]["kernel"])
    if sem.extra.get("scoring_func", "sigmoid") == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        top = np.argsort(-scores, axis=-1, kind="stable")[:, : sem.top_k]
        weights = np.take_along_axis(scores, top, axis=-1)
    else:
        scores = 1 / (1 + np.exp(-logits))
        top = np.argsort(-(scores + f32(routed["gate"]["bias"])), axis=-1)[:, : sem.top_k]
        weights = np.take_along_axis(scores, top, axis=-1)
        if sem.extra.get("norm_topk_prob", True):
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * np.float32(sem.extra["routed_scaling_factor"])
    out = _mlp(h, block["shared_experts"], _silu)
    wi_0, wi_1, wo = f32(routed["wi_0"]), f32(routed["wi_1"]), f32(routed["wo"])
    for t in range(h.shape[0]):
        for k in range(sem.top_k):
            e = top[t, k]
            out[t] += weights[t, k] * ((_silu(h[t] @ wi_0[e]) * (h[t] @ wi_1[e])) @ wo[e])
    return out


def _llama4_moe(h, block, sem: Semantics):
    """Llama 4: the top k router logits chosen; each chosen expert runs on the input scaled by the sigmoid of
    its logit (MaxText: ``inputs_2d * router_scores``, outputs summed with weight 1), plus the shared expert."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    routed = block["MoeBlock_0"]
    logits = h @ f32(routed["gate"]["kernel"])
    top = np.argsort(-logits, axis=-1, kind="stable")[:, : sem.top_k]
    scores = 1 / (1 + np.exp(-np.take_along_axis(logits, top, axis=-1)))
    out = _mlp(h, block["shared_experts"], _silu)
    wi_0, wi_1, wo = f32(routed["wi_0"]), f32(routed["wi_1"]), f32(routed["wo"])
    for t in range(h.shape[0]):
        for k in range(sem.top_k):
            e, x = top[t, k], h[t] * scores[t, k]
            out[t] += (_silu(x @ wi_0[e]) * (x @ wi_1[e])) @ wo[e]
    return out


def _llama4_positions(q, k, positions, sem: Semantics, nope: bool):
    """Llama 4's q/k after projection: RoPE (interleaved pairs) then an L2 norm, or on a NoPE layer neither,
    its queries temperature-tuned instead (1 + attn_scale * log1p(floor((position + 1) / floor_scale)))."""
    if nope:
        scale = np.log1p(np.floor((positions + 1) / sem.extra["floor_scale"])) * sem.extra["attn_scale"] + 1.0
        return (q * scale[:, None, None]).astype(np.float32), k
    inv_freq = rope_frequencies(q.shape[-1], sem.theta, sem.rope_scaling)
    q, k = apply_rope(q, positions, inv_freq, True), apply_rope(k, positions, inv_freq, True)
    if sem.extra["use_qk_norm"]:
        l2 = lambda x: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + sem.eps)  # noqa: E731
        q, k = l2(q), l2(k)
    return q, k


def _mla_attention(h, att, positions, sem: Semantics):
    """Multi-head latent attention: queries through wq_a, q_norm, wq_b (or one query kernel); keys and values
    from wkv_a's latent (kv_norm, wkv_b) plus one rope key for all heads; RoPE on interleaved pairs of the rope
    dimensions."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    rope = sem.extra["qk_rope_head_dim"]
    if "query" in att:  # DeepSeek-V2-Lite: no query LoRA
        q = np.einsum("te,ehd->thd", h, f32(att["query"]["kernel"]))
    else:
        q = rms_norm(h @ f32(att["wq_a"]["kernel"]), att["q_norm"]["scale"], sem.eps)
        q = np.einsum("tr,rhd->thd", q, f32(att["wq_b"]["kernel"]))
    latent = h @ f32(att["wkv_a"]["kernel"])
    kv = np.einsum("tr,rhd->thd", rms_norm(latent[:, :-rope], att["kv_norm"]["scale"], sem.eps),
                   f32(att["wkv_b"]["kernel"]))
    nope = q.shape[-1] - rope
    inv_freq = rope_frequencies(rope, sem.theta, None)
    q_rope = apply_rope(q[..., nope:], positions, inv_freq, interleaved=True)
    k_rope = apply_rope(latent[:, None, -rope:], positions, inv_freq, interleaved=True)
    q = np.concatenate([q[..., :nope], q_rope], axis=-1)
    k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rope, (*kv.shape[:2], rope))], axis=-1)
    v = kv[..., nope:]
    scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(math.sqrt(q.shape[-1]))
    scores = scores + np.triu(np.full(scores.shape[-2:], -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("thd,hde->te", np.einsum("hqk,khd->qhd", weights, v), f32(att["out"]["kernel"]))


def _qk_norm(x, scale, eps):
    """Per head (scale (head_dim,)), or over all heads at once (OLMo 3: scale (heads * head_dim,))."""
    if scale.shape[-1] == x.shape[-1]:
        return rms_norm(x, scale, eps)
    return rms_norm(x.reshape(x.shape[0], -1), scale, eps).reshape(x.shape)


def _attention(h, att, positions, sem: Semantics, window: int | None = None, nope: bool = False):
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    q = np.einsum("te,ehd->thd", h, f32(att["query"]["kernel"]))
    k = np.einsum("te,ehd->thd", h, f32(att["key"]["kernel"]))
    v = np.einsum("te,ehd->thd", h, f32(att["value"]["kernel"]))
    if "bias" in att["query"]:
        q, k, v = q + f32(att["query"]["bias"]), k + f32(att["key"]["bias"]), v + f32(att["value"]["bias"])
    if "query_norm" in att:
        q, k = _qk_norm(q, att["query_norm"]["scale"], sem.eps), _qk_norm(k, att["key_norm"]["scale"], sem.eps)
    head_dim = q.shape[-1]
    if sem.layout == "llama4":
        q, k = _llama4_positions(q, k, positions, sem, nope)
    else:
        inv_freq = rope_frequencies(head_dim, sem.theta, sem.rope_scaling)
        q, k = apply_rope(q, positions, inv_freq, sem.interleaved), apply_rope(k, positions, inv_freq, sem.interleaved)
    if sem.runtime_query_scale:
        q = q / np.float32(math.sqrt(head_dim))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k)
    if sem.attn_softcap:
        scores = np.tanh(scores / sem.attn_softcap) * sem.attn_softcap
    scores = scores + np.triu(np.full(scores.shape[-2:], -np.inf), 1)
    if window:  # a sliding layer: query t sees keys t - window + 1 .. t
        scores = scores + np.tril(np.full(scores.shape[-2:], -np.inf), -window)
    if "sinks" in att:  # gpt-oss: a per-head logit that takes part in the softmax, then is dropped
        sinks = np.broadcast_to(f32(att["sinks"])[:, None, None], (*scores.shape[:2], 1))
        scores = np.concatenate([scores, sinks], axis=-1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    if "sinks" in att:
        weights = weights[..., :-1]
    attended = np.einsum("hqk,khd->qhd", weights, v)
    out = np.einsum("thd,hde->te", attended, f32(att["out"]["kernel"]))
    return out + f32(att["out"]["bias"]) if "bias" in att["out"] else out


def forward(params: dict, tokens: np.ndarray, sem: Semantics, *, scan: bool) -> np.ndarray:
    """Logits (T, vocab) for one sequence of ``tokens``."""
    if sem.layout in ("qwen3_next", "qwen3_5"):  # the hybrid stack: its own forward, below
        return hybrid_forward(params, tokens, sem, scan=scan)
    if sem.layout == "gemma4":
        return gemma4_forward(params, tokens, sem, scan=scan)
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    embedding = f32(params["token_embedder"]["embedding"])
    x = embedding[tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    for i in range(sem.num_layers):
        p = layer_params(params, i, sem, scan)
        if sem.post_norm:
            sliding = sem.sliding_layers and sem.sliding_layers[i % len(sem.sliding_layers)]
            h = _attention(x, p["attention"], positions, sem, sem.sliding_window if sliding else None)
            x = x + rms_norm(h, p["post_self_attention_layer_norm"]["scale"], sem.eps)
            x = x + rms_norm(_mlp(x, p["mlp"], _silu), p["post_mlp_layer_norm"]["scale"], sem.eps)
            continue
        if sem.gemma:
            h = rms_norm(x, p["pre_self_attention_norm"]["scale"], sem.eps)
            h = _attention(h, p["self_attention"], positions, sem)
            x = x + rms_norm(h, p["post_self_attention_norm"]["scale"], sem.eps)
            h = rms_norm(x, p["pre_ffw_norm"]["scale"], sem.eps)
            x = x + rms_norm(_mlp(h, p["mlp"], _gelu_tanh), p["post_ffw_norm"]["scale"], sem.eps)
            continue
        h = rms_norm(x, p["pre_self_attention_layer_norm"]["scale"], sem.eps)
        if sem.layout == "deepseek":
            x = x + _mla_attention(h, p["self_attention"], positions, sem)
        else:
            nope = sem.layout == "llama4" and (i + 1) % sem.extra["nope_interval"] == 0
            x = x + _attention(h, p.get("self_attention", p.get("GptOssAttention")), positions, sem, nope=nope)
        h = rms_norm(x, p["post_self_attention_layer_norm"]["scale"], sem.eps)
        if "mlp" in p:  # a dense layer (every layer of a dense model; DeepSeek's first ones)
            x = x + _mlp(h, p["mlp"], _silu)
        elif sem.moe == "deepseek":
            x = x + _deepseek_moe(h, p["DeepSeekMoeBlock_0"], sem)
        elif sem.moe == "gpt_oss":
            x = x + _gpt_oss_moe(h, p["GptOssMlp"], sem)
        elif sem.moe == "llama4":
            x = x + _llama4_moe(h, p["Llama4MoEBlock_0"], sem)
        else:
            x = x + _moe(h, p.get("moe_block", p.get("MoeBlock_0")), sem)
    x = rms_norm(x, params["decoder"]["decoder_norm"]["scale"], sem.eps)
    if "logits_dense" in params["decoder"]:
        logits = x @ f32(params["decoder"]["logits_dense"]["kernel"])
    else:
        logits = x @ embedding.T
        if sem.gemma:  # MaxText: normalize_embedding_logits
            logits = logits / np.float32(math.sqrt(x.shape[-1]))
    if sem.final_softcap:
        logits = np.tanh(logits / sem.final_softcap) * sem.final_softcap
    return logits


# --- Qwen3-Next / Qwen3.5: the hybrid stack (MaxText decoder_block qwen3_next / qwen3_5) ---------------

def hybrid_layer_params(decoder: dict, i: int, period: int, num_layers: int, scan: bool, layout: str) -> dict:
    """HF layer ``i``'s parameters in a hybrid layout: unscanned ``layers_{i}``; Qwen3-Next scanned
    (``local_layers`` on axes (1, 2) = (period, position), ``global_layer`` on axis 1, a remainder
    block); Qwen3.5 scanned (``layers/layer_{position}`` over periods on axis 1)."""
    if not scan:
        return decoder[f"layers_{i}"]
    block, position = divmod(i, period)
    if layout == "qwen3_5":
        return _take(decoder["layers"][f"layer_{position}"], block, 1)
    if block == num_layers // period:
        return _take(decoder["layers_remainder"]["local_layers"], position, 1)
    if position == period - 1:
        return _take(decoder["layers"]["global_layer"], block, 1)
    return _take(_take(decoder["layers"]["local_layers"], block, 1), position, 1)


def _zero_centred_norm(x, scale, eps):
    """Qwen3NextRMSNorm: the stored weight w scales by (1 + w)."""
    return rms_norm(x, 1.0 + np.asarray(scale, np.float32), eps)


def _gated_delta_net(h, att, sem: Semantics):
    """Gated DeltaNet over one sequence, token by token (the recurrence HF and MaxText both compute)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    k_heads, v_heads, k_hd, v_hd = (sem.extra[k] for k in ("k_heads", "v_heads", "k_hd", "v_hd"))
    per_k = v_heads // k_heads
    T = h.shape[0]
    qkvz = (h @ f32(att["in_proj_qkvz"]["kernel"])).reshape(T, k_heads, -1)  # per key head [q|k|v|z]
    q, k = qkvz[..., :k_hd], qkvz[..., k_hd:2 * k_hd]
    v = qkvz[..., 2 * k_hd:2 * k_hd + per_k * v_hd].reshape(T, v_heads, v_hd)
    z = qkvz[..., 2 * k_hd + per_k * v_hd:].reshape(T, v_heads, v_hd)
    ba = (h @ f32(att["in_proj_ba"]["kernel"])).reshape(T, k_heads, 2 * per_k)  # per key head [b|a]
    b, a = ba[..., :per_k].reshape(T, v_heads), ba[..., per_k:].reshape(T, v_heads)
    mixed = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)  # (T, channels)
    kernel = f32(att["conv1d"]["kernel"])[:, 0, :]  # (taps, channels): causal depthwise convolution
    taps = kernel.shape[0]
    padded = np.concatenate([np.zeros((taps - 1, mixed.shape[1]), np.float32), mixed])
    conv = sum(padded[j:j + T] * kernel[j] for j in range(taps))
    conv = _silu(conv)
    q = conv[:, :k_heads * k_hd].reshape(T, k_heads, k_hd)
    k = conv[:, k_heads * k_hd:2 * k_heads * k_hd].reshape(T, k_heads, k_hd)
    v = conv[:, 2 * k_heads * k_hd:].reshape(T, v_heads, v_hd)
    q = np.repeat(q, per_k, axis=1)
    k = np.repeat(k, per_k, axis=1)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.float32(math.sqrt(k_hd))
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(f32(att["A_log"])) * np.log1p(np.exp(a + f32(att["dt_bias"])))
    state = np.zeros((v_heads, k_hd, v_hd), np.float32)
    out = np.zeros((T, v_heads, v_hd), np.float32)
    for t in range(T):
        state = state * np.exp(g[t])[:, None, None]
        memory = np.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - memory) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    gated = rms_norm(out, att["norm"]["rms_norm"]["scale"], sem.eps) * _silu(z)
    return gated.reshape(T, -1) @ f32(att["out_proj"]["kernel"])


def _gated_attention(h, att, positions, sem: Semantics):
    """Full attention whose query kernel carries an output gate per head; partial half-split RoPE."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    both = np.einsum("te,ehd->thd", h, f32(att["query"]["kernel"]))
    head_dim = both.shape[-1] // 2
    q, gate = both[..., :head_dim], both[..., head_dim:]
    k = np.einsum("te,ehd->thd", h, f32(att["key"]["kernel"]))
    v = np.einsum("te,ehd->thd", h, f32(att["value"]["kernel"]))
    q = _zero_centred_norm(q, att["query_norm"]["scale"], sem.eps)
    k = _zero_centred_norm(k, att["key_norm"]["scale"], sem.eps)
    rotary = int(head_dim * sem.extra["partial_rotary_factor"])
    inv_freq = rope_frequencies(rotary, sem.theta, None)
    q = np.concatenate([apply_rope(q[..., :rotary], positions, inv_freq, False), q[..., rotary:]], axis=-1)
    k = np.concatenate([apply_rope(k[..., :rotary], positions, inv_freq, False), k[..., rotary:]], axis=-1)
    q = q / np.float32(math.sqrt(head_dim))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) + np.triu(np.full((len(h), len(h)), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum("hqk,khd->qhd", weights, v) * (1 / (1 + np.exp(-gate)))
    return attended.reshape(len(h), -1) @ f32(att["out"]["kernel"])


def _shared_expert_moe(h, mlp, sem: Semantics):
    """Routed experts (softmax, top-k, renormalised) plus the shared expert scaled by sigmoid(gate)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    routed = _moe(h, mlp["routed_experts"], sem)
    shared = _mlp(h, mlp["shared_expert"], _silu)
    gate = 1 / (1 + np.exp(-(h @ f32(mlp["shared_expert_gate"]["kernel"]))))
    return routed + gate * shared


def dequantize(tree: dict) -> dict:
    """An FP8 model's tree (Qwen3.5's -fp8: kernels with ``kernel_scale``, experts with ``wi_0_scale``...)
    with every kernel multiplied by its block scales, in float32, as MaxText's runtime dequantises:
    an axis whose scale has as many entries as the kernel (heads, stacked layers) is not blocked."""
    out = {}
    for key, node in tree.items():
        if isinstance(node, dict):
            out[key] = dequantize(node)
        elif key.endswith("_scale"):
            continue
        else:
            scale = tree.get("kernel_scale" if key == "kernel" else f"{key}_scale")
            value = np.asarray(node, np.float32)
            if scale is not None:
                scale = np.asarray(scale, np.float32)
                for axis, (dim, blocks) in enumerate(zip(value.shape, scale.shape)):
                    scale = np.repeat(scale, dim // blocks, axis=axis)
                value = value * scale
            out[key] = value
    return out


def hybrid_forward(params: dict, tokens: np.ndarray, sem: Semantics, *, scan: bool) -> np.ndarray:
    """Logits (T, vocab) of a Qwen3-Next / Qwen3.5 MaxText tree (``sem.layout``: qwen3_next or qwen3_5)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    params = dequantize(params)
    period = sem.extra["period"]
    x = f32(params["token_embedder"]["embedding"])[tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    for i in range(sem.num_layers):
        p = hybrid_layer_params(params["decoder"], i, period, sem.num_layers, scan, sem.layout)
        h = _zero_centred_norm(x, p["input_layernorm"]["scale"], sem.eps)
        if "in_proj_qkvz" in p["attention"]:
            x = x + _gated_delta_net(h, p["attention"], sem)
        else:
            x = x + _gated_attention(h, p["attention"]["attention"], positions, sem)
        h = _zero_centred_norm(x, p["post_attention_layernorm"]["scale"], sem.eps)
        x = x + _shared_expert_moe(h, p["mlp"], sem)
    x = _zero_centred_norm(x, params["decoder"]["decoder_norm"]["scale"], sem.eps)
    return x @ f32(params["decoder"]["logits_dense"]["kernel"])


# --- Gemma 4 (MaxText decoder_block gemma4) ----------------------------------------------------------------

def gemma4_layer_params(decoder: dict, i: int, scan: bool) -> dict:
    """HF layer ``i``'s parameters: unscanned ``layers_{i}``; scanned, blocks of 6 (``scanned_blocks/local_layers``
    on axes (1, 2) = (block, position), ``scanned_blocks/global_layer`` on axis 1)."""
    if not scan:
        return decoder[f"layers_{i}"]
    block, position = divmod(i, 6)
    if position == 5:
        return _take(decoder["scanned_blocks"]["global_layer"], block, 1)
    return _take(_take(decoder["scanned_blocks"]["local_layers"], block, 1), position, 1)


def _gemma4_attention(h, att, positions, sem: Semantics, local: bool, shared_kv: dict | None = None):
    """q/k RMSNorm (scaled), v RMSNorm (unscaled); keys serve as values where no value kernel is stored; RoPE on
    halves (local: all of head_dim; global: its first ``partial_rotary_factor``, "proportional"); no query scaling.
    ``shared_kv`` (E2B / E4B): a layer without a key kernel takes the last earlier layer of its kind's keys and
    values (rotated and normed); a layer with one leaves them there."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    q = rms_norm(np.einsum("te,ehd->thd", h, f32(att["query"]["kernel"])), att["query_norm"]["scale"], sem.eps)
    head_dim = q.shape[-1]
    inv_freq = rope_frequencies(head_dim, sem.extra["local_theta" if local else "global_theta"], None)
    if not local:
        inv_freq[int(sem.extra["partial_rotary_factor"] * head_dim // 2):] = 0.0
    q = apply_rope(q, positions, inv_freq, False)
    if "key" in att:
        k = np.einsum("te,ehd->thd", h, f32(att["key"]["kernel"]))
        v = np.einsum("te,ehd->thd", h, f32(att["value"]["kernel"])) if "value" in att else k
        k = apply_rope(rms_norm(k, att["key_norm"]["scale"], sem.eps), positions, inv_freq, False)
        v = rms_norm(v, np.ones(v.shape[-1], np.float32), sem.eps)
        if shared_kv is not None:
            shared_kv[local] = k, v
    else:
        k, v = shared_kv[local]
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) + np.triu(np.full((q.shape[0],) * 2, -np.inf), 1)
    if local:
        scores = scores + np.tril(np.full(scores.shape[-2:], -np.inf), -sem.sliding_window)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("thd,hde->te", np.einsum("hqk,khd->qhd", weights, v), f32(att["out"]["kernel"]))


def _gemma4_moe(x, h, mlp, sem: Semantics):
    """26B-A4B's feed-forward: the dense MLP (MaxText's shared expert) on the pre-FFW-normed ``h`` plus the routed
    experts on the residual ``x``: router on RMSNorm(x) (unscaled) * pre_forward_scale_2 / sqrt(hidden), softmax,
    top k renormalised and times per_expert_scale; experts on pre_feedforward_layernorm_2(x)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    block, routed = mlp["moe_block"], mlp["moe_block"]["MoeBlock_0"]
    shared = rms_norm(_mlp(h, block["shared_experts"], _gelu_tanh), mlp["post_feedforward_layernorm_1"]["scale"],
                      sem.eps)
    gate_in = rms_norm(x, np.ones(x.shape[-1], np.float32), sem.eps) * f32(mlp["pre_forward_scale_2"])
    logits = (gate_in * np.float32(x.shape[-1] ** -0.5)) @ f32(routed["gate"]["kernel"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : sem.top_k]
    weights = np.take_along_axis(probs, top, axis=-1)
    weights = weights / weights.sum(-1, keepdims=True) * f32(routed["per_expert_scale"])[top]
    inputs = rms_norm(x, mlp["pre_feedforward_layernorm_2"]["scale"], sem.eps)
    out = np.zeros_like(x)
    wi_0, wi_1, wo = f32(routed["wi_0"]), f32(routed["wi_1"]), f32(routed["wo"])
    for t in range(x.shape[0]):
        for k in range(sem.top_k):
            e = top[t, k]
            out[t] += weights[t, k] * ((_gelu_tanh(inputs[t] @ wi_0[e]) * (inputs[t] @ wi_1[e])) @ wo[e])
    return shared + rms_norm(out, mlp["post_feedforward_layernorm_2"]["scale"], sem.eps)


def _gemma4_per_layer_inputs(embedder: dict, tokens: np.ndarray, x: np.ndarray, sem: Semantics) -> np.ndarray:
    """E2B / E4B (MaxText's Gemma4SmallPLE): (tokens, layers, ple) = (the token's row of embed_tokens_per_layer
    times sqrt(ple) + RMSNorm(x @ per_layer_model_projection / sqrt(hidden))) / sqrt(2)."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    ple = embedder["per_layer_projection_norm"]["scale"].shape[0]
    identity = f32(embedder["embed_tokens_per_layer"])[tokens] * np.float32(ple ** 0.5)
    context = (x @ f32(embedder["per_layer_model_projection"]["kernel"])) * np.float32(x.shape[-1] ** -0.5)
    context = rms_norm(context.reshape(len(tokens), sem.num_layers, ple),
                       embedder["per_layer_projection_norm"]["scale"], sem.eps)
    return (identity.reshape(len(tokens), sem.num_layers, ple) + context) * np.float32(2 ** -0.5)


def gemma4_forward(params: dict, tokens: np.ndarray, sem: Semantics, *, scan: bool) -> np.ndarray:
    """Gemma 4's text decoder: 5 sliding + 1 full layers (E2B: 4 + 1), each ending in ``layer_scalar``; Gemma's
    embedding and tied, soft-capped logits. E2B / E4B: per-layer inputs added after the MLP through a gelu gate, and
    layers without key kernels on the last earlier same-kind layer's keys and values."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    embedding = f32(params["token_embedder"]["embedding"])
    x = embedding[tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    embedder = params["decoder"].get("per_layer_embedder")
    per_layer = _gemma4_per_layer_inputs(embedder, tokens, x, sem) if embedder else None
    period, shared_kv = sem.extra.get("period", 6), {}
    for i in range(sem.num_layers):
        p = gemma4_layer_params(params["decoder"], i, scan)
        h = rms_norm(x, p["pre_self_attention_norm"]["scale"], sem.eps)
        h = _gemma4_attention(h, p["self_attention"], positions, sem, local=i % period != period - 1,
                              shared_kv=shared_kv)
        x = x + rms_norm(h, p["post_self_attention_norm"]["scale"], sem.eps)
        h = rms_norm(x, p["pre_ffw_norm"]["scale"], sem.eps)
        h = _gemma4_moe(x, h, p["mlp"], sem) if "moe_block" in p["mlp"] else _mlp(h, p["mlp"], _gelu_tanh)
        x = x + rms_norm(h, p["post_ffw_norm"]["scale"], sem.eps)
        if per_layer is not None:
            gate = _gelu_tanh(x @ f32(p["per_layer_input_gate"]["kernel"])) * per_layer[:, i]
            x = x + rms_norm(gate @ f32(p["per_layer_projection"]["kernel"]), p["post_per_layer_input_norm"]["scale"],
                             sem.eps)
        x = x * f32(p["layer_scalar"])
    x = rms_norm(x, params["decoder"]["decoder_norm"]["scale"], sem.eps)
    logits = x @ embedding.T / np.float32(math.sqrt(x.shape[-1]))
    return np.tanh(logits / sem.final_softcap) * sem.final_softcap if sem.final_softcap else logits
