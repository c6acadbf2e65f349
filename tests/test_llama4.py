"""Llama 4's text decoder: the layouts agree, export gives the hub's tensors back, and what MaxText cannot hold
is refused in one line.

The family's round-trip, logit and memory examples already run through the registry-derived tests
(tests/test_export.py, tests/test_logits.py, tests/test_memory.py); here what is Llama 4's own: MoE and
dense layers interleaved, scanned in cycles of 4, fused experts, the multimodal wrapper as transformers
saves it.
"""

import json

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE, llama4
from ckptconv.plan.conversion import read_spec
from tests.conftest import run_cli
from tests.test_convert import restore
from tests.test_export import hf_tensors

SMALL = {"num_experts": 4, "moe_intermediate_size": 32, "intermediate_size": 96, "tie_word_embeddings": False,
         "vocab_size": 128}
MAVERICK = synth.SynthModel(model_type="llama4", num_layers=8, config_overrides={"interleave_moe_layer_step": 2},
                            **SMALL)
EXPERTS = "language_model.model.layers.{}.feed_forward.experts.gate_up_proj"


def convert(src, dst, *flags: str) -> dict:
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr
    return json.loads((dst / "ckptconv-report.json").read_text())


def test_scanned_is_unscanned_restacked_in_cycles_of_four(tmp_path, synth_dir):
    """Scanned on 16 devices: ``decoder/layers/layers_{p}`` holds HF layers p, p + 4, ... on axis 1 (experts
    (E, cycles, ...)), each exactly the unscanned ``decoder/layers_{i}`` leaf; dense and MoE positions differ."""
    src = synth_dir(MAVERICK)
    convert(src, tmp_path / "scan", "--devices", "16")
    convert(src, tmp_path / "noscan", "--devices", "1", "--no-scan-layers")
    scanned, unscanned = restore(tmp_path / "scan"), restore(tmp_path / "noscan")
    layer_leaves = [n for n in scanned if "/decoder/layers/" in n]
    assert {n.split("/")[4] for n in layer_leaves} == {f"layers_{p}" for p in range(4)}
    assert any("layers_0/mlp/" in n for n in layer_leaves) and not any("layers_0/Llama4MoEBlock_0" in n
                                                                          for n in layer_leaves)
    assert any("layers_1/Llama4MoEBlock_0/MoeBlock_0/wi_0" in n for n in layer_leaves)
    for name in layer_leaves:
        position, rest = int(name.split("/")[4].removeprefix("layers_")), name.split("/", 5)[5]
        parts = [unscanned[f"params/params/decoder/layers_{i}/{rest}"] for i in range(position, 8, 4)]
        restacked = np.stack(parts, axis=1)
        assert scanned[name].shape == restacked.shape and scanned[name].tobytes() == restacked.tobytes(), name
    others = sorted(n for n in scanned if "/decoder/layers/" not in n)
    assert others == sorted(n for n in unscanned if "/decoder/layers_" not in n)
    assert all(scanned[n].tobytes() == unscanned[n].tobytes() for n in others)
    assert len(unscanned) - len(others) == 4 * (6 + 3) + 4 * (6 + 7)  # dense layers: 9 leaves, MoE layers: 13


def test_fused_experts_are_cut_in_halves(tmp_path, synth_dir):
    """``gate_up_proj`` (experts, emb, 2 * mlp): gate the first half of its last axis, as MaxText's
    ``np.split(..., 2, axis=-1)``; ``down_proj`` as stored; both unscanned, in bfloat16."""
    src = synth_dir(MAVERICK)
    convert(src, tmp_path / "dst", "--devices", "1", "--no-scan-layers")
    leaves, stored = restore(tmp_path / "dst"), hf_tensors(src)
    fused = stored[EXPERTS.format(3)]
    block = "params/params/decoder/layers_3/Llama4MoEBlock_0/MoeBlock_0"
    assert leaves[f"{block}/wi_0"].tobytes() == np.ascontiguousarray(fused[..., :32]).tobytes()
    assert leaves[f"{block}/wi_1"].tobytes() == np.ascontiguousarray(fused[..., 32:]).tobytes()
    down = stored["language_model.model.layers.3.feed_forward.experts.down_proj"]
    assert leaves[f"{block}/wo"].tobytes() == down.tobytes()
    q = stored["language_model.model.layers.3.self_attn.q_proj.weight"]  # not permuted, not scaled
    assert leaves["params/params/decoder/layers_3/self_attention/query/kernel"].tobytes() == \
        np.ascontiguousarray(q.T.reshape(64, 4, 16)).tobytes()


def test_checkpoint_saved_by_transformers_converts_and_exports_back(tmp_path):
    """Llama4ForConditionalGeneration as transformers' ``save_pretrained`` writes it (the hub's layout and a vision
    tower): the text decoder converts (the tower and projector reported, not converted), its logits are
    transformers', and export gives every text tensor back bit for bit in bfloat16."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.test_logits import maxtext_logits, semantics

    model = synth.SynthModel(model_type="llama4", num_layers=4, config_overrides={"interleave_moe_layer_step": 2},
                             **SMALL)
    config = transformers.AutoConfig.for_model(**model.config())
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(config)
    tokens = np.random.default_rng(5).integers(0, 128, size=10)
    with torch.no_grad():  # transformers initialises the experts and norms to constants: perturb every weight
        for tensor in hf.parameters():  # (bf16-exact; the module is cast only to save: its RoPE buffer is complex)
            values = torch.randn(tensor.shape) * 0.05 + (1.0 if tensor.ndim == 1 else 0.0)
            tensor.copy_(values.to(torch.bfloat16).to(torch.float32))
        expected = hf.eval().language_model(torch.tensor(tokens[None])).logits[0].numpy()
    src, dst, back = tmp_path / "hf", tmp_path / "dst", tmp_path / "back"
    hf.to(torch.bfloat16).save_pretrained(str(src))
    report = convert(src, dst, "--devices", "4", "--dtype", "float32", "--no-scan-layers")
    assert [e["what"] for e in report["not_converted"]] == ["multimodal projector", "vision tower"]
    got = maxtext_logits(dst, tokens, semantics(model), False, 128)
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)

    result = run_cli("export", str(dst), str(back), "--like", str(src), "--dtype", "bfloat16", "--progress", "none")
    assert result.returncode == 0, result.stderr
    stored, exported = hf_tensors(src), hf_tensors(back)
    text = {n: t for n, t in stored.items() if n.startswith("language_model.")}
    assert sorted(exported) == sorted(text)
    for name, tensor in text.items():
        assert exported[name].dtype == tensor.dtype and exported[name].tobytes() == tensor.tobytes(), name


def test_damaged_experts_tensor_is_one_line_exit_2(tmp_path, synth_dir):
    """A fused experts tensor one column short: refused before any write, in one line naming it."""
    bad = synth.SynthModel(model_type="llama4", num_layers=4, extra_tensors={EXPERTS.format(2): (4, 64, 63)},
                           **SMALL)
    src, dst = synth_dir(bad), tmp_path / "dst"
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "1")
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert EXPERTS.format(2) in result.stderr and "[4, 64, 64]" in result.stderr, result.stderr
    assert not dst.exists()


def test_layers_not_whole_cycles_convert_unscanned_only(tmp_path, synth_dir):
    src = synth_dir(synth.SynthModel(model_type="llama4", num_layers=6, **SMALL))
    result = run_cli("convert", str(src), str(tmp_path / "scan"), "--progress", "none", "--devices", "1")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "num_hidden_layers=6 is not a multiple of 4" in result.stderr and "--no-scan-layers" in result.stderr
    convert(src, tmp_path / "noscan", "--devices", "1", "--no-scan-layers")


@pytest.mark.parametrize("field, value, message", [
    ("moe_layers", [0, 1], r"moe_layers=\[0, 1\] is not every 2-th layer"),
    ("no_rope_layers", [1, 0, 1, 1], r"no_rope_layers=\[1, 0, 1, 1\] is not a NoPE layer every 4"),
    ("hidden_act", "gelu", "'hidden_act' = 'gelu' is not supported"),
    ("mystery", 1, r"text_config: unknown field\(s\) 'mystery'"),
    ("no_rope_layers", [1, 1, 1, 0], None),  # as transformers writes it: accepted
    ("moe_layers", [1, 3], None),
])
def test_config_patterns_maxtext_cannot_run_are_refused(field, value, message):
    config = synth.SynthModel(model_type="llama4", num_layers=4, config_overrides={
        "interleave_moe_layer_step": 2, field: value}, **SMALL).config()
    family = BY_MODEL_TYPE["llama4"]
    if message is None:
        spec = read_spec(family, config, "config.json")
        assert spec.value("moe_layers") == (1, 3) and spec.value("cycle") == 4
        return
    with pytest.raises(BadInputError, match=message):
        read_spec(family, config, "config.json")


def test_released_widths_plan_from_headers(tmp_path):
    """The whole Scout and Maverick releases (their widths; header-only files) plan without reading a byte."""
    from ckptconv.plan.conversion import make_plan
    from ckptconv.read.sources import LocalSource

    maverick = {**llama4.SCOUT, "num_experts": 128, "config_overrides": {"interleave_moe_layer_step": 2}}
    for name, fields, moe_positions in (("scout", llama4.SCOUT, 4), ("maverick", maverick, 2)):
        directory = tmp_path / name
        synth.write_checkpoint(synth.for_family(llama4.FAMILY, fields), str(directory), max_shard_bytes=5 * 10**9,
                               header_only=True)
        plan = make_plan(LocalSource(str(directory)), devices=16)
        experts = [leaf.shape for leaf in plan.leaves if leaf.name.endswith("MoeBlock_0/wi_0")]
        assert experts == [(fields["num_experts"], 12, 5120, 8192)] * moe_positions  # 48 layers: 12 cycles


@pytest.mark.parametrize("release", ["scout", "maverick"])
def test_configs_written_by_transformers_parse(release):
    """transformers' Llama4Config at its defaults (Scout's sizes) and with Maverick's text settings, as its
    config.json writes them, and the same in transformers 4's spelling (``rope_scaling`` and ``rope_theta``,
    ``torch_dtype``, an empty ``no_rope_layers``, ``attn_temperature_tuning`` as a number)."""
    transformers = pytest.importorskip("transformers")
    text = {} if release == "scout" else {"interleave_moe_layer_step": 2, "num_local_experts": 128,
                                          "use_qk_norm": False}
    config = json.loads(transformers.Llama4Config(text_config=text).to_json_string())
    older = json.loads(json.dumps(config))
    t = older["text_config"]
    t |= {"rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192},
          "rope_theta": t.pop("rope_parameters")["rope_theta"], "torch_dtype": "bfloat16", "no_rope_layers": [],
          "attn_temperature_tuning": 4, "cache_implementation": "hybrid", "for_llm_compressor": False}
    for variant in (config, older):
        spec = read_spec(BY_MODEL_TYPE["llama4"], variant, "config.json")
        assert spec.num_layers == 48 and spec.value("cycle") == 4
        assert {k: spec.dim(k) for k in ("emb", "heads", "kv_heads", "hd", "mlp", "moe_mlp", "experts", "vocab")} == {
            "emb": 5120, "heads": 40, "kv_heads": 8, "hd": 128, "mlp": 16384, "moe_mlp": 8192,
            "experts": 16 if release == "scout" else 128, "vocab": 202048}
        assert len(spec.value("moe_layers")) == (48 if release == "scout" else 24)


def _transformers_checkpoint(directory, num_layers: int = 4):
    """A tiny random Llama4ForConditionalGeneration saved by transformers (the hub's names, vision model and
    projector included), every weight perturbed and bfloat16-exact."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = synth.SynthModel(model_type="llama4", num_layers=num_layers,
                             config_overrides={"interleave_moe_layer_step": 2}, **SMALL)
    torch.manual_seed(1)
    hf = transformers.Llama4ForConditionalGeneration(transformers.AutoConfig.for_model(**model.config()))
    with torch.no_grad():
        for tensor in hf.parameters():
            tensor.copy_((torch.randn(tensor.shape) * 0.05).to(torch.bfloat16).to(torch.float32))
    hf.to(torch.bfloat16).save_pretrained(str(directory))
    return hf_tensors(directory)


VISION_LEAVES = "params/params/vision_encoder/"


@pytest.mark.parametrize("scan,devices", [(False, 1), (True, 16)], ids=["unscanned-1", "scanned-16"])
def test_multimodal_converts_the_vision_model_as_maxtext(tmp_path, scan, devices):
    """--multimodal: the vision model and projector as MaxText's llama4_ckpt_unscanned.py lays them out (its
    vision layers unscanned even beside a scanned decoder): every linear (in, out), the attention kernels
    (in, heads, head_dim) / (heads, head_dim, out) and biases (heads, head_dim), LayerNorms as scale and bias;
    nothing reported as not converted; the decoder's leaves are those of a conversion without the flag."""
    stored = _transformers_checkpoint(tmp_path / "hf")
    flags = ("--devices", str(devices)) + (() if scan else ("--no-scan-layers",))
    report = convert(tmp_path / "hf", tmp_path / "mm", *flags, "--multimodal")
    assert report["not_converted"] == [] and report["multimodal"] is True
    convert(tmp_path / "hf", tmp_path / "text", *flags)
    leaves, text = restore(tmp_path / "mm"), restore(tmp_path / "text")
    assert {n: v.tobytes() for n, v in leaves.items() if not n.startswith(VISION_LEAVES)} == \
        {n: v.tobytes() for n, v in text.items()}
    vision = {n.removeprefix(VISION_LEAVES): v for n, v in leaves.items() if n.startswith(VISION_LEAVES)}
    assert len(vision) == 7 + 2 * 16 + 3  # the model's own, 16 per layer, adapter and projector
    v = "vision_model."
    layer = "Llama4VisionModel_0/Llama4VisionEncoder_0/layers_1/"
    expected = {
        "Llama4VisionModel_0/class_embedding": stored[v + "class_embedding"],
        "Llama4VisionModel_0/positional_embedding_vlm": stored[v + "positional_embedding_vlm"],
        "Llama4VisionModel_0/Llama4UnfoldConvolution_0/vit_unfold_linear/kernel":
            stored[v + "patch_embedding.linear.weight"].T,
        "Llama4VisionModel_0/layernorm_post/bias": stored[v + "layernorm_post.bias"],
        layer + "self_attention_vision/query/kernel":
            stored[v + "model.layers.1.self_attn.q_proj.weight"].T.reshape(32, 2, 16),
        layer + "self_attention_vision/key/bias": stored[v + "model.layers.1.self_attn.k_proj.bias"].reshape(2, 16),
        layer + "self_attention_vision/out/kernel":
            stored[v + "model.layers.1.self_attn.o_proj.weight"].T.reshape(2, 16, 32),
        layer + "self_attention_vision/out/bias": stored[v + "model.layers.1.self_attn.o_proj.bias"],
        layer + "Llama4VisionMLP_0/vit_encoder_layer_mlp_fc1/kernel": stored[v + "model.layers.1.mlp.fc1.weight"].T,
        layer + "Llama4VisionMLP_0/vit_encoder_layer_mlp_fc2/bias": stored[v + "model.layers.1.mlp.fc2.bias"],
        layer + "post_attention_layer_norm/scale": stored[v + "model.layers.1.post_attention_layernorm.weight"],
        "Llama4VisionModel_0/Llama4VisionPixelShuffleMLP_0/pixel_shuffle_mlp/vit_pixel_shuffle_mlp_fc1/kernel":
            stored[v + "vision_adapter.mlp.fc1.weight"].T,
        "Llama4MultiModalProjector_0/vit_multi_modal_projector/kernel": stored["multi_modal_projector.linear_1.weight"].T,
    }
    for name, value in expected.items():
        assert vision[name].shape == value.shape and vision[name].tobytes() == np.ascontiguousarray(value).tobytes(), name


def test_multimodal_exports_every_tensor_back(tmp_path):
    """A --multimodal conversion exports back to every tensor transformers saved, bit for bit (vision included);
    one without the flag to the text tensors only."""
    stored = _transformers_checkpoint(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mm", "--devices", "4", "--multimodal")
    result = run_cli("export", str(tmp_path / "mm"), str(tmp_path / "back"), "--like", str(tmp_path / "hf"),
                     "--progress", "none")
    assert result.returncode == 0, result.stderr
    exported = hf_tensors(tmp_path / "back")
    assert sorted(exported) == sorted(stored) and any(n.startswith("vision_model.") for n in exported)
    for name, tensor in stored.items():
        assert exported[name].dtype == tensor.dtype and exported[name].tobytes() == tensor.tobytes(), name


def test_multimodal_vision_config_errors_name_the_field():
    config = synth.SynthModel(model_type="llama4", num_layers=4, **SMALL).config()
    config["vision_config"]["hidden_act"] = "relu"
    with pytest.raises(BadInputError, match=r"vision_config: field 'hidden_act' = 'relu' is not supported"):
        read_spec(BY_MODEL_TYPE["llama4"], config, "config.json")
    config["vision_config"] |= {"hidden_act": "gelu", "mystery": 1}
    with pytest.raises(BadInputError, match=r"vision_config: unknown field\(s\) 'mystery'"):
        read_spec(BY_MODEL_TYPE["llama4"], config, "config.json")


def test_multimodal_of_the_text_model_alone_is_one_line_exit_2(tmp_path, synth_dir):
    src = synth_dir(synth.SynthModel(model_type="llama4_text", num_layers=4, **SMALL))
    result = run_cli("convert", str(src), str(tmp_path / "dst"), "--progress", "none", "--multimodal")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "no vision model" in result.stderr and not (tmp_path / "dst").exists()
