"""Gemma 4's vision tower and projector under ``--multimodal`` (MaxText's use_multimodal=true): 26B-A4B and 31B.

With the flag every ``model.vision_tower.*`` / ``model.embed_vision.*`` tensor becomes a leaf under
``vision_encoder/`` named and shaped as MaxText 0.2.5's converter writes it (docs/bench/VISION.md: bit-identical to its
output), in both layouts (the tower's ``layer_{i}`` are never scanned), and ``export`` gives the source back;
without it the tower is reported and nothing of it is written. What MaxText's tower cannot hold (E2B / E4B, clipped
linears, no standardisation) is one line, exit 2, nothing written.
"""

import json
from dataclasses import replace

import pytest
from safetensors.numpy import load_file

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families.gemma4 import DENSE_TINY, E2B_TINY, MOE_TINY
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.multimodal import convert_verify_export
from tests.test_export import assert_same, hf_tensors, jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)

# the synthetic tower (gemma4.synthetic_config): 2 layers, hidden 32, 2 heads of 16, MLP 64, patch 4, 64 positions
DENSE = synth.SynthModel(model_type="gemma4", **DENSE_TINY, encoders=True)  # hidden 64
ENCODER = ("vision_encoder", "Gemma4VisionEncoderLayer_0")
LAYER = {  # one layer_{i}, MaxText 0.2.5's names and shapes
    **{("attention", m, "kernel"): (32, 2, 16) for m in ("query", "key", "value")},
    ("attention", "out", "kernel"): (2, 16, 32),
    ("attention", "query_norm", "scale"): (16,), ("attention", "key_norm", "scale"): (16,),
    **{(norm, "scale"): (32,) for norm in ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm",
                                           "post_ffw_norm")},
    ("mlp", "wi_0", "kernel"): (32, 64), ("mlp", "wi_1", "kernel"): (32, 64), ("mlp", "wo", "kernel"): (64, 32),
}
TOWER = {
    (*ENCODER, "vision_entry", "input_projection", "kernel"): (48, 32),
    (*ENCODER, "vision_entry", "pos_emb_param"): (64, 2, 32),
    (*ENCODER, "std_scale"): (32,), (*ENCODER, "std_bias"): (32,),
    ("vision_encoder", "Gemma4VisionProjector_0", "projection", "kernel"): (32, 64),
    **{(*ENCODER, f"layer_{i}", *path): shape for i in (0, 1) for path, shape in LAYER.items()},
}


def write(tmp_path, model: synth.SynthModel, **vision):
    directory = tmp_path / "src"
    synth.write_checkpoint(model, str(directory))
    if vision:
        config = json.loads((directory / "config.json").read_text())
        config["vision_config"].update(vision)
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "noscan"])
def test_multimodal_writes_the_tower_as_maxtext_and_exports_it_back(tmp_path, scan):
    source = write(tmp_path, DENSE)
    tensors = load_file(str(source / "model.safetensors"))
    assert sum(name.startswith(("model.vision_tower.", "model.embed_vision.")) for name in tensors) == 5 + 2 * 13
    plan = make_plan(LocalSource(str(source)), scan_layers=scan, devices=4, multimodal=True)
    text_only = make_plan(LocalSource(str(source)), scan_layers=scan, devices=4)
    leaves = {leaf.path[2:]: leaf.shape for leaf in plan.leaves}
    assert {path: shape for path, shape in leaves.items() if path[0] == "vision_encoder"} == TOWER
    assert {leaf.path for leaf in plan.leaves if leaf.path[2] != "vision_encoder"} == {
        leaf.path for leaf in text_only.leaves}
    assert plan.not_converted == () and plan.tensor_count == len(tensors)

    convert_verify_export(source, tmp_path, devices=16 if scan else 1, scan_layers=scan, source_tensors=tensors)


def test_the_moe_model_takes_the_same_tower(tmp_path):
    source = write(tmp_path, synth.SynthModel(model_type="gemma4", **{**MOE_TINY, "num_layers": 6}, encoders=True))
    plan = make_plan(LocalSource(str(source)), devices=1, multimodal=True)
    assert {leaf.path[2:]: leaf.shape for leaf in plan.leaves if leaf.path[2] == "vision_encoder"} == TOWER
    assert plan.not_converted == ()


def test_without_multimodal_the_tower_is_reported_and_not_written(tmp_path):
    source = write(tmp_path, DENSE)
    plan = make_plan(LocalSource(str(source)), devices=1)
    assert [(e["what"], e["tensors"]) for e in plan.not_converted] == [("vision projector", 1),
                                                                       ("vision tower", 4 + 2 * 13)]
    assert not [leaf for leaf in plan.leaves if "vision_encoder" in leaf.path]


@pytest.mark.parametrize("model, vision, reason", [
    (synth.SynthModel(model_type="gemma4", **E2B_TINY, encoders=True), {},
     "does not convert Gemma 4 E2B / E4B's vision tower"),
    (DENSE, {"use_clipped_linears": True}, "use_clipped_linears is true: MaxText 0.2.5's Gemma 4 tower has no"),
    (DENSE, {"standardize": False}, "standardize is false: MaxText 0.2.5's gemma4 mapping reads the tower's"),
    (DENSE, {"num_key_value_heads": 1}, "as many KV heads as heads"),
    (synth.SynthModel(model_type="gemma4_text", **DENSE_TINY), {}, "has no vision tower"),
], ids=["e2b", "clipped", "no-standardize", "kv-heads", "text-only"])
def test_a_tower_maxtext_cannot_hold_is_one_line_and_nothing_is_written(tmp_path, model, vision, reason):
    source, dst = write(tmp_path, model, **vision), tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert reason in result.stderr and "convert without --multimodal" in result.stderr
    assert not dst.exists()


def test_a_tower_tensor_of_another_shape_is_one_line(tmp_path):
    source = write(tmp_path, DENSE, intermediate_size=48)  # the MLP is stored 64 wide
    with pytest.raises(BadInputError, match=r"model\.vision_tower\.encoder\.layers\.0\.mlp\.\w+_proj\.linear\.weight'"
                                            r" has shape \[\d+, \d+\], config.json implies"):
        make_plan(LocalSource(str(source)), devices=1, multimodal=True)
    make_plan(LocalSource(str(source)), devices=1)  # the decoder alone still converts: the tower is not read


@pytest.mark.parametrize("name", ["gemma-4-26B-A4B-it", "gemma-4-31B-it", "gemma-4-E2B-it"])
def test_the_releases_towers(name):
    """The releases' whole vision_config: 26B-A4B's and 31B's tower (16 heads of 72 over 1152, 27 layers, a 10240
    x / y position table, standardize) is MaxText's; E2B's (clipped linears, no standardize) is refused."""
    import copy

    from ckptconv.families import gemma4_vision
    from ckptconv.families.base import MULTIMODAL, LayoutError
    from ckptconv.families.gemma4 import FAMILY
    from ckptconv.plan.conversion import read_spec
    from tests.published_configs import GEMMA4, GEMMA4_VISION

    config = copy.deepcopy(GEMMA4[name]) | {"vision_config": GEMMA4_VISION[name]}
    spec = read_spec(FAMILY, config, "config.json")
    assert {k: spec.dims[k] for k in ("v_emb", "v_heads", "v_hd", "v_q", "v_mlp", "v_layers", "v_positions",
                                      "v_patch_in")} == (
        {"v_emb": 1152, "v_heads": 16, "v_hd": 72, "v_q": 1152, "v_mlp": 4304, "v_layers": 27, "v_positions": 10240,
         "v_patch_in": 768} if name != "gemma-4-E2B-it" else
        {"v_emb": 768, "v_heads": 12, "v_hd": 64, "v_q": 768, "v_mlp": 3072, "v_layers": 16, "v_positions": 10240,
         "v_patch_in": 768})
    spec = replace(spec, values={**spec.values, MULTIMODAL: True})
    if name == "gemma-4-E2B-it":
        with pytest.raises(LayoutError, match="does not convert Gemma 4 E2B / E4B's vision tower"):
            FAMILY.layout(spec, False)
        return
    stacks = FAMILY.layout(spec, True)
    assert [s.prefix for s in stacks if s.encoder] == [(*gemma4_vision.ENCODER, f"layer_{i}") for i in range(27)]
