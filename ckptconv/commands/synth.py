"""Synthesise a small random HF checkpoint of any supported family (demo, tests, benchmarks).

The ``config.json`` looks like the hub's for that family (each family writes its own:
``Family.synthetic.config``; Gemma 3 nests its decoder in ``text_config`` and names tensors
``language_model.model.*``, as ``Gemma3ForConditionalGeneration`` checkpoints ship). Tensor
names and shapes come from the family's own rules through the planner, so a synthetic
checkpoint is exactly what the planner expects. Weights are random but
bf16-representable, so a float32 reference forward pass and the bf16 checkpoint agree. Files
are written tensor by tensor, never holding the model, so benchmark-sized checkpoints (16 GB)
can be made here too. ``header_only`` writes headers with sparse (unallocated) data, for
planning the real giants' shapes without their bytes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from ckptconv import dtypes
from ckptconv.families import BY_MODEL_TYPE
from ckptconv.families.base import JSON_NULL, MULTIMODAL, Example, Family, LayoutError, multimodal
from ckptconv.families.inputs import FP8_CHANNEL, FP8_KEPT


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
    num_experts: int = 0  # MoE families: experts per layer
    moe_intermediate_size: int = 0  # MoE families: each expert's MLP width
    # "fp8" (DeepSeek-V3, Kimi-K2 releases), "mxfp4" (gpt-oss releases), "int4" (Kimi-K2-Thinking's experts)
    quantization: str | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    config_overrides: dict = field(default_factory=dict)
    extra_tensors: dict = field(default_factory=dict)  # name -> shape, e.g. a vision tower to be reported
    encoders: bool = False  # also the encoders the config describes (the rules' names, as --multimodal reads them)

    def config(self) -> dict:
        """The ``config.json`` the family writes for these sizes (its ``synthetic.config``), plus the overrides."""
        config = _drop_none(BY_MODEL_TYPE[self.model_type].synthetic.config(self))
        # after the template's unset fields are dropped: an override of None is written as null,
        # as real configs hold them (DeepSeek-V2-Lite's "q_lora_rank": null)
        (config["text_config"] if "text_config" in config else config).update(self.config_overrides)
        return config


def for_family(family: Family, fields: Mapping[str, Any]) -> SynthModel:
    """The synthetic model an :class:`~ckptconv.families.base.Example` of ``family`` describes
    (``model_type`` defaults to the family's first)."""
    return SynthModel(**{"model_type": family.model_types[0], **fields})


def for_example(family: Family, example: Example) -> SynthModel:
    """The synthetic model a test derived from ``example`` converts: with its encoders where the example
    converts them (``Example.multimodal``)."""
    return for_family(family, {**example.model, **({"encoders": True} if example.multimodal else {})})


QWEN3_0_6B = SynthModel(
    vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, intermediate_size=3072, tie_word_embeddings=True,
)
LLAMA3_8B = SynthModel(
    model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
    config_overrides={"rope_theta": 500000.0},
)


def _drop_none(config: dict) -> dict:
    """Unset fields (None) left out; ``JSON_NULL`` written as null."""
    return {k: (_drop_none(v) if isinstance(v, dict) else None if v is JSON_NULL else v)
            for k, v in config.items() if v is not None}


def tensor_shapes(model: SynthModel) -> dict[str, tuple[int, ...]]:
    """HF tensor names (as the hub stores them) and shapes for ``model``, from its family's rules."""
    from ckptconv.plan.conversion import expected_tensors, read_spec

    family = BY_MODEL_TYPE[model.model_type]
    spec = read_spec(family, model.config(), "<synthetic config>")
    stacks = None
    if model.encoders and family.encoders:  # as the hub ships them, whether or not a conversion asks for them
        with_encoders = replace(spec, values={**spec.values, MULTIMODAL: True})
        stacks = _layout(family, with_encoders)
        spec = spec if stacks is None else with_encoders  # None: this config has none (gemma3_text)
    stacks = stacks or _layout(family, spec)
    expected = expected_tensors(family.active_rules(spec), stacks, spec)
    stored, hub = family.synthetic.hub_prefixes.get(model.model_type, ("", ""))
    shapes = {}
    for name, (rule, shape) in expected.items():
        join = family.join_for(name)
        if join is not None and join.in_parts(spec):  # stored in parts (Qwen3.5's in_proj_qkv, in_proj_z...)
            shapes.update(join.part_shapes(name, spec, shape))
            continue
        # the hub nests the decoder, not the encoders (Qwen3-VL: model.language_model.* beside model.visual.*)
        nested = hub and name.startswith(stored) and rule.when is not multimodal
        shapes[hub + name[len(stored):] if nested else name] = shape
    shapes.update({name: tuple(shape) for name, shape in model.extra_tensors.items()})
    return shapes


# 1-D scales that multiply (norms; Gemma 4's layer_scalar and router scales), near 1 like trained models
NEAR_ONE = ("norm.weight", "layer_scalar", "router.scale", "router.per_expert_scale")


def _layout(family: Family, spec) -> tuple | None:
    """The layer stacks the spec's tensors are named by: scanned, or unscanned for a model MaxText cannot scan
    (the same tensors); None where neither exists (``--multimodal`` for a config without encoders)."""
    for scan in (True, False):
        try:
            return family.layout(spec, scan)
        except LayoutError:
            continue
    return None


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Random weights rounded to bf16 values; norms near 1 like trained models."""
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02 if len(shape) > 1 else 0.1)
    if len(shape) == 1 and name.endswith(NEAR_ONE):
        values += np.float32(1.0)
    return values.astype(ml_dtypes.bfloat16).astype(dtype)


POOL_ELEMENTS = 24 * 1024 * 1024 + 7  # ~48 MiB of bf16: larger than zstd's window, so data stays incompressible
FP8_POOL_COLUMNS = 4096  # the fast FP8 pool is the bf16 pool quantised as a (rows, 4096) weight: 24 MiB of codes


@dataclass(frozen=True)
class _Stored:
    """One stored tensor of the file: name, safetensors dtype, shape, and the logical tensor it belongs to."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    logical: str
    itemsize: int


@dataclass(frozen=True)
class _Release:
    """What decides which tensors a release stores quantised, read from the model's config once (not once per
    tensor: a giant release has 200 000)."""

    quantization: str | None
    model_type: str
    keeps_scales: bool
    scheme: str | None
    ignore: tuple[str, ...]

    @classmethod
    def of(cls, model: SynthModel) -> _Release:
        from ckptconv.plan.conversion import read_spec

        spec = read_spec(BY_MODEL_TYPE[model.model_type], model.config(), "<synthetic config>")
        scheme = spec.values.get("quantization")
        return cls(model.quantization, model.model_type, scheme == FP8_KEPT, scheme,
                   tuple(_quantization_config(model).get("ignore", ())))


def _stored_entries(release: _Release, name: str, shape: tuple[int, ...], st_name: str,
                    itemsize: int) -> list[_Stored]:
    """The stored tensors of one logical tensor: itself, or its quantised parts as the hub ships them."""
    kind = _quantized(release, name, shape)
    if kind == "fp8-v4":  # e4m3 weight + one ue8m0 scale per 128x128 block named <module>.scale (DeepSeek-V4)
        scale = tuple(-(-d // 128) for d in shape)
        return [_Stored(name, "F8_E4M3", shape, name, 1),
                _Stored(name.removesuffix(".weight") + ".scale", "F8_E8M0", scale, name, 1)]
    if kind == "fp4":  # two E2M1 codes per int8 + one ue8m0 scale per 32 values of a row (DeepSeek-V4's experts)
        rows, cols = shape
        return [_Stored(name, "I8", (rows, cols // 2), name, 1),
                _Stored(name.removesuffix(".weight") + ".scale", "F8_E8M0", (rows, cols // 32), name, 1)]
    if kind == "fp8":  # e4m3 weight + one float32 scale per 128x128 block (DeepSeek-V3, Kimi-K2)
        scale = tuple(-(-d // 128) for d in shape)
        return [_Stored(name, "F8_E4M3", shape, name, 1), _Stored(name + "_scale_inv", "F32", scale, name, 4)]
    if kind == "fp8-channel":  # e4m3 weight + one bfloat16 scale per row (compressed-tensors: Llama 4 Maverick FP8)
        return [_Stored(name, "F8_E4M3", shape, name, 1), _Stored(name + "_scale", "BF16", (shape[0], 1), name, 2)]
    if kind == "mxfp4":  # logical (experts, cols, rows) -> blocks (experts, rows, cols/32, 16) + scales (gpt-oss)
        experts, cols, rows = shape
        return [_Stored(name + "_blocks", "U8", (experts, rows, cols // 32, 16), name, 1),
                _Stored(name + "_scales", "U8", (experts, rows, cols // 32), name, 1)]
    if kind == "int4":  # compressed-tensors pack-quantized: 8 values per int32, a bf16 scale per 32, the shape
        rows, cols = shape
        return [_Stored(name + "_packed", "I32", (rows, cols // 8), name, 4),
                _Stored(name + "_scale", "BF16", (rows, cols // 32), name, 2),
                _Stored(name + "_shape", "I32", (2,), name, 4)]
    return [_Stored(name, st_name, shape, name, itemsize)]


def _quantized(release: _Release, name: str, shape: tuple[int, ...]) -> str | None:
    """Which tensors the hub quantises: DeepSeek's linear layers (not the router); gpt-oss's experts.
    Qwen3.5's FP8 releases are kept quantised (``keeps_scales``: their rules read the block scales themselves
    whatever --dtype; DeepSeek's read them so only under --dtype float8_e4m3fn, else decode them)."""
    quantization = release.quantization
    if quantization == "fp8" and release.model_type == "deepseek_v4":  # FP8 linear layers, FP4 routed experts
        if ".ffn.experts." in name:
            return "fp4"
        return "fp8-v4" if name.endswith(_FP8_V4) else None
    if quantization == "fp8" and release.keeps_scales:
        return None
    if quantization == "fp8" and release.scheme == FP8_CHANNEL:  # the linears compressed-tensors quantised
        quantised = (".layers." in name and name.endswith(".weight") and len(shape) == 2
                     and not _ignored(name.removesuffix(".weight"), release.ignore))
        return "fp8-channel" if quantised else None
    if (quantization == "fp8" and ".layers." in name and name.endswith(_FP8_LINEAR)
            and not name.endswith(_FP8_KEPT)):
        return "fp8"
    if quantization == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return "mxfp4"
    if (quantization == "int4" and name.endswith(_LINEAR)
            and not _ignored(name.removesuffix(".weight"), release.ignore)):
        return "int4"
    return None


def _quantization_config(model: SynthModel) -> dict:
    """The release's quantization_config: at the top of config.json, or in its text_config (Kimi-K2.5's)."""
    config = model.config()
    return config.get("quantization_config") or config.get("text_config", {}).get("quantization_config") or {}


# DeepSeek's FP8 releases: the linear layers of every layer, the indexer's two (V3.2); its weights_proj stays bf16
_FP8_LINEAR = ("proj.weight", "proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight")
_FP8_KEPT = ("indexer.weights_proj.weight",)
# DeepSeek-V4's (as far as MaxText's deepseek4 config and transformers' quantizer tell: bench/hf_tiny_v4.py)
_FP8_V4 = tuple(f"{m}.weight" for m in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b",
                                        "attn.indexer.wq_b", "shared_experts.w1", "shared_experts.w2",
                                        "shared_experts.w3"))
_LINEAR = ("proj.weight", "proj_with_mqa.weight", "lm_head.weight")  # DeepSeek's nn.Linear modules (the router is not)


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' ``ignore``: a name, or ``re:`` and a pattern matched at the name's start."""
    return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module for entry in ignore)


def quantize_fp8_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weight, bfloat16 (rows, 1) scales) for ``values``: each row scaled to use e4m3's range."""
    amax = np.abs(values).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(ml_dtypes.bfloat16)
    codes = np.clip(values / scale.astype(np.float32), -448.0, 448.0)
    return codes.astype(ml_dtypes.float8_e4m3fn), scale


def quantize_fp8(values: np.ndarray, ue8m0: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weight, float32 block scales) for ``values``: each 128x128 block scaled to use e4m3's range;
    ``ue8m0`` (``scale_fmt`` of DeepSeek-V3.1 / V3.2): each scale rounded up to a power of two."""
    rows, cols = values.shape
    blocks = np.zeros((-(-rows // 128) * 128, -(-cols // 128) * 128), np.float32)
    blocks[:rows, :cols] = np.abs(values)
    amax = blocks.reshape(blocks.shape[0] // 128, 128, blocks.shape[1] // 128, 128).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    if ue8m0:
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:rows, :cols]
    return (values / expanded).astype(ml_dtypes.float8_e4m3fn), scale


def write_checkpoint(model: SynthModel, directory: str, max_shard_bytes: int | None = None,
                     header_only: bool = False, fast: bool = False) -> dict[str, tuple]:
    """Write ``config.json`` and safetensors (sharded with an index if over ``max_shard_bytes``).

    ``fast``: big plain tensors are cut from one pool of random values at a different offset
    each (the same statistics and compressibility, ~10x faster to make), FP8 weights and their
    block scales from that pool quantised once, other e4m3 codes from a pool of random ones
    (DeepSeek-V3.2's memory example: 51 s of CPU to make without those pools, 4 with them), for
    memory and speed benchmarks of very wide models; ``header_only``: no data at all (sparse
    files). Quantised tensors (``SynthModel.quantization``) are stored in the hub's formats.
    Returns the logical tensors' shapes.
    """
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.config(), f, indent=2, allow_nan=False)
    dtype = dtypes.OUTPUT[model.dtype]
    st_name = dtypes.NAMES[dtype]
    shapes = tensor_shapes(model)
    release = _Release.of(model)
    entries = [entry for name, shape in shapes.items()
               for entry in _stored_entries(release, name, shape, st_name, dtype.itemsize)]
    # a kept-FP8 release (Qwen3.5's): every weight with a block scale of its own is stored e4m3
    entries = [_Stored(e.name, "F8_E4M3", e.shape, e.logical, 1) if e.name + "_scale_inv" in shapes else e
               for e in entries]
    groups = _group(entries, max_shard_bytes)
    names = {e.name for e in entries}
    rng = np.random.default_rng(model.seed)
    pool = random_tensor(rng, "pool", (POOL_ELEMENTS, 1), dtype).reshape(-1) if fast else None
    quantization = _quantization_config(model)
    make = _Maker(rng, dtype, pool, frozenset(n for n in shapes if n.endswith("_scale_inv")),
                  quantization.get("scale_fmt") == "ue8m0",
                  frozenset(e.name for e in entries if e.st_dtype == "F8_E4M3" and e.name + "_scale" in names))
    make.v4_scales = frozenset(e.name for e in entries if e.st_dtype == "F8_E8M0")
    if len(groups) == 1:
        _write_file(os.path.join(directory, "model.safetensors"), groups[0], make, header_only)
    else:
        weight_map = {}
        for index, group in enumerate(groups):
            file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            _write_file(os.path.join(directory, file), group, make, header_only)
            weight_map.update({entry.name: file for entry in group})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2, allow_nan=False)
    return shapes


def _group(entries: list[_Stored], max_bytes: int | None) -> list[list[_Stored]]:
    """Files of at most ``max_bytes``; the parts of one quantised tensor stay in one file."""
    groups: list[list[_Stored]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry.shape) * entry.itemsize
        starts_tensor = not groups[-1] or groups[-1][-1].logical != entry.logical
        if max_bytes and groups[-1] and starts_tensor and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    return groups


class _Maker:
    """Bytes of each stored tensor: random bf16-exact values, or their quantised parts."""

    def __init__(self, rng: np.random.Generator, dtype: np.dtype, pool: np.ndarray | None,
                 kept_scales: frozenset[str] = frozenset(), ue8m0: bool = False,
                 row_scaled: frozenset[str] = frozenset()) -> None:
        self.rng, self.dtype, self.pool, self.ue8m0 = rng, dtype, pool, ue8m0
        self.row_scaled = row_scaled  # FP8 weights with one scale per row (compressed-tensors float-quantized)
        self.kept_scales = kept_scales  # block scales of a kept-FP8 release: their weights are bare e4m3
        self.v4_scales: frozenset[str] = frozenset()  # DeepSeek-V4's <module>.scale block scales (ue8m0)
        self.pending: dict[str, np.ndarray] = {}  # second part of a quantised tensor, written next
        self.fp8_pools: dict[bool, tuple[np.ndarray, np.ndarray]] = {}  # fast: by ue8m0 (see _fp8_pool)
        self.any_e4m3: np.ndarray | None = None  # fast: uniformly random e4m3 codes (see _any_e4m3)

    def chunks(self, entry: _Stored):
        if entry.name in self.pending:
            yield self.pending.pop(entry.name).tobytes()
        elif entry.st_dtype == "F8_E4M3" and entry.name + "_scale_inv" in self.kept_scales:
            yield from self._any_e4m3(entry.shape)
        elif entry.st_dtype == "F8_E4M3" and entry.name in self.row_scaled and self.pool is not None:
            scale = np.abs(self.rng.standard_normal((entry.shape[0], 1), dtype=np.float32)) * np.float32(1e-4)
            self.pending[entry.name + "_scale"] = (scale + np.float32(1e-5)).astype(ml_dtypes.bfloat16)
            yield from self._any_e4m3(entry.shape)  # fast: finite e4m3 codes, random
        elif entry.st_dtype == "F8_E4M3" and entry.name in self.row_scaled:
            weight, scale = quantize_fp8_rows(random_tensor(self.rng, entry.name, entry.shape, np.dtype(np.float32)))
            self.pending[entry.name + "_scale"] = scale
            yield weight.tobytes()
        elif entry.st_dtype == "F8_E4M3" and entry.name.removesuffix(".weight") + ".scale" in self.v4_scales:
            if self.pool is not None:
                scale = self._fp8_scales(entry.shape, True)
                yield from self._fp8_codes(entry.shape, True)
            else:
                weight, scale = quantize_fp8(random_tensor(self.rng, entry.name, entry.shape, np.dtype(np.float32)),
                                             True)
                yield weight.tobytes()
            self.pending[entry.name.removesuffix(".weight") + ".scale"] = scale.astype(ml_dtypes.float8_e8m0fnu)
        elif entry.st_dtype == "F8_E4M3" and self.pool is not None:  # fast: block-quantised codes, cut from a pool
            self.pending[entry.name + "_scale_inv"] = self._fp8_scales(entry.shape, self.ue8m0)
            yield from self._fp8_codes(entry.shape, self.ue8m0)
        elif entry.st_dtype == "F8_E4M3":
            weight, scale = quantize_fp8(random_tensor(self.rng, entry.name, entry.shape, np.dtype(np.float32)),
                                         self.ue8m0)
            self.pending[entry.name + "_scale_inv"] = scale
            yield weight.tobytes()
        elif entry.st_dtype == "I8":  # FP4 codes: any byte is two valid codes
            self.pending[entry.name.removesuffix(".weight") + ".scale"] = self.rng.integers(
                118, 124, (entry.shape[0], entry.shape[1] // 16), dtype=np.uint8)  # ue8m0 2^-9 .. 2^-4
            yield self.rng.integers(0, 256, entry.shape, dtype=np.uint8).tobytes()
        elif entry.name.endswith("_packed"):
            rows, words = entry.shape
            base = entry.name.removesuffix("_packed")
            scale = np.abs(self.rng.standard_normal((rows, words // 4), dtype=np.float32)) * np.float32(0.004)
            self.pending[base + "_scale"] = (scale + np.float32(1e-4)).astype(ml_dtypes.bfloat16)
            self.pending[base + "_shape"] = np.array([rows, words * 8], np.int32)
            yield self.rng.integers(0, 2**32, entry.shape, dtype=np.uint32).view(np.int32).tobytes()
        elif entry.name.endswith("_blocks"):
            blocks = self.rng.integers(0, 256, entry.shape, dtype=np.uint8)
            self.pending[entry.name.removesuffix("_blocks") + "_scales"] = self.rng.integers(
                118, 124, entry.shape[:3], dtype=np.uint8)  # 2^-9 .. 2^-4: weights of trained sizes
            yield blocks.tobytes()
        elif self.pool is None or len(entry.shape) < 2:
            yield random_tensor(self.rng, entry.name, entry.shape, self.dtype).tobytes()
        else:
            yield from self._cut(self.pool, math.prod(entry.shape))

    def _cut(self, pool: np.ndarray, count: int):
        """``count`` elements of ``pool`` from a random offset, wrapping around: no tensor-sized buffer, and no
        copy (the file is written from the pool's own memory)."""
        start = int(self.rng.integers(0, pool.size))
        while count:
            take = min(count, pool.size - start)
            yield pool[start:start + take]
            count -= take
            start = 0

    def _any_e4m3(self, shape: tuple[int, ...]):
        """Finite e4m3 codes of either sign, uniformly random (0x7F is NaN); ``fast``: cut from a pool of them."""
        if self.pool is None:
            yield _random_e4m3(self.rng, shape).tobytes()
            return
        if self.any_e4m3 is None:
            self.any_e4m3 = _random_e4m3(self.rng, POOL_ELEMENTS)
        yield from self._cut(self.any_e4m3, math.prod(shape))

    def _fp8_pool(self, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
        """(e4m3 codes, their float32 block scales) of the bf16 pool quantised as :func:`quantize_fp8` quantises a
        weight, made once: a fast tensor's codes and scales are cut from them, so they have the statistics (and
        the incompressibility) of a quantised weight without quantising gigabytes."""
        if ue8m0 not in self.fp8_pools:
            usable = self.pool.size // (128 * FP8_POOL_COLUMNS) * 128 * FP8_POOL_COLUMNS
            codes, scales = quantize_fp8(self.pool[:usable].astype(np.float32).reshape(-1, FP8_POOL_COLUMNS), ue8m0)
            # one code fewer than whole blocks: a tensor larger than the pool does not repeat in step with its rows
            self.fp8_pools[ue8m0] = codes.reshape(-1)[:-1], scales.reshape(-1)
        return self.fp8_pools[ue8m0]

    def _fp8_codes(self, shape: tuple[int, ...], ue8m0: bool):
        return self._cut(self._fp8_pool(ue8m0)[0], math.prod(shape))

    def _fp8_scales(self, shape: tuple[int, ...], ue8m0: bool) -> np.ndarray:
        """Block scales for a ``shape`` weight (one per 128x128 block), cut from the pool's own."""
        grid = tuple(-(-d // 128) for d in shape)
        return np.concatenate(list(self._cut(self._fp8_pool(ue8m0)[1], math.prod(grid)))).reshape(grid)


def _random_e4m3(rng: np.random.Generator, shape) -> np.ndarray:
    codes = rng.integers(0, 0x7F, shape, dtype=np.uint8)  # finite magnitudes (0x7F is NaN), then a random sign
    return codes | (rng.integers(0, 2, shape, dtype=np.uint8) << 7)


def _write_file(path: str, entries: list[_Stored], make: _Maker, header_only: bool = False) -> None:
    header, offset = {}, 0
    for entry in entries:
        nbytes = math.prod(entry.shape) * entry.itemsize
        header[entry.name] = {"dtype": entry.st_dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        if header_only:
            f.truncate(8 + len(header_bytes) + offset)  # a sparse file: the plan reads headers only
            return
        for entry in entries:
            for chunk in make.chunks(entry):
                f.write(chunk)
