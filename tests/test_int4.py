"""Kimi-K2-Thinking's INT4 experts (compressed-tensors ``pack-quantized``) as the hub ships them.

The reference decoder here is written from the format's definition: column ``c`` is the nibble
at bits 4 * (c % 8) of int32 word c // 8, stored as value + 8, times the bfloat16 scale of its
group of 32, the product rounded once to bfloat16. It is itself checked against compressed-tensors'
decompressor where that library is installed. Conversions are checked leaf by leaf against
MaxText's DeepSeek hooks applied to the dequantised tensors; ``verify`` re-derives every value
from the INT4 source.
"""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE, deepseek
from ckptconv.families.inputs import INT4_SCHEME, INT4Groups, resolve
from ckptconv.plan.conversion import read_spec
from ckptconv.read.safetensors_io import index_checkpoint
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.test_convert import restore
from tests.test_quantized import expected_deepseek, load_stored

BF16 = np.dtype(ml_dtypes.bfloat16)


def reference_int4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(rows, cols/8) int32 and (rows, cols/32) bfloat16 -> (rows, cols) bfloat16, column by column."""
    rows, words = packed.shape
    columns = np.arange(words * 8)
    unsigned = packed.view(np.uint32)[:, columns // 8]
    codes = (unsigned >> (4 * (columns % 8)).astype(np.uint32)) & 0xF
    with np.errstate(over="ignore"):  # a scale near bfloat16's largest times 8 is inf, as in bfloat16 arithmetic
        return ((codes.astype(np.float32) - 8) * scale.astype(np.float32)[:, columns // 32]).astype(BF16)


def pack(values: np.ndarray) -> np.ndarray:
    """Integers in [-8, 7], (rows, cols) -> the int32 words compressed-tensors stores."""
    codes = (values.astype(np.int64) + 8).reshape(values.shape[0], -1, 8)
    return (codes << (4 * np.arange(8))).sum(axis=-1).astype(np.uint32).view(np.int32)


def random_int4(rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(0, 2**32, (rows, cols // 8), dtype=np.uint32).view(np.int32)
    scale = (np.abs(rng.standard_normal((rows, cols // 32))) * 0.004).astype(BF16)
    return packed, scale


def test_reference_is_compressed_tensors_decompressor():
    """The reference gives compressed-tensors' bits, subnormal and overflowing scales included."""
    pytest.importorskip("compressed_tensors")
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    rng = np.random.default_rng(7)
    packed, scale = random_int4(rng, 48, 256)
    scale[0, 0] = np.float32(1e-40)  # a bfloat16 subnormal
    scale[1, 1] = np.float32(3e38)  # 8 * 3e38 overflows to inf
    scale[2, 2] = -scale[2, 2]  # any sign
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
    state = {"weight_packed": torch.from_numpy(packed.copy()),
             "weight_scale": torch.from_numpy(scale.view(np.int16).copy()).view(torch.bfloat16),
             "weight_shape": torch.tensor([48, 256], dtype=torch.int32)}
    theirs = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16
    assert theirs.view(torch.int16).numpy().tobytes() == reference_int4(packed, scale).tobytes()
    values = rng.integers(-8, 8, (4, 64), dtype=np.int8)  # and our packing is theirs: lowest nibble first, + 8
    assert pack_to_int32(torch.from_numpy(values), 4).numpy().tobytes() == pack(values).tobytes()


def test_pack_layout_by_hand():
    values = np.array([[-8, -7, -1, 0, 1, 2, 3, 7] * 4], np.int8)
    assert pack(values)[0, 0].view(np.uint32) == 0xFBA98710
    decoded = reference_int4(pack(values), np.ones((1, 1), BF16))
    assert decoded.astype(np.float32).tolist() == values.astype(np.float32).tolist()


def _int4_file(tmp_path, packed, scale, shape=None) -> tuple[LocalSource, dict]:
    shape = np.array([packed.shape[0], packed.shape[1] * 8], np.int32) if shape is None else shape
    tmp_path.mkdir(exist_ok=True)
    save_file({"w.weight_packed": packed, "w.weight_scale": scale, "w.weight_shape": shape},
              str(tmp_path / "model.safetensors"))
    source = LocalSource(str(tmp_path))
    return source, index_checkpoint(source)


@pytest.mark.parametrize("shape", [(256, 384), (300, 224), (64, 7168)])
def test_int4_reads_equal_the_reference_for_every_band(tmp_path, shape):
    packed, scale = random_int4(np.random.default_rng(1), *shape)
    source, infos = _int4_file(tmp_path, packed, scale)
    int4, consumed = resolve("w.weight", infos, INT4_SCHEME)
    assert isinstance(int4, INT4Groups) and consumed == ("w.weight_packed", "w.weight_scale", "w.weight_shape")
    assert int4.shape == shape and int4.dtype == BF16 and int4.name == "w.weight"
    expected = reference_int4(packed, scale)
    for band in (1, 7, 128, 131, shape[0]):
        for start in range(0, shape[0], band):
            got = int4.read(source, ((start, min(start + band, shape[0])), (0, shape[1])))
            assert got.tobytes() == expected[start:start + band].tobytes(), (band, start)
    for row in sorted({0, 3, min(127, shape[0] - 2), shape[0] - 1}):  # parts of one row (the only partial reads)
        for cols in ((5, 200), (32, 64), (31, 33), (0, shape[1]), (shape[1] - 6, shape[1]), (8, 9)):
            got = int4.read(source, ((row, row + 1), cols))
            assert got.tobytes() == np.ascontiguousarray(expected[row:row + 1, cols[0]:cols[1]]).tobytes(), (row, cols)


def test_int4_decode_memory_is_bounded():
    """decode_bytes: besides the result, about the packed words, whatever the read's size."""
    import tracemalloc

    class Memory:  # a Source serving the bytes from memory (the read's own copies are counted)
        uri = "memory"

        def __init__(self, blob):
            self.blob = blob

        def read_range(self, file, offset, length):
            return self.blob[offset:offset + length]

    packed, scale = random_int4(np.random.default_rng(3), 2048, 7168)
    blob = packed.tobytes() + scale.tobytes() + np.array([2048, 7168], np.int32).tobytes()
    from ckptconv.read.safetensors_io import TensorInfo
    infos = (TensorInfo("w.weight_packed", "f", np.dtype(np.int32), packed.shape, 0),
             TensorInfo("w.weight_scale", "f", BF16, scale.shape, packed.nbytes),
             TensorInfo("w.weight_shape", "f", np.dtype(np.int32), (2,), packed.nbytes + scale.nbytes))
    int4 = INT4Groups(*infos)
    source = Memory(blob)
    tracemalloc.start()
    got = int4.read(source, ((0, 2048), (0, 7168)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    per_element = peak / got.size
    print(f"INT4 decode: {per_element:.2f} bytes per element at the peak, result included")
    assert per_element <= BF16.itemsize + int4.decode_bytes + 0.25  # the result + temporaries (+ the 4 MiB band)
    assert got.tobytes() == reference_int4(packed, scale).tobytes()


def test_int4_stored_shape_and_parts_are_checked(tmp_path):
    packed, scale = random_int4(np.random.default_rng(2), 64, 256)
    source, infos = _int4_file(tmp_path / "a", packed, scale, shape=np.array([64, 255], np.int32))
    with pytest.raises(BadInputError, match=re.escape("'w.weight_shape' holds [64, 255]")):
        resolve("w.weight", infos, INT4_SCHEME)[0].read(source, ((0, 1), (0, 256)))
    source, infos = _int4_file(tmp_path / "b", packed, scale.astype(np.float32))
    with pytest.raises(BadInputError, match="expected int32 \\(rows, cols/8\\), bfloat16"):
        resolve("w.weight", infos, INT4_SCHEME)
    del infos["w.weight_scale"]
    with pytest.raises(BadInputError, match="has no 'w.weight_scale'"):
        resolve("w.weight", infos, INT4_SCHEME)


KIMI = synth.SynthModel(model_type="kimi_k2", hidden_size=256, num_layers=3, num_heads=4, head_dim=16,
                        intermediate_size=320, moe_intermediate_size=192, num_experts=4, quantization="int4",
                        vocab_size=300)


def dequantized(src) -> dict[str, np.ndarray]:
    """The bfloat16 checkpoint compressed-tensors' decompressor gives for ``src``."""
    stored = load_stored(src / "model.safetensors")
    out = {}
    for name, value in stored.items():
        if name.endswith(("_scale", "_shape")):
            continue
        if name.endswith("_packed"):
            base = name.removesuffix("_packed")
            assert stored[base + "_shape"].tolist() == [value.shape[0], value.shape[1] * 8]
            out[base] = reference_int4(value, stored[base + "_scale"])
        else:
            out[name] = value.astype(BF16)
    return out


def test_synthetic_release_quantises_what_the_hub_does(synth_dir):
    """The experts INT4; ``ignore`` keeps attention, shared experts, the dense MLP and lm_head bfloat16."""
    stored = index_checkpoint(LocalSource(str(synth_dir(KIMI))))
    packed = {name.removesuffix(".weight_packed") for name in stored if name.endswith("_packed")}
    assert packed == {f"model.layers.{i}.mlp.experts.{e}.{p}_proj" for i in (1, 2) for e in range(4)
                      for p in ("gate", "up", "down")}
    assert stored["model.layers.1.mlp.experts.0.down_proj.weight_shape"].dtype == np.int32
    for plain in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                  "model.layers.1.self_attn.kv_b_proj.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"):
        assert stored[plain].dtype == BF16, plain


@pytest.mark.parametrize("scan, devices, dtype", [(True, 4, "bfloat16"), (False, 1, "float32")])
def test_int4_release_converts_like_the_dequantised_route(tmp_path, synth_dir, scan, devices, dtype):
    src, dst = synth_dir(KIMI), tmp_path / "dst"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", dtype]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr
    expected = expected_deepseek(dequantized(src), KIMI, scan, dtype)
    restored = restore(dst)
    assert restored.keys() == expected.keys() | {"step"}
    for name, value in expected.items():
        assert restored[name].shape == value.shape and restored[name].dtype == value.dtype, name
        assert restored[name].tobytes() == value.tobytes(), name
    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["model"]["values"]["quantization"] == INT4_SCHEME
    assert report["source_bytes"] < report["output_bytes"] * (0.75 if dtype == "bfloat16" else 0.4)
    planned = run_cli("plan", str(src), "--devices", str(devices), "--json")
    assert json.loads(planned.stdout)["quantization"] == INT4_SCHEME


def _weights(config):
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


BAD_CONFIGS = {  # what a release could say that this reader must not guess about -> the field named
    "format": (lambda q: q.update(format="naive-quantized"), "field 'format'"),
    "bits": (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "field 'num_bits'"),
    "float": (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "field 'type'"),
    "asymmetric": (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "field 'symmetric'"),
    "channel": (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="channel"), "field 'strategy'"),
    "group_size": (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=128), "field 'group_size'"),
    "actorder": (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "field 'actorder'"),
    "activations": (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
                    "field 'input_activations'"),
    "two groups": (lambda q: q["config_groups"].update(group_1=q["config_groups"]["group_0"]), "2 groups"),
    "kv cache": (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "field 'kv_cache_scheme'"),
    "sparsity": (lambda q: q.update(sparsity_config={"format": "sparse-24"}), "field 'sparsity_config'"),
    "unknown": (lambda q: q["config_groups"]["group_0"]["weights"].update(zero_points_packed=True),
                "unknown field(s) 'zero_points_packed'"),
    "no format": (lambda q: q.pop("format"), "field 'format'"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_unsupported_compressed_tensors_configs_are_refused(case):
    edit, message = BAD_CONFIGS[case]
    config = KIMI.config()
    edit(config["quantization_config"])
    with pytest.raises(BadInputError, match=re.escape(message)) as err:
        read_spec(BY_MODEL_TYPE["kimi_k2"], config, "src/config.json")
    assert str(err.value).startswith("src/config.json: quantization_config") and "\n" not in str(err.value)


def test_compressed_tensors_is_read_only_where_a_family_reads_it():
    config = synth.SynthModel(model_type="gpt_oss", num_layers=2, num_experts=4, quantization="mxfp4").config()
    config["quantization_config"] = deepseek.INT4_QUANTIZATION_CONFIG
    with pytest.raises(BadInputError, match="field 'quant_method' = 'compressed-tensors' is not supported"):
        read_spec(BY_MODEL_TYPE["gpt_oss"], config, "src/config.json")


@pytest.mark.slow
def test_full_size_kimi_k2_thinking_plans_under_two_gib(tmp_path):
    """Kimi-K2-Thinking (1T, INT4 experts) from its config.json, header-only shards: a bounded peak and a time."""
    from tests.published_configs import KIMI_K2_THINKING

    model = synth.SynthModel(model_type="kimi_k2", quantization="int4", config_overrides=dict(KIMI_K2_THINKING))
    synth.write_checkpoint(model, str(tmp_path), max_shard_bytes=5 * 10**9, header_only=True)
    for devices in (1, 16):
        result = run_cli("plan", str(tmp_path), "--devices", str(devices), "--json")
        assert result.returncode == 0, result.stderr
        planned = json.loads(result.stdout)
        print(devices, {k: planned[k] for k in ("source_bytes", "output_bytes", "predicted_peak_rss_bytes",
                                                "predicted_seconds")})
        assert planned["quantization"] == INT4_SCHEME
        assert 500 * 2**30 < planned["source_bytes"] < 700 * 2**30  # ~594 GB as released
        assert planned["output_bytes"] > 1800 * 2**30
        assert planned["predicted_peak_rss_bytes"] <= 2 * 2**30
        assert 3600 < planned["predicted_seconds"] < 12 * 3600
