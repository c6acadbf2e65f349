"""Qwen3.5-MoE's vision tower under ``--multimodal`` (MaxText's use_multimodal=true), scanned and unscanned.

Qwen3.5's tower is Qwen3-VL's without deepstack mergers; MaxText 0.2.5 names its modules
``Qwen3_5MoeVisionEncoder_0`` / ``Qwen3_5MoeVisionProjector_0`` and, with no deepstack injection, runs the vision
path with the decoder scanned as well as unscanned (docs/bench/VISION.md: both bit-identical to its converter). The
tower's blocks are ``blocks_{i}`` in both layouts. Without the flag the tower is reported, as the ``mtp.*`` layer
always is.
"""

import json

import pytest
from safetensors.numpy import load_file, save_file

from ckptconv.commands import synth
from ckptconv.families.qwen3_5_moe import SMALL
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.multimodal import convert_verify_export
from tests.test_export import assert_same, hf_tensors, jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)

# the synthetic tower: 1 block, hidden 32, 2 heads of 16, MLP 64, patch 4 (t 2), 64 positions, merged 4 x 32 = 128
MODEL = synth.SynthModel(model_type="qwen3_5_moe", num_layers=4, encoders=True, **SMALL)
ENCODER = ("vision_encoder", "Qwen3_5MoeVisionEncoder_0")
PROJECTOR = ("vision_encoder", "Qwen3_5MoeVisionProjector_0")
TOWER = {  # MaxText 0.2.5's names and shapes (no merger_{j}: no deepstack)
    (*ENCODER, "patch_embed", "proj", "kernel"): (2, 4, 4, 3, 32), (*ENCODER, "patch_embed", "proj", "bias"): (32,),
    (*ENCODER, "pos_embed_interpolate", "pos_embed"): (64, 32),
    **{(*ENCODER, "blocks_0", ln, p): (32,) for ln in ("ln1", "ln2") for p in ("scale", "bias")},
    **{(*ENCODER, "blocks_0", "attn", "attn", m, "kernel"): (32, 2, 16) for m in ("query", "key", "value")},
    **{(*ENCODER, "blocks_0", "attn", "attn", m, "bias"): (2, 16) for m in ("query", "key", "value")},
    (*ENCODER, "blocks_0", "attn", "attn", "out", "kernel"): (2, 16, 32),
    (*ENCODER, "blocks_0", "attn", "attn", "out", "bias"): (32,),
    (*ENCODER, "blocks_0", "mlp", "kernel"): (32, 64), (*ENCODER, "blocks_0", "mlp", "bias"): (64,),
    (*ENCODER, "blocks_0", "mlp_out", "kernel"): (64, 32), (*ENCODER, "blocks_0", "mlp_out", "bias"): (32,),
    (*PROJECTOR, "merger", "ln_q", "scale"): (32,), (*PROJECTOR, "merger", "ln_q", "bias"): (32,),
    (*PROJECTOR, "merger", "mlp_0", "kernel"): (128, 128), (*PROJECTOR, "merger", "mlp_0", "bias"): (128,),
    (*PROJECTOR, "merger", "mlp_2", "kernel"): (128, 64), (*PROJECTOR, "merger", "mlp_2", "bias"): (64,),
}


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))
    return directory


@pytest.mark.parametrize("scan", [True, False])
def test_multimodal_names_the_tower_as_maxtext_in_both_layouts(source, scan):
    plan = make_plan(LocalSource(str(source)), scan_layers=scan, devices=4, multimodal=True)
    assert plan.scan_layers is scan and plan.not_converted == ()
    leaves = {leaf.path[2:]: leaf.shape for leaf in plan.leaves}
    assert {path: shape for path, shape in leaves.items() if path[0] == "vision_encoder"} == TOWER
    assert plan.tensor_count == len(load_file(str(source / "model.safetensors")))


def test_multimodal_scanned_converts_verifies_and_exports_back(tmp_path, source):
    report, _ = convert_verify_export(source, tmp_path, devices=16)
    assert report["scan_layers"] is True  # qkv, in_proj_* split back by export


def test_without_multimodal_the_tower_is_reported(source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=1)
    assert plan.scan_layers is True
    assert [(e["what"], e["tensors"]) for e in plan.not_converted] == [("vision tower", 3 + 12 + 6)]
    assert not [leaf for leaf in plan.leaves if "vision_encoder" in leaf.path]


def test_deepstack_indexes_are_refused_in_one_line(tmp_path, source):
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0]
    (source / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "vision_config" in result.stderr and "deepstack_visual_indexes must be empty" in result.stderr
    assert not dst.exists()


def test_multimodal_without_a_vision_config_is_one_line(tmp_path, source):
    config = json.loads((source / "config.json").read_text())
    del config["vision_config"]
    (source / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")},
              str(source / "model.safetensors"), metadata={"format": "pt"})
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "has no vision_config" in result.stderr
    assert not dst.exists()
