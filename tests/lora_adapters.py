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
