"""The quantised giants as the hub ships them: FP8 (DeepSeek-V3, Kimi-K2) and MXFP4 (gpt-oss).

Dequantisation is checked against references written here from the formats' definitions
(e4m3 times the block's float32 scale; E2M1 codes times 2^(e - 127)), computed in float32 and
rounded once to bfloat16 as MaxText's dequantisers do. Conversions are checked leaf by leaf
against MaxText's hooks applied to those dequantised tensors, ``verify`` re-derives every value
from the quantised source, and gpt-oss's logits match transformers running the dequantised model.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptconv.commands import synth
from ckptconv.errors import BadInputError
from ckptconv.families.inputs import FP8, FP8Blocks, FP8Channel, MXFP4
from ckptconv.read.safetensors_io import index_checkpoint
from ckptconv.read.sources import LocalSource
from tests import maxtext_forward
from tests.conftest import run_cli
from tests.maxtext_forward import Semantics
from tests.test_convert import DTYPES, restore
from tests.test_logits import unflatten

BF16 = np.dtype(ml_dtypes.bfloat16)


def reference_fp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """value[i, j] = weight[i, j] * scale[i // 128, j // 128], in float32, rounded to bfloat16."""
    rows, cols = np.arange(weight.shape[0]) // 128, np.arange(weight.shape[1]) // 128
    return (weight.astype(np.float32) * scale.astype(np.float32)[rows][:, cols]).astype(BF16)


def e2m1(code: int) -> float:
    """One E2M1 code: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; 0b1000 is +0 (as MaxText)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)
    return -magnitude if sign and magnitude else magnitude


def reference_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(experts, rows, groups, 16) codes, low nibble first, times 2^(scale - 127); then rows <-> columns."""
    table = np.array([e2m1(code) for code in range(16)], np.float32)
    low, high = table[blocks & 15], table[blocks >> 4]
    codes = np.stack([low, high], axis=-1).reshape(*blocks.shape[:3], 32)
    values = codes * np.exp2(scales.astype(np.float32) - 127)[..., None]
    # contiguous: safetensors' numpy writer stores a strided view's raw buffer, not its logical order
    return np.ascontiguousarray(values.reshape(*blocks.shape[:2], -1).astype(BF16).swapaxes(1, 2))


def load_stored(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file via the reference reader (its torch loader: numpy has no float8)."""
    import torch
    from safetensors.torch import load_file as load_torch

    views = {torch.bfloat16: (torch.int16, BF16), torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn))}
    out = {}
    for name, tensor in load_torch(str(path)).items():
        if tensor.dtype in views:
            as_int, dtype = views[tensor.dtype]
            out[name] = tensor.view(as_int).numpy().view(dtype)
        else:
            out[name] = tensor.numpy()
    return out


def dequantized(src) -> dict[str, np.ndarray]:
    """The bfloat16 checkpoint MaxText's dequantisers would write for ``src``."""
    stored = load_stored(src / "model.safetensors")
    out = {}
    for name, value in stored.items():
        if name.endswith(("_scale_inv", "_scales")):
            continue
        if name + "_scale_inv" in stored:
            out[name] = reference_fp8(value, stored[name + "_scale_inv"])
        elif name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = reference_mxfp4(value, stored[base + "_scales"])
        else:
            out[name] = value.astype(BF16)
    return out


def test_e2m1_table_is_the_spec():
    assert [e2m1(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1(c) for c in range(9, 16)] == [-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert np.signbit(np.float32(e2m1(8))) == np.False_  # MaxText's gpt-oss dequantiser: +0.0


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 7168 // 16)])
def test_fp8_reads_equal_the_reference_for_every_band(tmp_path, shape):
    rng = np.random.default_rng(1)
    weight, scale = synth.quantize_fp8((rng.standard_normal(shape) * 0.02).astype(np.float32))
    save_file({"w": weight, "w_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    source = LocalSource(str(tmp_path))
    infos = index_checkpoint(source)
    fp8 = FP8Blocks(infos["w"], infos["w_scale_inv"])
    expected = reference_fp8(weight, scale)
    assert fp8.shape == shape and fp8.dtype == BF16
    for band in (1, 7, 128, 131, shape[0]):
        for start in range(0, shape[0], band):
            box = ((start, min(start + band, shape[0])), (0, shape[1]))
            got = fp8.read(source, box)
            assert got.tobytes() == expected[start:start + band].tobytes(), (band, start)
    for row in sorted({0, 3, 127, min(128, shape[0] - 1), shape[0] - 1}):  # parts of one row (the only partial reads plans make), any alignment
        for cols in ((5, 200), (128, min(256, shape[1])), (0, shape[1]), (shape[1] - 6, shape[1])):
            got = fp8.read(source, ((row, row + 1), cols))
            assert got.tobytes() == np.ascontiguousarray(expected[row:row + 1, cols[0]:cols[1]]).tobytes(), (row, cols)


def test_every_fp8_code_decodes_as_the_cast_does(tmp_path):
    """All 256 e4m3 codes (zeros of both signs, subnormals, the largest, both NaNs) in every column position of a
    block, through the block-scaled and the per-row decoders (each takes its float32 values from a table, not from
    ml_dtypes' cast), against the cast: the same bits."""
    codes = np.arange(256, dtype=np.uint8).view(FP8)
    weight = np.stack([np.roll(codes, r) for r in range(128)])  # (128, 256): each code in 128 columns
    scale = np.array([[0.5, 3.0]], np.float32)
    rows = np.linspace(0.25, 4, 128, dtype=np.float32).astype(BF16)[:, None]
    save_file({"w": weight, "w_scale_inv": scale, "c": weight, "c_scale": rows}, str(tmp_path / "model.safetensors"))
    source = LocalSource(str(tmp_path))
    infos = index_checkpoint(source)
    whole = ((0, 128), (0, 256))
    with np.errstate(invalid="ignore"):
        blocks = (weight.astype(np.float32) * np.repeat(scale, 128, axis=1)).astype(BF16)
        channel = (weight.astype(np.float32) * rows.astype(np.float32)).astype(BF16)
    assert FP8Blocks(infos["w"], infos["w_scale_inv"]).read(source, whole).tobytes() == blocks.tobytes()
    assert FP8Channel(infos["c"], infos["c_scale"]).read(source, whole).tobytes() == channel.tobytes()
    assert np.isnan(blocks.astype(np.float32)).sum() == 2 * 128  # the NaN codes really are in it


def test_mxfp4_reads_equal_the_reference_for_every_band(tmp_path):
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (3, 10, 4), dtype=np.uint8)
    scales[0, 0, 0] = 0  # 2^-127: a float32 subnormal
    scales[1, 0, 0] = 254  # 2^127: codes above 1.5 overflow to inf, as in MaxText's float32 product
    save_file({"e_blocks": blocks, "e_scales": scales}, str(tmp_path / "model.safetensors"))
    source = LocalSource(str(tmp_path))
    infos = index_checkpoint(source)
    mx = MXFP4(infos["e_blocks"], infos["e_scales"])
    expected = reference_mxfp4(blocks, scales)
    assert mx.shape == (3, 128, 10) == expected.shape and mx.order == (0, 2, 1)
    assert mx.read(source, ((0, 3), (0, 128), (0, 10))).tobytes() == np.ascontiguousarray(expected).tobytes()
    for e in range(3):
        for rows in ((0, 2), (2, 6), (6, 10)):
            got = mx.read(source, ((e, e + 1), (0, 128), rows))
            assert got.tobytes() == np.ascontiguousarray(expected[e:e + 1, :, rows[0]:rows[1]]).tobytes()
    scales[2, 9, 3] = 255  # E8M0's not-a-number: refused, naming the tensor
    save_file({"e_blocks": blocks, "e_scales": scales}, str(tmp_path / "model.safetensors"))
    source = LocalSource(str(tmp_path))
    infos = index_checkpoint(source)
    with pytest.raises(BadInputError, match="'e_scales' holds the scale 255"):
        MXFP4(infos["e_blocks"], infos["e_scales"]).read(source, ((2, 3), (0, 128), (8, 10)))


DEEPSEEK = synth.SynthModel(model_type="deepseek_v3", hidden_size=256, num_layers=3, num_heads=4, head_dim=16,
                            intermediate_size=320, moe_intermediate_size=192, num_experts=4, quantization="fp8",
                            vocab_size=300)
GPT_OSS = synth.SynthModel(model_type="gpt_oss", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                           head_dim=16, intermediate_size=96, num_experts=4, quantization="mxfp4", vocab_size=300)


def expected_deepseek(hf: dict, model: synth.SynthModel, scan: bool, dtype: str) -> dict[str, np.ndarray]:
    """MaxText's DeepSeek hooks (reshape_kernel: .T then reshape) on the dequantised tensors."""
    config = model.config()
    heads, emb = config["num_attention_heads"], config["hidden_size"]
    dense, layers, experts = config["first_k_dense_replace"], config["num_hidden_layers"], config["n_routed_experts"]
    p = "model.layers.{i}."

    def t(name, *reshape):
        return lambda i: hf[p.format(i=i) + name].T.reshape(*reshape) if reshape else hf[p.format(i=i) + name].T

    def plain(name):
        return lambda i: hf[p.format(i=i) + name]

    attention = {
        "pre_self_attention_layer_norm/scale": plain("input_layernorm.weight"),
        "post_self_attention_layer_norm/scale": plain("post_attention_layernorm.weight"),
        "self_attention/wq_a/kernel": t("self_attn.q_a_proj.weight"),
        "self_attention/q_norm/scale": plain("self_attn.q_a_layernorm.weight"),
        "self_attention/wq_b/kernel": t("self_attn.q_b_proj.weight", config["q_lora_rank"], heads, -1),
        "self_attention/wkv_a/kernel": t("self_attn.kv_a_proj_with_mqa.weight"),
        "self_attention/kv_norm/scale": plain("self_attn.kv_a_layernorm.weight"),
        "self_attention/wkv_b/kernel": t("self_attn.kv_b_proj.weight", config["kv_lora_rank"], heads, -1),
        "self_attention/out/kernel": t("self_attn.o_proj.weight", heads, -1, emb),
    }
    dense_layer = attention | {f"mlp/{k}/kernel": t(f"mlp.{n}_proj.weight") for k, n in
                               (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down"))}
    block = "DeepSeekMoeBlock_0"
    moe_layer = attention | {
        f"{block}/shared_experts/{k}/kernel": t(f"mlp.shared_experts.{n}_proj.weight")
        for k, n in (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down"))} | {
        f"{block}/MoeBlock_0/gate/kernel": t("mlp.gate.weight"),
        BIAS: plain("mlp.gate.e_score_correction_bias")} | {
        f"{block}/MoeBlock_0/{k}": (lambda i, n=n: np.stack([hf[p.format(i=i) + f"mlp.experts.{e}.{n}_proj.weight"].T
                                                             for e in range(experts)]))
        for k, n in (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down"))}
    params = {"token_embedder/embedding": hf["model.embed_tokens.weight"],
              "decoder/decoder_norm/scale": hf["model.norm.weight"],
              "decoder/logits_dense/kernel": hf["lm_head.weight"].T}
    for stack, tree, hf_layers in (("dense_layers", dense_layer, range(dense)), ("moe_layers", moe_layer,
                                                                                range(dense, layers))):
        for name, make in tree.items():
            # the router bias (a MoEBiasVar in MaxText's model) under params/params, layers stacked on axis 0
            root, axis = "params/params", 0 if name == BIAS else 1
            if scan:
                params[f"{root}/decoder/{stack}/{name}"] = np.stack([make(i) for i in hf_layers], axis=axis)
            else:
                params |= {f"{root}/decoder/{stack}_{j}/{name}": make(i) for j, i in enumerate(hf_layers)}
    return {(k if k.startswith("params/") else f"params/params/{k}"): np.asarray(v).astype(DTYPES[dtype])
            for k, v in params.items()}


BIAS = "DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"


def expected_gpt_oss(hf: dict, model: synth.SynthModel, scan: bool, dtype: str) -> dict[str, np.ndarray]:
    """MaxText's gpt-oss hooks: reshape_kernel, reshape_bias, interleave (even -> wi_0, odd -> wi_1)."""
    config = model.config()
    heads, kv, emb = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    p = "model.layers.{i}."
    layer = {
        "pre_self_attention_layer_norm/scale": lambda i: hf[p.format(i=i) + "input_layernorm.weight"],
        "post_self_attention_layer_norm/scale": lambda i: hf[p.format(i=i) + "post_attention_layernorm.weight"],
        "GptOssAttention/sinks": lambda i: hf[p.format(i=i) + "self_attn.sinks"],
        "GptOssAttention/out/kernel": lambda i: hf[p.format(i=i) + "self_attn.o_proj.weight"].T.reshape(heads, -1, emb),
        "GptOssAttention/out/bias": lambda i: hf[p.format(i=i) + "self_attn.o_proj.bias"],
        "GptOssMlp/gate/kernel": lambda i: hf[p.format(i=i) + "mlp.router.weight"].T,
        "GptOssMlp/gate/bias": lambda i: hf[p.format(i=i) + "mlp.router.bias"],
        "GptOssMlp/wi_0": lambda i: hf[p.format(i=i) + "mlp.experts.gate_up_proj"][..., ::2],
        "GptOssMlp/wi_1": lambda i: hf[p.format(i=i) + "mlp.experts.gate_up_proj"][..., 1::2],
        "GptOssMlp/wi_0_bias": lambda i: hf[p.format(i=i) + "mlp.experts.gate_up_proj_bias"][..., ::2],
        "GptOssMlp/wi_1_bias": lambda i: hf[p.format(i=i) + "mlp.experts.gate_up_proj_bias"][..., 1::2],
        "GptOssMlp/wo": lambda i: hf[p.format(i=i) + "mlp.experts.down_proj"],
        "GptOssMlp/wo_bias": lambda i: hf[p.format(i=i) + "mlp.experts.down_proj_bias"],
    }
    for short, name, n in (("q", "query", heads), ("k", "key", kv), ("v", "value", kv)):
        layer[f"GptOssAttention/{name}/kernel"] = (
            lambda i, s=short, n=n: hf[p.format(i=i) + f"self_attn.{s}_proj.weight"].T.reshape(emb, n, -1))
        layer[f"GptOssAttention/{name}/bias"] = (
            lambda i, s=short, n=n: hf[p.format(i=i) + f"self_attn.{s}_proj.bias"].reshape(n, -1))
    params = {"token_embedder/embedding": hf["model.embed_tokens.weight"],
              "decoder/decoder_norm/scale": hf["model.norm.weight"],
              "decoder/logits_dense/kernel": hf["lm_head.weight"].T}
    layers = config["num_hidden_layers"]
    for name, make in layer.items():
        if scan:  # blocks of (sliding, full): layers_0 over the even layers, layers_1 over the odd ones
            for b in range(2):
                params[f"decoder/layers/layers_{b}/{name}"] = np.stack([make(i) for i in range(b, layers, 2)], axis=1)
        else:
            params |= {f"decoder/layers_{i}/{name}": make(i) for i in range(layers)}
    return {f"params/params/{k}": np.asarray(v).astype(DTYPES[dtype]) for k, v in params.items()}


CASES = [  # model, expected, scan, devices, dtype
    (DEEPSEEK, expected_deepseek, True, 4, "bfloat16"),
    (DEEPSEEK, expected_deepseek, False, 1, "float32"),
    (GPT_OSS, expected_gpt_oss, True, 4, "bfloat16"),
    (GPT_OSS, expected_gpt_oss, False, 1, "bfloat16"),
]


@pytest.mark.parametrize("model, expect, scan, devices, dtype", CASES,
                         ids=[f"{c[0].model_type}-{'scan' if c[2] else 'noscan'}-{c[3]}dev-{c[4]}" for c in CASES])
def test_quantized_release_converts_like_maxtexts_two_step_route(tmp_path, synth_dir, model, expect, scan, devices,
                                                                  dtype):
    src, dst = synth_dir(model), tmp_path / "dst"
    flags = ["--scan-layers" if scan else "--no-scan-layers", "--devices", str(devices), "--dtype", dtype]
    result = run_cli("convert", str(src), str(dst), "--progress", "none", *flags)
    assert result.returncode == 0, result.stderr
    expected = expect(dequantized(src), model, scan, dtype)
    restored = restore(dst)
    assert restored.keys() == expected.keys() | {"step"}
    for name, value in expected.items():
        assert restored[name].shape == value.shape and restored[name].dtype == value.dtype, name
        assert restored[name].tobytes() == value.tobytes(), name
    verified = run_cli("verify", str(src), str(dst))
    assert verified.returncode == 0 and "verify: OK" in verified.stdout, verified.stdout + verified.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert report["model"]["values"]["quantization"] == {"deepseek_v3": "fp8-block-128", "gpt_oss": "mxfp4"}[
        model.model_type]
    assert report["source_bytes"] < report["output_bytes"] * (0.75 if model.model_type == "deepseek_v3" else 1)


def test_mtp_layer_is_reported_not_converted(tmp_path):
    model = synth.SynthModel(
        model_type="deepseek_v3", hidden_size=128, num_layers=2, num_heads=2, head_dim=16, intermediate_size=160,
        moe_intermediate_size=64, num_experts=2, quantization="fp8", vocab_size=100,
        config_overrides={"num_nextn_predict_layers": 1},
        extra_tensors={"model.layers.2.enorm.weight": (128,), "model.layers.2.eh_proj.weight": (128, 256),
                       "model.layers.2.shared_head.norm.weight": (128,)})
    synth.write_checkpoint(model, str(tmp_path / "src"))
    planned = json.loads(run_cli("plan", str(tmp_path / "src"), "--devices", "1", "--json").stdout)
    # two bf16 norms, and eh_proj as released: an FP8 weight with its (1, 2) block scales
    assert planned["not_converted"] == [{"what": "multi-token prediction (MTP) layer", "tensors": 4,
                                         "bytes": 2 * 128 * 2 + 128 * 256 + 2 * 4, "example": "model.layers.2.eh_proj.weight"}]


def test_gpt_oss_logits_match_transformers_on_the_dequantised_model(tmp_path, synth_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = synth.SynthModel(model_type="gpt_oss", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=16, intermediate_size=64, num_experts=4, quantization="mxfp4", vocab_size=128,
                             # plain RoPE (transformers' gpt_oss default is the release's YaRN, which the
                             # reference forward does not model; RoPE settles no weight)
                             config_overrides={"rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}})
    src, dst, bf16 = synth_dir(model), tmp_path / "dst", tmp_path / "bf16"
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4", "--dtype", "float32")
    assert result.returncode == 0, result.stderr

    bf16.mkdir()  # the bfloat16 copy MaxText's dequantiser would write, for transformers to run
    save_file(dequantized(src), str(bf16 / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (bf16 / "config.json").write_text(json.dumps(config))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.float32,
                                                                 attn_implementation="eager")
    hf_model.eval()
    tokens = np.random.default_rng(4).integers(0, 128, size=10)
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens[None])).logits[0].numpy()
    sem = Semantics(family="gpt_oss", num_layers=2, eps=config["rms_norm_eps"], theta=10000.0,
                    runtime_query_scale=True, moe="gpt_oss", top_k=config["num_experts_per_tok"], layout="gpt_oss",
                    extra={"swiglu_limit": 7.0, "swiglu_alpha": 1.702})
    got = maxtext_forward.forward(unflatten(restore(dst))["params"]["params"], tokens, sem, scan=True)
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["DEEPSEEK_V3", "KIMI_K2"])
def test_full_size_giants_plan_under_two_gib(tmp_path, name):
    """DeepSeek-V3 (671B) and Kimi-K2 (1T) from their published config.json, with header-only shards
    (real headers, no data): the plan accepts them and predicts a bounded peak and a time."""
    from tests import published_configs

    config = getattr(published_configs, name)
    model = synth.SynthModel(model_type=config["model_type"], quantization="fp8", config_overrides=dict(config))
    synth.write_checkpoint(model, str(tmp_path), max_shard_bytes=5 * 10**9, header_only=True)
    for devices in (1, 16):
        result = run_cli("plan", str(tmp_path), "--devices", str(devices), "--json")
        assert result.returncode == 0, result.stderr
        planned = json.loads(result.stdout)
        assert planned["source_bytes"] > 600 * 2**30 and planned["output_bytes"] > 2 * 600 * 2**30
        assert planned["predicted_peak_rss_bytes"] <= 2 * 2**30
        assert 3600 < planned["predicted_seconds"] < 6 * 3600  # hours on 2 cores, at the measured rate


def test_deepseek_queries_without_lora(tmp_path, synth_dir):
    """q_lora_rank null (DeepSeek-V2-Lite's queries): q_proj becomes self_attention/query, reshaped per head."""
    model = synth.SynthModel(model_type="deepseek_v3", hidden_size=128, num_layers=2, num_heads=2, head_dim=16,
                             intermediate_size=160, moe_intermediate_size=64, num_experts=2, vocab_size=100,
                             config_overrides={"q_lora_rank": None})
    src, dst = synth_dir(model), tmp_path / "dst"
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "1", "--no-scan-layers")
    assert result.returncode == 0, result.stderr
    hf, restored = dequantized(src), restore(dst)
    for stack, layer in (("dense_layers_0", 0), ("moe_layers_0", 1)):
        query = hf[f"model.layers.{layer}.self_attn.q_proj.weight"].T.reshape(128, 2, -1)
        assert restored[f"params/params/decoder/{stack}/self_attention/query/kernel"].tobytes() == query.tobytes()
        assert f"params/params/decoder/{stack}/self_attention/wq_a/kernel" not in restored


# DeepSeek-V3.2's FP8 release: the indexer's wq_b and wk are FP8 with block scales, like every linear layer
V32 = synth.SynthModel(model_type="deepseek_v32", hidden_size=128, num_layers=2, num_heads=2, head_dim=16,
                       intermediate_size=160, moe_intermediate_size=64, num_experts=2, vocab_size=100,
                       quantization="fp8")
WK, WQ_B = "model.layers.1.self_attn.indexer.wk.weight", "model.layers.0.self_attn.indexer.wq_b.weight"


def _nan_scale(tensors):
    tensors[WK + "_scale_inv"][0, 0] = float("nan")


def _scale_of_the_wrong_grid(tensors):
    tensors[WQ_B + "_scale_inv"] = tensors[WQ_B + "_scale_inv"][:, :0]


def _without_scale(tensors):
    del tensors[WK + "_scale_inv"]


@pytest.mark.parametrize("change, message", [
    (_nan_scale, repr(WK + "_scale_inv")),
    (_scale_of_the_wrong_grid, repr(WQ_B + "_scale_inv")),
    (_without_scale, repr(WK)),
], ids=["nan-scale", "scale-grid", "no-scale"])
def test_deepseek_v32_damaged_indexer_is_one_line_exit_2(tmp_path, change, message):
    """A damaged FP8 indexer tensor (NaN scale, a scale grid that is not the weight's, a missing scale) is refused
    in one line naming it, exit 2, before anything is written."""
    from safetensors.torch import load_file, save_file

    src, dst = tmp_path / "hf", tmp_path / "dst"
    synth.write_checkpoint(V32, str(src))
    tensors = load_file(str(src / "model.safetensors"))
    assert tensors[WK].dtype == tensors[WQ_B].dtype == __import__("torch").float8_e4m3fn
    change(tensors)
    save_file(tensors, str(src / "model.safetensors"))
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "4")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not dst.exists() or not any(dst.iterdir())


def test_deepseek_v32_fp8_indexer_converts_dequantised_and_mtp_is_reported(tmp_path):
    """The indexer's FP8 wq_b and wk are dequantised as MaxText's deepseek_dequantize does (weight x its 128x128
    block scale, to bfloat16), weights_proj and k_norm copied; the MTP layer after the last one is reported."""
    model = synth.SynthModel(**{**V32.__dict__, "config_overrides": {"num_nextn_predict_layers": 1},
                                "extra_tensors": {"model.layers.2.self_attn.indexer.k_norm.bias": (16,)}})
    src, dst = tmp_path / "hf", tmp_path / "dst"
    synth.write_checkpoint(model, str(src))
    result = run_cli("convert", str(src), str(dst), "--progress", "none", "--devices", "1", "--no-scan-layers")
    assert result.returncode == 0, result.stderr
    report = json.loads((dst / "ckptconv-report.json").read_text())
    assert [e["what"] for e in report["not_converted"]] == ["multi-token prediction (MTP) layer"]
    hf, restored = dequantized(src), restore(dst)
    layer = "params/params/decoder/moe_layers_0/self_attention/indexer/"
    expected = {"wq_b/kernel": hf["model.layers.1.self_attn.indexer.wq_b.weight"].T.reshape(32, 4, 16),
                "wk/kernel": hf[WK].T,
                "weights_proj/kernel": hf["model.layers.1.self_attn.indexer.weights_proj.weight"].T,
                "k_norm/scale": hf["model.layers.1.self_attn.indexer.k_norm.weight"],
                "k_norm/bias": hf["model.layers.1.self_attn.indexer.k_norm.bias"]}
    for leaf, want in expected.items():
        assert restored[layer + leaf].tobytes() == want.astype(ml_dtypes.bfloat16).tobytes(), leaf
