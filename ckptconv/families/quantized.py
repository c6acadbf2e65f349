"""``quantization_config`` of the releases read as shipped: which scheme (see :mod:`ckptconv.inputs`).

A checkpoint without ``quantization_config`` is a bfloat16 copy; with one, every tensor whose
quantised parts are present is decoded, the others read as stored (the releases keep embeddings,
norms and routers in bfloat16).
"""

from __future__ import annotations

from ckptconv.inputs import FP8_BLOCK, MXFP4_SCHEME
from ckptconv.spec import ConfigReader

# quant_method -> (scheme, the fields that must hold for it, fields that change no weight)
METHODS = {
    "fp8": (FP8_BLOCK, {"fmt": "e4m3", "weight_block_size": [128, 128]}, ("activation_scheme", "scale_fmt")),
    "mxfp4": (MXFP4_SCHEME, {}, ("modules_to_not_convert",)),
}


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
    return scheme
