"""``--dtype float8_e4m3fn``: MaxText 0.2.5's ``--save_dtype float8_e4m3fn`` (weight-only quantisation).

MaxText's ``to_maxtext`` casts nothing to e4m3 in that mode: each tensor keeps the dtype its source stores it
in (``_convert_tensor_to_numpy``: e4m3 stays e4m3, bfloat16 and float32 stay, anything else becomes float32),
and only its ``qwen3.5-*-fp8`` models hold the block scales. So:

- Qwen3.5's FP8 release, scanned and unscanned: the e4m3 weights stay e4m3, their scales and every unquantised
  tensor keep the release's dtype; the values are the bfloat16 conversion's (e4m3 is exact in bfloat16), in
  fewer bytes; ``verify`` passes; MaxText's runtime semantics on the tree give transformers' logits of the
  release's values; ``export`` gives the release's own files back;
- a tensor the release stores in float32 stays float32, a float16 one becomes float32 (MaxText's rule);
- DeepSeek-V3's and Kimi-K2's FP8 releases (MaxText 0.2.5's converter drops their scales: nothing to be
  bit-identical to): e4m3 kernels with their float32 scales beside them, regrouped onto the grid MaxText's loader
  dequantises by; that dequantisation gives transformers' logits of the release's values; ``verify`` passes;
  ``export`` gives the release's own files back;
- a source with no FP8 weights (a bfloat16 release, MXFP4, INT4) is refused in one line, exit 2, and nothing is
  written.

Bit-for-bit equality with MaxText's own output is measured by ``bench/compare_families.py`` (the ``-keepfp8``
cases in docs/bench/FAMILIES.md); MaxText's own loader and forward pass on kept DeepSeek checkpoints by
``bench/keep_fp8_deepseek.py`` (docs/bench/KEEP-FP8-DEEPSEEK.md).
"""

from __future__ import annotations

import importlib.util
import json

import ml_dtypes
import numpy as np
import pytest

from ckptconv.commands import synth
from ckptconv.commands.convert import ConvertRequest, convert as convert_checkpoint
from tests import hub_checkpoints, maxtext_forward
from tests.conftest import run_cli
from tests.test_convert import restore
from tests.test_logits import unflatten

# Skipped without the test extra's torch and transformers, found but not imported here: the memory phase collects
# this module for its two memory tests, which need neither (importing them is ~3 s of a core per collecting worker).
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs torch and transformers (the test extra)", allow_module_level=True)

TOKENS = np.array([3, 17, 101, 42, 7, 90, 9, 64, 5, 77, 120, 33])
E4M3, BF16 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16)
KEEP = "float8_e4m3fn"


def convert(src, dst, scan: bool, dtype: str, devices: int = 4) -> dict:
    """In this process (convert imports neither JAX nor Orbax: the device count is the request's); the CLI runs where
    its exit status and message are what is tested (the refusals below) and for verify and export."""
    convert_checkpoint(ConvertRequest(str(src), str(dst), devices=devices, scan_layers=scan, dtype=dtype,
                                      progress="none"))
    return json.loads((dst / "ckptconv-report.json").read_text())


def quantised(leaves: dict[str, np.ndarray]) -> set[str]:
    """The leaves that have a block-scale leaf beside them (``kernel``/``kernel_scale``, ``wi_0``/``wi_0_scale``)."""
    return {name for name in leaves if (name[:-len("kernel")] + "kernel_scale" if name.endswith("/kernel")
                                        else name + "_scale") in leaves}


@pytest.mark.parametrize("scan", [True, False])
def test_fp8_release_kept_as_stored(tmp_path, scan):
    from tests.test_qwen3_next import semantics

    config = hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=4 if scan else 5)
    src = tmp_path / "hf"
    stored = hub_checkpoints.make_fp8(str(src), config)
    kept_report = convert(src, tmp_path / "kept", scan, KEEP)
    wide_report = convert(src, tmp_path / "wide", scan, "bfloat16")
    kept, wide = restore(tmp_path / "kept"), restore(tmp_path / "wide")
    assert kept.keys() == wide.keys()
    weights = quantised(kept)
    for name, value in kept.items():
        if not name.startswith("params/"):
            continue
        assert value.dtype == (E4M3 if name in weights else BF16), name  # the release: e4m3 weights, all else bf16
        assert value.astype(BF16).view(np.uint16).tobytes() == wide[name].view(np.uint16).tobytes(), name
    assert {n.rsplit("/", 1)[-1] for n in weights} == {"kernel", "wi_0", "wi_1", "wo"}
    param_bytes = sum(v.nbytes for n, v in kept.items() if n.startswith("params/"))
    assert kept_report["output_bytes"] == param_bytes and kept_report["dtype"] == KEEP
    assert param_bytes < 0.6 * wide_report["output_bytes"]

    verified = run_cli("verify", str(src), str(tmp_path / "kept"), "--progress", "none")
    assert verified.returncode == 0 and "OK" in verified.stdout + verified.stderr, verified.stderr

    expected = hub_checkpoints.fp8_logits(config, stored, TOKENS)
    got = maxtext_forward.hybrid_forward(unflatten(kept)["params"]["params"], TOKENS, semantics(config), scan=scan)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_float32_stays_float32_and_float16_becomes_float32(tmp_path):
    """MaxText keeps a float32 tensor float32 and upcasts any other non-e4m3, non-bfloat16 one to float32."""
    config = hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=4)
    bf16_config = {k: v for k, v in config.items() if k != "quantization_config"}
    tensors = hub_checkpoints.fp8_tensors(hub_checkpoints.hub_tensors(hub_checkpoints.build(bf16_config), bf16_config))
    a_log, norm = "model.language_model.layers.0.linear_attn.A_log", "model.language_model.norm.weight"
    tensors[a_log] = tensors[a_log].astype(np.float32)
    tensors[norm] = tensors[norm].astype(np.float16)
    src, dst = tmp_path / "hf", tmp_path / "dst"
    hub_checkpoints.write_stored(str(src), tensors, config)
    convert(src, dst, True, KEEP)
    leaves = restore(dst)
    got_a_log = leaves["params/params/decoder/layers/layer_0/attention/A_log"]
    assert got_a_log.dtype == np.float32 and np.array_equal(got_a_log[:, 0], tensors[a_log])
    got_norm = leaves["params/params/decoder/decoder_norm/scale"]
    assert got_norm.dtype == np.float32 and np.array_equal(got_norm, tensors[norm].astype(np.float32))
    assert leaves["params/params/decoder/layers/layer_1/attention/A_log"].dtype == BF16  # the others as stored


def _raw(directory) -> dict:
    """Every tensor of a safetensors directory: dtype, shape and bytes."""
    import torch
    from safetensors.torch import load_file

    return {name: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for path in sorted(directory.glob("*.safetensors")) for name, t in load_file(str(path)).items()}


def test_kept_checkpoint_exports_the_release_back(tmp_path):
    config = hub_checkpoints.qwen3_5_moe_fp8_config(num_hidden_layers=4)
    src, dst, back = tmp_path / "hf", tmp_path / "dst", tmp_path / "back"
    hub_checkpoints.make_fp8(str(src), config)
    convert(src, dst, True, KEEP)
    result = run_cli("export", str(dst), str(back), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert _raw(back) == {k: v for k, v in _raw(src).items() if not k.startswith(("mtp.", "model.visual."))}


@pytest.mark.slow
@pytest.mark.memory
def test_kept_peak_is_predicted(synth_dir, tmp_path, record_property):
    """At Qwen3.5-397B-A17B-FP8's widths (one period, 8 experts), kept e4m3 with 1 and 16 devices: the plan's
    prediction bounds the measured peak, within 1.5x (the tiles hold e4m3 bytes, the prediction counts them)."""
    from ckptconv.families.qwen3_5_moe import WIDTHS_397B
    from tests import scratch
    from tests.test_memory import GiB, convert_peak

    model = synth.SynthModel(model_type="qwen3_5_moe", quantization="fp8",
                             **{**WIDTHS_397B, "num_layers": 4, "num_experts": 8})
    src = synth_dir(model, name="qwen3.5-397b-fp8-period", max_shard_bytes=5 * 10**9, fast=True)
    for devices in (16, 1):
        measured, _, source_bytes = convert_peak(src, tmp_path / f"out{devices}", devices, "--dtype", KEEP,
                                                 record=record_property)
        assert source_bytes > 1.5 * GiB and measured < 1.5 * GiB
    scratch.discard(src)  # late, as test_memory's sources (tests/scratch.py)


@pytest.mark.slow
@pytest.mark.memory
def test_kept_deepseek_peak_is_predicted(synth_dir, tmp_path, record_property):
    """At DeepSeek-V3's layer widths (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, MLP 18432, experts of 2048;
    one dense and one MoE layer with 8 experts), kept e4m3 with 16 and 1 devices: the plan's prediction bounds the
    measured peak, within 1.5x (the scale grids are read whole and regrouped: a few KiB a tensor). Both figures go to
    the memory phase's JUnit file, where `.ci/run` prints them with the examples'."""
    from ckptconv.families.deepseek import V32_WIDTHS
    from tests import scratch
    from tests.test_memory import GiB, convert_peak

    widths = {**V32_WIDTHS, "model_type": "deepseek_v3", "num_layers": 2,
              "config_overrides": {k: v for k, v in V32_WIDTHS["config_overrides"].items() if "index" not in k}}
    src = synth_dir(synth.SynthModel(**widths), name="deepseek-v3-fp8-widths", max_shard_bytes=5 * 10**9, fast=True)
    for devices in (16, 1):
        measured, _, source_bytes = convert_peak(src, tmp_path / f"out{devices}", devices, "--dtype", KEEP,
                                                 record=record_property)
        assert source_bytes > 1 * GiB and measured < 1.5 * GiB
    scratch.discard(src)


def _bf16_qwen3_5(directory) -> None:
    hub_checkpoints.make(str(directory), hub_checkpoints.qwen3_5_moe_config())


def _synthetic(model: synth.SynthModel):
    return lambda directory: synth.write_checkpoint(model, str(directory))


GPT_OSS = synth.SynthModel(model_type="gpt_oss", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                           head_dim=16, intermediate_size=96, num_experts=4, quantization="mxfp4", vocab_size=300)


@pytest.mark.parametrize("make, message", [
    (_bf16_qwen3_5, "has no FP8 weights to keep (no quantization_config): the scales would have to be guessed"),
    (_synthetic(synth.SynthModel(model_type="qwen3")), "has no FP8 weights to keep (no quantization_config)"),
    (_synthetic(GPT_OSS), "has no FP8 weights to keep (its experts are MXFP4)"),
    (_synthetic(synth.SynthModel(model_type="deepseek_v3", num_layers=3, num_experts=4)),
     "has no FP8 weights to keep (no quantization_config)"),
], ids=["qwen3.5-bf16", "qwen3", "gpt-oss-mxfp4", "deepseek-v3-bf16"])
@pytest.mark.parametrize("command", ["convert", "plan"])
def test_source_without_keepable_fp8_is_refused_in_one_line(tmp_path, make, message, command):
    src, dst = tmp_path / "hf", tmp_path / "dst"
    make(src)
    args = (command, str(src)) + ((str(dst), "--progress", "none") if command == "convert" else ())
    result = run_cli(*args, "--dtype", KEEP)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "--dtype float8_e4m3fn" in lines[0], lines
    assert not dst.exists()


def test_export_refuses_float8_output(tmp_path):
    """export writes Hugging Face files in one dtype: float8_e4m3fn is convert's mode, not export's."""
    result = run_cli("export", str(tmp_path / "ckpt"), str(tmp_path / "back"), "--like", str(tmp_path), "--dtype", KEEP)
    assert result.returncode == 2 and "float8_e4m3fn" in result.stderr


# DeepSeek-V3's FP8 layout at small widths: 4 heads of 128 nope + 64 RoPE (q_b_proj's 128-row blocks straddle heads),
# kv_lora 512 + 64 (kv_a_proj_with_mqa: 4.5 blocks), q_lora 192, MLPs of 320 and 192 rows (partial blocks)
DEEPSEEK_FP8 = {"hidden_size": 256, "num_layers": 3, "num_heads": 4, "head_dim": 128, "intermediate_size": 320,
                "moe_intermediate_size": 192, "num_experts": 4, "quantization": "fp8", "vocab_size": 300,
                "config_overrides": {"q_lora_rank": 192, "kv_lora_rank": 512, "qk_rope_head_dim": 64}}


@pytest.mark.parametrize("model_type, scan, devices", [("deepseek_v3", True, 16), ("deepseek_v3", False, 1),
                                                       ("kimi_k2", True, 4)])
def test_deepseek_fp8_release_kept(tmp_path, synth_dir, model_type, scan, devices):
    """DeepSeek-V3's and Kimi-K2's FP8 releases kept: e4m3 kernels as stored, each ``weight_scale_inv`` in float32
    beside its kernel on the grid MaxText's loader dequantises by; that dequantisation (MaxText's
    ``dequantize_weight`` rule: every kernel axis a multiple of its scale's) gives transformers' float32 logits of
    the release's values; the bfloat16 conversion is the same values rounded once more."""
    from tests.test_logits import hf_logits, semantics

    model = synth.SynthModel(model_type=model_type, **DEEPSEEK_FP8)
    src = synth_dir(model)
    report = convert(src, tmp_path / "kept", scan, KEEP, devices)
    kept = restore(tmp_path / "kept")
    weights = quantised(kept)
    assert {n.rsplit("/", 1)[-1] for n in weights} == {"kernel", "wi_0", "wi_1", "wo"}
    assert len(weights) == sum(1 for n in kept if n.endswith("_scale"))  # every scale leaf beside its kernel
    for name, value in kept.items():
        if not name.startswith("params/"):
            continue
        if name in weights:
            scale = kept[name[:-len("kernel")] + "kernel_scale" if name.endswith("/kernel") else name + "_scale"]
            assert value.dtype == E4M3 and scale.dtype == np.float32, name
            assert scale.ndim == value.ndim and all(d % s == 0 for d, s in zip(value.shape, scale.shape)), name
        elif not name.endswith("_scale"):
            assert value.dtype == BF16, name  # embeddings, norms, router, bias: as the release stores them
    wq_b = next(v for n, v in kept.items() if n.endswith("wq_b/kernel_scale"))
    assert wq_b.shape[-1] == 3  # 192 rows a head: three 64-row groups, none straddling a 128-row block
    assert report["dtype"] == KEEP

    reference = tmp_path / "dequantised"
    hub_checkpoints.dequantised_release(src, reference)
    tokens = TOKENS % model.vocab_size
    expected = hf_logits(reference, tokens)
    params = maxtext_forward.dequantize(unflatten(kept)["params"]["params"])
    got = maxtext_forward.forward(params, tokens, semantics(model), scan=scan)[:, :model.vocab_size]
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)

    verified = run_cli("verify", str(src), str(tmp_path / "kept"), "--progress", "none")
    assert verified.returncode == 0 and "OK" in verified.stdout + verified.stderr, verified.stderr

    # export: the release's own files back (e4m3 weights, float32 block scales ungrouped), config.json as shipped
    back = tmp_path / "back"
    result = run_cli("export", str(tmp_path / "kept"), str(back), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert _raw(back) == _raw(src)
    assert (back / "config.json").read_text() == (src / "config.json").read_text()


def test_deepseek_v32_fp8_release_kept_and_exported_back(tmp_path, synth_dir):
    """DeepSeek-V3.2's FP8 release (its lightning indexer's ``wq_b`` and ``wk`` FP8 too, power-of-two scales) kept by
    the same rules: every FP8 weight e4m3 beside its float32 scale, and ``export`` gives the release's files back."""
    model = synth.SynthModel(model_type="deepseek_v32", **DEEPSEEK_FP8)
    src = synth_dir(model)
    convert(src, tmp_path / "kept", True, KEEP)
    kept = restore(tmp_path / "kept")
    weights = quantised(kept)
    assert {n for n in weights if "/indexer/" in n} == {
        "params/params/decoder/dense_layers/self_attention/indexer/wq_b/kernel",
        "params/params/decoder/dense_layers/self_attention/indexer/wk/kernel",
        "params/params/decoder/moe_layers/self_attention/indexer/wq_b/kernel",
        "params/params/decoder/moe_layers/self_attention/indexer/wk/kernel"}
    assert all(kept[n].dtype == E4M3 for n in weights)
    back = tmp_path / "back"
    result = run_cli("export", str(tmp_path / "kept"), str(back), "--like", str(src), "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert _raw(back) == _raw(src)
