"""End to end through the CLI: layout, sharding, chunking and every value, restated independently.

Expected values are computed here from the HF tensors (read with the reference safetensors
reader) with MaxText's transforms written out from scratch, not with ckptconv's tables; the
checkpoint is read back with Orbax's own restore.
"""

import json
import math

import ml_dtypes  # noqa: F401  (registers bfloat16 for safetensors.numpy)
import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from ckptconv.families import olmo3
from tests.conftest import run_cli

AXIS = "checkpoint_sharding_axis"
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}


def expected_params(src, model: synth.SynthModel, scan: bool, dtype: str) -> dict[str, np.ndarray]:
    """MaxText's params for the HF checkpoint in ``src``, by MaxText's rules restated."""
    hf = load_file(str(src / "model.safetensors"))
    emb, nq, nkv, hd = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    mt = model.model_type
    interleave = mt == "llama" and model.config().get("rope_scaling", {}).get("rope_type") == "llama3"
    prescale = mt in ("llama", "mistral")
    perm = [j // 2 + (j % 2) * hd // 2 for j in range(hd)]
    out_dtype = DTYPES[dtype]

    def q_or_k(w, heads, is_q):
        x = w.T.reshape(emb, heads, hd)
        if interleave:
            x = x[..., perm]
        if is_q and prescale:
            x = x.astype(np.float32) * np.float32(1 / math.sqrt(hd))
        return x

    per_layer = {
        "self_attention/query/kernel": lambda p: q_or_k(hf[p + "self_attn.q_proj.weight"], nq, True),
        "self_attention/key/kernel": lambda p: q_or_k(hf[p + "self_attn.k_proj.weight"], nkv, False),
        "self_attention/value/kernel": lambda p: hf[p + "self_attn.v_proj.weight"].T.reshape(emb, nkv, hd),
        "self_attention/out/kernel": lambda p: hf[p + "self_attn.o_proj.weight"].T.reshape(nq, hd, emb),
        "pre_self_attention_layer_norm/scale": lambda p: hf[p + "input_layernorm.weight"],
        "post_self_attention_layer_norm/scale": lambda p: hf[p + "post_attention_layernorm.weight"],
        "mlp/wi_0/kernel": lambda p: hf[p + "mlp.gate_proj.weight"].T,
        "mlp/wi_1/kernel": lambda p: hf[p + "mlp.up_proj.weight"].T,
        "mlp/wo/kernel": lambda p: hf[p + "mlp.down_proj.weight"].T,
    }
    if mt == "qwen3":
        per_layer["self_attention/query_norm/scale"] = lambda p: hf[p + "self_attn.q_norm.weight"]
        per_layer["self_attention/key_norm/scale"] = lambda p: hf[p + "self_attn.k_norm.weight"]
    if mt == "qwen2":
        for short, heads in (("q", nq), ("k", nkv), ("v", nkv)):
            name = {"q": "query", "k": "key", "v": "value"}[short]
            per_layer[f"self_attention/{name}/bias"] = (
                lambda p, s=short, h=heads: hf[p + f"self_attn.{s}_proj.bias"].reshape(h, hd))
    if mt == "olmo3":  # post-norm; module "attention"; q/k norms over all heads, copied (MaxText's hooks: identity)
        per_layer = {name.replace("self_attention/", "attention/"): make for name, make in per_layer.items()
                     if name != "pre_self_attention_layer_norm/scale"}
        per_layer["post_mlp_layer_norm/scale"] = lambda p: hf[p + "post_feedforward_layernorm.weight"]
        per_layer["attention/query_norm/scale"] = lambda p: hf[p + "self_attn.q_norm.weight"]
        per_layer["attention/key_norm/scale"] = lambda p: hf[p + "self_attn.k_norm.weight"]
    params = {"token_embedder/embedding": hf["model.embed_tokens.weight"],
              "decoder/decoder_norm/scale": hf["model.norm.weight"]}
    if not model.tie_word_embeddings:
        params["decoder/logits_dense/kernel"] = hf["lm_head.weight"].T
    for name, make in per_layer.items():
        layers = [make(f"model.layers.{i}.") for i in range(model.num_layers)]
        if scan and mt == "olmo3":  # MaxText scans blocks of (3 sliding, 1 full): block position b holds b, b+4, ...
            params |= {f"decoder/layers/layers_{b}/{name}": np.stack(layers[b::4], axis=1) for b in range(4)}
        elif scan:
            params[f"decoder/layers/{name}"] = np.stack(layers, axis=1)
        else:
            params |= {f"decoder/layers_{i}/{name}": layer for i, layer in enumerate(layers)}
    return {f"params/params/{k}": np.asarray(v).astype(out_dtype) for k, v in params.items()}


def restore(dst) -> dict[str, np.ndarray]:
    import jax
    import orbax.checkpoint as ocp

    items = dst / "0" / "items"
    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(items)
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = checkpointer.restore(items, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in path): np.asarray(v) for path, v in flat}


def maxtext_partition(shape, devices):
    if devices == 1 or not shape:
        return None
    if shape[0] % devices == 0:
        return [AXIS]
    if len(shape) > 1 and shape[1] % devices == 0:
        return [None, AXIS]
    return [None]


CASES = [  # model_type, tied, scan, devices, dtype, extra config, layers
    ("qwen3", True, True, 16, "bfloat16", {}, 2),
    ("llama", False, True, 16, "bfloat16", {"rope_scaling": LLAMA31_ROPE}, 2),
    ("llama", True, False, 16, "float32", {}, 2),
    ("mistral", False, False, 1, "float32", {}, 2),
    ("qwen2", False, True, 1, "bfloat16", {}, 2),
    ("qwen3", False, False, 16, "float32", {}, 2),
    ("olmo3", False, True, 16, "bfloat16", {"rope_scaling": olmo3.YARN}, 8),  # OLMo 3: whole blocks of 4
    ("olmo3", False, False, 1, "float32", {}, 8),
]


@pytest.mark.parametrize("model_type, tied, scan, devices, dtype, extra, layers", CASES,
                         ids=[f"{c[0]}-{'scan' if c[2] else 'noscan'}-{c[3]}dev-{c[4]}" for c in CASES])
def test_convert_layout_sharding_and_values(tmp_path, synth_dir, model_type, tied, scan, devices, dtype, extra, layers):
    model = synth.SynthModel(model_type=model_type, tie_word_embeddings=tied, num_layers=layers,
                             config_overrides=extra)
    src, dst = synth_dir(model), tmp_path / "dst"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", dtype]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr

    expected = expected_params(src, model, scan, dtype)
    restored = restore(dst)
    assert restored.keys() == expected.keys() | {"step"}
    for name, value in expected.items():
        assert restored[name].dtype == value.dtype, name
        assert restored[name].shape == value.shape, name
        assert restored[name].tobytes() == value.tobytes(), name

    inspected = json.loads(run_cli("inspect", str(dst), "--json").stdout)
    assert inspected["complete"] and inspected["custom_metadata"] == {"scan_layers": scan}
    for leaf in inspected["leaves"]:
        if leaf["name"] == "step":
            continue
        shape = tuple(leaf["shape"])
        spec = maxtext_partition(shape, devices)
        assert leaf["partition_spec"] == spec, leaf
        if devices > 1:
            assert leaf["mesh_shape"] == [devices] and leaf["axis_names"] == [AXIS]
        shard = [d // devices if i < len(spec or []) and spec[i] == AXIS else d for i, d in enumerate(shape)]
        assert all(s % c == 0 for s, c in zip(shard, leaf["chunk_shape"])), f"chunk crosses a shard: {leaf}"

    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["status"] == "complete" and report["devices"] == devices and report["scan_layers"] == scan
    assert report["tensors"] == len(synth.tensor_shapes(model))
    assert set(report["stage_seconds"]) == {"plan", "read", "transform", "write", "commit"}
    assert report["peak_rss_bytes"] > 50 * 2**20
    # CPU of every thread, so users can size a VM: JAX's start alone takes well over 0.1 s
    assert 0.1 < report["cpu_seconds"] and report["cpu_seconds_per_gib"] == pytest.approx(
        report["cpu_seconds"] / (report["output_bytes"] / 2**30), rel=1e-2)

    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr


def test_sharded_index_checkpoint_and_rerun(tmp_path, synth_dir):
    """A multi-file checkpoint converts; rerunning is a no-op; other options are refused; --overwrite works."""
    src = synth_dir(synth.SynthModel(num_layers=3), max_shard_bytes=60_000)
    assert (src / "model.safetensors.index.json").exists()
    dst = tmp_path / "dst"
    first = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none")
    assert first.returncode == 0, first.stderr
    again = run_cli("convert", str(src), str(dst), "--devices", "4", "--progress", "none")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    other = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none")
    assert other.returncode == 2 and "--overwrite" in other.stderr and "Traceback" not in other.stderr
    replaced = run_cli("convert", str(src), str(dst), "--devices", "1", "--progress", "none", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((dst / "ckptconv-report.json").read_text())["devices"] == 1
    assert run_cli("verify", str(src), str(dst)).returncode == 0


def test_relative_destination(tmp_path, synth_dir):
    """Orbax wants absolute paths; the CLI accepts what a user types."""
    src = synth_dir()
    result = run_cli("convert", str(src), "out/model", "--devices", "1", "--progress", "none", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "model" / "0" / "items" / "_METADATA").exists()
    assert run_cli("verify", str(src), "out/model", cwd=tmp_path).returncode == 0
    assert run_cli("inspect", "out/model", cwd=tmp_path).returncode == 0
