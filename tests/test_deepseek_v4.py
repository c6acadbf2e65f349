"""DeepSeek-V4-Flash's quantised files as released: FP8 linear layers with ue8m0 ``<module>.scale`` blocks and FP4
routed experts (int8, two E2M1 codes per byte, one ue8m0 scale per 32 values of a row).

A synthetic bfloat16 checkpoint has one layer's experts and attention projections quantised here (torch, from the
formats' definitions); the converted leaves must be the references computed below in NumPy (code times scale in
float32, rounded once to bfloat16, code 0b1000 as -0.0: MaxText's ``deepseek_dequantize.py``), and damaged scales
must be refused in one line, exit 2, nothing written.
"""

import json
from functools import partial

import ml_dtypes
import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.families import deepseek_v4
from tests.conftest import run_cli
from tests.test_convert import restore

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from tests.v4_formats import dequantize, quantize_fp4, quantize_fp8  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
MODEL = synth.for_family(deepseek_v4.FAMILY, deepseek_v4.SMALL)
FP8_WEIGHTS = ("layers.3.attn.wq_b.weight", "layers.3.attn.wo_a.weight", "layers.3.ffn.shared_experts.w2.weight")
FP4_WEIGHTS = tuple(f"layers.3.ffn.experts.{e}.w{w}.weight" for e in range(8) for w in (1, 2, 3))


def release(directory, damage: str | None = None) -> dict[str, np.ndarray]:
    """The synthetic checkpoint with FP8_WEIGHTS and FP4_WEIGHTS quantised as the release stores them; returns the
    reference (bfloat16) value of each."""
    synth.write_checkpoint(MODEL, str(directory))
    tensors = load_file(str(directory / "model.safetensors"))
    expected = {}
    for name in FP8_WEIGHTS + FP4_WEIGHTS:
        fp4 = name in FP4_WEIGHTS
        codes, scale = (partial(quantize_fp4, negative_zero_column=True) if fp4 else quantize_fp8)(tensors.pop(name))
        module = name.removesuffix(".weight")
        expected[name] = dequantize(codes, scale).astype(BF16)
        if damage == "grid" and name == FP8_WEIGHTS[0]:
            scale = torch.cat([scale, scale[:1]])  # one block row too many
        if damage == "nan" and name == FP4_WEIGHTS[0]:
            scale = scale.clone()
            scale.view(torch.uint8)[0, 0] = 255  # ue8m0's not-a-number
        tensors[name], tensors[module + ".scale"] = codes, scale
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config |= {"expert_dtype": "fp4", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]}}
    (directory / "config.json").write_text(json.dumps(config))
    return expected


def test_fp8_and_fp4_release_decodes_as_maxtexts_dequantiser(tmp_path):
    expected = release(tmp_path / "hf")
    result = run_cli("convert", str(tmp_path / "hf"), str(tmp_path / "mt"), "--progress", "none", "--no-scan-layers")
    assert result.returncode == 0, result.stderr
    leaves = restore(tmp_path / "mt")
    attention = "params/params/decoder/layers_3/self_attention/"
    wq_b = expected["layers.3.attn.wq_b.weight"].T.reshape(64, 4, 64)
    np.testing.assert_array_equal(leaves[attention + "wq_b/kernel"].view(np.uint16), wq_b.view(np.uint16))
    wo_a = expected["layers.3.attn.wo_a.weight"].reshape(2, 32, 128).transpose(0, 2, 1)
    np.testing.assert_array_equal(leaves[attention + "o_a_proj/kernel"].view(np.uint16), wo_a.view(np.uint16))
    moe = "params/params/decoder/layers_3/mlp/MoeBlock_0/"
    for w, leaf in (("1", "wi_0"), ("3", "wi_1"), ("2", "wo")):
        stacked = np.stack([expected[f"layers.3.ffn.experts.{e}.w{w}.weight"].T for e in range(8)])
        np.testing.assert_array_equal(leaves[moe + leaf].view(np.uint16), stacked.view(np.uint16))  # -0.0 kept
    assert (leaves[moe + "wi_0"].view(np.uint16) == 0x8000).any()


@pytest.mark.parametrize("damage, message", [("grid", "one scale per 128x128 block"), ("nan", "not-a-number")])
def test_damaged_scales_are_refused(tmp_path, damage, message):
    release(tmp_path / "hf", damage)
    result = run_cli("convert", str(tmp_path / "hf"), str(tmp_path / "mt"), "--progress", "none", "--no-scan-layers")
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "mt").exists() or not any((tmp_path / "mt").iterdir())


def dequantized(path) -> dict[str, np.ndarray]:
    """The bfloat16 checkpoint MaxText's deepseek_dequantize.py writes for a V4 release (its other tensors cast)."""
    stored = load_file(str(path))
    out = {}
    for name, tensor in stored.items():
        if name.endswith(".scale"):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        if scale is None:
            out[name] = tensor.to(torch.float32).numpy().astype(BF16)
            continue
        out[name] = dequantize(tensor, scale).astype(BF16)
    return out


def test_fp8_fp4_release_exports_dequantised_bfloat16(tmp_path, scan=True):
    """Export of a converted V4 release gives every tensor back as MaxText's dequantiser would write it (FP8 and FP4
    weights decoded to bfloat16), and a config.json without quantization_config or expert_dtype."""
    from safetensors.numpy import load_file as load_numpy

    model = synth.for_family(deepseek_v4.FAMILY, {**deepseek_v4.SMALL, "quantization": "fp8"})
    src, mt, hf = tmp_path / "src", tmp_path / "mt", tmp_path / "hf"
    synth.write_checkpoint(model, str(src))
    layout = ["--scan-layers" if scan else "--no-scan-layers", "--devices", "4", "--progress", "none"]
    assert run_cli("convert", str(src), str(mt), *layout).returncode == 0
    result = run_cli("export", str(mt), str(hf), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    exported = {}
    for file in sorted(hf.glob("*.safetensors")):
        exported |= load_numpy(str(file))
    want = dequantized(src / "model.safetensors")
    assert sorted(exported) == sorted(want)
    assert [n for n in want if exported[n].dtype != BF16 or exported[n].tobytes() != want[n].tobytes()] == []
    config = json.loads((hf / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config


def test_mtp_layer_is_reported_not_converted(tmp_path):
    """The release's MTP layer (``num_nextn_predict_layers: 1``), stored as ``mtp.0.*`` or as the layer after the
    last, is reported, not converted (as MaxText's deepseek4 drops it)."""
    model = synth.SynthModel(**{**MODEL.__dict__, "config_overrides": {"num_nextn_predict_layers": 1},
                                "extra_tensors": {"mtp.0.attn_norm.weight": (128,), "layers.5.ffn_norm.weight": (128,)}})
    synth.write_checkpoint(model, str(tmp_path / "hf"))
    result = run_cli("convert", str(tmp_path / "hf"), str(tmp_path / "mt"), "--progress", "none", "--no-scan-layers")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "mt" / "ckptconv-report.json").read_text())
    assert [(e["what"], e["tensors"]) for e in report["not_converted"]] == [("multi-token prediction (MTP) layer", 2)]
