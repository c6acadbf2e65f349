"""Every dtype ckptconv names, in one table: safetensors' names with their sizes and NumPy dtypes,
the dtypes a checkpoint may be written in, and the float dtypes a source's weights may have.
Readers, writers, the planners and the synthetic models all take their dtypes from here."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ckptconv import settings

# Every dtype the reference knows, with its size in bits.
BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

# The reference's dtypes of whole bytes (its sub-byte F4/F6 ones are refused by name).
SAFETENSORS: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

# NumPy dtype -> its safetensors name (what a writer puts in a header).
NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in SAFETENSORS.items()}
BF16, F16, F32 = SAFETENSORS["BF16"], SAFETENSORS["F16"], SAFETENSORS["F32"]
E4M3 = SAFETENSORS["F8_E4M3"]
# --dtype -> the dtype of the written weights, for each name settings.CONVERT_DTYPES allows (export writes
# only the settings.OUTPUT_DTYPES ones).
OUTPUT: dict[str, np.dtype] = {name: np.dtype(getattr(ml_dtypes, name, None) or name)
                               for name in settings.CONVERT_DTYPES}
# --dtype float8_e4m3fn is MaxText 0.2.5's --save_dtype float8_e4m3fn, weight-only quantisation: nothing is cast
# to e4m3; each tensor is written in the dtype its source stores it in (an FP8 release's e4m3 weights, its scales'
# and the unquantised tensors' bfloat16 or float32), any other float dtype in float32 (to_maxtext.py's
# _convert_tensor_to_numpy). So no value is rounded twice and nothing is quantised without the source's scales.
KEPT: dict[np.dtype, np.dtype] = {E4M3: E4M3, BF16: BF16, F32: F32, F16: F32}


def leaf_dtype(output: np.dtype, source: np.dtype) -> np.dtype:
    """The dtype a leaf is written in under ``--dtype`` ``output`` when its source tensor is ``source``."""
    return KEPT[source] if output == E4M3 else output
# The float dtypes a source's weights may have (anything else is refused or decoded by a quantised input).
FLOAT_SOURCES = frozenset({BF16, F16, F32})
