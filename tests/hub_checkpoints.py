"""Tiny random Qwen3-Next and Qwen3.5-MoE checkpoints made with transformers' own classes, stored as the hub ships them.

transformers 5 keeps the routed experts of a layer fused in memory (``experts.gate_up_proj`` (E, 2I, H),
``experts.down_proj`` (E, H, I)) and its ``save_pretrained`` writes them one by one. The hub's files differ
by family (/work/shared/HUB-FORMATS.md): Qwen3-Next ships the experts one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``), Qwen3.5 ships them fused, as transformers holds them,
beside its vision tower (``model.visual.*``) and both ship a multi-token-prediction layer (``mtp.*``) that
transformers never builds. So the weights are taken from the model's own state dict, renamed to the
hub's layout, and written as the hub names its files (``model-0000N-of-0000M.safetensors`` with
``model.safetensors.index.json``), with ``config.json`` in the published spelling (Qwen3-Next's in
transformers 4's: ``rope_theta``, ``partial_rotary_factor``, ``full_attention_interval``).

Every weight is rounded to bfloat16 and the norms, gates and decay parameters are perturbed from
transformers' initial constants, so a misplaced norm or a swapped ``A_log`` changes the logits.
Runs in any venv with torch, transformers (>= 5.2) and safetensors (the project's, or MaxText's for the bench).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

QWEN3_NEXT_SIZES = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                    "intermediate_size": 96, "num_hidden_layers": 8, "full_attention_interval": 4}
MTP_TENSORS = {"mtp.fc.weight": ("emb", "2emb"), "mtp.norm.weight": ("emb",),
               "mtp.pre_fc_norm_embedding.weight": ("emb",), "mtp.layers.0.input_layernorm.weight": ("emb",)}


def qwen3_next_config(**sizes: Any) -> dict:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (as MaxText 0.2.5 copies it) with tiny sizes (and
    token ids inside the tiny vocabulary)."""
    s = {**QWEN3_NEXT_SIZES, **sizes}
    return {"architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
            "decoder_sparse_step": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.05,
            "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
            "norm_topk_prob": True,
            "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, **s}


def qwen3_5_moe_config(**sizes: Any) -> dict:
    """Qwen/Qwen3.5-35B-A3B's config.json (as MaxText 0.2.5 copies it) with tiny sizes: the text decoder
    in ``text_config``, a one-block vision tower, mRoPE sections."""
    s = {**QWEN3_NEXT_SIZES, **sizes}
    for dense in ("intermediate_size",):
        s.pop(dense)
    period, layers = s.pop("full_attention_interval"), s["num_hidden_layers"]
    text = {"attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
            "eos_token_id": 2, "full_attention_interval": period, "hidden_act": "silu", "initializer_range": 0.05,
            "layer_types": ["full_attention" if (i + 1) % period == 0 else "linear_attention" for i in range(layers)],
            "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_moe_text",
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "rms_norm_eps": 1e-06,
            "router_aux_loss_coef": 0.001, "use_cache": True, "mamba_ssm_dtype": "float32",
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [1, 1, 0], "rope_type": "default",
                                "rope_theta": 10000000, "partial_rotary_factor": 0.25}, **s}
    vision = {"deepstack_visual_indexes": [], "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32,
              "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 64, "model_type": "qwen3_5_moe",
              "num_heads": 2, "num_position_embeddings": 64, "out_hidden_size": s["hidden_size"], "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056,
            "model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False,
            "transformers_version": "4.57.0.dev0", "video_token_id": 248057, "vision_config": vision,
            "vision_end_token_id": 248054, "vision_start_token_id": 248053}


def build(config: dict, seed: int = 0):
    """The transformers model of ``config`` (float32, eval), its weights bf16-exact and perturbed."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if config["model_type"] == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config))
    else:
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**config))
    model = model.to(torch.float32)  # text_config's "dtype": "bfloat16" builds the decoder in bfloat16
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.empty_like(param).uniform_(1.0, 16.0)))
            elif param.ndim == 1:  # norms (zero-centred or not), dt_bias: away from their constant starts
                param.add_(torch.randn_like(param) * 0.2)
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model.eval()


def hub_tensors(model, config: dict) -> dict[str, np.ndarray]:
    """The model's weights under the hub's names and layouts (bf16 values as float32 arrays), plus
    ``mtp.*`` tensors the hub ships beside them."""
    import torch

    tensors: dict[str, np.ndarray] = {}
    per_expert = config["model_type"] == "qwen3_next"
    for name, value in model.state_dict().items():
        array = value.detach().to(torch.float32).numpy()
        if per_expert and name.endswith("mlp.experts.gate_up_proj"):
            half = array.shape[1] // 2
            base = name.removesuffix("gate_up_proj")
            for e in range(array.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = array[e, :half]
                tensors[f"{base}{e}.up_proj.weight"] = array[e, half:]
        elif per_expert and name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(array.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = array[e]
        else:
            tensors[name] = array
    emb = config.get("text_config", config)["hidden_size"]
    rng = np.random.default_rng(7)
    for name, dims in MTP_TENSORS.items():
        shape = tuple({"emb": emb, "2emb": 2 * emb}[d] for d in dims)
        tensors[name] = rng.standard_normal(shape).astype(np.float32) * np.float32(0.02)
    return tensors


def write_hub(directory: str, tensors: dict[str, np.ndarray], config: dict, files: int = 3) -> None:
    """``config.json`` and the tensors in bfloat16, as ``files`` shards with the hub's index."""
    import ml_dtypes
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = sorted(tensors)
    per_file = math.ceil(len(names) / files)
    weight_map = {}
    for index in range(files):
        file = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        part = names[index * per_file:(index + 1) * per_file]
        save_file({n: np.ascontiguousarray(tensors[n].astype(ml_dtypes.bfloat16)) for n in part},
                  os.path.join(directory, file), metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    total = sum(t.size * 2 for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def logits(model, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 logits for one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens[None])).logits[0].numpy()


def make(directory: str, config: dict, tokens: np.ndarray | None = None, seed: int = 0) -> np.ndarray | None:
    """Write the hub-format checkpoint of ``config``; return transformers' logits on ``tokens``."""
    model = build(config, seed)
    write_hub(directory, hub_tensors(model, config), config)
    return None if tokens is None else logits(model, tokens)


# --- FP8 releases (Qwen/Qwen3.5-35B-A3B-FP8, -397B-A17B-FP8) ---------------------------------------

FP8_BLOCK = 128
# sizes whose kernels span whole 128-blocks (the FP8 release's grid), still tiny
QWEN3_5_FP8_SIZES = {"vocab_size": 128, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 128, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                     "linear_key_head_dim": 128, "linear_value_head_dim": 128, "moe_intermediate_size": 128,
                     "shared_expert_intermediate_size": 128, "num_hidden_layers": 4}
FP8_QUANTIZED = ("proj.weight", "in_proj_qkv.weight", "in_proj_z.weight")  # the decoder's linear layers
# modules the release keeps in bfloat16 (its quantization_config.modules_to_not_convert, by name ending)
FP8_NOT_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                     "conv1d.weight", "in_proj_a.weight", "in_proj_b.weight", "norm.weight", "layernorm.weight",
                     "A_log", "dt_bias")


def qwen3_5_moe_fp8_config(**sizes: Any) -> dict:
    """Qwen/Qwen3.5-35B-A3B-FP8's config.json with tiny sizes: the bf16 release's plus its quantization_config."""
    config = qwen3_5_moe_config(**{**QWEN3_5_FP8_SIZES, **sizes})
    config["text_config"]["rope_parameters"]["mrope_section"] = [8, 8, 0]  # rotary dim 32: 16 frequencies
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens", "model.visual",
                                   "mlp.gate", "shared_expert_gate", "linear_attn.conv1d", "linear_attn.in_proj_a",
                                   "linear_attn.in_proj_b", "norm", "A_log", "dt_bias"]}
    return config


def quantize_fp8_bf16_scales(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes, bfloat16 block scales) as the FP8 releases store a (rows, cols) weight: each 128x128
    block divided by its (bfloat16) scale, amax / 448."""
    import ml_dtypes

    rows, cols = values.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    padded = np.zeros((grid[0] * FP8_BLOCK, grid[1] * FP8_BLOCK), np.float32)
    padded[:rows, :cols] = np.abs(values)
    amax = padded.reshape(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(ml_dtypes.bfloat16)
    expanded = np.repeat(np.repeat(scale.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return (values / expanded).astype(ml_dtypes.float8_e4m3fn), scale


def fp8_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A bf16 release's tensors as its FP8 release stores them: experts one by one, the linear layers as
    e4m3 with a bfloat16 ``weight_scale_inv`` per 128x128 block (values in their storage dtypes)."""
    import ml_dtypes

    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = array.shape[1] // 2
            base = name.removesuffix("gate_up_proj")
            out |= {f"{base}{e}.{p}_proj.weight": part for e in range(array.shape[0])
                    for p, part in (("gate", array[e, :half]), ("up", array[e, half:]))}
        elif name.endswith("mlp.experts.down_proj"):
            out |= {f"{name.removesuffix('down_proj')}{e}.down_proj.weight": array[e] for e in range(array.shape[0])}
        else:
            out[name] = array
    stored = {}
    for name, array in out.items():
        if (name.startswith("model.language_model.layers.") and name.endswith(FP8_QUANTIZED)
                and not name.endswith(FP8_NOT_QUANTIZED)):
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_bf16_scales(array)
        else:
            stored[name] = array.astype(ml_dtypes.bfloat16)
    return stored


def write_stored(directory: str, tensors: dict[str, np.ndarray], config: dict, files: int = 3) -> None:
    """Like :func:`write_hub`, each tensor in its own dtype (FP8 releases: e4m3, bfloat16)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = sorted(tensors)
    per_file = math.ceil(len(names) / files)
    weight_map = {}
    for index in range(files):
        file = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        part = names[index * per_file:(index + 1) * per_file]
        save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, os.path.join(directory, file),
                  metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def make_fp8(directory: str, config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the FP8 release of ``config`` (made from transformers' model, as :func:`make`); returns its tensors."""
    bf16_config = {k: v for k, v in config.items() if k != "quantization_config"}
    stored = fp8_tensors(hub_tensors(build(bf16_config, seed), bf16_config))
    write_stored(directory, stored, config)
    return stored


def dequantized(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The FP8 release's values (e4m3 x its block's scale, exact in float32), its experts fused again as
    transformers holds them; the scales themselves dropped."""
    values: dict[str, np.ndarray] = {}
    for name, array in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        array = array.astype(np.float32)
        if scale is not None:
            expanded = np.repeat(np.repeat(scale.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)
            array = array * expanded[:array.shape[0], :array.shape[1]]
        values[name] = array
    fused: dict[str, np.ndarray] = {}
    for name in [n for n in values if ".mlp.experts.0." in n]:
        base, projection = name.split(".mlp.experts.0.")
        count = sum(1 for n in values if n.startswith(base + ".mlp.experts.") and n.endswith(projection))
        fused.setdefault(base, {})[projection] = np.stack(
            [values.pop(f"{base}.mlp.experts.{e}.{projection}") for e in range(count)])
    for base, parts in fused.items():
        values[f"{base}.mlp.experts.gate_up_proj"] = np.concatenate(
            [parts["gate_proj.weight"], parts["up_proj.weight"]], axis=1)
        values[f"{base}.mlp.experts.down_proj"] = parts["down_proj.weight"]
    return values


def fp8_logits(config: dict, stored: dict[str, np.ndarray], tokens: np.ndarray, seed: int = 0) -> np.ndarray:
    """transformers' float32 logits of the FP8 release's values (what MaxText's runtime dequantises to)."""
    import torch

    bf16_config = {k: v for k, v in config.items() if k != "quantization_config"}
    model = build(bf16_config, seed)
    state = model.state_dict()
    with torch.no_grad():
        for name, array in dequantized(stored).items():
            if name in state:
                state[name].copy_(torch.from_numpy(array))
    return logits(model, tokens)


def dequantised_release(src, dst) -> None:
    """A DeepSeek-V3 / Kimi-K2 FP8 release (directory ``src``) as float32 safetensors transformers loads at ``dst``:
    every FP8 weight times its block's scale in float32 (as MaxText's loader dequantises it), config.json without
    quantization_config (Kimi-K2 as DeepSeek-V3's class, which it is)."""
    import torch
    from safetensors.torch import load_file, save_file

    stored = {n: t for path in sorted(src.glob("*.safetensors")) for n, t in load_file(str(path)).items()}
    values = {}
    for name, tensor in stored.items():
        if name.endswith("_scale_inv"):
            continue
        value = tensor.to(torch.float32)
        scale = stored.get(name + "_scale_inv")
        if scale is not None:
            value = value * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:value.shape[0], :value.shape[1]]
        values[name] = value.contiguous()
    dst.mkdir()
    save_file(values, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3", "torch_dtype": "float32"}))
