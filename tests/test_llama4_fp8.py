"""Llama 4 Maverick's FP8 release (Llama-4-Maverick-17B-128E-Instruct-FP8), read straight from its files.

Meta ships it as compressed-tensors ``float-quantized``: each quantised ``nn.Linear`` an e4m3 ``weight`` with a
``weight_scale`` (rows, 1), one scale per output row; the routed experts one by one
(``feed_forward.experts.{e}.{gate,up,down}_proj.weight``, as transformers' ``SequentialLlama4TextExperts``
holds them to quantise them) rather than the bf16 release's fused ``experts.gate_up_proj``; attention, routers,
the vision tower, the projector and lm_head in bfloat16 (``ignore``). MaxText 0.2.5 has no route for it (its
Llama 4 scripts read bf16 hub files or Meta's original checkpoints): the check is that converting the FP8 files
gives exactly the leaves of converting the bf16 model transformers dequantises them to.
"""

import json
import shutil

import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli
from tests.test_convert import restore
from tests.test_export import hf_tensors

SMALL = {"num_experts": 4, "moe_intermediate_size": 32, "intermediate_size": 96, "tie_word_embeddings": False,
         "vocab_size": 128}
FP8 = synth.SynthModel(model_type="llama4", num_layers=8, quantization="fp8",
                       config_overrides={"interleave_moe_layer_step": 2}, **SMALL)
LAYER = "language_model.model.layers.{}.feed_forward."


def dequantised(src, dst) -> None:
    """The bf16 model transformers makes of the FP8 files (``CompressedTensorsDequantize``: the e4m3 codes times
    their row scale in float32, rounded once to bfloat16), in the bf16 release's layout (fused experts
    (experts, in, out)), its config without ``quantization_config``; computed with torch, not ckptconv."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    stored = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, value in stored.items():
        if name.endswith("_scale"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = (value.to(torch.float32) * stored[name + "_scale"].to(torch.float32)).to(torch.bfloat16)
        plain[name] = value
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"]
    for layer in range(text["num_hidden_layers"]):
        p = LAYER.format(layer) + "experts."
        if p + "0.gate_proj.weight" not in plain:
            continue
        experts = range(text["num_local_experts"])
        gate_up = [torch.cat([plain.pop(f"{p}{e}.gate_proj.weight").T, plain.pop(f"{p}{e}.up_proj.weight").T], -1)
                   for e in experts]
        plain[p + "gate_up_proj"] = torch.stack(gate_up).contiguous()
        plain[p + "down_proj"] = torch.stack([plain.pop(f"{p}{e}.down_proj.weight").T for e in experts]).contiguous()
    dst.mkdir()
    save_file(plain, str(dst / "model.safetensors"))
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))


def convert(src, dst, *flags: str) -> dict:
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr
    return json.loads((dst / "ckptconv-report.json").read_text())


def test_synthetic_release_is_laid_out_as_the_hub_ships_it(synth_dir):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    src = synth_dir(FP8)
    stored = load_file(str(src / "model.safetensors"))
    expert = LAYER.format(1) + "experts.3.gate_proj.weight"
    assert stored[expert].dtype == torch.float8_e4m3fn and tuple(stored[expert].shape) == (32, 64)
    assert stored[expert + "_scale"].dtype == torch.bfloat16 and tuple(stored[expert + "_scale"].shape) == (32, 1)
    assert stored[LAYER.format(0) + "down_proj.weight"].dtype == torch.float8_e4m3fn  # dense MLP: quantised
    for bf16 in ("language_model.model.layers.1.self_attn.q_proj.weight", LAYER.format(1) + "router.weight",
                 "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"):
        assert stored[bf16].dtype == torch.bfloat16, bf16
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in stored)


@pytest.mark.parametrize("scan,devices", [(True, 16), (False, 1)], ids=["scanned-16", "unscanned-1"])
def test_converts_to_the_leaves_of_the_dequantised_bf16_model(tmp_path, synth_dir, scan, devices):
    """Every leaf bit for bit the conversion of the bf16 model transformers dequantises the FP8 files to."""
    src = synth_dir(FP8)
    dequantised(src, tmp_path / "bf16")
    flags = ("--devices", str(devices)) + (() if scan else ("--no-scan-layers",))
    report = convert(src, tmp_path / "from-fp8", *flags)
    convert(tmp_path / "bf16", tmp_path / "from-bf16", *flags)
    ours, reference = restore(tmp_path / "from-fp8"), restore(tmp_path / "from-bf16")
    assert sorted(ours) == sorted(reference) and len(ours) > 40
    for name in reference:
        assert ours[name].dtype == reference[name].dtype and ours[name].shape == reference[name].shape, name
        assert ours[name].tobytes() == reference[name].tobytes(), name
    assert json.dumps(report).count("fp8-channel") >= 1


def test_export_writes_the_bf16_release(tmp_path, synth_dir):
    """Exported --like the FP8 release: the bf16 release's tensors (fused experts), exactly the dequantised
    model's, and its config.json without quantization_config."""
    src = synth_dir(FP8)
    dequantised(src, tmp_path / "bf16")
    convert(src, tmp_path / "mt", "--devices", "4")
    result = run_cli("export", str(tmp_path / "mt"), str(tmp_path / "hf"), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    exported, reference = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "bf16")
    assert sorted(exported) == sorted(reference)
    assert all(exported[n].tobytes() == reference[n].tobytes() for n in reference)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config


EXPERT = LAYER.format(3) + "experts.2.up_proj.weight"


def _scale_a_row_short(tensors):
    tensors[EXPERT + "_scale"] = tensors[EXPERT + "_scale"][:-1].contiguous()


def _scale_per_tensor(tensors):
    tensors[EXPERT + "_scale"] = tensors[EXPERT + "_scale"][:1].contiguous()


def _nan_scale(tensors):
    tensors[EXPERT + "_scale"][7, 0] = float("nan")


def _inf_scale(tensors):
    tensors[EXPERT + "_scale"][-1, 0] = float("inf")


def _no_scale(tensors):
    del tensors[EXPERT + "_scale"]


@pytest.mark.parametrize("change", [_scale_a_row_short, _scale_per_tensor, _nan_scale, _inf_scale, _no_scale],
                         ids=["scale-row-short", "scale-per-tensor", "nan-scale", "inf-scale", "no-scale"])
def test_damaged_fp8_expert_is_one_line_exit_2(tmp_path, synth_dir, change):
    """A damaged FP8 expert (its row scales a row short or one for the tensor, a NaN or infinite scale, none) is
    refused in one line naming it, exit 2, before anything is written."""
    from safetensors.torch import load_file, save_file

    src, dst = synth_dir(FP8), tmp_path / "dst"
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(src / "model.safetensors"))
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and EXPERT in lines[0], result.stderr
    assert not dst.exists() or not any(dst.iterdir())


def test_damaged_fp8_dense_weight_is_one_line_exit_2(tmp_path, synth_dir):
    """A dense layer's (not an expert's) NaN row scale: refused the same way."""
    from safetensors.torch import load_file, save_file

    src, dst = synth_dir(FP8), tmp_path / "dst"
    name = LAYER.format(2) + "gate_proj.weight"
    tensors = load_file(str(src / "model.safetensors"))
    tensors[name + "_scale"][0, 0] = float("nan")
    save_file(tensors, str(src / "model.safetensors"))
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--no-scan-layers")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and name in result.stderr
    shutil.rmtree(src)


def test_keeping_fp8_is_refused_in_one_line(tmp_path, synth_dir):
    """--dtype float8_e4m3fn: MaxText's llama4 model has no leaves for row scales; refused, nothing written."""
    src, dst = synth_dir(FP8), tmp_path / "dst"
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--dtype", "float8_e4m3fn")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "scale per row" in result.stderr and not dst.exists()


@pytest.mark.parametrize("change, message", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "'strategy' = 'tensor'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "'num_bits' = 4"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "'dynamic' = False"),
    (lambda q: q.update(format="pack-quantized"), "is not supported"),  # read as INT4: its fields refused
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "'kv_cache_scheme'"),
], ids=["per-tensor", "int4-bits", "static-activations", "int4-format", "kv-cache"])
def test_quantization_configs_that_change_the_weights_are_refused(change, message):
    """What would add tensors or change what the stored codes mean is refused, naming the field."""
    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec

    config = FP8.config()
    change(config["quantization_config"])
    with pytest.raises(BadInputError, match=message):
        read_spec(BY_MODEL_TYPE["llama4"], config, "config.json")
