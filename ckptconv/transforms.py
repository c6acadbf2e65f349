"""Per-tensor transforms between HF and MaxText layouts: small pure functions, one direction each.

Each :class:`Step` knows how to transform an array and how to transform a *shape*, so the
planner can check every output shape from the safetensors headers alone, before reading a
byte of weights. Steps that change values (scaling, +1) declare ``exact=False`` so the
pipeline computes them in float32. Every value-changing or permuting step has its inverse
here too, tested against it, ready for the MaxText -> HF direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ckptconv.spec import ModelSpec

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """One named transform: ``apply(array, spec)`` and ``shape(shape, spec)``."""

    name: str
    apply: Callable[[np.ndarray, ModelSpec], np.ndarray]
    shape: Callable[[Shape, ModelSpec], Shape]
    exact: bool = True  # True when the step only moves values (no arithmetic)
    row_local: bool = True  # output row i depends only on input row i (so blocks of rows transform alone)


def _transpose(x: np.ndarray, spec: ModelSpec, block: int = 16) -> np.ndarray:
    """``x.T`` made contiguous, copied in bands of ``block`` rows.

    A plain strided copy of a large matrix misses the cache on every element; bands whose
    source rows stay in cache copy ~2x faster. 2-byte dtypes are moved as uint16 (bfloat16
    has no fast copy loop in numpy).
    """
    if x.ndim != 2:
        return np.ascontiguousarray(x.T)
    raw = x.view(np.uint16) if x.dtype.itemsize == 2 else x
    out = np.empty(raw.shape[::-1], dtype=raw.dtype)
    for start in range(0, raw.shape[0], block):
        out[:, start:start + block] = raw[start:start + block].T
    return out.view(x.dtype)


TRANSPOSE = Step("transpose", _transpose, lambda s, spec: tuple(reversed(s)), row_local=False)


def split_last(heads_of: Callable[[ModelSpec], int]) -> Step:
    """(..., heads*head_dim) -> (..., heads, head_dim): MaxText keeps heads as their own axis."""

    def shape(s: Shape, spec: ModelSpec) -> Shape:
        return (*s[:-1], heads_of(spec), s[-1] // heads_of(spec))

    return Step("split_heads", lambda x, spec: x.reshape(shape(x.shape, spec)), shape)


def split_first(heads_of: Callable[[ModelSpec], int]) -> Step:
    """(heads*head_dim, ...) -> (heads, head_dim, ...): the attention output kernel."""

    def shape(s: Shape, spec: ModelSpec) -> Shape:
        return (heads_of(spec), s[0] // heads_of(spec), *s[1:])

    return Step("split_heads_first", lambda x, spec: x.reshape(shape(x.shape, spec)), shape, row_local=False)


def _rope_half_to_interleaved(x: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """HF rotates halves ``[x0..x_{d/2-1} | x_{d/2}..]``; MaxText rotates pairs ``(x0, x_{d/2}), ...``.

    So output position ``2i`` takes input ``i`` and ``2i+1`` takes ``i + d/2`` along the last
    (head_dim) axis.
    """
    d = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], 2, d // 2).swapaxes(-1, -2).reshape(x.shape))


def _rope_interleaved_to_half(x: np.ndarray, spec: ModelSpec) -> np.ndarray:
    d = x.shape[-1]
    return np.ascontiguousarray(x.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(x.shape))


ROPE_INTERLEAVE = Step("rope_interleave", _rope_half_to_interleaved, lambda s, spec: s)
ROPE_DEINTERLEAVE = Step("rope_deinterleave", _rope_interleaved_to_half, lambda s, spec: s)


def _rope_to_maxtext(x: np.ndarray, spec: ModelSpec) -> np.ndarray:
    return _rope_half_to_interleaved(x, spec) if spec.interleave_rope else x


def _rope_from_maxtext(x: np.ndarray, spec: ModelSpec) -> np.ndarray:
    return _rope_interleaved_to_half(x, spec) if spec.interleave_rope else x


# Only models whose MaxText attention rotates interleaved pairs (Llama 3.1+) are permuted.
ROPE_TO_MAXTEXT = Step("rope_to_maxtext", _rope_to_maxtext, lambda s, spec: s)
ROPE_FROM_MAXTEXT = Step("rope_from_maxtext", _rope_from_maxtext, lambda s, spec: s)


def query_scale(spec: ModelSpec) -> float:
    """MaxText's Llama attention expects queries pre-scaled by 1/sqrt(head_dim) in the weights."""
    return 1.0 / math.sqrt(spec.head_dim)


SCALE_QUERY = Step("scale_query", lambda x, spec: x * np.float32(query_scale(spec)), lambda s, spec: s, exact=False)
UNSCALE_QUERY = Step("unscale_query", lambda x, spec: x / np.float32(query_scale(spec)), lambda s, spec: s, exact=False)

NORM_PLUS_ONE = Step("norm_plus_one", lambda x, spec: x + np.float32(1.0), lambda s, spec: s, exact=False)
NORM_MINUS_ONE = Step("norm_minus_one", lambda x, spec: x - np.float32(1.0), lambda s, spec: s, exact=False)


def q_heads(spec: ModelSpec) -> int:
    return spec.num_heads


def kv_heads(spec: ModelSpec) -> int:
    return spec.num_kv_heads


def column_sliceable(steps: tuple[Step, ...]) -> bool:
    """True when ``steps`` are a transpose followed by row-local steps: then output rows
    ``a:b`` are ``apply_steps(x[:, a:b])``, and a big kernel can be produced piece by piece."""
    return bool(steps) and steps[0] is TRANSPOSE and all(step.row_local for step in steps[1:])


def apply_steps(x: np.ndarray, steps: tuple[Step, ...], spec: ModelSpec) -> np.ndarray:
    """Apply ``steps`` in order; value-changing steps run in float32 (as MaxText's converter does)."""
    if not all(step.exact for step in steps) and x.dtype != np.float32:
        x = x.astype(np.float32)
    for step in steps:
        x = step.apply(x, spec)
    return x


def output_shape(shape: Shape, steps: tuple[Step, ...], spec: ModelSpec) -> Shape:
    """The shape ``steps`` turn ``shape`` into, computed without touching data."""
    for step in steps:
        shape = step.shape(shape, spec)
    return shape
