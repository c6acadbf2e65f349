"""A tiny random DeepSeek-V4-Flash release in the hub's layout (bench only; MaxText's venv, transformers 5.25).

    <maxtext-venv>/bin/python bench/hf_tiny_v4.py OUT_DIR [--bf16]

The release stores the reference implementation's names (``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
``layers.{i}.ffn.experts.{e}.w1.weight``, ``hc_head_fn``): transformers' ``conversion_mapping`` renames them on
load. Every shape and name here is checked by loading the bfloat16 copy into transformers' own
``DeepseekV4ForCausalLM`` (no missing, unexpected or mismatched key). Quantised as the release is (as far as can be
told offline: MaxText's ``deepseek4_284b`` config, transformers' FP8 quantizer and MaxText's ``deepseek_dequantize``):
linear layers FP8 e4m3 with one ue8m0 (``float8_e8m0fnu``) scale per 128x128 block named ``<module>.scale``; routed
experts FP4 e2m1, two per int8 byte (low nibble first) with one ue8m0 scale per 32 values of a row; router, indexer
``weights_proj``, compressors, norms, mHC and sinks unquantised (float32 where transformers keeps them float32).
Assumed, not known: which projections the release leaves unquantised (the compressors' ``wkv``/``wgate`` and
``weights_proj`` here), and ``tid2eid`` as int64 (transformers' buffer dtype).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.v4_formats import quantize_fp4, quantize_fp8  # noqa: E402  (the repository root, above)

SIZES = {"vocab_size": 256, "hidden_size": 128, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
         "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64, "index_n_heads": 2, "index_head_dim": 32, "num_hidden_layers": 5,
         "num_hash_layers": 3, "compress_ratios": [0, 0, 4, 128, 4], "hc_mult": 4, "sliding_window": 8,
         "index_topk": 4}
FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")


def config(sizes: dict, quantized: bool) -> dict:
    c = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
         "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "hidden_act": "silu",
         "max_position_embeddings": 4096, "n_shared_experts": 1, "norm_topk_prob": True,
         "num_key_value_heads": 1, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                          "type": "yarn"},
         "rope_theta": 10000, "compress_rope_theta": 160000, "routed_scaling_factor": 1.5,
         "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc",
         "torch_dtype": "bfloat16", **sizes}
    if quantized:
        c["expert_dtype"] = "fp4"
        c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    return c


def shapes(c: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    H, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    heads, hd, ql = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    og, ol, E, moe = c["o_groups"], c["o_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"]
    ih, ihd, hc_dim = c["index_n_heads"], c["index_head_dim"], 2 * hc + hc * hc
    f32, bf16 = torch.float32, torch.bfloat16
    out = {"embed.weight": ((V, H), bf16), "norm.weight": ((H,), f32), "head.weight": ((V, H), bf16),
           "hc_head_fn": ((hc, hc * H), f32), "hc_head_base": ((hc,), f32), "hc_head_scale": ((1,), f32)}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        out |= {p + "attn_norm.weight": ((H,), f32), p + "ffn_norm.weight": ((H,), f32),
                p + "attn.wq_a.weight": ((ql, H), bf16), p + "attn.q_norm.weight": ((ql,), f32),
                p + "attn.wq_b.weight": ((heads * hd, ql), bf16), p + "attn.wkv.weight": ((hd, H), bf16),
                p + "attn.kv_norm.weight": ((hd,), f32), p + "attn.attn_sink": ((heads,), f32),
                p + "attn.wo_a.weight": ((og * ol, heads * hd // og), bf16), p + "attn.wo_b.weight": ((H, og * ol), bf16),
                p + "ffn.gate.weight": ((E, H), bf16),
                p + "ffn.shared_experts.w1.weight": ((moe, H), bf16), p + "ffn.shared_experts.w3.weight": ((moe, H), bf16),
                p + "ffn.shared_experts.w2.weight": ((H, moe), bf16)}
        for hcn in ("hc_attn", "hc_ffn"):
            out |= {p + f"{hcn}_fn": ((hc_dim, hc * H), f32), p + f"{hcn}_base": ((hc_dim,), f32),
                    p + f"{hcn}_scale": ((3,), f32)}
        if i < c["num_hash_layers"]:
            out[p + "ffn.gate.tid2eid"] = ((V, c["num_experts_per_tok"]), torch.int64)
        else:
            out[p + "ffn.gate.bias"] = ((E,), f32)
        ratio = c["compress_ratios"][i]
        if ratio:
            cd = 2 * hd if ratio == 4 else hd
            out |= {p + "attn.compressor.wgate.weight": ((cd, H), bf16), p + "attn.compressor.wkv.weight": ((cd, H), bf16),
                    p + "attn.compressor.norm.weight": ((hd,), f32), p + "attn.compressor.ape": ((ratio, cd), f32)}
        if ratio == 4:
            q = p + "attn.indexer."
            out |= {q + "compressor.wgate.weight": ((2 * ihd, H), bf16), q + "compressor.wkv.weight": ((2 * ihd, H), bf16),
                    q + "compressor.norm.weight": ((ihd,), f32), q + "compressor.ape": ((ratio, 2 * ihd), f32),
                    q + "weights_proj.weight": ((ih, H), bf16), q + "wq_b.weight": ((ih * ihd, ql), bf16)}
        for e in range(E):
            out |= {p + f"ffn.experts.{e}.w1.weight": ((moe, H), bf16), p + f"ffn.experts.{e}.w3.weight": ((moe, H), bf16),
                    p + f"ffn.experts.{e}.w2.weight": ((H, moe), bf16)}
    return out


def random_tensors(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in shapes(c).items():
        if dtype == torch.int64:
            out[name] = torch.randint(0, c["n_routed_experts"], shape, generator=g, dtype=torch.int64)
        elif name.endswith(("norm.weight", "_scale")):
            out[name] = (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        else:
            out[name] = (0.05 * torch.randn(shape, generator=g)).to(dtype)
    return out


def quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        layerless = module.split(".", 2)[-1] if module.startswith("layers.") else module
        if ".ffn.experts." in name:
            out[name], out[module + ".scale"] = quantize_fp4(t)
        elif name.endswith(".weight") and layerless in FP8_MODULES:
            out[name], out[module + ".scale"] = quantize_fp8(t)
        else:
            out[name] = t
    return out


def write(out: Path, c: dict, tensors: dict[str, torch.Tensor], files: int = 2) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for k in range(files):
        part = {n: tensors[n].contiguous() for n in names[k::files]}
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(c, indent=2))


def check_with_transformers(directory: Path) -> None:
    """transformers' own DeepseekV4ForCausalLM loads the bfloat16 copy with no key missing, unexpected or mismatched."""
    from transformers import DeepseekV4ForCausalLM

    _, info = DeepseekV4ForCausalLM.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"transformers does not load {directory} as DeepSeek-V4: {bad}")
    print(f"transformers loads {directory}: every key matched")


def main() -> None:
    out = Path(sys.argv[1])
    bf16 = "--bf16" in sys.argv
    tensors = random_tensors(config(SIZES, False))
    if bf16:
        write(out, config(SIZES, False), tensors)
        check_with_transformers(out)
    else:
        write(out, config(SIZES, True), quantize(tensors))


if __name__ == "__main__":
    main()
