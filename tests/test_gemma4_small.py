"""Gemma 4 E2B / E4B (MaxText's gemma4_small): the releases' configs, what is refused, and the unscanned-only layout.

Round trips, logits (E2B's 4 + 1 pattern with wide shared layers, E4B's 5 + 1), export and memory come from the
family's own examples (``gemma4.SYNTHETIC``); docs/bench/GEMMA4.md has the comparison with MaxText's converter.
"""

from __future__ import annotations

import copy
import json

import pytest

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families import BY_MODEL_TYPE, gemma4
from ckptconv.plan.conversion import make_plan, read_spec
from ckptconv.read.sources import LocalSource
from tests.conftest import run_cli
from tests.test_gemma4 import VISION


def _e4b() -> dict:
    from tests.published_configs import GEMMA4

    config = copy.deepcopy(GEMMA4["gemma-4-E2B-it"])
    config["text_config"].update(  # google/gemma-4-E4B-it's, as MaxText 0.2.5's hf_model_configs.py has it
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_key_value_heads=2,
        num_kv_shared_layers=18, use_double_wide_mlp=False,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7)
    return config


# layers, hidden, KV heads, global head dim, global KV heads, MLP, shared MLP, per-layer width, first shared, period
RELEASES = {"gemma-4-E2B-it": (35, 1536, 1, 512, 1, 6144, 12288, 256, 15, 5),
            "gemma-4-E4B-it": (42, 2560, 2, 512, 2, 10240, 10240, 256, 24, 6)}


@pytest.mark.parametrize("name", RELEASES)
def test_the_releases_configs_read_as_maxtexts_models(name):
    from tests.published_configs import GEMMA4

    config = GEMMA4[name] if name in GEMMA4 else _e4b()
    spec = read_spec(BY_MODEL_TYPE["gemma4"], config, "config.json")
    wide = spec.dim("wide_mlp") if spec.value("wide_mlp") else spec.dim("mlp")
    assert (spec.num_layers, spec.dim("emb"), spec.dim("kv_heads"), spec.dim("ghd"), spec.dim("global_kv_heads"),
            spec.dim("mlp"), wide, spec.dim("ple"), spec.value("first_shared"),
            spec.value("small_period")) == RELEASES[name]
    assert spec.value("maxtext_model") == {5: "gemma4-e2b", 6: "gemma4-e4b"}[spec.value("small_period")]


def _config(fields: dict, **text: object) -> dict:
    config = synth.SynthModel(model_type="gemma4", **fields).config()
    config["text_config"].update(text)
    return config


SIXES = ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.parametrize("text, message", [
    ({"layer_types": SIXES + SIXES[:4]}, "not a whole number of blocks of 4 or 5 sliding layers and 1 full one"),
    ({"layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2 + ["sliding_attention"] * 2},
     "not a whole number of blocks"),
    ({"layer_types": None}, "need one entry per layer"),
    ({"attention_k_eq_v": True}, "'attention_k_eq_v' = True is not supported"),
    ({"enable_moe_block": True}, "'enable_moe_block' = True is not supported"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers=6 of 10 layers"),
    ({"hidden_size_per_layer_input": 0}, "without per-layer inputs"),
    ({"per_layer_config": {"4": {"head_dim": 32}, "9": {"head_dim": 64}}}, "disagree"),
    ({"per_layer_config": {"4": {"head_dim": 32, "num_key_value_heads": 2}, "9": {"head_dim": 32}}},
     "expected head_dim"),
])
def test_configs_maxtext_cannot_run_are_refused_by_name(text, message):
    with pytest.raises(BadInputError, match="config.json: text_config: ") as err:
        read_spec(BY_MODEL_TYPE["gemma4"], _config(gemma4.E2B_TINY, **text), "config.json")
    assert message in str(err.value)


def test_transformers_per_layer_config_reads_as_global_head_dim():
    """transformers 5.25 saves the global layers' head dim alone in per_layer_config (KV heads stay the local ones
    without attention_k_eq_v)."""
    saved = _config(gemma4.E2B_TINY, global_head_dim=None, per_layer_config={"4": {"head_dim": 32},
                                                                               "9": {"head_dim": 32}})
    saved["text_config"] = {k: v for k, v in saved["text_config"].items() if v is not None}
    spec = read_spec(BY_MODEL_TYPE["gemma4"], saved, "config.json")
    assert (spec.dim("ghd"), spec.dim("global_kv_heads"), spec.dim("gkv")) == (32, 2, 64)


def test_unscanned_by_default_towers_reported_and_scan_layers_refused_in_one_line(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    model = synth.SynthModel(model_type="gemma4", extra_tensors=VISION, **gemma4.E2B_TINY)
    synth.write_checkpoint(model, str(src))
    plan = make_plan(LocalSource(str(src)), devices=1)
    reported = {entry["what"].split(" (")[0]: entry["tensors"] for entry in plan.not_converted}
    assert reported == {"vision tower": 2, "vision projector": 1}
    assert plan.tensor_count == len(synth.tensor_shapes(model)) - len(VISION)
    names = {leaf.name for leaf in plan.leaves}
    assert "params/params/decoder/layers_9/self_attention/query/kernel" in names
    assert "params/params/decoder/layers_9/self_attention/key/kernel" not in names  # a shared layer
    result = run_cli("convert", str(src), str(dst), "--scan-layers", "--progress", "none")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "run unscanned only in MaxText's gemma4_small decoder" in result.stderr and not dst.exists()
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "1")
    assert result.returncode == 0, result.stderr
    assert json.loads((dst / "ckptconv-report.json").read_text())["scan_layers"] is False


@pytest.mark.parametrize("extra, message", [
    # (a shared layer's keys, which the releases still store, are reported instead: tests/test_releases.py)
    # a narrow MLP in a wide shared layer
    ({"model.language_model.layers.8.mlp.gate_proj.weight": (96, 64)}, "layers.8.mlp.gate_proj.weight"),
])
def test_tensors_a_layer_cannot_hold_exit_2_and_write_nothing(tmp_path, extra, message):
    src, dst = tmp_path / "src", tmp_path / "dst"
    synth.write_checkpoint(synth.SynthModel(model_type="gemma4", extra_tensors=extra, **gemma4.E2B_TINY), str(src))
    result = run_cli("convert", str(src), str(dst), "--progress", "none")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr and not dst.exists()
