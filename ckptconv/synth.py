"""Synthesise a small random HF checkpoint of any supported family (demo, tests, benchmarks).

Tensor names and shapes come from the family's own rules, so a synthetic checkpoint is
exactly what the planner expects. Weights are random but bf16-representable, so a float32
reference forward pass and the bf16 checkpoint agree. Files are written tensor by tensor,
never holding the model, so benchmark-sized checkpoints (16 GB) can be made here too.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ckptconv.families import BY_MODEL_TYPE
from ckptconv.families.base import dimensions
from ckptconv.spec import ConfigReader

_ST_DTYPE = {"bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16)), "float32": ("F32", np.dtype(np.float32))}


@dataclass(frozen=True)
class SynthModel:
    """Sizes of a synthetic model; defaults give a tiny Qwen3 that converts in seconds."""

    model_type: str = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    dtype: str = "bfloat16"
    seed: int = 0
    config_overrides: dict = field(default_factory=dict)

    def config(self) -> dict:
        config = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "torch_dtype": self.dtype,
        }
        config.update(self.config_overrides)
        return {k: v for k, v in config.items() if v is not None}


QWEN3_0_6B = SynthModel(
    vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
)
LLAMA3_8B = SynthModel(
    model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
    config_overrides={"rope_theta": 500000.0},
)

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def tensor_shapes(model: SynthModel) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes for ``model``, derived from its family's rules."""
    family = BY_MODEL_TYPE[model.model_type]
    spec = family.read_spec(ConfigReader(model.config(), "<synthetic config>", family.extra_config_fields))
    dims = dimensions(spec)
    shapes = {}
    for rule in family.active_rules(spec):
        names = [rule.hf.format(layer=i) for i in range(spec.num_layers)] if rule.per_layer else [rule.hf]
        for name in names:
            shapes[name] = tuple(dims[d] for d in rule.hf_shape)
    return shapes


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Random weights rounded to bf16 values; norms near 1 like trained models."""
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02 if len(shape) > 1 else 0.1)
    if len(shape) == 1 and name.endswith("norm.weight"):
        values += np.float32(1.0)
    return values.astype(ml_dtypes.bfloat16).astype(dtype)


def write_checkpoint(model: SynthModel, directory: str, max_shard_bytes: int | None = None) -> dict[str, tuple]:
    """Write ``config.json`` and safetensors (sharded with an index if over ``max_shard_bytes``)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.config(), f, indent=2)
    st_name, dtype = _ST_DTYPE[model.dtype]
    shapes = tensor_shapes(model)
    groups = _group(shapes, dtype.itemsize, max_shard_bytes)
    rng = np.random.default_rng(model.seed)
    if len(groups) == 1:
        _write_file(os.path.join(directory, "model.safetensors"), groups[0], shapes, st_name, dtype, rng)
    else:
        weight_map = {}
        for index, names in enumerate(groups):
            file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            _write_file(os.path.join(directory, file), names, shapes, st_name, dtype, rng)
            weight_map.update({name: file for name in names})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    return shapes


def _group(shapes: dict, itemsize: int, max_bytes: int | None) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if max_bytes and groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _write_file(path: str, names: list[str], shapes: dict, st_name: str, dtype: np.dtype, rng) -> None:
    header, offset = {}, 0
    for name in names:
        nbytes = math.prod(shapes[name]) * dtype.itemsize
        header[name] = {"dtype": st_name, "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for name in names:
            f.write(random_tensor(rng, name, shapes[name], dtype).tobytes())
