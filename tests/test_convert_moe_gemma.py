"""MoE and Gemma families end to end: every value against an independent restatement of MaxText's converter.

The restatement follows MaxText 0.2.5's ``param_mapping`` hooks as written there (reshape_kernel,
expert transposes, +1 norms, query scaling in float32, the Gemma embedding scaled and padded or
cut), computed here with NumPy from the HF tensors read by the reference ``safetensors``
reader, stacked as MaxText stacks them: experts first, then layers on axis 1.
"""

import json

import ml_dtypes  # noqa: F401  (registers bfloat16 for safetensors.numpy)
import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from tests.conftest import run_cli
from tests.test_convert import DTYPES, maxtext_partition, restore

BF16 = np.dtype(ml_dtypes.bfloat16)


def hf_tensors(src) -> dict[str, np.ndarray]:
    tensors = load_file(str(src / "model.safetensors"))
    return {("model." + k[len("language_model.model."):] if k.startswith("language_model.model.") else k): v
            for k, v in tensors.items()}


def computed(x: np.ndarray, fn, out_dtype: np.dtype, src_dtype: np.dtype) -> np.ndarray:
    """MaxText's hooks compute on arrays of the save dtype (bf16 math rounds once, like float32 then cast)."""
    return fn(x.astype(np.float32)).astype(out_dtype)


def expected_params(src, model: synth.SynthModel, scan: bool, dtype: str) -> dict[str, np.ndarray]:
    hf = hf_tensors(src)
    out = DTYPES[dtype]
    config = model.config()
    text = config.get("text_config", config)
    mt = model.model_type
    emb, nq, nkv, hd = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    L = text["num_hidden_layers"]
    qscale = np.float32(1 / np.sqrt(hd))

    def kernel(w):  # reshape_kernel: x.T.reshape(target)
        return w.T

    def heads(w, n):
        return w.T.reshape(emb, n, hd)

    def out_kernel(w):
        return w.T.reshape(nq, hd, emb)

    def plus_one(w):
        return computed(w, lambda x: x + np.float32(1.0), out, w.dtype)

    gemma = mt.startswith("gemma")
    layer: dict[str, callable] = {}
    p = "model.layers.{i}."
    if gemma:
        q = (lambda i: computed(heads(hf[p.format(i=i) + "self_attn.q_proj.weight"], nq), lambda x: x * qscale, out, BF16)
             if mt == "gemma2" else heads(hf[p.format(i=i) + "self_attn.q_proj.weight"], nq))
        layer = {
            "pre_self_attention_norm/scale": lambda i: plus_one(hf[p.format(i=i) + "input_layernorm.weight"]),
            "post_self_attention_norm/scale": lambda i: plus_one(hf[p.format(i=i) + "post_attention_layernorm.weight"]),
            "pre_ffw_norm/scale": lambda i: plus_one(hf[p.format(i=i) + "pre_feedforward_layernorm.weight"]),
            "post_ffw_norm/scale": lambda i: plus_one(hf[p.format(i=i) + "post_feedforward_layernorm.weight"]),
            "self_attention/query/kernel": q,
            "self_attention/key/kernel": lambda i: heads(hf[p.format(i=i) + "self_attn.k_proj.weight"], nkv),
            "self_attention/value/kernel": lambda i: heads(hf[p.format(i=i) + "self_attn.v_proj.weight"], nkv),
            "self_attention/out/kernel": lambda i: out_kernel(hf[p.format(i=i) + "self_attn.o_proj.weight"]),
            "mlp/wi_0/kernel": lambda i: kernel(hf[p.format(i=i) + "mlp.gate_proj.weight"]),
            "mlp/wi_1/kernel": lambda i: kernel(hf[p.format(i=i) + "mlp.up_proj.weight"]),
            "mlp/wo/kernel": lambda i: kernel(hf[p.format(i=i) + "mlp.down_proj.weight"]),
        }
        if mt == "gemma3":
            layer["self_attention/query_norm/scale"] = lambda i: plus_one(hf[p.format(i=i) + "self_attn.q_norm.weight"])
            layer["self_attention/key_norm/scale"] = lambda i: plus_one(hf[p.format(i=i) + "self_attn.k_norm.weight"])
    else:
        experts = text.get("num_experts", text.get("num_local_experts"))
        block, router, names = (("moe_block", "mlp.gate", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                                                          "mlp.experts.{e}.down_proj"))
                                if mt == "qwen3_moe" else
                                ("MoeBlock_0", "block_sparse_moe.gate", ("block_sparse_moe.experts.{e}.w1",
                                                                         "block_sparse_moe.experts.{e}.w3",
                                                                         "block_sparse_moe.experts.{e}.w2")))
        q = (lambda i: heads(hf[p.format(i=i) + "self_attn.q_proj.weight"], nq)) if mt == "qwen3_moe" else (
            lambda i: computed(heads(hf[p.format(i=i) + "self_attn.q_proj.weight"], nq), lambda x: x * qscale, out, BF16))
        layer = {
            "pre_self_attention_layer_norm/scale": lambda i: hf[p.format(i=i) + "input_layernorm.weight"],
            "post_self_attention_layer_norm/scale": lambda i: hf[p.format(i=i) + "post_attention_layernorm.weight"],
            "self_attention/query/kernel": q,
            "self_attention/key/kernel": lambda i: heads(hf[p.format(i=i) + "self_attn.k_proj.weight"], nkv),
            "self_attention/value/kernel": lambda i: heads(hf[p.format(i=i) + "self_attn.v_proj.weight"], nkv),
            "self_attention/out/kernel": lambda i: out_kernel(hf[p.format(i=i) + "self_attn.o_proj.weight"]),
            f"{block}/gate/kernel": lambda i: kernel(hf[p.format(i=i) + router + ".weight"]),
        }
        for leaf, name in zip(("wi_0", "wi_1", "wo"), names):  # (experts, ...) per layer: experts lead
            layer[f"{block}/{leaf}"] = (lambda i, name=name: np.stack(
                [kernel(hf[p.format(i=i) + name.format(e=e) + ".weight"]) for e in range(experts)]))
        if mt == "qwen3_moe":
            layer["self_attention/query_norm/scale"] = lambda i: hf[p.format(i=i) + "self_attn.q_norm.weight"]
            layer["self_attention/key_norm/scale"] = lambda i: hf[p.format(i=i) + "self_attn.k_norm.weight"]

    params: dict[str, np.ndarray] = {}
    embedding = hf["model.embed_tokens.weight"]
    if mt == "gemma2":  # pad to 256128 rows, then scale by float32 sqrt(hidden)
        padded = np.zeros((256128, emb), dtype=embedding.dtype)
        padded[: embedding.shape[0]] = embedding
        params["token_embedder/embedding"] = computed(padded, lambda x: x * np.float32(emb ** 0.5), out, BF16)
    elif mt == "gemma3":  # scale by sqrt(hidden) rounded to bfloat16, then pad or cut to 262144 rows
        scaled = computed(embedding, lambda x: x * np.float32(ml_dtypes.bfloat16(emb ** 0.5)), out, BF16)
        padded = np.zeros((262144, emb), dtype=out)
        rows = min(262144, scaled.shape[0])
        padded[:rows] = scaled[:rows]
        params["token_embedder/embedding"] = padded
    else:
        params["token_embedder/embedding"] = embedding
    params["decoder/decoder_norm/scale"] = plus_one(hf["model.norm.weight"]) if gemma else hf["model.norm.weight"]
    if "lm_head.weight" in hf and not gemma and not text.get("tie_word_embeddings", True):
        params["decoder/logits_dense/kernel"] = kernel(hf["lm_head.weight"])

    def stack(arrays):  # MaxText stacks layers on axis 1 (expert leaves keep experts on axis 0)
        return np.stack(arrays, axis=1)

    for name, make in layer.items():
        if mt == "gemma2":
            head, rest = name.split("/", 1)
            for half, first in (("local", 0), ("global", 1)):
                layers = list(range(first, L, 2))
                if scan:
                    params[f"decoder/layers/{head}_{half}/{rest}"] = stack([make(i) for i in layers])
                else:
                    params |= {f"decoder/layers_{j}/{head}_{half}/{rest}": make(i) for j, i in enumerate(layers)}
        elif mt == "gemma3" and scan:
            blocks = L // 6
            for b in range(6 if blocks else 0):
                params[f"decoder/layers/layers_{b}/{name}"] = stack([make(i) for i in range(b, blocks * 6, 6)])
            for r in range(L - blocks * 6):
                params[f"decoder/layers_remainder/layers_{r}/{name}"] = make(blocks * 6 + r)
        elif scan:
            params[f"decoder/layers/{name}"] = stack([make(i) for i in range(L)])
        else:
            params |= {f"decoder/layers_{i}/{name}": make(i) for i in range(L)}
    return {f"params/params/{k}": np.asarray(v).astype(out) for k, v in params.items()}


CASES = [  # model, scan, devices, dtype
    (synth.SynthModel(model_type="qwen3_moe", num_experts=16, moe_intermediate_size=48, tie_word_embeddings=False), True, 16, "bfloat16"),
    (synth.SynthModel(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=48), False, 1, "bfloat16"),
    (synth.SynthModel(model_type="mixtral", num_experts=4, num_layers=16, tie_word_embeddings=False), True, 16, "bfloat16"),
    (synth.SynthModel(model_type="mixtral", num_experts=4, tie_word_embeddings=False), False, 4, "float32"),
    (synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=100), True, 16, "bfloat16"),
    (synth.SynthModel(model_type="gemma2", num_layers=4, vocab_size=100), False, 1, "float32"),
    (synth.SynthModel(model_type="gemma3", num_layers=7, vocab_size=100, hidden_size=80, num_heads=5,
                      num_kv_heads=1), True, 16, "bfloat16"),
    (synth.SynthModel(model_type="gemma3", num_layers=13, vocab_size=262150, hidden_size=16, head_dim=4,
                      intermediate_size=32), True, 1, "bfloat16"),
    (synth.SynthModel(model_type="gemma3", num_layers=7, vocab_size=100), False, 4, "float32"),
]


@pytest.mark.parametrize("model, scan, devices, dtype", CASES,
                         ids=[f"{c[0].model_type}-{'scan' if c[1] else 'noscan'}-{c[2]}dev-{c[3]}" for c in CASES])
def test_values_sharding_and_verify(tmp_path, synth_dir, model, scan, devices, dtype):
    src, dst = synth_dir(model), tmp_path / "dst"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", dtype]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr
    expected = expected_params(src, model, scan, dtype)
    restored = restore(dst)
    assert restored.keys() == expected.keys() | {"step"}
    for name, value in expected.items():
        assert restored[name].shape == value.shape and restored[name].dtype == value.dtype, name
        assert restored[name].tobytes() == value.tobytes(), name
    inspected = json.loads(run_cli("inspect", str(dst), "--json").stdout)
    assert inspected["complete"]
    for leaf in inspected["leaves"]:
        if leaf["name"] != "step":
            assert leaf["partition_spec"] == maxtext_partition(tuple(leaf["shape"]), devices), leaf
    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr
