"""Peak RSS must not grow with the model, and the plan's prediction must bound it tightly.

- 4x the layers (4x the bytes) at the same widths: the same peak;
- 4x the experts at the same widths: the same peak;
- Llama-3-70B widths (hidden 8192, MLP 28672, vocab 128256; a 2-layer model of 5 GB) convert
  under 1 GiB with 1 and with 16 devices;
- for each, ``plan``'s predicted peak (what Prefect admission reserves) is >= the measured one
  and within 1.5x of it.

A converter that held a whole model or a whole stacked leaf (as MaxText's does) would add
hundreds of MiB to the bigger variant's peak. The figure is the kernel's high-water mark of the
conversion process itself (``VmHWM`` in its report), never ``ru_maxrss`` of a child forked from
this (large) test process, which would include the parent.
"""

import json
import shutil

import pytest

from ckptconv.commands import synth
from tests.conftest import run_cli

MiB = 2**20
GiB = 2**30


def convert_peak(src, dst, devices: int) -> tuple[int, int, int]:
    """(measured peak, predicted peak, source bytes) of one conversion in a fresh process (output removed)."""
    result = run_cli("convert", str(src), str(dst), "--devices", str(devices), "--progress", "none", timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    shutil.rmtree(dst)  # the wide cases write gigabytes: keep the suite's disk use small
    planned = run_cli("plan", str(src), "--devices", str(devices), "--json")
    predicted = json.loads(planned.stdout)["predicted_peak_rss_bytes"]
    measured = report["peak_rss_bytes"]
    print(f"{src.name} on {devices} devices: measured {measured / MiB:.0f} MiB, predicted {predicted / MiB:.0f} MiB, "
          f"source {report['source_bytes'] / MiB:.0f} MiB")
    assert measured <= predicted, "admission relies on the prediction being an upper bound"
    assert predicted <= 1.5 * measured, "a prediction far above the peak wastes the worker's memory"
    return measured, predicted, report["source_bytes"]


def converted(synth_dir, tmp_path, model: synth.SynthModel, name: str, devices: int) -> tuple[int, int, int]:
    src = synth_dir(model, name=name, fast=True)
    return convert_peak(src, tmp_path / f"{name}-out{devices}", devices)


@pytest.mark.slow
def test_peak_rss_does_not_grow_with_layers(synth_dir, tmp_path):
    def model(layers):
        return synth.SynthModel(vocab_size=8192, hidden_size=1024, num_layers=layers, num_heads=8, num_kv_heads=4,
                                head_dim=128, intermediate_size=4096)

    small_peak, _, small_bytes = converted(synth_dir, tmp_path, model(6), "layers6", 16)
    big_peak, _, big_bytes = converted(synth_dir, tmp_path, model(24), "layers24", 16)
    assert big_bytes - small_bytes > 500 * MiB  # the big model really is much bigger
    assert big_peak <= small_peak + 64 * MiB, (small_peak / MiB, big_peak / MiB)


@pytest.mark.slow
def test_peak_rss_does_not_grow_with_experts(synth_dir, tmp_path):
    """Qwen3-30B-A3B widths (hidden 2048, expert MLP 768), 2 layers, 8 vs 32 experts."""
    def model(experts):
        return synth.SynthModel(model_type="qwen3_moe", vocab_size=32000, hidden_size=2048, num_layers=2,
                                num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                                num_experts=experts, moe_intermediate_size=768, tie_word_embeddings=False)

    small_peak, _, small_bytes = converted(synth_dir, tmp_path, model(8), "experts8", 16)
    big_peak, _, big_bytes = converted(synth_dir, tmp_path, model(32), "experts32", 16)
    assert big_bytes - small_bytes > 400 * MiB
    assert big_peak <= small_peak + 64 * MiB, (small_peak / MiB, big_peak / MiB)
    one_device_peak, _, _ = convert_peak(tmp_path / "experts32", tmp_path / "experts32-out1", 1)  # also bounded
    assert one_device_peak <= small_peak + 64 * MiB


@pytest.mark.slow
def test_fp8_release_peak_does_not_grow_with_experts(synth_dir, tmp_path):
    """A DeepSeek-V3-shaped FP8 release (hidden 2048 and MLA ranks 512/256 here, 1 dense + 2 MoE
    layers), 8 vs 32 routed experts: the experts are decoded read unit by read unit."""
    def model(experts):
        return synth.SynthModel(model_type="deepseek_v3", quantization="fp8", vocab_size=16384, hidden_size=2048,
                                num_layers=3, num_heads=16, head_dim=128, intermediate_size=5632,
                                moe_intermediate_size=1024, num_experts=experts,
                                config_overrides={"q_lora_rank": 512, "kv_lora_rank": 256, "qk_rope_head_dim": 64})

    small_peak, _, small_bytes = converted(synth_dir, tmp_path, model(8), "fp8-experts8", 16)
    big_peak, _, big_bytes = converted(synth_dir, tmp_path, model(32), "fp8-experts32", 16)
    assert big_bytes - small_bytes > 250 * MiB  # FP8 bytes: 24 more experts x 3 kernels x 2 layers x 2 MiB
    assert big_peak <= small_peak + 64 * MiB, (small_peak / MiB, big_peak / MiB)


@pytest.mark.slow
def test_int4_release_peak_does_not_grow_with_experts(synth_dir, tmp_path):
    """Kimi-K2-Thinking's format (INT4 experts, the rest bfloat16) at hidden 2048: 8 vs 32 experts."""
    def model(experts):
        return synth.SynthModel(model_type="kimi_k2", quantization="int4", vocab_size=16384, hidden_size=2048,
                                num_layers=3, num_heads=16, head_dim=128, intermediate_size=5632,
                                moe_intermediate_size=1024, num_experts=experts,
                                config_overrides={"q_lora_rank": 512, "kv_lora_rank": 256, "qk_rope_head_dim": 64})

    small_peak, _, small_bytes = converted(synth_dir, tmp_path, model(8), "int4-experts8", 16)
    big_peak, _, big_bytes = converted(synth_dir, tmp_path, model(32), "int4-experts32", 16)
    assert big_bytes - small_bytes > 140 * MiB  # INT4 bytes: 24 more experts x 3 kernels x 2 layers x 1.1 MiB
    assert big_peak <= small_peak + 64 * MiB, (small_peak / MiB, big_peak / MiB)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 16])
def test_llama_70b_widths_convert_under_one_gib(synth_dir, tmp_path_factory, devices):
    """Two layers at Llama-3-70B widths (tied, to keep the suite's disk and time small: the widths
    are what sets the memory). With --devices 1 no axis is sharded: tiles are cut from the
    bytes budget alone, not from shards."""
    src = _wide_source(tmp_path_factory)
    measured, _, source_bytes = convert_peak(src, tmp_path_factory.mktemp(f"out{devices}") / "dst", devices)
    assert source_bytes > 4.5 * GiB
    assert measured <= 1 * GiB


_WIDE: dict = {}


def _wide_source(tmp_path_factory):
    if "src" not in _WIDE:
        model = synth.SynthModel(model_type="llama", vocab_size=128256, hidden_size=8192, num_layers=2, num_heads=64,
                                 num_kv_heads=8, head_dim=128, intermediate_size=28672, tie_word_embeddings=True,
                                 config_overrides={"rope_theta": 500000.0})
        src = tmp_path_factory.mktemp("llama70b-widths") / "src"
        synth.write_checkpoint(model, str(src), max_shard_bytes=5 * 10**9, fast=True)
        _WIDE["src"] = src
    return _WIDE["src"]


@pytest.mark.slow
def test_olmo3_32b_widths_peak_is_bounded_and_the_full_model_is_predicted_alike(synth_dir, tmp_path):
    """One block of OLMo 3 32B (hidden 5120, MLP 27648, 40 query / 8 KV heads, vocab 100278: 4 layers, 6 GB)
    converts with 1 and 16 devices under 1.5 GiB, the prediction bounding it; the plan of the whole
    64-layer model (its published config.json, header-only files) predicts what the block does with 16 devices
    (the widths set the tiles; only the OCDBT node cache grows with the chunk count, and it is full by then)."""
    from tests.published_configs import OLMO3_32B_INSTRUCT

    block = {**OLMO3_32B_INSTRUCT, "num_hidden_layers": 4, "layer_types": OLMO3_32B_INSTRUCT["layer_types"][:4]}
    src = synth_dir(synth.SynthModel(model_type="olmo3", config_overrides=block), name="olmo3-32b-block",
                    max_shard_bytes=5 * 10**9, fast=True)
    predictions = []
    for devices in (16, 1):
        measured, predicted, source_bytes = convert_peak(src, tmp_path / f"olmo3-out{devices}", devices)
        assert source_bytes > 5.5 * GiB
        assert measured <= 1.5 * GiB
        predictions.append(predicted)
    full = tmp_path / "olmo3-32b-full"
    synth.write_checkpoint(synth.SynthModel(model_type="olmo3", config_overrides=dict(OLMO3_32B_INSTRUCT)), str(full),
                           max_shard_bytes=5 * 10**9, header_only=True)
    for devices in (16, 1):
        planned = json.loads(run_cli("plan", str(full), "--devices", str(devices), "--json").stdout)
        print(f"Olmo-3.1-32B on {devices} devices: source {planned['source_bytes'] / GiB:.1f} GiB, predicted peak "
              f"{planned['predicted_peak_rss_bytes'] / MiB:.0f} MiB, {planned['predicted_seconds'] / 60:.0f} min")
        assert 55 * GiB < planned["source_bytes"] < 70 * GiB  # 32B parameters in bfloat16
        assert planned["predicted_peak_rss_bytes"] <= max(predictions) + 64 * MiB <= 1.5 * GiB
