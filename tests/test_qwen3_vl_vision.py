"""Qwen3-VL's vision tower under ``--multimodal`` (MaxText's use_multimodal=true), unscanned only.

With the flag every ``model.visual.*`` tensor becomes a leaf under ``vision_encoder/`` named and shaped as MaxText
0.2.5's converter writes it (docs/bench/VISION.md: bit-identical to its output): the fused ``qkv`` cut into query, key
and value, the deepstack mergers beside the blocks. MaxText runs that path unscanned only: the default layout is
then unscanned, an explicit ``--scan-layers`` is one line saying why; without the flag the tower is reported.
"""


import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.multimodal import convert_verify_export, qwen3_vl_tower
from tests.test_export import jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)

# the synthetic tower: 1 block, hidden 32, 2 heads of 16, MLP 64, deepstack at block 0, merged width 4 x 32 = 128
MODEL = synth.SynthModel(model_type="qwen3_vl", num_layers=2, encoders=True)
ENCODER = ("vision_encoder", "Qwen3VLVisionEncoder_0")
PROJECTOR = ("vision_encoder", "Qwen3VLVisionProjector_0")
TOWER = qwen3_vl_tower(ENCODER, PROJECTOR)  # MaxText 0.2.5's names and shapes


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))
    return directory


def test_multimodal_is_unscanned_named_as_maxtext_and_exports_back(tmp_path, source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=4, multimodal=True)
    assert plan.scan_layers is False and plan.not_converted == ()
    leaves = {leaf.path[2:]: leaf.shape for leaf in plan.leaves}
    assert {path: shape for path, shape in leaves.items() if path[0] == "vision_encoder"} == TOWER
    assert plan.tensor_count == len(load_file(str(source / "model.safetensors")))

    report, _ = convert_verify_export(source, tmp_path, devices=16)
    assert report["scan_layers"] is False  # the fused qkv joined back by export


def test_scan_layers_with_multimodal_is_one_line_and_nothing_is_written(tmp_path, source):
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal", "--scan-layers")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "runs Qwen3-VL's vision path (deepstack features injected into decoder layers) unscanned only" in (
        result.stderr)
    assert not dst.exists()


def test_without_multimodal_the_tower_is_reported_and_the_default_stays_scanned(source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=1)
    assert plan.scan_layers is True
    assert [(e["what"], e["tensors"]) for e in plan.not_converted] == [("vision tower", 3 + 12 + 6 + 6)]
    assert not [leaf for leaf in plan.leaves if "vision_encoder" in leaf.path]
