"""Qwen3-Omni-MoE's thinker towers under ``--multimodal`` (MaxText's use_multimodal=true; its qwen3-omni model sets
use_audio), unscanned only.

With the flag every ``thinker.visual.*`` and ``thinker.audio_tower.*`` tensor becomes a leaf under
``vision_encoder/`` and ``audio_encoder/`` named and shaped as MaxText 0.2.5's converter writes it (docs/bench/VISION.md:
bit-identical to its output on a transformers-made checkpoint); ``export`` gives every tensor back bit for bit.
MaxText runs the vision path unscanned only: the default layout is then unscanned, an explicit ``--scan-layers`` is
one line saying why; without the flag both towers are reported, not written.
"""


import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from ckptconv.read.stored import open_leaf, read_region
from tests.conftest import run_cli
from tests.multimodal import convert_verify_export, qwen3_vl_tower
from tests.test_export import assert_same, hf_tensors, jax_with_16_devices  # noqa: F401 (autouse: JAX with 16)

# vision: 1 block, hidden 32, 2 heads of 16, MLP 64, deepstack at block 0, merged width 4 x 32 = 128, out 64;
# audio: 1 layer, d_model 32, 2 heads, FFN 64, 16 mel bins -> 2 after three stride-2 convolutions of 16 channels
MODEL = synth.SynthModel(model_type="qwen3_omni_moe", num_layers=2, num_experts=4, moe_intermediate_size=32,
                         tie_word_embeddings=False, encoders=True)
V_ENCODER = ("vision_encoder", "Qwen3OmniMoeVisionEncoder_0")
V_PROJECTOR = ("vision_encoder", "Qwen3OmniMoeVisionProjector_0")
A_ENCODER = ("audio_encoder", "Qwen3OmniAudioEncoder_0")
A_PROJECTOR = ("audio_encoder", "Qwen3OmniAudioProjector_0")
VISION = qwen3_vl_tower(V_ENCODER, V_PROJECTOR)  # MaxText 0.2.5's names and shapes (its to_maxtext output)
LAYER = (*A_ENCODER, "layers_0")
AUDIO = {
    (*A_ENCODER, "conv2d1", "kernel"): (3, 3, 1, 16), (*A_ENCODER, "conv2d1", "bias"): (16,),
    **{(*A_ENCODER, f"conv2d{i}", "kernel"): (3, 3, 16, 16) for i in (2, 3)},
    **{(*A_ENCODER, f"conv2d{i}", "bias"): (16,) for i in (2, 3)},
    (*A_ENCODER, "conv_out", "kernel"): (32, 32),
    (*A_ENCODER, "layernorm_post", "scale"): (32,), (*A_ENCODER, "layernorm_post", "bias"): (32,),
    (*A_PROJECTOR, "proj1", "kernel"): (32, 32), (*A_PROJECTOR, "proj1", "bias"): (32,),
    (*A_PROJECTOR, "proj2", "kernel"): (32, 64), (*A_PROJECTOR, "proj2", "bias"): (64,),
    **{(*LAYER, ln, p): (32,) for ln in ("input_layer_norm", "post_attention_layer_norm") for p in ("scale", "bias")},
    **{(*LAYER, "self_attention_audio", m, "kernel"): (32, 2, 16) for m in ("query", "key", "value")},
    **{(*LAYER, "self_attention_audio", m, "bias"): (2, 16) for m in ("query", "key", "value")},
    (*LAYER, "self_attention_audio", "out", "kernel"): (2, 16, 32),
    (*LAYER, "self_attention_audio", "out", "bias"): (32,),
    (*LAYER, "AudioMLP", "wi", "kernel"): (32, 64), (*LAYER, "AudioMLP", "wi", "bias"): (64,),
    (*LAYER, "AudioMLP", "wo", "kernel"): (64, 32), (*LAYER, "AudioMLP", "wo", "bias"): (32,),
}


@pytest.fixture
def source(tmp_path):
    directory = tmp_path / "src"
    synth.write_checkpoint(MODEL, str(directory))
    return directory


def test_multimodal_is_unscanned_named_as_maxtext_and_exports_back(tmp_path, source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=4, multimodal=True)
    assert plan.scan_layers is False
    assert [e["what"] for e in plan.not_converted] == []  # no talker in the synthetic checkpoint
    leaves = {leaf.path[2:]: leaf.shape for leaf in plan.leaves}
    assert {path: shape for path, shape in leaves.items() if path[0] == "vision_encoder"} == VISION
    assert {path: shape for path, shape in leaves.items() if path[0] == "audio_encoder"} == AUDIO
    assert plan.tensor_count == len(load_file(str(source / "model.safetensors")))

    report, _ = convert_verify_export(source, tmp_path, devices=16)
    assert report["scan_layers"] is False  # qkv fused back, convs as stored, by export


def test_conv2d_kernel_as_maxtext_permutes_it(tmp_path, source):
    """(out, in, kh, kw) -> (kh, kw, in, out), as MaxText's reshape_conv2d_audio hook."""
    mt = tmp_path / "maxtext"
    convert(ConvertRequest(str(source), str(mt), devices=1, scan_layers=None, progress="none", multimodal=True))
    stored = load_file(str(source / "model.safetensors"))["thinker.audio_tower.conv2d2.weight"]
    got = read_region(open_leaf(str(mt), ("params", "params", *A_ENCODER, "conv2d2", "kernel")), ())
    assert np.array_equal(got.view(np.uint16), stored.transpose(2, 3, 1, 0).view(np.uint16))


def test_scan_layers_with_multimodal_is_one_line_and_nothing_is_written(tmp_path, source):
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal", "--scan-layers")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "runs Qwen3-Omni's vision path (deepstack features injected into decoder layers) unscanned only" in (
        result.stderr)
    assert not dst.exists()


def test_a_misshapen_audio_tensor_is_one_line_and_nothing_is_written(tmp_path, source):
    path = source / "model.safetensors"
    tensors = load_file(str(path))
    tensors["thinker.audio_tower.conv_out.weight"] = tensors["thinker.audio_tower.conv_out.weight"][:, :16].copy()
    save_file(tensors, str(path), metadata={"format": "pt"})
    dst = tmp_path / "dst"
    result = run_cli("convert", str(source), str(dst), "--progress", "none", "--multimodal", "--devices", "1")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "thinker.audio_tower.conv_out.weight" in result.stderr and "[32, 32]" in result.stderr, result.stderr
    assert not dst.exists()


def test_without_multimodal_the_towers_are_reported_and_the_default_stays_scanned(source):
    plan = make_plan(LocalSource(str(source)), scan_layers=None, devices=1)
    assert plan.scan_layers is True
    assert sorted((e["what"], e["tensors"]) for e in plan.not_converted) == [("audio tower", 29),
                                                                              ("vision tower", 27)]
    assert not [leaf for leaf in plan.leaves if leaf.path[2] in ("vision_encoder", "audio_encoder")]


def test_with_multimodal_the_talker_and_code2wav_are_still_reported(tmp_path):
    speech = {"talker.model.embed_tokens.weight": (32, 16), "code2wav.decoder.0.conv.weight": (8, 8, 7)}
    model = synth.SynthModel(model_type="qwen3_omni_moe", num_layers=2, num_experts=4, moe_intermediate_size=32,
                             tie_word_embeddings=False, encoders=True, extra_tensors=speech)
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=None, devices=1, multimodal=True)
    assert sorted((e["what"].split(" (")[0], e["tensors"]) for e in plan.not_converted) == [
        ("code2wav vocoder", 1), ("talker", 1)]
    assert plan.tensor_count == len(synth.tensor_shapes(model)) - len(speech)


def test_the_release_vision_config_fields_are_read_and_their_older_spellings_checked():
    """The release's ``vision_config`` also says ``in_chans`` / ``spatial_patch_size`` (older spellings of
    ``in_channels`` / ``patch_size``) and run-time fields; the towers' sizes are those of the release's modules
    (``conv_out``: 480 channels x 16 mel bins after three halvings of 128 = 7680 inputs)."""
    import copy

    from ckptconv.errors import BadInputError
    from ckptconv.families import BY_MODEL_TYPE
    from ckptconv.plan.conversion import read_spec
    from tests.published_configs import QWEN3_OMNI_30B_A3B

    config = copy.deepcopy(QWEN3_OMNI_30B_A3B)
    vision = config["thinker_config"]["vision_config"]
    vision.update(in_chans=3, spatial_patch_size=16, image_size=768, tokens_per_second=2, apply_vit_abs_pos_embed=True)
    spec = read_spec(BY_MODEL_TYPE["qwen3_omni_moe"], config, "config.json")
    assert (spec.dim("a_conv_in"), spec.dim("v_merged"), spec.dim("v_deepstack")) == (7680, 4608, 3)
    vision["spatial_patch_size"] = 14
    with pytest.raises(BadInputError, match="spatial_patch_size=14 disagrees with patch_size=16"):
        read_spec(BY_MODEL_TYPE["qwen3_omni_moe"], config, "config.json")
