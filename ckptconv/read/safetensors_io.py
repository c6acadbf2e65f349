"""Safetensors headers and ranged tensor reads, from any :class:`~ckptconv.read.sources.Source`.

We parse the format ourselves (it is an 8-byte length, a JSON header and raw bytes) because
the reference reader memory-maps whole files, which makes RSS grow to the file size, and it
cannot read from GCS or the hub by range. Every header is validated before any tensor is
read, so a truncated or corrupt file fails the plan, not the write.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from ckptconv import dtypes
from ckptconv.errors import BadInputError
from ckptconv.read.safetensors_header import MAX_HEADER_BYTES, Entry, check_layout, parse_header
from ckptconv.read.sources import Source, check_member_name
from ckptconv.read.strict_json import JsonError, loads


MAX_ARRAY_BYTES = 2**63 - 1  # numpy's limit on the extent of an array's non-zero axes
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
    """Parse and validate the header of one safetensors file, exactly as strictly as the
    reference library (:mod:`ckptconv.read.safetensors_header`): a file it refuses fails here, before
    any tensor is read; a file it loads gives the same tensors at the same offsets.
    """
    where = f"{source.uri}/{file}"
    file_size = source.size(file)
    if file_size < 8:
        raise BadInputError(f"{where}: not a safetensors file ({file_size} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(source.read_range(file, 0, 8)))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise BadInputError(f"{where}: corrupt safetensors header length {header_len} (file is {file_size} bytes)")
    entries = parse_header(where, bytes(source.read_range(file, 8, header_len)))
    data_start = 8 + header_len
    check_layout(where, entries, file_size - data_start)
    return {entry.name: _tensor_info(where, file, entry, data_start) for entry in entries}


def _tensor_info(where: str, file: str, entry: Entry, data_start: int) -> TensorInfo:
    dtype = dtypes.SAFETENSORS.get(entry.dtype)
    if dtype is None:  # the reference knows it, but it packs several values in a byte
        raise BadInputError(f"{where}: tensor {entry.name!r}: dtype {entry.dtype} is not supported "
                            f"(sub-byte; supported: {', '.join(dtypes.SAFETENSORS)})")
    if math.prod(d for d in entry.shape if d) * dtype.itemsize > MAX_ARRAY_BYTES:  # e.g. [0, 2**32, 2**32]
        raise BadInputError(f"{where}: tensor {entry.name!r}: shape {list(entry.shape)} is not supported "
                            "(no array can have it, even with no elements)")
    return TensorInfo(entry.name, file, dtype, entry.shape, data_start + entry.begin)


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
    """The index's tensor -> shard map; every shard must be a plain file name in the source."""
    where = f"{source.uri}/{INDEX_FILE}"
    try:
        index = loads(bytes(source.read_range(INDEX_FILE, 0, source.size(INDEX_FILE))).decode("utf-8"))
        weight_map = index["weight_map"]
    except (UnicodeDecodeError, JsonError, KeyError, TypeError) as err:
        raise BadInputError(f"{where}: not a valid safetensors index ({_one_line(err)})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise BadInputError(f"{where}: weight_map must map tensor names to file names")
    first_tensor: dict[str, str] = {}  # one check per file, not per tensor, naming the file's first tensor
    for tensor, file in weight_map.items():
        first_tensor.setdefault(file, tensor)
    for file, tensor in sorted(first_tensor.items()):
        check_member_name(f"{where}: tensor {tensor!r}", file)
        if not source.exists(file):
            raise BadInputError(f"{where}: tensor {tensor!r} maps to missing file {file!r}")
    return weight_map


def _one_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0][:200] or type(err).__name__


def read_box(source: Source, info: TensorInfo, box: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Read one contiguous region of a tensor into a fresh array.

    ``box`` is a (start, stop) per axis: single indices on the leading axes, a range on one
    axis, whole axes after it (what :mod:`ckptconv.families.tiles` plans), so it is one byte range.
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
