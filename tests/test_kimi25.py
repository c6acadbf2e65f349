"""Kimi-K2.5 / K2.6 (``kimi_k25``): the multimodal wrapper around Kimi-K2-Thinking's text decoder, as the hub
ships it (``language_model.`` names, ``text_config``, INT4 experts, a vision tower and projector beside).

The strong check is cheap: the same random values written as a plain Kimi-K2-Thinking checkpoint (the
synthetic writer draws them in the same order) convert to the same leaves, bit for bit, so everything
tests/test_int4.py and the DeepSeek tests prove of Kimi-K2 holds for the wrapper. The logits of the
wrapper itself (transformers' Kimi_K25ForConditionalGeneration on these files) are tests/test_logits.py's
``kimi_k25`` and ``kimi_k25-noscan`` cases.
"""

import json
import re

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE
from ckptconv.families.inputs import INT4_SCHEME
from ckptconv.plan.conversion import read_spec
from ckptconv.read.safetensors_io import index_checkpoint
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.test_convert import restore
from tests.test_int4 import dequantized
from tests.test_quantized import load_stored

SIZES = dict(hidden_size=256, num_layers=3, num_heads=4, head_dim=16, intermediate_size=320,
             moe_intermediate_size=192, num_experts=4, quantization="int4", vocab_size=300)
VISION = {"vision_tower.patch_embed.proj.weight": (32, 3, 14, 14), "mm_projector.proj.0.weight": (128, 128)}
K25 = synth.SynthModel(model_type="kimi_k25", extra_tensors=VISION, **SIZES)
K2 = synth.SynthModel(model_type="kimi_k2", **SIZES)  # the same values without the wrapper
BIAS = "params/params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"


def test_synthetic_release_is_laid_out_as_the_hub_ships_it(synth_dir):
    """Every text tensor under language_model., the experts INT4, the vision tower and projector beside."""
    stored = index_checkpoint(LocalSource(str(synth_dir(K25))))
    text = {name for name in stored if not name.startswith(tuple(VISION))}
    assert all(name.startswith("language_model.") for name in text)
    assert {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight"} <= text
    packed = {name.removesuffix(".weight_packed") for name in stored if name.endswith("_packed")}
    assert packed == {f"language_model.model.layers.{i}.mlp.experts.{e}.{p}_proj" for i in (1, 2) for e in range(4)
                      for p in ("gate", "up", "down")}
    config = K25.config()
    assert config["model_type"] == "kimi_k25" and config["text_config"]["model_type"] == "kimi_k2"
    assert "quantization_config" in config["text_config"] and "quantization_config" not in config


@pytest.mark.parametrize("scan, devices, dtype", [(True, 4, "bfloat16"), (False, 1, "float32")])
def test_converts_to_the_leaves_of_the_same_kimi_k2(tmp_path, synth_dir, scan, devices, dtype):
    """The wrapper's checkpoint converts to exactly what the same model stored as plain Kimi-K2-Thinking does;
    the vision tower and projector are reported, not written; the router bias is under params/params."""
    flags = ["--progress", "none", "--devices", str(devices), "--dtype", dtype,
             "--scan-layers" if scan else "--no-scan-layers"]
    ours, plain = tmp_path / "k25", tmp_path / "k2"
    for src, dst in ((synth_dir(K25, "k25-src"), ours), (synth_dir(K2, "k2-src"), plain)):
        result = run_cli("convert", str(src), str(dst), *flags)
        assert result.returncode == 0, result.stderr
    got, expected = restore(ours), restore(plain)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name
    assert (BIAS if scan else BIAS.replace("moe_layers", "moe_layers_0")) in got
    report = json.loads((ours / "ckptconv-report.json").read_text())
    assert report["family"] == "kimi_k25" and report["model"]["values"]["quantization"] == INT4_SCHEME
    skipped = {entry["what"]: entry["example"] for entry in report["not_converted"]}
    assert skipped == {"vision tower (MoonViT)": "vision_tower.patch_embed.proj.weight",
                       "multimodal projector": "mm_projector.proj.0.weight"}
    verified = run_cli("verify", str(tmp_path / "k25-src"), str(ours))
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr


def test_quantization_config_at_the_top_is_read_too():
    """A release may keep quantization_config beside text_config: the same spec; in both places, the same spec if
    the copies are identical (as transformers 5.7 saves Kimi-K2.5), refused if they differ (tests/test_releases.py)."""
    family, config = BY_MODEL_TYPE["kimi_k25"], K25.config()
    inner = read_spec(family, config, "src/config.json")
    moved = {**config, "quantization_config": config["text_config"]["quantization_config"],
             "text_config": {k: v for k, v in config["text_config"].items() if k != "quantization_config"}}
    outer = read_spec(family, moved, "src/config.json")
    assert (outer.dims, outer.values, outer.num_layers) == (inner.dims, inner.values, inner.num_layers)
    assert inner.values["quantization"] == INT4_SCHEME and inner.model_type == "kimi_k25"
    both = read_spec(family, {**config, "quantization_config": config["text_config"]["quantization_config"]},
                     "src/config.json")
    assert (both.dims, both.values, both.num_layers) == (inner.dims, inner.values, inner.num_layers)
    differing = {**config, "quantization_config": {**config["text_config"]["quantization_config"], "ignore": []}}
    with pytest.raises(BadInputError, match="quantization_config in both config.json and its text_config"):
        read_spec(family, differing, "src/config.json")


def test_config_written_by_transformers_parses():
    """Kimi_K25Config as transformers writes it (its text_config rewritten as deepseek_v3, its own vision fields)."""
    transformers = pytest.importorskip("transformers")
    text = transformers.DeepseekV3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
                                         n_routed_experts=4, moe_intermediate_size=32)
    config = transformers.Kimi_K25Config(text_config=text.to_dict(), tie_word_embeddings=False,
                                         vision_config={"hidden_size": 32, "num_hidden_layers": 1})
    data = json.loads(config.to_json_string())
    spec = read_spec(BY_MODEL_TYPE[data["model_type"]], data, "config.json")
    assert (spec.dim("emb"), spec.dim("experts"), spec.num_layers, spec.value("dense_layers")) == (64, 4, 2, 1)


def test_the_wrapper_fields_of_the_release_are_accepted():
    """Kimi-K2-Thinking's published config.json as the text_config, beside the wrapper's own fields (those
    vLLM's KimiK25Config reads, vision settings in the release's vt_* spelling): Kimi-K2-Thinking's spec."""
    from tests.published_configs import KIMI_K2_THINKING

    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}, "bos_token_id": 163584,
              "eos_token_id": 163585, "pad_token_id": 163839, "ignore_index": -100, "tie_word_embeddings": False,
              "media_placeholder_token_id": 163605, "use_unified_vision_chunk": True,
              "video_placeholder": "<|kimi_k25_video_placeholder|>", "dtype": "bfloat16",
              "vision_config": {"vt_hidden_size": 1152, "vt_num_hidden_layers": 27, "mm_hidden_size": 1152,
                                "text_hidden_size": 7168, "patch_size": 14, "merge_kernel_size": [2, 2]},
              "text_config": KIMI_K2_THINKING}
    wrapped = read_spec(BY_MODEL_TYPE["kimi_k25"], config, "config.json")
    plain = read_spec(BY_MODEL_TYPE["kimi_k2"], KIMI_K2_THINKING, "config.json")
    assert (wrapped.dims, wrapped.values, wrapped.num_layers) == (plain.dims, plain.values, plain.num_layers)
    assert wrapped.dim("experts") == 384 and wrapped.values["quantization"] == INT4_SCHEME


@pytest.mark.parametrize("field, value, message", [
    ("text_config.model_type", "deepseek_v32", "text_config: field 'model_type' = 'deepseek_v32' is not supported"),
    ("tie_word_embeddings", True, "field 'tie_word_embeddings' = True is not supported"),
    ("text_config.vision_thing", 1, "text_config: unknown field(s) 'vision_thing'"),
])
def test_config_errors_name_the_field(field, value, message):
    config = K25.config()
    target = config["text_config"] if field.startswith("text_config.") else config
    target[field.removeprefix("text_config.")] = value
    with pytest.raises(BadInputError, match=re.escape(message)):
        read_spec(BY_MODEL_TYPE["kimi_k25"], config, "src/config.json")


def test_export_writes_the_hub_names_dequantised(tmp_path, synth_dir):
    """Export back: every text tensor under its language_model. name, the INT4 experts as compressed-tensors'
    decompressor gives them in bfloat16, the rest bit for bit; text_config without quantization_config."""
    src, dst, back = synth_dir(K25), tmp_path / "dst", tmp_path / "back"
    assert run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "2").returncode == 0
    result = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    expected = {name: value for name, value in dequantized(src).items() if not name.startswith(tuple(VISION))}
    exported = {}
    for file in sorted(back.glob("*.safetensors")):
        exported |= load_stored(file)
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():
        assert exported[name].dtype == value.dtype and exported[name].tobytes() == value.tobytes(), name
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and "quantization_config" not in config["text_config"]
    assert config["text_config"] == {
        k: v for k, v in json.loads((src / "config.json").read_text())["text_config"].items()
        if k != "quantization_config"}


EXPERT = "language_model.model.layers.1.mlp.experts.2.up_proj.weight"


def _one_group_short(tensors):
    """The packed words of one expert a group (32 values, 4 words) short of its scales and shape."""
    tensors[EXPERT + "_packed"] = tensors[EXPERT + "_packed"][:, :-4].contiguous()


def _one_group_short_everywhere(tensors):
    """Packed words and scales a group short alike, the stored shape too: a tensor of the wrong width."""
    _one_group_short(tensors)
    tensors[EXPERT + "_scale"] = tensors[EXPERT + "_scale"][:, :-1].contiguous()
    tensors[EXPERT + "_shape"][1] -= 32


def _nan_scale(tensors):
    tensors[EXPERT + "_scale"][5, 3] = float("nan")


def _inf_scale(tensors):
    tensors[EXPERT + "_scale"][-1, -1] = float("-inf")


def _shape_off_by_a_group(tensors):
    """The parts agree; the stored shape says a group more."""
    tensors[EXPERT + "_shape"][1] += 32


@pytest.mark.parametrize("change", [_one_group_short, _one_group_short_everywhere, _nan_scale, _inf_scale,
                                    _shape_off_by_a_group],
                         ids=["packed", "all-parts", "nan-scale", "inf-scale", "stored-shape"])
def test_damaged_int4_expert_is_one_line_exit_2(tmp_path, synth_dir, change):
    """A damaged INT4 expert (packed words a group short, a NaN or infinite group scale, a stored shape that is
    not its parts') is refused in one line naming it, exit 2, before anything is written."""
    from safetensors.torch import load_file, save_file

    src, dst = synth_dir(K25), tmp_path / "dst"
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(src / "model.safetensors"))
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and EXPERT.removesuffix(".weight") in lines[0], result.stderr
    assert not dst.exists() or not any(dst.iterdir())


def test_conditional_generation_checkpoint_saved_by_transformers(tmp_path):
    """Kimi_K25ForConditionalGeneration as transformers saves it (the hub's names, except the text layers, which
    transformers 5.24 saves as ``language_model.model.blocks.N``): the text decoder converts, the vision tower
    and projector are reported, the text logits match, and export gives back the names it saved."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.test_logits import hf_logits, maxtext_logits, semantics

    torch.manual_seed(0)
    model = synth.SynthModel(model_type="kimi_k25", hidden_size=64, num_layers=3, num_heads=4, head_dim=16,
                             intermediate_size=96, moe_intermediate_size=32, num_experts=4, vocab_size=128)
    fields = {k: v for k, v in model.config().items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_model = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(**fields))
    with torch.no_grad():  # a router bias that steers routing (transformers initialises it to zeros)
        for name, tensor in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape) * 0.2)
    src, dst, back = tmp_path / "hf", tmp_path / "dst", tmp_path / "back"
    hf_model.to(torch.bfloat16).save_pretrained(str(src))  # bf16-exact weights
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert sorted(e["what"] for e in report["not_converted"]) == ["multimodal projector", "vision tower (MoonViT)"]
    tokens = np.random.default_rng(5).integers(0, 128, size=10)
    expected = hf_logits(src, tokens)
    got = maxtext_logits(dst, tokens, semantics(model), True, 128)
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)
    result = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    saved = set(index_checkpoint(LocalSource(str(src))))
    exported = set(index_checkpoint(LocalSource(str(back))))
    assert exported == {n for n in saved if n.startswith("language_model.")}
