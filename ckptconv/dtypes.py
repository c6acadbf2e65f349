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
# --dtype -> the dtype of the written weights, for each name settings.OUTPUT_DTYPES allows.
OUTPUT: dict[str, np.dtype] = {name: np.dtype(getattr(ml_dtypes, name, None) or name)
                               for name in settings.OUTPUT_DTYPES}
# The float dtypes a source's weights may have (anything else is refused or decoded by a quantised input).
FLOAT_SOURCES = frozenset({BF16, F16, F32})
