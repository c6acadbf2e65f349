"""Qwen3-VL-MoE's vision tower under ``--multimodal``: Qwen3-VL's tower, the same rules and the same leaves.

MaxText 0.2.5 converts ``qwen3-vl-30b-a3b``'s tower with Qwen3-VL's mapping and hooks, so the leaves under
``vision_encoder/`` are named and shaped exactly as the dense model's (docs/bench/VISION.md: bit-identical to MaxText's
output); beside them the MoE decoder, unscanned (MaxText runs the deepstack path unscanned only). Export joins the
fused ``qkv`` and the experts back.
"""


import json

import pytest
from safetensors.numpy import load_file, save_file

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import ExportRequest, export
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.multimodal import convert_verify_export
from tests.test_export import assert_same, hf_tensors, jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)
from tests.test_qwen3_vl_vision import TOWER

MODEL = synth.SynthModel(model_type="qwen3_vl_moe", num_layers=2, num_experts=4, moe_intermediate_size=48,
                         tie_word_embeddings=False, encoders=True)


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))
    return directory


def test_multimodal_is_the_dense_tower_unscanned_and_exports_back(tmp_path, source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=4, multimodal=True)
    assert plan.scan_layers is False and plan.not_converted == ()
    leaves = {leaf.path[2:]: leaf.shape for leaf in plan.leaves}
    assert {path: shape for path, shape in leaves.items() if path[0] == "vision_encoder"} == TOWER
    assert leaves[("decoder", "layers_1", "moe_block", "wi_0")] == (4, 64, 48)  # the MoE decoder beside it
    assert plan.tensor_count == len(load_file(str(source / "model.safetensors")))

    report, _ = convert_verify_export(source, tmp_path, devices=16)
    assert report["scan_layers"] is False  # qkv and gate_up_proj joined back by export


def test_scan_layers_with_multimodal_is_one_line_and_nothing_is_written(tmp_path, source):
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal", "--scan-layers")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "unscanned only" in result.stderr and "--no-scan-layers" in result.stderr
    assert not dst.exists()


def test_a_tower_tensor_of_the_wrong_shape_is_one_line(tmp_path, source):
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.visual.blocks.0.attn.qkv.weight"] = tensors["model.visual.blocks.0.attn.qkv.weight"][:64]
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "model.visual.blocks.0.attn.qkv.weight" in result.stderr and "[96, 32]" in result.stderr
    assert not dst.exists()


def test_without_multimodal_the_tower_is_reported_and_the_default_stays_scanned(source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=1)
    assert plan.scan_layers is True
    assert [(e["what"], e["tensors"]) for e in plan.not_converted] == [("vision tower", 3 + 12 + 6 + 6)]
    assert not [leaf for leaf in plan.leaves if "vision_encoder" in leaf.path]


def test_a_checkpoint_of_the_release_before_the_tower_exports(tmp_path, source):
    """ckptconv 0.1.0 recorded no tower sizes in a Qwen3-VL-MoE report (it never read the tower): its checkpoints
    (a zoo's nightly ones) still export --like their source, held only to the fields their report records. The
    report here is this version's with the tower's sizes taken out and 0.1.0's tool line, as 0.1.0 wrote it."""
    mt, hf = tmp_path / "maxtext", tmp_path / "hf"
    convert(ConvertRequest(str(source), str(mt), devices=16, progress="none"))
    path = mt / "ckptconv-report.json"
    report = json.loads(path.read_text())
    assert report["tool"] != "ckptconv 0.1.0" and any(d.startswith("v_") for d in report["model"]["dims"])
    report["model"]["dims"] = {d: n for d, n in report["model"]["dims"].items() if not d.startswith("v_")}
    path.write_text(json.dumps({**report, "tool": "ckptconv 0.1.0"}))
    exported = export(ExportRequest(str(mt), str(hf), like=str(source), progress="none"))
    assert exported["status"] == "complete"
    tensors = load_file(str(source / "model.safetensors"))
    assert_same({n: t for n, t in tensors.items() if not n.startswith("model.visual.")}, hf_tensors(hf))
