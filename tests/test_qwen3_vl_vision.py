"""Qwen3-VL's vision tower under ``--multimodal`` (MaxText's use_multimodal=true), unscanned only.

With the flag every ``model.visual.*`` tensor becomes a leaf under ``vision_encoder/`` named and shaped as MaxText
0.2.5's converter writes it (bench/VISION.md: bit-identical to its output): the fused ``qkv`` cut into query, key
and value, the deepstack mergers beside the blocks. MaxText runs that path unscanned only: the default layout is
then unscanned, an explicit ``--scan-layers`` is one line saying why; without the flag the tower is reported.
"""

import json

import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import ExportRequest, export
from ckptconv.commands.verification import verify
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.test_export import assert_same, hf_tensors, jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)

# the synthetic tower: 1 block, hidden 32, 2 heads of 16, MLP 64, deepstack at block 0, merged width 4 x 32 = 128
MODEL = synth.SynthModel(model_type="qwen3_vl", num_layers=2, encoders=True)
ENCODER = ("vision_encoder", "Qwen3VLVisionEncoder_0")
PROJECTOR = ("vision_encoder", "Qwen3VLVisionProjector_0")
MERGER = {("ln_q", "scale"): (128,), ("ln_q", "bias"): (128,), ("mlp_0", "kernel"): (128, 128),
          ("mlp_0", "bias"): (128,), ("mlp_2", "kernel"): (128, 64), ("mlp_2", "bias"): (64,)}
TOWER = {  # MaxText 0.2.5's names and shapes
    (*ENCODER, "patch_embed", "proj", "kernel"): (2, 16, 16, 3, 32), (*ENCODER, "patch_embed", "proj", "bias"): (32,),
    (*ENCODER, "pos_embed_interpolate", "pos_embed"): (2304, 32),
    **{(*ENCODER, "blocks_0", ln, p): (32,) for ln in ("ln1", "ln2") for p in ("scale", "bias")},
    **{(*ENCODER, "blocks_0", "attn", "attn", m, "kernel"): (32, 2, 16) for m in ("query", "key", "value")},
    **{(*ENCODER, "blocks_0", "attn", "attn", m, "bias"): (2, 16) for m in ("query", "key", "value")},
    (*ENCODER, "blocks_0", "attn", "attn", "out", "kernel"): (2, 16, 32),
    (*ENCODER, "blocks_0", "attn", "attn", "out", "bias"): (32,),
    (*ENCODER, "blocks_0", "mlp", "kernel"): (32, 64), (*ENCODER, "blocks_0", "mlp", "bias"): (64,),
    (*ENCODER, "blocks_0", "mlp_out", "kernel"): (64, 32), (*ENCODER, "blocks_0", "mlp_out", "bias"): (32,),
    **{(*ENCODER, "merger_0", *path): shape for path, shape in MERGER.items()},
    **{(*PROJECTOR, "merger", *path): shape for path, shape in MERGER.items() if path[0] != "ln_q"},
    (*PROJECTOR, "merger", "ln_q", "scale"): (32,), (*PROJECTOR, "merger", "ln_q", "bias"): (32,),
}


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))
    return directory


def test_multimodal_is_unscanned_named_as_maxtext_and_exports_back(tmp_path, source):
    mt, hf = tmp_path / "maxtext", tmp_path / "hf"
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=4, multimodal=True)
    assert plan.scan_layers is False and plan.not_converted == ()
    leaves = {leaf.path[2:]: leaf.shape for leaf in plan.leaves}
    assert {path: shape for path, shape in leaves.items() if path[0] == "vision_encoder"} == TOWER
    assert plan.tensor_count == len(load_file(str(source / "model.safetensors")))

    convert(ConvertRequest(str(source), str(mt), devices=16, scan_layers=None, progress="none", multimodal=True))
    report = json.loads((mt / "ckptconv-report.json").read_text())
    assert report["scan_layers"] is False and report["multimodal"] is True
    assert verify(str(source), str(mt)).ok
    exported = export(ExportRequest(str(mt), str(hf), like=str(source), progress="none"))
    assert exported["status"] == "complete" and exported["scan_layers"] is False
    assert_same(load_file(str(source / "model.safetensors")), hf_tensors(hf))  # the fused qkv joined back


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
