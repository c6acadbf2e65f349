"""Tiny LoRA adapters made by PEFT itself on a synthetic base, saved as PEFT saves them.

PEFT initialises ``lora_B`` to zeros (an adapter that changes nothing); the helpers give both
matrices random bfloat16-representable values, so a bfloat16 output keeps them exactly and every
projection's contribution is visible in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from ckptconv.commands import synth

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: Path, directory: Path, *, rank: int = 4, alpha: float = 8, targets=ALL, seed: int = 0,
                 std: float = 0.05, **config) -> Path:
    """A PEFT LoRA adapter of the HF model at ``base``, with random A and B, saved (safetensors) at ``directory``."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), **config)
    wrapped = peft.get_peft_model(model, lora)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_" in name:
                values = (rng.standard_normal(tuple(parameter.shape)) * std).astype(ml_dtypes.bfloat16)
                parameter.copy_(torch.from_numpy(values.astype(np.float32)))
    wrapped.save_pretrained(str(directory))
    return directory


def edit_config(directory: Path, **fields) -> None:
    """Change fields of a saved ``adapter_config.json`` (a config PEFT would not write with these weights)."""
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def adapter_tensors(directory: Path) -> dict[str, np.ndarray]:
    """The adapter's tensors by the base weight's name and ``lora_A``/``lora_B``: ``{base_name: (A, B)}``."""
    stored = load_file(str(directory / "adapter_model.safetensors"))
    pairs: dict[str, list] = {}
    for name, value in stored.items():
        stem, which = name.removeprefix("base_model.model.").rsplit(".lora_", 1)
        pairs.setdefault(stem + ".weight", [None, None])["AB".index(which[0])] = value
    return {name: tuple(pair) for name, pair in pairs.items()}


def write_merged_base(base: Path, adapter: Path, directory: Path, scaling: float) -> Path:
    """The base with ``W + scaling * B A`` written out (float32 arithmetic, rounded once to W's dtype): the
    checkpoint a merged conversion must equal once converted plainly."""
    directory.mkdir(parents=True)
    for item in base.iterdir():
        if not item.name.endswith(".safetensors"):
            (directory / item.name).write_bytes(item.read_bytes())
    pairs = adapter_tensors(adapter)
    for file in sorted(base.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name, (a, b) in pairs.items():
            if name in tensors:
                w = tensors[name]
                delta = np.matmul(b.astype(np.float32), a.astype(np.float32)) * np.float32(scaling)
                tensors[name] = (w.astype(np.float32) + delta).astype(w.dtype)
        save_file(tensors, str(directory / file.name), metadata={"format": "pt"})
    return directory


def write_peft_adapter(model: synth.SynthModel, directory: Path, rank: int, alpha: int) -> None:
    """A rank-``rank`` adapter on every projection, in PEFT's file layout (random bf16-exact float32 values)."""
    directory.mkdir(parents=True)
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes = {"self_attn.q_proj": (q, model.hidden_size), "self_attn.k_proj": (kv, model.hidden_size),
              "self_attn.v_proj": (kv, model.hidden_size), "self_attn.o_proj": (model.hidden_size, q),
              "mlp.gate_proj": (model.intermediate_size, model.hidden_size),
              "mlp.up_proj": (model.intermediate_size, model.hidden_size),
              "mlp.down_proj": (model.hidden_size, model.intermediate_size)}
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(model.num_layers):
        for module, (out, into) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            for which, shape in (("lora_A", (rank, into)), ("lora_B", (out, rank))):
                values = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
                tensors[f"{stem}.{which}.weight"] = values.astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": [m.split(".")[1] for m in shapes],
              "bias": "none", "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
              "auto_mapping": {"base_model_class": "Qwen3ForCausalLM"}}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
