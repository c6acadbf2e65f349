"""Gemma 3's SigLIP vision tower and multimodal projector under ``--multimodal`` (MaxText's use_multimodal=true).

With the flag every tower tensor becomes a leaf under ``vision_encoder/`` named and shaped as MaxText 0.2.5's
converter writes it (docs/bench/VISION.md: bit-identical to its output), in both layouts (the tower's
``encoderblock_{i}`` are never scanned), and ``export`` gives the source back; without it, as MaxText by default,
the tower is reported in ``not_converted`` and nothing of it is written. The sources are in the hub's form
(``vision_tower.vision_model.*`` beside ``language_model.model.*``).
"""

import json

import pytest
from safetensors.numpy import load_file, save_file

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.commands.export import ExportRequest, export
from ckptconv.errors import BadInputError
from ckptconv.families.gemma3 import FAMILY
from ckptconv.plan.conversion import make_plan, read_spec
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.multimodal import convert_verify_export
from tests.test_export import assert_same, hf_tensors, jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)

# two tower layers, 8 decoder layers (a scanned block of 6 and a remainder of 2); image 28 / patch 14: 4 positions
MODEL = synth.SynthModel(model_type="gemma3", num_layers=8, vocab_size=96, encoders=True)
NORMS = ("norm.weight",)  # 1 + w (the decoder's and the projector's RMSNorms): back within one bfloat16 step
TOWER = ("params", "params", "vision_encoder", "Gemma3VisionEncoderLayer_0")
ATTENTION = "MultiHeadDotProductAttention_0"
BLOCK = {  # one encoderblock_{i}: hidden 32, 2 heads of 16, MLP 64
    **{(f"LayerNorm_{i}", p): (32,) for i in (0, 1) for p in ("scale", "bias")},
    **{(ATTENTION, m, "kernel"): (32, 2, 16) for m in ("query", "key", "value")},
    **{(ATTENTION, m, "bias"): (2, 16) for m in ("query", "key", "value")},
    (ATTENTION, "out", "kernel"): (2, 16, 32), (ATTENTION, "out", "bias"): (32,),
    ("MlpBlockViT_0", "Dense_0", "kernel"): (32, 64), ("MlpBlockViT_0", "Dense_0", "bias"): (64,),
    ("MlpBlockViT_0", "Dense_1", "kernel"): (64, 32), ("MlpBlockViT_0", "Dense_1", "bias"): (32,),
}


@pytest.fixture
def source(tmp_path):
    """The synthetic Gemma 3 with its 2-layer tower, the tower named as the hub's releases name it."""
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    assert sum(name.startswith("vision_tower.") for name in tensors) == 5 + 16 * 2
    save_file({("vision_tower.vision_model." + name[len("vision_tower."):] if name.startswith("vision_tower.")
                else name): value for name, value in tensors.items()}, str(path), metadata={"format": "pt"})
    return directory


def leaves(plan) -> dict[tuple[str, ...], tuple[int, ...]]:
    return {leaf.path: leaf.shape for leaf in plan.leaves}


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "noscan"])
def test_multimodal_writes_the_tower_as_maxtext_and_exports_it_back(tmp_path, source, scan):
    plan = make_plan(LocalSource(str(source)), scan_layers=scan, devices=4, multimodal=True)
    text_only = make_plan(LocalSource(str(source)), scan_layers=scan, devices=4)
    tower = {path[2:]: shape for path, shape in leaves(plan).items() if path[2] == "vision_encoder"}
    assert {p for p in leaves(plan) if p[2] != "vision_encoder"} == set(leaves(text_only))
    blocks = [(*TOWER[2:], "Transformer", f"encoderblock_{i}") for i in (0, 1)]
    assert tower == {  # MaxText 0.2.5's names and shapes (hidden 32, 2 heads of 16, MLP 64, patch 14, 4 positions)
        (*TOWER[2:], "embedding", "kernel"): (14, 14, 3, 32), (*TOWER[2:], "embedding", "bias"): (32,),
        (*TOWER[2:], "pos_embedding"): (1, 4, 32),
        (*TOWER[2:], "Transformer", "encoder_norm", "scale"): (32,),
        (*TOWER[2:], "Transformer", "encoder_norm", "bias"): (32,),
        ("vision_encoder", "VisionEmbedder_0", "mm_input_projection", "w"): (32, 64),
        ("vision_encoder", "VisionEmbedder_0", "mm_soft_embedding_norm", "scale"): (32,),
        **{(*block, *path): shape for block in blocks for path, shape in BLOCK.items()},
    }
    assert plan.not_converted == () and plan.tensor_count == len(load_file(str(source / "model.safetensors")))

    convert_verify_export(source, tmp_path, devices=16 if scan else 1, scan_layers=scan, close=NORMS)


def test_without_multimodal_the_tower_is_reported_and_not_written(tmp_path, source):
    """MaxText's default (use_multimodal=false): the text decoder only; the tower and projector are named in the
    report, and export says they are not in the checkpoint."""
    mt, hf = tmp_path / "maxtext", tmp_path / "hf"
    convert(ConvertRequest(str(source), str(mt), devices=1, progress="none"))
    report = json.loads((mt / "ckptconv-report.json").read_text())
    assert report["multimodal"] is False
    assert [(e["what"], e["tensors"]) for e in report["not_converted"]] == [("multimodal projector", 2),
                                                                             ("vision tower", 37)]
    plan = make_plan(LocalSource(str(source)), devices=1)
    assert not [leaf for leaf in plan.leaves if "vision_encoder" in leaf.path]
    exported = export(ExportRequest(str(mt), str(hf), like=str(source), progress="none"))
    assert not [name for name in hf_tensors(hf) if "vision" in name or "multi_modal" in name]
    assert {"vision tower: not in a MaxText checkpoint, not exported",
            "multimodal projector: not in a MaxText checkpoint, not exported"} <= {
        e["what"] for e in exported["not_exported"]}


def test_transformers_5_names_without_vision_model_are_the_same_tensors(tmp_path):
    """transformers >= 5.8 saves the tower as ``vision_tower.*`` (no ``vision_model.``): converted alike."""
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))  # the rules' own names: vision_tower.embeddings...
    plan = make_plan(LocalSource(str(directory)), devices=1, multimodal=True)
    assert sum(leaf.path[2] == "vision_encoder" for leaf in plan.leaves) == 7 + 16 * 2


def test_a_tower_tensor_of_another_shape_is_one_line_and_nothing_is_written(tmp_path, source):
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["intermediate_size"] = 48  # fc1/fc2 are stored 64 wide
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match=r"vision_tower\.vision_model\.encoder\.layers\.0\.mlp\.fc[12]\.weight' "
                                            r"has shape \[\d+, \d+\], config.json implies"):
        make_plan(LocalSource(str(source)), devices=1, multimodal=True)
    make_plan(LocalSource(str(source)), devices=1)  # the decoder alone still converts: the tower is not read


def test_multimodal_for_a_text_only_gemma3_is_refused(tmp_path, synth_dir):
    source, dst = synth_dir(synth.SynthModel(model_type="gemma3_text", num_layers=2, vocab_size=96)), tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "gemma3_text checkpoint (Gemma3ForCausalLM) has no vision tower" in result.stderr
    assert not dst.exists()


def test_the_tower_sizes_come_from_vision_config():
    dims = read_spec(FAMILY, MODEL.config(), "config.json").dims
    assert {k: v for k, v in dims.items() if k.startswith("v_")} == {
        "v_emb": 32, "v_mlp": 64, "v_layers": 2, "v_heads": 2, "v_channels": 3, "v_patch": 14, "v_positions": 4}
    assert dims["v_patch"] ** 2 * dims["v_positions"] == 28 * 28
