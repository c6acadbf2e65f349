"""Gemma 4 (31B dense, 26B-A4B MoE): the text decoder converts; the towers are named; what MaxText's gemma4 decoder
cannot run is refused by name, before anything is written.

Bit-equality with MaxText 0.2.5's own converter and MaxText's forward pass: bench/compare_families.py,
bench/maxtext_logits.py (docs/bench/GEMMA4.md).
"""

import json

import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE, gemma4
from ckptconv.plan.conversion import make_plan, read_spec
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli

DENSE = {**gemma4.DENSE_TINY, "num_layers": 6}
MOE = gemma4.MOE_TINY
VISION = {"model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight": (32, 32),
          "model.vision_tower.patch_embedder.input_proj.weight": (32, 48),
          "model.embed_vision.embedding_projection.weight": (64, 32)}


@pytest.mark.parametrize("fields", [DENSE, MOE], ids=["31b", "26b-a4b"])
def test_towers_are_reported_not_converted(tmp_path, fields):
    model = synth.SynthModel(model_type="gemma4", extra_tensors=VISION, **fields)
    synth.write_checkpoint(model, str(tmp_path))
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=True, devices=1)
    reported = {entry["what"].split(" (")[0]: entry["tensors"] for entry in plan.not_converted}
    assert reported == {"vision tower": 2, "vision projector": 1}
    assert plan.tensor_count == len(synth.tensor_shapes(model)) - len(VISION)


def _config(fields: dict, **text: object) -> dict:
    config = synth.SynthModel(model_type="gemma4", **fields).config()
    config["text_config"].update(text)
    return config


@pytest.mark.parametrize("text, message", [
    ({"num_hidden_layers": 8}, "num_hidden_layers=8 is not a multiple of 6"),
    ({"attention_k_eq_v": False}, "'attention_k_eq_v' = False is not supported"),
    # E2B / E4B's fields on a large model's config (keys as values): tests/test_gemma4_small.py has the rest
    ({"num_kv_shared_layers": 4, "hidden_size_per_layer_input": 16}, "'attention_k_eq_v' = True is not supported"),
    ({"layer_types": ["full_attention"] * 6}, "field 'layer_types'"),
    ({"num_global_key_value_heads": 3}, "not a multiple of num_global_key_value_heads=3"),
    ({"per_layer_config": {"5": {"head_dim": 64, "num_key_value_heads": 1}}}, "disagree"),
    ({"per_layer_config": {"4": {"head_dim": 32, "num_key_value_heads": 1}}}, "not the full-attention layers"),
    ({"enable_moe_block": True, "num_experts": 1}, "num_experts=1"),
    ({"mystery": 1}, "unknown field(s) 'mystery'"),
])
def test_configs_maxtext_cannot_run_are_refused_by_name(text, message):
    with pytest.raises(BadInputError, match="config.json: text_config: ") as err:
        read_spec(BY_MODEL_TYPE["gemma4"], _config(DENSE, **text), "config.json")
    assert message in str(err.value)


def test_transformers_per_layer_config_reads_as_the_releases_fields():
    """transformers >= 5.24 saves the global layers' sizes as per_layer_config (layer index -> sizes)."""
    release = _config(MOE)
    saved = _config(MOE, global_head_dim=None, num_global_key_value_heads=None,
                    per_layer_config={"05": {"head_dim": 32, "num_key_value_heads": 1}})
    saved["text_config"] = {k: v for k, v in saved["text_config"].items() if v is not None}
    a, b = (read_spec(BY_MODEL_TYPE["gemma4"], c, "config.json") for c in (release, saved))
    assert (a.dim("ghd"), a.dim("global_kv_heads")) == (b.dim("ghd"), b.dim("global_kv_heads")) == (32, 1)


@pytest.mark.parametrize("fields, extra, message", [
    # a global layer of the releases has no value projection (its keys serve as values)
    (DENSE, {"model.language_model.layers.5.self_attn.v_proj.weight": (32, 64)},
     "v_proj.weight', a tensor of a local or local_moe or local_ple layer, but config.json makes layer 5 a global "
     "layer"),
    # a router in a dense model
    (DENSE, {"model.language_model.layers.0.router.proj.weight": (4, 64)},
     "router.proj.weight', a tensor of a global_moe or local_moe layer, but config.json makes layer 0 a local layer"),
])
def test_tensors_of_another_layer_kind_exit_2_and_write_nothing(tmp_path, fields, extra, message):
    src, dst = tmp_path / "src", tmp_path / "dst"
    synth.write_checkpoint(synth.SynthModel(model_type="gemma4", extra_tensors=extra, **fields), str(src))
    result = run_cli("convert", str(src), str(dst), "--progress", "none")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr and not dst.exists()


def test_global_layer_of_local_width_exits_2_naming_the_tensor(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    model = synth.SynthModel(model_type="gemma4", **DENSE)
    shapes = synth.tensor_shapes(model)
    name = "model.language_model.layers.5.self_attn.q_proj.weight"
    synth.write_checkpoint(synth.SynthModel(model_type="gemma4", **DENSE, extra_tensors={name: (64, 64)}), str(src))
    assert shapes[name] == (128, 64)  # 4 heads of global_head_dim 32
    result = run_cli("convert", str(src), str(dst), "--progress", "none")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "layers.5.self_attn.q_proj.weight" in result.stderr and not dst.exists()


@pytest.mark.parametrize("fields, scan", [(DENSE, True), (MOE, False)], ids=["31b-scan", "26b-a4b-noscan"])
def test_saved_by_transformers_converts_and_gives_its_logits(tmp_path, fields, scan):
    """Gemma4ForConditionalGeneration as transformers builds and saves it (a vision tower, per_layer_config in its
    config.json, fused experts): the decoder converts, the towers are reported, and the text logits match."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.maxtext_forward import forward
    from tests.test_convert import restore
    from tests.test_logits import semantics, unflatten

    model_fields = {**fields, "config_overrides": {"sliding_window": 5}}
    config = synth.SynthModel(model_type="gemma4", **model_fields).config()
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(transformers.AutoConfig.for_model(**config)).float().eval()
    with torch.no_grad():  # bf16-exact weights; norms, scales and layer_scalar away from their initial constants
        scalars = [b for name, b in model.named_buffers() if name.endswith("layer_scalar")]
        for tensor in [*model.parameters(), *scalars]:
            noise = torch.randn(tensor.shape) * (0.05 if tensor.ndim > 1 else 0.1)
            tensor.copy_((tensor + noise if tensor.ndim == 1 else noise).to(torch.bfloat16).float())
    src, dst = tmp_path / "hf", tmp_path / "dst"
    model.save_pretrained(str(src))
    assert "per_layer_config" in json.loads((src / "config.json").read_text())["text_config"]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--dtype", "float32",
                     "--scan-layers" if scan else "--no-scan-layers")
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert {e["what"] for e in report["not_converted"]} == {"vision tower", "vision projector"}, report["not_converted"]
    tokens = np.random.default_rng(5).integers(0, fields["vocab_size"], size=12)
    with torch.no_grad():
        expected = model(torch.tensor(tokens[None])).logits[0].numpy()
    params = unflatten(restore(dst))["params"]["params"]
    got = forward(params, tokens, semantics(synth.SynthModel(model_type="gemma4", **model_fields)), scan=scan)
    np.testing.assert_allclose(got[:, : fields["vocab_size"]], expected, atol=2e-5, rtol=1e-4)


# MaxText 0.2.5's model configs (configs/models/gemma4-*.yml): layers, emb, heads, kv heads, head_dim, global head_dim,
# global kv heads, mlp, experts, expert mlp
RELEASES = {"gemma-4-26B-A4B-it": (30, 2816, 16, 8, 256, 512, 2, 2112, 128, 704),
            "gemma-4-31B-it": (60, 5376, 32, 16, 256, 512, 4, 21504, None, None)}


@pytest.mark.parametrize("name", RELEASES)
def test_the_releases_configs_read_as_maxtexts_models(name):
    from tests.published_configs import GEMMA4

    spec = read_spec(BY_MODEL_TYPE["gemma4"], GEMMA4[name], "config.json")
    assert (spec.num_layers, *(spec.dims.get(d) for d in ("emb", "heads", "kv_heads", "hd", "ghd", "global_kv_heads",
                                                          "mlp", "experts", "moe_mlp"))) == RELEASES[name]
