"""How a stored chunk's bytes are compressed: the codec that takes the place of Orbax's zstd in a leaf's chain.

Orbax's zarr3 chain stores a chunk as ``bytes`` then ``zstd``; every reader (Orbax, MaxText, tensorstore,
``inspect --deep``, ``export``) reads the chain from the leaf's stored ``zarr.json``, so the codec is the
writer's free choice and MaxText restores any of these unchanged.

The choice ``lz4`` is blosc's lz4 over bit planes (``bitshuffle``, ``typesize`` = the dtype's width). A bf16
weight's sign and high exponent bits are nearly constant across a chunk, its mantissa bits are noise;
bit planes put the constant bits together, where lz4 finds them, without zstd's entropy coder. Measured
here on bf16 weights (64 MiB, normal and row-scaled): 0.756 of raw against zstd's 0.78 (levels 1 and 3
alike), written about 2x and decoded about 1.7x as fast as zstd. One host's read of device 0's shard of a
Llama-3-8B-widths checkpoint (8 layers, 16 devices) took 0.38-0.43 s against 0.51-0.57 s with zstd (page
cache), and its conversion 27.9 s against 33.9 s; see docs/bench/RESTORE.md.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

# zstd's level when zstd is chosen. Orbax's zarr3 default is 3; on bf16 weights level 1 stores the same
# bytes (0.78 of raw, both) for 55% of the CPU (0.21 against 0.36 CPU-s per 128 MiB here).
ZSTD_LEVEL = 1
# blosc's level for lz4: 1 and 3 stored the same bytes on bf16 weights (0.756) at the same speed.
BLOSC_LEVEL = 1


def _lz4_bitshuffle(dtype: np.dtype) -> dict[str, Any]:
    return {"name": "blosc", "configuration": {"cname": "lz4", "clevel": BLOSC_LEVEL, "shuffle": "bitshuffle",
                                               "typesize": int(dtype.itemsize)}}


def _zstd(dtype: np.dtype) -> dict[str, Any]:
    return {"name": "zstd", "configuration": {"level": ZSTD_LEVEL}}


# name -> the codec that stands where Orbax puts zstd (None: raw bytes, Orbax's use_compression=False)
CODECS: dict[str, Callable[[np.dtype], dict[str, Any]] | None] = {
    "lz4": _lz4_bitshuffle,
    "zstd": _zstd,
    "none": None,
}
# Unless --compression says otherwise, a conversion writes lz4 where its data files are by device and zstd where they
# are in the source's order (chosen). In the source's order blosc's buffers cost memory: blosc keeps each chunk's
# compressed copy in a buffer of the chunk's full size, so lz4 holds about twice the data file while it is gathered
# (a 256 MiB leaf written in 64 MiB data files on 16 devices grew RSS by 171 MiB with lz4 against 77 with zstd),
# beyond what plan predicts. By device each device's data file is written apart and the difference did not show
# (the memory examples over one window peaked at 0.75-0.89 of the prediction with lz4, tests/test_memory.py), and
# there a host reads its shard faster: device 0's shard of Llama-3-8B's widths (8 layers, 16 devices) from gs://
# with 20 ms per request in 0.77 s against 0.90 s with zstd (medians of 5; the same 11 requests), docs/bench/RESTORE.md.
SOURCE_ORDER = "zstd"
BY_DEVICE = "lz4"
DEFAULT = SOURCE_ORDER  # a writer called without a choice writes in the source's order


def chosen(asked: str | None, by_device: bool) -> str:
    """The codec a conversion writes: as asked (``--compression``), else by its layout (``settings.COMPRESSION`` None)."""
    if asked is not None:
        return asked
    return BY_DEVICE if by_device else SOURCE_ORDER


def compresses(name: str) -> bool:
    """Whether Orbax should build its chain with a compressor for ``name`` to replace."""
    return CODECS[name] is not None


def with_codec(node: Any, name: str, dtype: np.dtype) -> Any:
    """``node`` (a spec's JSON built with Orbax's zstd when :func:`compresses`) with that zstd replaced by
    ``name``'s codec for ``dtype``."""
    make = CODECS[name]
    if make is None:
        return node
    if isinstance(node, dict):
        if node.get("name") == "zstd":
            return make(dtype)
        return {key: with_codec(value, name, dtype) for key, value in node.items()}
    if isinstance(node, list):
        return [with_codec(item, name, dtype) for item in node]
    return node
