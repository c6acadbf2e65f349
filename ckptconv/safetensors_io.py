"""Safetensors headers and ranged tensor reads, from any :class:`~ckptconv.sources.Source`.

We parse the format ourselves (it is an 8-byte length, a JSON header and raw bytes) because
the reference reader memory-maps whole files, which makes RSS grow to the file size, and it
cannot read from GCS or the hub by range. Every header is validated before any tensor is
read, so a truncated or corrupt file fails the plan, not the write.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ckptconv.errors import BadInputError
from ckptconv.sources import Source

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

MAX_HEADER_BYTES = 100 * 1024 * 1024
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype and shape."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(source: Source, file: str) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors file.

    Checks that the header is JSON, every dtype is known, every byte range matches its
    shape, ranges do not overlap and the file is long enough to hold them all.
    """
    where = f"{source.uri}/{file}"
    file_size = source.size(file)
    if file_size < 8:
        raise BadInputError(f"{where}: not a safetensors file ({file_size} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(source.read_range(file, 0, 8)))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise BadInputError(f"{where}: corrupt safetensors header length {header_len} (file is {file_size} bytes)")
    try:
        header = json.loads(bytes(source.read_range(file, 8, header_len)))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInputError(f"{where}: safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise BadInputError(f"{where}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    tensors = {name: _tensor_info(where, file, name, entry, data_start) for name, entry in header.items()}
    _check_ranges(where, tensors, data_start, file_size)
    return tensors


def _tensor_info(where: str, file: str, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise BadInputError(f"{where}: tensor {name!r}: header entry lacks dtype/shape/data_offsets")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise BadInputError(f"{where}: tensor {name!r}: unsupported dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    valid = (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
             and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
             and 0 <= offsets[0] <= offsets[1])
    if not valid:
        raise BadInputError(f"{where}: tensor {name!r}: invalid shape {shape!r} or data_offsets {offsets!r}")
    shape, (begin, end) = tuple(shape), offsets
    info = TensorInfo(name, file, dtype, shape, data_start + begin)
    if end - begin != info.nbytes:
        raise BadInputError(
            f"{where}: tensor {name!r}: {end - begin} bytes stored, shape {list(shape)} "
            f"{entry['dtype']} needs {info.nbytes}"
        )
    return info


def _check_ranges(where: str, tensors: dict[str, TensorInfo], data_start: int, file_size: int) -> None:
    position = data_start
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if info.offset < position:
            raise BadInputError(f"{where}: tensor {info.name!r} overlaps the tensor before it")
        position = info.offset + info.nbytes
    if position > file_size:
        raise BadInputError(
            f"{where}: file is truncated: {file_size} bytes, tensors need {position}"
        )


def index_checkpoint(source: Source) -> dict[str, TensorInfo]:
    """All tensors of a HF checkpoint directory: ``model.safetensors`` or an index with shards.

    Refuses pickle-based checkpoints (``*.bin``, ``*.pt``): we never unpickle.
    """
    if source.exists(INDEX_FILE):
        files = sorted(set(_read_index(source).values()))
    elif source.exists(SINGLE_FILE):
        files = [SINGLE_FILE]
    else:
        names = source.list_names()
        shards = [n for n in names if n.endswith(".safetensors")]
        if shards:
            files = sorted(shards)
        elif any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in names):
            raise BadInputError(
                f"{source.uri}: only pickle checkpoints (*.bin/*.pt) found; ckptconv never unpickles. "
                "Convert them to safetensors first."
            )
        else:
            raise BadInputError(f"{source.uri}: no {SINGLE_FILE} or {INDEX_FILE} found")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(source, file).items():
            if name in tensors:
                raise BadInputError(f"{source.uri}: tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = info
    return tensors


def _read_index(source: Source) -> dict[str, str]:
    where = f"{source.uri}/{INDEX_FILE}"
    try:
        weight_map = json.loads(bytes(source.read_range(INDEX_FILE, 0, source.size(INDEX_FILE))))["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise BadInputError(f"{where}: not a valid safetensors index ({err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise BadInputError(f"{where}: weight_map must map tensor names to file names")
    for file in sorted(set(weight_map.values())):  # one existence check per file, not per tensor
        if not source.exists(file):
            tensor = next(t for t, f in weight_map.items() if f == file)
            raise BadInputError(f"{where}: tensor {tensor!r} maps to missing file {file}")
    return weight_map


def read_box(source: Source, info: TensorInfo, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Read one contiguous region of a tensor into a fresh array.

    ``box`` is a (start, stop) per axis: single indices on the leading axes, a range on one
    axis, whole axes after it (what :mod:`ckptconv.tiles` plans), so it is one byte range.
    """
    shape = tuple(stop - start for start, stop in box)
    if len(box) != len(info.shape) or any(not 0 <= start <= stop <= dim for (start, stop), dim in zip(box, info.shape)):
        raise ValueError(f"{info.name}: box {box} does not lie inside shape {info.shape}")
    cut = next((axis for axis, (start, stop) in enumerate(box) if stop - start != 1), len(box))
    if any(box[axis] != (0, info.shape[axis]) for axis in range(cut + 1, len(box))):
        raise ValueError(f"{info.name}: box {box} is not one contiguous range of {info.shape}")
    start = 0
    for (first, _), dim in zip(box, info.shape):
        start = start * dim + first
    data = source.read_range(info.file, info.offset + start * info.dtype.itemsize, math.prod(shape) * info.dtype.itemsize)
    return np.frombuffer(data, dtype=info.dtype).reshape(shape)
