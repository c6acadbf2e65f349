"""A small NumPy forward pass over a MaxText *layout* parameter tree (dense decoders).

It follows MaxText's semantics, not HF's: kernels are (in, ..., out) einsums, heads are
their own axis, queries of Llama/Mistral arrive pre-scaled in the weights while Qwen scales
at run time, Llama 3.1+ rotates *interleaved* pairs while the others rotate halves, and tied
models take logits from the embedding. If a conversion gets any of that wrong, logits differ
from the HF model's.
"""

from __future__ import annotations

import math

import numpy as np


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


def layer_params(params: dict, i: int, scan: bool) -> dict:
    decoder = params["decoder"]
    if not scan:
        return decoder[f"layers_{i}"]

    def take(node):
        return {k: take(v) for k, v in node.items()} if isinstance(node, dict) else np.take(node, i, axis=1)

    return take(decoder["layers"])


def forward(params: dict, tokens: np.ndarray, *, family: str, num_layers: int, eps: float, theta: float,
            rope_scaling: dict | None, interleaved: bool, scan: bool) -> np.ndarray:
    """Logits (T, vocab) for one sequence of ``tokens``."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    x = f32(params["token_embedder"]["embedding"])[tokens]
    positions = np.arange(len(tokens), dtype=np.float64)
    for i in range(num_layers):
        p = layer_params(params, i, scan)
        att = p["self_attention"]
        h = rms_norm(x, p["pre_self_attention_layer_norm"]["scale"], eps)
        q = np.einsum("te,ehd->thd", h, f32(att["query"]["kernel"]))
        k = np.einsum("te,ehd->thd", h, f32(att["key"]["kernel"]))
        v = np.einsum("te,ehd->thd", h, f32(att["value"]["kernel"]))
        if "bias" in att["query"]:
            q, k, v = q + f32(att["query"]["bias"]), k + f32(att["key"]["bias"]), v + f32(att["value"]["bias"])
        if "query_norm" in att:
            q, k = rms_norm(q, att["query_norm"]["scale"], eps), rms_norm(k, att["key_norm"]["scale"], eps)
        head_dim = q.shape[-1]
        inv_freq = rope_frequencies(head_dim, theta, rope_scaling)
        q, k = apply_rope(q, positions, inv_freq, interleaved), apply_rope(k, positions, inv_freq, interleaved)
        if family in ("qwen2", "qwen3"):  # run-time query scaling; Llama/Mistral have it in the weights
            q = q / np.float32(math.sqrt(head_dim))
        groups = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k)
        scores = scores + np.triu(np.full(scores.shape[-2:], -np.inf), 1)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", weights, v)
        x = x + np.einsum("thd,hde->te", attended, f32(att["out"]["kernel"]))
        h = rms_norm(x, p["post_self_attention_layer_norm"]["scale"], eps)
        mlp = p["mlp"]
        gate = np.einsum("te,em->tm", h, f32(mlp["wi_0"]["kernel"]))
        up = np.einsum("te,em->tm", h, f32(mlp["wi_1"]["kernel"]))
        x = x + np.einsum("tm,me->te", gate / (1 + np.exp(-gate)) * up, f32(mlp["wo"]["kernel"]))
    x = rms_norm(x, params["decoder"]["decoder_norm"]["scale"], eps)
    if "logits_dense" in params["decoder"]:
        return x @ f32(params["decoder"]["logits_dense"]["kernel"])
    return x @ f32(params["token_embedder"]["embedding"]).T
