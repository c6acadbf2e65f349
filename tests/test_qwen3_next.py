"""Qwen3-Next (and Qwen3.5-MoE's text decoder): the hybrid Gated DeltaNet / gated-attention stack.

Checkpoints are made with transformers' own classes and stored as the hub ships them
(``tests/hub_checkpoints.py``: per-expert or fused experts, separate or fused linear-attention
projections, ``mtp.*``, an index over several files). Each is converted with the CLI and:

- its leaves are MaxText 0.2.5's tree (names and shapes restated from MaxText's model: nested
  ``local_layers`` scans, a flat output kernel, a remainder block);
- MaxText's run-time semantics (``tests/maxtext_forward.hybrid_forward``) on the converted tree
  reproduce transformers' float32 logits;
- ``export`` gives the hub's files back bit for bit;
- bad input (a fused projection of the wrong width, a layer of the wrong kind) is one line, exit 2,
  and nothing is written;
- Qwen3.5's FP8 releases are kept quantised (e4m3 weights, their block scales as MaxText's scale
  leaves): dequantised as MaxText's runtime does, the tree gives transformers' logits of the release's
  values, and export gives the release's own files back;
- the full releases (Qwen3.5-397B-A17B: 512 experts a layer) plan under 1.5 GiB from header-only files.

Bit-for-bit equality with MaxText's own converter is measured by ``bench/compare_families.py``
(docs/bench/FAMILIES.md), MaxText's own forward pass by ``bench/maxtext_hybrid.py`` (docs/bench/HYBRID.md), the
peak memory at the releases' widths by ``bench/hybrid_memory.py`` (docs/bench/HYBRID-MEMORY.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from ckptconv.commands.convert import ConvertRequest, convert as convert_checkpoint
from ckptconv.plan.conversion import make_plan
from ckptconv.read.sources import LocalSource
from tests import hub_checkpoints, maxtext_forward
from tests.conftest import run_cli
from tests.maxtext_forward import Semantics
from tests.test_export import hf_tensors
from tests.test_families import hybrid_leaves
from tests.test_logits import unflatten
from tests.test_convert import restore

pytest.importorskip("torch")
pytest.importorskip("transformers")

TOKENS = np.array([3, 17, 101, 42, 7, 90, 9, 64, 5, 77, 120, 33])


def semantics(config: dict) -> Semantics:
    text = config.get("text_config", config)
    rope = text.get("rope_parameters", {})
    return Semantics(family=config["model_type"], num_layers=text["num_hidden_layers"], eps=text["rms_norm_eps"],
                     theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                     top_k=text["num_experts_per_tok"], moe="softmax_topk",
                     layout="qwen3_5" if config["model_type"] == "qwen3_5_moe" else "qwen3_next",
                     extra={"norm_topk_prob": True, "period": text["full_attention_interval"],
                            "partial_rotary_factor": rope.get("partial_rotary_factor",
                                                              text.get("partial_rotary_factor")),
                            "k_heads": text["linear_num_key_heads"], "v_heads": text["linear_num_value_heads"],
                            "k_hd": text["linear_key_head_dim"], "v_hd": text["linear_value_head_dim"]})


def convert(src, dst, scan: bool, devices: int, dtype: str = "float32"):
    """In this process (convert imports neither JAX nor Orbax: the device count is the request's); the CLI runs where
    its exit status and message are what is tested (the bad-input and plan cases below)."""
    convert_checkpoint(ConvertRequest(str(src), str(dst), devices=devices, scan_layers=scan, dtype=dtype,
                                      progress="none"))
    return json.loads((dst / "ckptconv-report.json").read_text())


CONFIGS = {"qwen3_next": hub_checkpoints.qwen3_next_config, "qwen3_5_moe": hub_checkpoints.qwen3_5_moe_config}
CASES = {  # name: (config, scan, devices)
    "qwen3_next": (hub_checkpoints.qwen3_next_config(), True, 4),
    "qwen3_next-remainder": (hub_checkpoints.qwen3_next_config(num_hidden_layers=6), True, 4),
    "qwen3_next-noscan": (hub_checkpoints.qwen3_next_config(num_hidden_layers=6), False, 1),
    "qwen3_5_moe": (hub_checkpoints.qwen3_5_moe_config(), True, 4),
    "qwen3_5_moe-noscan": (hub_checkpoints.qwen3_5_moe_config(num_hidden_layers=6), False, 1),
}
NOT_CONVERTED = {"qwen3_next": [("multi-token prediction (MTP) layer", len(hub_checkpoints.MTP_TENSORS))],
                 "qwen3_5_moe": [("multi-token prediction (MTP) layer", len(hub_checkpoints.MTP_TENSORS)),
                                 ("vision tower", 21)]}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    config, scan, devices = CASES[case]
    src, dst = tmp_path / "hf", tmp_path / "dst"
    expected = hub_checkpoints.make(str(src), config, TOKENS)
    report = convert(src, dst, scan, devices)
    assert [(e["what"], e["tensors"]) for e in report["not_converted"]] == NOT_CONVERTED[config["model_type"]]
    params = unflatten(restore(dst))["params"]["params"]
    got = maxtext_forward.hybrid_forward(params, TOKENS, semantics(config), scan=scan)
    assert np.abs(expected).max() > 0.1  # a real signal
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, layers, scan", [("qwen3_next", 8, True), ("qwen3_next", 6, True),
                                                   ("qwen3_next", 5, False), ("qwen3_5_moe", 8, True),
                                                   ("qwen3_5_moe", 5, False)])
def test_plan_is_maxtexts_tree(tmp_path, family, layers, scan):
    config = CONFIGS[family](num_hidden_layers=layers)
    hub_checkpoints.write_hub(str(tmp_path), hub_checkpoints.hub_tensors(hub_checkpoints.build(config), config), config)
    plan = make_plan(LocalSource(str(tmp_path)), scan_layers=scan, devices=4)
    assert {leaf.name: leaf.shape for leaf in plan.leaves} == hybrid_leaves(config, scan)


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("scan", [True, False])
def test_export_gives_the_hub_files_back_bit_for_bit(tmp_path, family, scan):
    """Qwen3.5's fused leaves go back to the parts the hub stores (in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a; gate_up_proj from wi_0 and wi_1)."""
    config = CONFIGS[family](num_hidden_layers=(6 if family == "qwen3_next" else 8) if scan else 5)
    src, dst, back = tmp_path / "hf", tmp_path / "dst", tmp_path / "back"
    hub_checkpoints.make(str(src), config)
    convert(src, dst, scan, 4, dtype="bfloat16")
    result = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    source = {k: v for k, v in hf_tensors(src).items() if not k.startswith(("mtp.", "model.visual."))}
    exported = hf_tensors(back)
    assert sorted(exported) == sorted(source)
    for name, want in source.items():
        assert exported[name].dtype == want.dtype and exported[name].tobytes() == want.tobytes(), name
    report = json.loads((back / "ckptconv-report.json").read_text())
    assert any("multi-token prediction" in note["what"] for note in report["not_exported"])
    if family == "qwen3_5_moe":
        assert any("vision tower" in note["what"] for note in report["not_exported"])
        assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in exported


def bad_checkpoint(tmp_path, change, family: str = "qwen3_next") -> tuple:
    config = CONFIGS[family](num_hidden_layers=4)
    tensors = hub_checkpoints.hub_tensors(hub_checkpoints.build(config), config)
    change(config, tensors)
    src = tmp_path / "hf"
    hub_checkpoints.write_hub(str(src), tensors, config)
    return src, tmp_path / "dst"


def _narrow_qkvz(config, tensors):
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    tensors[name] = tensors[name][:-16]


def _full_attention_at_layer_2(config, tensors):
    for name in [n for n in tensors if n.startswith("model.layers.3.self_attn.")]:
        tensors[name.replace("layers.3.", "layers.2.")] = tensors[name]
    for name in [n for n in tensors if n.startswith("model.layers.2.linear_attn.")]:
        del tensors[name]


def _layer_types_out_of_pattern(config, tensors):
    config["layer_types"] = ["linear_attention", "linear_attention", "full_attention", "full_attention"]


@pytest.mark.parametrize("change, message", [
    (_narrow_qkvz, "tensor 'model.layers.1.linear_attn.in_proj_qkvz.weight' has shape [176, 64], config.json implies "
                   "[192, 64]"),
    (_full_attention_at_layer_2, "layer 2 holds 'model.layers.2.self_attn.q_proj.weight', a tensor of a full "
                                 "attention layer, but config.json makes layer 2 a linear attention layer"),
    (_layer_types_out_of_pattern, "field 'layer_types' = ['linear_attention', 'linear_attention', 'full_attention', "
                                  "'full_attention'] is not the pattern MaxText runs"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, change, message):
    src, dst = bad_checkpoint(tmp_path, change)
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not dst.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name, family, billions", [("QWEN3_NEXT_80B", "qwen3_next", 80),
                                                    ("QWEN3_5_35B", "qwen3_5_moe", 35),
                                                    ("QWEN3_5_397B", "qwen3_5_moe", 397),
                                                    ("QWEN3_5_397B_FP8", "qwen3_5_moe", 397)])
def test_full_size_releases_plan_under_one_and_a_half_gib(tmp_path, name, family, billions):
    """The releases from their published config.json with header-only shards (real headers, no data):
    the plan accepts them and predicts a bounded peak (Qwen3.5-397B-A17B: 512 experts a layer)."""
    from ckptconv.commands import synth
    from tests import published_configs

    config = getattr(published_configs, name)
    fp8 = "quantization_config" in config
    model = synth.SynthModel(model_type=family, tie_word_embeddings=config["tie_word_embeddings"],
                             config_overrides=dict(config.get("text_config", config)),
                             quantization="fp8" if fp8 else None)
    synth.write_checkpoint(model, str(tmp_path), max_shard_bytes=5 * 10**9, header_only=True)
    (tmp_path / "config.json").write_text(json.dumps(config))  # the published file itself, not synth's spelling
    for devices in (1, 16):
        result = run_cli("plan", str(tmp_path), "--devices", str(devices), "--json")
        assert result.returncode == 0, result.stderr
        planned = json.loads(result.stdout)
        print(name, devices, planned["source_bytes"] / 2**30, planned["predicted_peak_rss_gib"],
              planned["predicted_seconds"], planned["largest_read_bytes"] / 2**20)
        per_weight = 1 if fp8 else 2  # e4m3 bytes (most of an FP8 release), else bfloat16's
        assert 0.9 * billions * per_weight * 10**9 < planned["source_bytes"] < 1.1 * billions * 2 * 10**9
        assert planned["predicted_peak_rss_bytes"] <= 1.5 * 2**30


L35 = "model.language_model.layers."


def _narrow_qkv(config, tensors):
    tensors[L35 + "1.linear_attn.in_proj_qkv.weight"] = tensors[L35 + "1.linear_attn.in_proj_qkv.weight"][:-2]


def _no_z(config, tensors):
    del tensors[L35 + "2.linear_attn.in_proj_z.weight"]


def _gate_up_of_the_wrong_width(config, tensors):
    tensors[L35 + "0.mlp.experts.gate_up_proj"] = tensors[L35 + "0.mlp.experts.gate_up_proj"][:, :-2]


@pytest.mark.parametrize("change, message", [
    (_narrow_qkv, "tensor 'model.language_model.layers.1.linear_attn.in_proj_qkv.weight' has shape [126, 64], "
                  "config.json implies [128, 64]"),
    (_no_z, "missing tensor 'model.language_model.layers.2.linear_attn.in_proj_z.weight' (with "
            "'model.language_model.layers.2.linear_attn.in_proj_qkv.weight', it makes MaxText's in_proj_qkvz)"),
    (_gate_up_of_the_wrong_width, "tensor 'model.language_model.layers.0.mlp.experts.gate_up_proj' has shape "
                                  "[4, 62, 64], config.json implies [4, 64, 64]"),
])
def test_qwen3_5_bad_input_is_one_line_exit_2_nothing_written(tmp_path, change, message):
    src, dst = bad_checkpoint(tmp_path, change, "qwen3_5_moe")
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and ".safetensors" in lines[0], lines
    assert not dst.exists()


def test_qwen3_5_scanned_needs_whole_periods(tmp_path):
    """MaxText's qwen3_5 scan holds whole periods only: 6 layers convert unscanned, and are refused scanned."""
    config = hub_checkpoints.qwen3_5_moe_config(num_hidden_layers=6)
    src, dst = tmp_path / "hf", tmp_path / "dst"
    hub_checkpoints.make(str(src), config)
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ckptconv: error: {src}/config.json: num_hidden_layers=6 is not a multiple of full_attention_interval=4: "
        "MaxText's qwen3_5 scan holds whole periods only (convert with --no-scan-layers)"]
    assert not dst.exists()


# --- the pieces: TakePart / PutPart, the Join input -------------------------------------------------

def test_gate_up_halves_split_and_join_back():
    from ckptconv.families import transforms as t
    from ckptconv.families.qwen3_5_moe import GATE, SWAP_LAST, UP
    from ckptconv.read.spec import ModelSpec

    spec = ModelSpec("qwen3_5_moe", "qwen3_5_moe", 1, {"moe_mlp": 4, "moe_mlp2": 8})
    fused = np.random.default_rng(0).standard_normal((3, 8, 5)).astype(np.float32)  # (experts, 2 * mlp, emb)
    gate, up = (t.apply_steps(fused, (part, SWAP_LAST), spec) for part in (GATE, UP))
    np.testing.assert_array_equal(gate, fused[:, :4].transpose(0, 2, 1))  # MaxText's process_wi_0_wi_1
    np.testing.assert_array_equal(up, fused[:, 4:].transpose(0, 2, 1))
    assert t.chain_quantum(1, fused.shape, (GATE, SWAP_LAST), spec)[0] == 8  # a read holds both halves
    assert t.chain_quantum(0, fused.shape, (GATE, SWAP_LAST), spec)[0] == 1  # experts may be cut anywhere
    back = np.empty_like(fused)
    for leaf, part in ((gate, GATE), (up, UP)):
        steps = (part, SWAP_LAST)
        t.apply_inverse(leaf, steps, spec, t.inverse_boxes(t.full_box(fused.shape), fused.shape, steps, spec), back)
    np.testing.assert_array_equal(back, fused)


def test_join_regroups_per_key_head_as_maxtext_does():
    """The Join of in_proj_qkv and in_proj_z equals MaxText 0.2.5's concat_qkvz_and_transpose (restated) before
    its transpose, for every band of fused rows, including bands that cut groups and sections."""
    from ckptconv.families.inputs import Plain, join_input
    from ckptconv.families.qwen3_5_moe import JOINS
    from ckptconv.read.safetensors_io import TensorInfo
    from ckptconv.read.spec import ModelSpec

    k_heads, v_heads, k_hd, v_hd, emb = 2, 6, 3, 2, 5
    spec = ModelSpec("qwen3_5_moe", "qwen3_5_moe", 1, {"k_heads": k_heads, "v_heads": v_heads,
                                                       "k_dim": k_heads * k_hd, "v_dim": v_heads * v_hd})
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((2 * k_heads * k_hd + v_heads * v_hd, emb)).astype(np.float32)
    z = rng.standard_normal((v_heads * v_hd, emb)).astype(np.float32)

    stored = {"x.linear_attn.in_proj_qkv.weight": qkv, "x.linear_attn.in_proj_z.weight": z}

    class InMemory(Plain):  # a stored tensor whose bytes are an array here
        def read(self, source, box):
            return stored[self.name][tuple(slice(*b) for b in box)]

    def find(name):
        return InMemory(TensorInfo(name, "f.safetensors", np.dtype(np.float32), stored[name].shape, 0)), (name,)

    fused_shape = (len(qkv) + len(z), emb)
    joined, consumed = join_input("x.linear_attn.in_proj_qkvz.weight", JOINS[0], spec, fused_shape, find)
    assert consumed == ("x.linear_attn.in_proj_qkv.weight", "x.linear_attn.in_proj_z.weight")
    q, k, v = qkv[:k_heads * k_hd], qkv[k_heads * k_hd:2 * k_heads * k_hd], qkv[2 * k_heads * k_hd:]
    per_k = v_heads // k_heads
    expected = np.concatenate([q.reshape(k_heads, k_hd, -1), k.reshape(k_heads, k_hd, -1),
                               v.reshape(k_heads, per_k * v_hd, -1), z.reshape(k_heads, per_k * v_hd, -1)],
                              axis=1).reshape(-1, emb)
    assert joined.shape == expected.shape
    for band in (1, 3, 7, len(expected)):
        for start in range(0, len(expected), band):
            stop = min(start + band, len(expected))
            np.testing.assert_array_equal(joined.read(None, ((start, stop), (0, emb))), expected[start:stop])


def test_qwen3_next_fp8_release_is_refused_in_one_line():
    """Qwen3-Next's FP8 release: MaxText 0.2.5 has no qwen3-next fp8 model to hold it; said so by name."""
    from ckptconv.errors import BadInputError
    from ckptconv.families import family_for
    from ckptconv.plan.conversion import read_spec
    from tests import published_configs

    config = {**published_configs.QWEN3_NEXT_80B,
              "quantization_config": published_configs.QWEN3_5_35B_FP8["quantization_config"]}
    with pytest.raises(BadInputError, match="quantised releases of this family .* are not supported yet"):
        read_spec(family_for(config["model_type"], "config.json"), config, "config.json")


@pytest.mark.parametrize("family", CONFIGS)
def test_configs_written_by_transformers_parse(family):
    """transformers 5 writes these configs its own way: rope_parameters, layer_types and no
    full_attention_interval (Qwen3-Next), no attn_output_gate or mRoPE sections (Qwen3.5)."""
    import transformers

    from ckptconv.families import family_for
    from ckptconv.plan.conversion import read_spec

    sizes = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4)
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**sizes)
    else:
        config = transformers.Qwen3_5MoeConfig(text_config=sizes, vision_config={"depth": 1})
    data = json.loads(config.to_json_string())
    spec = read_spec(family_for(data["model_type"], "config.json"), data, "config.json")
    qkvz = 2 * 2 * 128 + 2 * 4 * 128  # key and value head dims: transformers' default 128
    assert (spec.num_layers, spec.value("period"), spec.dim("qkvz"), spec.dim("experts")) == (8, 4, qkvz, 4)


# --- Qwen3.5's FP8 releases, kept quantised as MaxText's qwen3.5-*-fp8 models hold them --------------

@pytest.mark.parametrize("scan", [True, False])
def test_fp8_release_logits_and_export(tmp_path, scan):
    """e4m3 weights as shipped and their block scales as MaxText's scale leaves: the tree dequantised as
    MaxText's runtime does gives transformers' logits of the release's values; export gives back the
    release's own files (e4m3 weights, bfloat16 weight_scale_inv, its quantization_config) bit for bit."""
    import torch
    from safetensors.torch import load_file

    config = hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=4 if scan else 5)
    src, dst, back = tmp_path / "hf", tmp_path / "dst", tmp_path / "back"
    stored = hub_checkpoints.make_fp8(str(src), config)
    expected = hub_checkpoints.fp8_logits(config, stored, TOKENS)
    convert(src, dst, scan, 4, dtype="bfloat16")
    params = unflatten(restore(dst))["params"]["params"]
    leaf = params["decoder"]["layers"]["layer_3"] if scan else params["decoder"]["layers_3"]
    assert "kernel_scale" in leaf["attention"]["attention"]["query"]
    got = maxtext_forward.hybrid_forward(params, TOKENS, semantics(config), scan=scan)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)

    result = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr

    def raw(directory) -> dict:
        return {name: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                for path in sorted(directory.glob("*.safetensors")) for name, t in load_file(str(path)).items()}

    source = {k: v for k, v in raw(src).items() if not k.startswith(("mtp.", "model.visual."))}
    assert raw(back) == source
    assert source["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"][0] == "torch.float8_e4m3fn"
    assert json.loads((back / "config.json").read_text())["quantization_config"] == config["quantization_config"]


def _fp8_without_scale(config, tensors):
    del tensors[L35 + "0.linear_attn.out_proj.weight_scale_inv"]


def _fp8_scale_of_the_wrong_grid(config, tensors):
    tensors[L35 + "3.self_attn.q_proj.weight_scale_inv"] = tensors[L35 + "3.self_attn.q_proj.weight_scale_inv"][:, :1]


def _fp8_weight_left_bfloat16(config, tensors):
    import ml_dtypes

    name = L35 + "1.mlp.shared_expert.up_proj.weight"
    tensors[name] = tensors[name].astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("change, message", [
    (_fp8_without_scale, "missing tensor 'model.language_model.layers.0.linear_attn.out_proj.weight_scale_inv' "
                         "(needed for MaxText leaf attention/out_proj/kernel_scale)"),
    (_fp8_scale_of_the_wrong_grid, "tensor 'model.language_model.layers.3.self_attn.q_proj.weight_scale_inv' has "
                                   "shape [4, 1], config.json implies [4, 2]"),
    (_fp8_weight_left_bfloat16, "tensor 'model.language_model.layers.1.mlp.shared_expert.up_proj.weight' has dtype "
                                "bfloat16, but the FP8 release stores it as float8_e4m3fn"),
])
def test_fp8_bad_input_is_one_line_exit_2_nothing_written(tmp_path, change, message):
    config = hub_checkpoints.qwen3_5_moe_fp8_config()
    bf16_config = {k: v for k, v in config.items() if k != "quantization_config"}
    tensors = hub_checkpoints.fp8_tensors(hub_checkpoints.hub_tensors(hub_checkpoints.build(bf16_config), bf16_config))
    change(config, tensors)
    src, dst = tmp_path / "hf", tmp_path / "dst"
    hub_checkpoints.write_stored(str(src), tensors, config)
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not dst.exists()


def test_qwen3_5_saved_by_transformers_converts(tmp_path):
    """transformers' own save_pretrained writes Qwen3.5's experts one by one (not fused, as the hub does):
    they are read stacked, and the logits match."""
    config = hub_checkpoints.qwen3_5_moe_config()
    model = hub_checkpoints.build(config)
    expected = hub_checkpoints.logits(model, TOKENS)
    src, dst = tmp_path / "hf", tmp_path / "dst"
    model.save_pretrained(str(src))
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in load_file(
        str(src / "model.safetensors"))
    convert(src, dst, True, 4)
    got = maxtext_forward.hybrid_forward(unflatten(restore(dst))["params"]["params"], TOKENS, semantics(config),
                                         scan=True)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
