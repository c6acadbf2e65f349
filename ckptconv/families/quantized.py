"""``quantization_config`` of the releases read as shipped: which scheme (see :mod:`ckptconv.families.inputs`).

A checkpoint without ``quantization_config`` is a bfloat16 copy; with one, every tensor whose
quantised parts are present is decoded, the others read as stored (the releases keep embeddings,
norms and routers in bfloat16; compressed-tensors lists them in ``ignore``).
"""

from __future__ import annotations

from ckptconv.families.inputs import FP8_BLOCK, FP8_CHANNEL, INT4_GROUP, INT4_SCHEME, MXFP4_SCHEME
from ckptconv.read.spec import ConfigReader

# quant_method -> (scheme, the fields that must hold for it, fields that change no weight)
METHODS = {
    "fp8": (FP8_BLOCK, {"fmt": "e4m3", "weight_block_size": [128, 128]}, ("activation_scheme", "scale_fmt")),
    "mxfp4": (MXFP4_SCHEME, {}, ("modules_to_not_convert",)),
    "compressed-tensors": (INT4_SCHEME, {}, ("ignore", "global_compression_ratio", "version")),
}
# compressed-tensors' weight arguments that decide how the stored integers decode (Kimi-K2-Thinking's)
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
                "dynamic": False, "actorder": None, "block_structure": None}


def read_quantization(cfg: ConfigReader, methods: tuple[str, ...]) -> str | None:
    """The scheme this release is stored in (None: not quantised), refusing anything else."""
    if not cfg.has("quantization_config"):
        return None
    q = cfg.nested("quantization_config")
    method = q.require("quant_method", methods, None)
    scheme, required, runtime = METHODS[method]
    for name, value in required.items():
        q.require(name, (value,), value)
    q.runtime(*runtime)
    if method == "compressed-tensors" and q.raw("format") == "float-quantized":
        _compressed_tensors_fp8(q)
        return FP8_CHANNEL
    if method == "compressed-tensors":
        _compressed_tensors(q)
    return scheme


# compressed-tensors' FP8 weight arguments (Llama-4-Maverick-17B-128E-Instruct-FP8's): e4m3 with one scale per
# output row (strategy "channel"); the values decode as stored whatever observer chose the scales
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "actorder": None, "block_structure": None}


def _single_group(q: ConfigReader) -> ConfigReader:
    """A compressed-tensors config with one quantisation group, stored compressed, and nothing that would add
    tensors (k/v cache scales, sparsity metadata, transforms): the group, to be read by its scheme."""
    q.require("quantization_status", ("compressed",), "compressed")
    q.require("kv_cache_scheme", (None,), None)  # would add k/v scales
    q.require("sparsity_config", ({},), {})
    q.require("transform_config", ({},), {})
    groups = q.nested("config_groups")
    if len(groups.config) != 1:
        groups.fail(f"{len(groups.config)} groups: only one quantisation scheme for all quantised layers is supported")
    group = groups.nested(next(iter(groups.config)))
    return group


def _compressed_tensors_fp8(q: ConfigReader) -> None:
    """One group of ``float-quantized`` FP8 weights, one scale per output row (``weight_scale``); activations
    quantised on the fly (``dynamic``: no ``input_scale`` tensors) change no stored weight. Which modules are
    quantised (``ignore``) is read from the tensors: an e4m3 weight with a ``weight_scale`` beside it decodes."""
    group = _single_group(q)
    group.require("format", (None, "float-quantized"), None)
    group.require("targets", (["Linear"],), None)
    group.require("output_activations", (None,), None)
    if group.has("input_activations"):
        inputs = group.nested("input_activations")
        inputs.require("dynamic", (True,), None)  # static activation scales would be tensors of their own
        inputs.runtime("num_bits", "type", "symmetric", "strategy", "group_size", "actorder", "block_structure",
                       "observer", "observer_kwargs")
    else:
        group.require("input_activations", (None,), None)
    weights = group.nested("weights")
    for name, value in FP8_WEIGHTS.items():
        weights.require(name, (value,), value if value is None or name == "dynamic" else None)
    weights.runtime("observer", "observer_kwargs", "scale_dtype", "zp_dtype")


def _compressed_tensors(q: ConfigReader) -> None:
    """One weight-only group of pack-quantized symmetric INT4 (no activation scales, no sparsity,
    no transforms: each would add tensors or change what the integers mean)."""
    q.require("format", ("pack-quantized",), None)
    group = _single_group(q)
    group.require("format", ("pack-quantized",), "pack-quantized")
    group.require("targets", (["Linear"],), None)
    group.require("input_activations", (None,), None)
    group.require("output_activations", (None,), None)
    weights = group.nested("weights")
    for name, value in INT4_WEIGHTS.items():
        weights.require(name, (value,), value if name in ("dynamic", "actorder", "block_structure") else None)
    weights.require("scale_dtype", (None, "torch.bfloat16"), None)  # the scale tensors' dtype is checked too
    weights.runtime("observer", "observer_kwargs", "zp_dtype")  # calibration settings; symmetric: no zero point
