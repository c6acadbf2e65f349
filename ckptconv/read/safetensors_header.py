"""A safetensors header, accepted exactly when the reference library (``safetensors`` 0.8) accepts it.

A header that is off by a few bytes must never parse: every tensor would then be read from
the wrong offset, and the conversion would succeed with wrong values. So we follow the
reference's own rules (``SafeTensors::read_metadata`` and ``Metadata::validate`` in
``safetensors/src/tensor.rs``), which ``tests/test_safetensors_strict.py`` checks against the
library itself on a family of damaged files:

- the 8-byte little-endian length is at most 100,000,000 and the header fits in the file;
- the header is UTF-8 JSON as strict as ``serde_json`` (:mod:`ckptconv.read.strict_json`);
  trailing JSON whitespace (spaces, as ``save_file`` pads to 8 bytes) is allowed;
- it is an object: ``__metadata__`` (once; null or string -> string) and tensors, each an object
  with ``dtype``, ``shape``, ``data_offsets`` given once (other fields ignored) or the array
  ``[dtype, shape, data_offsets]``, as serde reads a struct; a repeated tensor name keeps the last;
- sorted by offsets, the tensors tile the data from byte 0 with no gap or overlap, each
  exactly ``prod(shape) * itemsize`` bytes (zero-sized tensors included), no product overflows
  64 bits, and the last one ends where the file ends.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

from ckptconv import dtypes
from ckptconv.errors import BadInputError
from ckptconv.read.strict_json import JsonError, Pairs, loads

MAX_HEADER_BYTES = 100_000_000  # the reference's MAX_HEADER_SIZE
USIZE_LIMIT = 2**64  # shapes, offsets and sizes are Rust usize

FIELDS = ("dtype", "shape", "data_offsets")
METADATA_KEY = "__metadata__"


class Entry(NamedTuple):
    """One tensor as the header declares it; ``begin``/``end`` count from the end of the header.

    A named tuple, not a dataclass: a giant release declares 200 000 of them, and a tuple of strings and ints
    is built in C and is no work for the garbage collector once made."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_header(where: str, header: bytes) -> list[Entry]:
    """The tensors a header declares, typed as the reference types them; :class:`BadInputError` if not."""
    with collector_paused():
        try:
            tree = loads(header.decode("utf-8"), pairs=True)
        except UnicodeDecodeError as err:
            raise BadInputError(f"{where}: safetensors header is not valid UTF-8 (byte {err.start})") from None
        except JsonError as err:
            raise BadInputError(f"{where}: safetensors header is not valid JSON ({err})") from None
        if not isinstance(tree, Pairs):
            raise BadInputError(f"{where}: safetensors header is not a JSON object")
        tensors: dict[str, Entry] = {}
        seen_metadata = False
        for name, value in tree:
            if name == METADATA_KEY:
                if seen_metadata:
                    raise BadInputError(f"{where}: safetensors header has two {METADATA_KEY} fields")
                seen_metadata = True
                _check_metadata(where, value)
            else:  # a repeated name keeps the last, as serde's map
                tensors[name] = _usual_entry(name, value) or _entry(where, name, value)
        return list(tensors.values())


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a header's tree is built and read (and while a plan is made:
    :func:`ckptconv.plan.conversion.make_plan`). Its objects (about ten per tensor) are all alive until the header
    is parsed, so a collection finds nothing to free, yet each one walks every object of the process: on
    Kimi-K2.6's 208 000 tensors these walks were half of reading the headers, a quarter of making the plan.
    Reference counting still frees as usual; the collector runs again when the header is parsed (a few ms later,
    for every thread). A call that finds it off (the host program's choice, or another thread's header) leaves
    it alone; the call that turned it off turns it back on, even if another thread's header is still parsing,
    which then only parses slower."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _usual_entry(name: str, value: Any) -> Entry | None:
    """The entry as :func:`_entry` reads it, for the form every writer uses (``{"dtype": known, "shape": [...],
    "data_offsets": [begin, end]}``, in that order, of unsigned 64-bit integers); ``None`` for anything else,
    which :func:`_entry` reads field by field (and refuses with its messages). The same checks, without a
    function call per field and per number: this loop runs once per tensor of a release."""
    if type(value) is not Pairs or len(value) != 3:
        return None
    (dtype_key, dtype), (shape_key, shape), (offsets_key, offsets) = value
    if not (dtype_key == "dtype" and shape_key == "shape" and offsets_key == "data_offsets"
            and type(dtype) is str and dtype in dtypes.BITS
            and type(shape) is list and type(offsets) is list and len(offsets) == 2):
        return None
    for number in shape:
        if type(number) is not int or not 0 <= number < USIZE_LIMIT:
            return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not (0 <= begin < USIZE_LIMIT and 0 <= end < USIZE_LIMIT):
        return None
    return Entry(name, dtype, tuple(shape), begin, end)


def _check_metadata(where: str, value: Any) -> None:
    if value is not None and not (isinstance(value, Pairs) and all(isinstance(v, str) for _, v in value)):
        raise BadInputError(f"{where}: safetensors {METADATA_KEY} must map strings to strings")


def _entry(where: str, name: str, value: Any) -> Entry:
    fields = _fields(where, name, value)
    dtype, shape, offsets = fields
    if isinstance(dtype, Pairs) and len(dtype) == 1 and dtype[0][1] is None:
        dtype = dtype[0][0]  # serde also reads a unit enum variant written as {"F32": null}
    if not isinstance(dtype, str) or dtype not in dtypes.BITS:
        raise BadInputError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
    valid = (_is_usize_list(shape) and _is_usize_list(offsets) and len(offsets) == 2)
    if not valid:
        raise BadInputError(f"{where}: tensor {name!r}: invalid shape {shape!r} or data_offsets {offsets!r}")
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _fields(where: str, name: str, value: Any) -> tuple[Any, Any, Any]:
    """(dtype, shape, data_offsets) from an object (each field once) or a 3-element array."""
    if isinstance(value, Pairs):
        found: dict[str, Any] = {}
        for key, item in value:
            if key in FIELDS:
                if key in found:
                    raise BadInputError(f"{where}: tensor {name!r}: header entry has two {key!r} fields")
                found[key] = item
        if len(found) == len(FIELDS):
            return found["dtype"], found["shape"], found["data_offsets"]
    elif isinstance(value, list) and len(value) == len(FIELDS):
        return value[0], value[1], value[2]
    raise BadInputError(f"{where}: tensor {name!r}: header entry lacks dtype/shape/data_offsets")


def _is_usize_list(value: Any) -> bool:
    return (isinstance(value, list) and not isinstance(value, Pairs)
            and all(type(v) is int and 0 <= v < USIZE_LIMIT for v in value))


def check_layout(where: str, entries: list[Entry], data_bytes: int) -> None:
    """Offsets tile ``[0, data_bytes)`` exactly and every size matches its shape (``Metadata::validate``)."""
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        label = f"{where}: tensor {entry.name!r}"
        if entry.begin != position or entry.end < entry.begin:
            raise BadInputError(f"{label}: data_offsets [{entry.begin}, {entry.end}] should start at byte "
                                f"{position}, where the tensor before it ends (gap, overlap or disorder)")
        position = entry.end
        bits = dtypes.BITS[entry.dtype]
        count = 1
        for dim in entry.shape:
            count *= dim
            if count >= USIZE_LIMIT:
                raise BadInputError(f"{label}: shape {list(entry.shape)} overflows 64 bits")
        if count * bits >= USIZE_LIMIT:
            raise BadInputError(f"{label}: shape {list(entry.shape)} overflows 64 bits")
        if count * bits % 8:
            raise BadInputError(f"{label}: shape {list(entry.shape)} {entry.dtype} does not fill whole bytes")
        if entry.end - entry.begin != count * bits // 8:
            raise BadInputError(f"{label}: {entry.end - entry.begin} bytes stored, shape {list(entry.shape)} "
                                f"{entry.dtype} needs {count * bits // 8}")
    if position > data_bytes:
        raise BadInputError(f"{where}: file is truncated: tensors need {position} bytes after the header, "
                            f"the file holds {data_bytes}")
    if position < data_bytes:
        raise BadInputError(f"{where}: {data_bytes - position} bytes after the last tensor "
                            f"(the header's offsets do not cover the file: wrong header length?)")
