"""Per-tensor transforms between HF and MaxText layouts: small pure steps, each with its inverse.

A :class:`Step` knows four things about itself:
- ``shape``: the output shape for an input shape, so the planner checks every leaf from the
  safetensors headers alone, before a byte of weights is read;
- ``forward``: which output *region* (a box) a given input region becomes, so the planner can
  cut a tensor into bounded read units and know where each lands in the leaf;
- ``quantum``: how finely an input axis may be cut for ``forward`` to stay a box (a head
  split needs whole heads, a RoPE permutation the whole head_dim);
- ``apply``: the values, for a region exactly as for the whole tensor.
Steps that change values (scaling, +1) declare ``exact=False`` so the chain runs in float32,
as MaxText's converter computes them. Each step has an ``inverse`` for MaxText -> HF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ckptconv.read import buffers

if TYPE_CHECKING:
    from ckptconv.read.spec import ModelSpec

Shape = tuple[int, ...]
Box = tuple[tuple[int, int], ...]  # half-open (start, stop) per axis
WHOLE = 0  # quantum meaning "this axis cannot be cut"


class Misaligned(ValueError):
    """A region that a step cannot map to a box (e.g. half a head)."""


def full_box(shape: Shape) -> Box:
    return tuple((0, dim) for dim in shape)


def box_shape(box: Box) -> Shape:
    return tuple(stop - start for start, stop in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def _axis(axis: int, ndim: int) -> int:
    return axis % ndim


@dataclass(frozen=True)
class Step:
    """Base step: the identity on shapes and boxes. Subclasses override what they change."""

    name: str

    @property
    def exact(self) -> bool:
        """True when the step only moves values (no arithmetic)."""
        return True

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        return shape

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        return box

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        return 1

    def axis_image(self, axis: int, shape: Shape, spec: ModelSpec) -> tuple[int, int]:
        """(output axis, input units per output unit) that input ``axis`` becomes."""
        return axis, 1

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        return x

    def inverse(self) -> Step:
        """The step that undoes this one (MaxText -> HF); steps that lose information have none."""
        raise NotImplementedError(f"{self.name} has no inverse")


@dataclass(frozen=True)
class Permute(Step):
    """Reorder axes: output axis ``j`` is input axis ``perm[j]`` (``(1, 0)`` is ``.T``)."""

    perm: tuple[int, ...] = (1, 0)

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        return tuple(shape[p] for p in self.perm)

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        return tuple(box[p] for p in self.perm)

    def axis_image(self, axis: int, shape: Shape, spec: ModelSpec) -> tuple[int, int]:
        return self.perm.index(axis), 1

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        batch = len(self.perm) - 2
        if self.perm == (*range(batch), batch + 1, batch):  # a transpose of each matrix: (1, 0), (0, 2, 1), ...
            return _transpose_last_two(x)
        out = buffers.empty(tuple(x.shape[p] for p in self.perm), x.dtype)
        np.copyto(out, np.transpose(x, self.perm))
        return out

    def inverse(self) -> Step:
        inverse = tuple(self.perm.index(axis) for axis in range(len(self.perm)))
        return Permute(self.name, inverse)


def _transpose_last_two(x: np.ndarray, block: int = 16) -> np.ndarray:
    """``x.swapaxes(-1, -2)`` made contiguous: each matrix of a stack (experts' fused weights) copied in bands of
    ``block`` rows.

    A plain strided copy of a large matrix misses the cache on every element; bands whose source rows stay in cache
    copy 2-4x faster (2048x4096 bfloat16: 11 ms against 46), and matrix by matrix 3-7x faster than one strided copy
    of the stack (8x7168x2048: 156 ms against 844). Values are moved as unsigned integers of their size, NumPy's own
    types, whatever their dtype (ml_dtypes' bfloat16 and float8 bring their own copy loops).
    """
    raw = _unsigned(x)
    out = buffers.empty((*raw.shape[:-2], raw.shape[-1], raw.shape[-2]), raw.dtype)
    for index in np.ndindex(raw.shape[:-2]):
        matrix, transposed = raw[index], out[index]
        for start in range(0, matrix.shape[0], block):
            transposed[:, start:start + block] = matrix[start:start + block].T
    return out.view(x.dtype)


def _unsigned(x: np.ndarray) -> np.ndarray:
    """``x`` viewed as unsigned integers of its size, NumPy's own types, to be moved whatever its dtype."""
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x


@dataclass(frozen=True)
class Split(Step):
    """Split ``axis`` of size ``n`` into ``(outer, n // outer)``: MaxText keeps heads as an axis.

    ``outer`` names a dimension of the spec (``heads``, ``kv_heads``). Cuts along ``axis``
    must fall on whole inner blocks (whole heads).
    """

    axis: int = -1
    outer: str = "heads"

    def _inner(self, shape: Shape, spec: ModelSpec) -> tuple[int, int, int]:
        axis = _axis(self.axis, len(shape))
        outer = spec.dim(self.outer)
        if shape[axis] % outer:
            raise Misaligned(f"{self.name}: axis {axis} of {shape} does not split into {outer} {self.outer}")
        return axis, outer, shape[axis] // outer

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis, outer, inner = self._inner(shape, spec)
        return (*shape[:axis], outer, inner, *shape[axis + 1:])

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        axis, _, inner = self._inner(shape, spec)
        start, stop = box[axis]
        if start % inner or stop % inner:
            raise Misaligned(f"{self.name}: range {start}:{stop} cuts a block of {inner}")
        return (*box[:axis], (start // inner, stop // inner), (0, inner), *box[axis + 1:])

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        split_axis, _, inner = self._inner(shape, spec)
        return inner if axis == split_axis else 1

    def axis_image(self, axis: int, shape: Shape, spec: ModelSpec) -> tuple[int, int]:
        split_axis, _, inner = self._inner(shape, spec)
        if axis == split_axis:
            return axis, inner
        return (axis + 1, 1) if axis > split_axis else (axis, 1)

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        return x.reshape(box_shape(out_box))

    def inverse(self) -> Step:
        return Merge(f"merge_{self.outer}", self.axis, self.outer)


@dataclass(frozen=True)
class Merge(Step):
    """The inverse of :class:`Split`: axes ``(axis, axis + 1)`` become one (MaxText -> HF)."""

    axis: int = -1
    outer: str = "heads"

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis = _axis(self.axis, len(shape) - 1)
        return (*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        return x.reshape(box_shape(out_box))

    def inverse(self) -> Step:
        return Split(f"split_{self.outer}", self.axis, self.outer)


@dataclass(frozen=True)
class RopeInterleave(Step):
    """HF rotates halves ``[x0..x_{d/2-1} | x_{d/2}..]``; MaxText's Llama 3.1+ rotates pairs.

    Output position ``2i`` takes input ``i`` and ``2i+1`` takes ``i + d/2`` along the last
    (head_dim) axis. Applied only when the spec's ``when`` value is true (``interleave_rope``),
    so a family writes the step once and the config decides.
    """

    when: str = "interleave_rope"
    to_pairs: bool = True

    def _active(self, spec: ModelSpec) -> bool:
        return bool(spec.value(self.when))

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        return WHOLE if axis == len(shape) - 1 and self._active(spec) else 1

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        """Each half copied into (or out of) every other position: two copies whose halves are contiguous runs, where
        one copy of the swapped axes wrote runs of one value (a 16 MiB bfloat16 query, 64 heads of 128: 3.1 ms against
        25 into pairs, 2.8 against 4.0 back)."""
        if not self._active(spec):
            return x
        raw = _unsigned(x)
        half = raw.shape[-1] // 2
        out = np.empty(raw.shape, raw.dtype)
        if self.to_pairs:
            pairs = out.reshape(*raw.shape[:-1], half, 2)
            pairs[..., 0], pairs[..., 1] = raw[..., :half], raw[..., half:]
        else:
            pairs = raw.reshape(*raw.shape[:-1], half, 2)
            out[..., :half], out[..., half:] = pairs[..., 0], pairs[..., 1]
        return out.view(x.dtype)

    def inverse(self) -> Step:
        return RopeInterleave(f"{self.name}_inverse", self.when, not self.to_pairs)


@dataclass(frozen=True)
class Scale(Step):
    """Multiply by the spec value ``factor`` (e.g. ``query_scale``, ``embed_scale``), in float32."""

    factor: str = "query_scale"
    divide: bool = False
    # float64 arithmetic, rounded once to the output dtype: MaxText's converter scales LoRA's lora_B
    # by a float64 1/sqrt(head_dim) (numpy promotes the float32 weights), its base kernels in float32
    wide: bool = False

    @property
    def exact(self) -> bool:
        return False

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        factor = (np.float64 if self.wide else np.float32)(spec.value(self.factor))
        return x / factor if self.divide else x * factor

    def inverse(self) -> Step:
        return Scale(f"{self.name}_inverse", self.factor, not self.divide, self.wide)


@dataclass(frozen=True)
class Add(Step):
    """Add a constant, in float32 (Gemma stores RMSNorm scales as ``w`` where MaxText wants ``1 + w``)."""

    constant: float = 1.0

    @property
    def exact(self) -> bool:
        return False

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        return x + np.float32(self.constant)

    def inverse(self) -> Step:
        return Add(f"{self.name}_inverse", -self.constant)


@dataclass(frozen=True)
class PerHead(Step):
    """Apply ``steps`` head by head to the last axis of a 2-D tensor that stays flat.

    MaxText's LoRA ``kernel_lora_b`` of a projection is ``(r, heads * head_dim)``, flat, while the
    base kernel's own steps (RoPE order, query scaling) act on a ``head_dim`` axis: this step
    reshapes to ``(..., heads, head_dim)``, runs them, and flattens back. Cuts fall on whole heads.
    """

    steps: tuple[Step, ...] = ()

    @property
    def exact(self) -> bool:
        return all(step.exact for step in self.steps)

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        return spec.dim("hd") if axis == len(shape) - 1 else 1

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        heads = x.reshape(*x.shape[:-1], -1, spec.dim("hd"))  # a region holds whole heads, maybe not all
        for step in self.steps:
            heads = step.apply(heads, spec, full_box(heads.shape))
        return np.ascontiguousarray(heads).reshape(x.shape)

    def inverse(self) -> Step:
        return PerHead(f"{self.name}_inverse", tuple(step.inverse() for step in reversed(self.steps)))


Size = int | str  # a count, or the name of a spec dimension (sizes that follow the config)


def _size(value: Size, spec: ModelSpec) -> int:
    return spec.dim(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class TakeRanges(Step):
    """Split a fused tensor: along ``axis``, viewed as consecutive periods of ``period`` elements, keep
    ``[start, start + width)`` of each. One transform for every split of contiguous ranges:

    - a fused projection: one period (``period`` the whole axis), the range of one part (q of a fused qkv);
    - regrouped heads: the same range of every head group (``period`` a group's width);
    - interleaved columns: ``width`` 1, ``period`` 2 (gpt-oss's gate/up: :func:`TakeStrided`).

    Sizes are counts or spec dimension names. Cuts along ``axis`` fall on whole periods. The inverse,
    :class:`PutRanges`, joins: it puts the values back into their ranges of the fused tensor.
    """

    axis: int = -1
    period: Size = 2
    start: Size = 0
    width: Size = 1

    def _sizes(self, shape: Shape, spec: ModelSpec) -> tuple[int, int, int, int]:
        axis = _axis(self.axis, len(shape))
        period, start, width = (_size(v, spec) for v in (self.period, self.start, self.width))
        if not (period > 0 and 0 <= start and width > 0 and start + width <= period) or shape[axis] % period:
            raise Misaligned(f"{self.name}: axis {axis} of {shape} is not whole periods of {period} holding "
                             f"[{start}, {start + width})")
        return axis, period, start, width

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis, period, _, width = self._sizes(shape, spec)
        return (*shape[:axis], shape[axis] // period * width, *shape[axis + 1:])

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        axis, period, _, width = self._sizes(shape, spec)
        start, stop = box[axis]
        if start % period or stop % period:
            raise Misaligned(f"{self.name}: range {start}:{stop} cuts a period of {period}")
        return (*box[:axis], (start // period * width, stop // period * width), *box[axis + 1:])

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        own, period, _, _ = self._sizes(shape, spec)
        return period if axis == own else 1

    def axis_image(self, axis: int, shape: Shape, spec: ModelSpec) -> tuple[int, int]:
        # ``width`` output units per ``period`` input units; counting each as a whole period keeps a later
        # step's quantum on whole periods (exact for width 1)
        own, period, _, _ = self._sizes(shape, spec)
        return axis, period if axis == own else 1

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        axis, period, start, width = self._sizes(x.shape, spec)
        periods = x.reshape(*x.shape[:axis], x.shape[axis] // period, period, *x.shape[axis + 1:])
        taken = periods[(slice(None),) * (axis + 1) + (slice(start, start + width),)]
        return np.ascontiguousarray(taken).reshape(*x.shape[:axis], -1, *x.shape[axis + 1:])

    def inverse(self) -> Step:
        return PutRanges(f"{self.name}_inverse", self.axis, self.period, self.start, self.width)


@dataclass(frozen=True)
class PutRanges(Step):
    """The inverse of :class:`TakeRanges`, a join: the values go to ``[start, start + width)`` of every period
    along ``axis`` of a tensor the rule's other outputs fill in their own ranges.

    A single output cannot make the whole tensor, so ``apply`` refuses; the export assembles the tensor with
    :meth:`place`, once per output (gpt-oss: ``wi_0`` to even, ``wi_1`` to odd columns of ``gate_up_proj``). It
    must be the last step of an inverse chain.
    """

    axis: int = -1
    period: Size = 2
    start: Size = 0
    width: Size = 1

    def _sizes(self, ndim: int, spec: ModelSpec) -> tuple[int, int, int, int]:
        return (_axis(self.axis, ndim), *(_size(v, spec) for v in (self.period, self.start, self.width)))

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis, period, _, width = self._sizes(len(shape), spec)
        if shape[axis] % width:
            raise Misaligned(f"{self.name}: axis {axis} of {shape} is not whole ranges of {width}")
        return (*shape[:axis], shape[axis] // width * period, *shape[axis + 1:])

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        raise NotImplementedError(f"{self.name}: fills only its ranges of the fused tensor; use place()")

    def place(self, out: np.ndarray, x: np.ndarray, spec: ModelSpec) -> None:
        """Write ``x`` into its ranges of ``out`` (the whole tensor or a region of whole periods)."""
        axis, period, start, width = self._sizes(out.ndim, spec)
        periods = out.reshape(*out.shape[:axis], out.shape[axis] // period, period, *out.shape[axis + 1:])
        periods[(slice(None),) * (axis + 1) + (slice(start, start + width),)] = x.reshape(
            *x.shape[:axis], x.shape[axis] // width, width, *x.shape[axis + 1:])

    def inverse(self) -> Step:
        return TakeRanges(f"{self.name}_inverse", self.axis, self.period, self.start, self.width)


def TakeStrided(name: str, axis: int = -1, start: int = 0, step: int = 2) -> TakeRanges:  # noqa: N802 (stable name)
    """Every ``step``-th element of ``axis`` from ``start``: one fused HF tensor -> several leaves (gpt-oss stores
    ``gate`` and ``up`` interleaved column by column). :class:`TakeRanges` with ranges one element wide."""
    return TakeRanges(name, axis, step, start, 1)


def PutStrided(name: str, axis: int = -1, start: int = 0, step: int = 2) -> PutRanges:  # noqa: N802 (stable name)
    """The inverse of :func:`TakeStrided`: the values go to every ``step``-th element of ``axis`` from ``start``."""
    return PutRanges(name, axis, step, start, 1)


@dataclass(frozen=True)
class Fill(Step):
    """A 1-D leaf of the spec dimension ``size`` holding ``value`` everywhere, whatever the tensor read: for a
    leaf the release has no tensor for and MaxText's converter writes a constant into (DeepSeek-V4's
    ``mhc_norm`` scales, ones). The tensor read is whole and only places the leaf in its layer. No inverse:
    export writes nothing back for it."""

    size: str = "emb"
    value: float = 1.0

    @property
    def exact(self) -> bool:
        return False

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        return (spec.dim(self.size),)

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        return ((0, spec.dim(self.size)),)

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        return WHOLE

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        return np.full(box_shape(out_box), self.value, np.float32)

    def inverse(self) -> Step:
        return Discard(f"{self.name}_inverse")


@dataclass(frozen=True)
class Discard(PutRanges):
    """The inverse of :class:`Fill`: the constant goes nowhere (the tensor read is the other outputs' to rebuild)."""

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        raise NotImplementedError(f"{self.name}: a constant leaf has no HF tensor")

    def place(self, out: np.ndarray, x: np.ndarray, spec: ModelSpec) -> None:
        return None


@dataclass(frozen=True)
class Resize(Step):
    """Pad with zero rows or drop rows along ``axis`` to the spec dimension ``size``.

    MaxText builds its embedding with its own vocabulary size (Gemma 2: 256128 rows for HF's
    256000; Gemma 3: 262144 for 262208); its converter pads with zeros or truncates. ``forward``
    maps source rows only; the tile plan writes the zero rows (``apply`` pads to its out box).
    """

    axis: int = 0
    size: str = "maxtext_vocab"
    source: str = "vocab"  # the spec dimension the input has along ``axis`` (what the inverse restores)

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis = _axis(self.axis, len(shape))
        return (*shape[:axis], spec.dim(self.size), *shape[axis + 1:])

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        axis = _axis(self.axis, len(shape))
        size = spec.dim(self.size)
        start, stop = box[axis]
        return (*box[:axis], (min(start, size), min(stop, size)), *box[axis + 1:])

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        axis = _axis(self.axis, x.ndim)
        want = box_shape(out_box)[axis]
        have = x.shape[axis]
        if have >= want:
            return x[(slice(None),) * axis + (slice(0, want),)]
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, want - have)
        return np.pad(x, pad)

    def inverse(self) -> Step:
        """Back to ``source`` rows: rows MaxText dropped come back as zeros, its padding is dropped."""
        return Resize(f"{self.name}_inverse", self.axis, self.source, self.size)


@dataclass(frozen=True)
class Regroup(Step):
    """Block scales (one per ``block`` rows of a weight axis of ``size`` rows, the last block possibly partial)
    -> the same scales repeated on the coarsest uniform grid that tiles the kernel MaxText makes of that axis.

    MaxText's loader dequantises a kernel by its scale leaf only on a uniform grid: each kernel axis is cut into
    equal blocks of ``kernel dim / scale dim`` (``dequantize_weight``). An FP8 release's 128-row blocks are that grid
    only when the axis holds whole blocks and no head split cuts one: DeepSeek's ``q_b_proj`` has 192 rows a head,
    ``kv_a_proj_with_mqa`` 576 rows. Groups of ``gcd(block, rows a part)`` rows (``parts``: the heads the axis
    splits into; none: the whole axis) never straddle a block nor a head, so repeating each block's scale over its
    groups is exact; it is the identity when the axis holds whole blocks a part (Qwen3.5's, most of DeepSeek's).
    """

    axis: int = 0
    size: str = "emb"
    parts: str | None = None
    block: int = 128

    def _grid(self, shape: Shape, spec: ModelSpec) -> tuple[int, int, int]:
        """(axis, rows, rows a group)."""
        axis, rows = _axis(self.axis, len(shape)), spec.dim(self.size)
        parts = spec.dim(self.parts) if self.parts else 1
        if rows % parts:
            raise Misaligned(f"{self.name}: {self.size}={rows} does not split into {parts} {self.parts}")
        return axis, rows, math.gcd(self.block, rows // parts)

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis, rows, group = self._grid(shape, spec)
        if shape[axis] != -(-rows // self.block):
            raise Misaligned(f"{self.name}: axis {axis} of {shape} is not the {self.block}-blocks of {rows} rows")
        return (*shape[:axis], rows // group, *shape[axis + 1:])

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        axis, rows, group = self._grid(shape, spec)
        start, stop = box[axis]
        return (*box[:axis], (start * self.block // group, min(stop * self.block, rows) // group), *box[axis + 1:])

    def quantum(self, axis: int, shape: Shape, spec: ModelSpec) -> int:
        return WHOLE if axis == _axis(self.axis, len(shape)) else 1  # a scale grid is small: read whole

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        axis, rows, group = self._grid(x.shape, spec)
        return np.take(x, np.arange(rows // group) * group // self.block, axis=axis)

    def inverse(self) -> Step:
        return Ungroup(f"{self.name}_inverse", self.axis, self.size, self.parts, self.block)


@dataclass(frozen=True)
class Ungroup(Regroup):
    """The inverse of :class:`Regroup` (MaxText -> HF): one scale a block again, the first of its groups."""

    def shape(self, shape: Shape, spec: ModelSpec) -> Shape:
        axis, rows, group = self._grid(shape, spec)
        if shape[axis] != rows // group:
            raise Misaligned(f"{self.name}: axis {axis} of {shape} is not {rows // group} groups of {rows} rows")
        return (*shape[:axis], -(-rows // self.block), *shape[axis + 1:])

    def forward(self, box: Box, shape: Shape, spec: ModelSpec) -> Box:
        axis, rows, group = self._grid(shape, spec)
        start, stop = box[axis]
        return (*box[:axis], (start * group // self.block, -(-stop * group // self.block)), *box[axis + 1:])

    def apply(self, x: np.ndarray, spec: ModelSpec, out_box: Box) -> np.ndarray:
        axis, rows, group = self._grid(x.shape, spec)
        return np.take(x, np.arange(-(-rows // self.block)) * self.block // group, axis=axis)

    def inverse(self) -> Step:
        return Regroup(self.name.removesuffix("_inverse"), self.axis, self.size, self.parts, self.block)


# --- The steps families use ---------------------------------------------------------------

TRANSPOSE = Permute("transpose", (1, 0))


def split_last(outer: str) -> Step:
    """(..., outer*inner) -> (..., outer, inner): heads become their own axis."""
    return Split(f"split_{outer}", -1, outer)


def split_first(outer: str) -> Step:
    """(outer*inner, ...) -> (outer, inner, ...): the attention output kernel."""
    return Split(f"split_{outer}_first", 0, outer)


ROPE_TO_MAXTEXT = RopeInterleave("rope_to_maxtext", "interleave_rope", True)
ROPE_FROM_MAXTEXT = ROPE_TO_MAXTEXT.inverse()
SCALE_QUERY = Scale("scale_query", "query_scale")
UNSCALE_QUERY = SCALE_QUERY.inverse()
SCALE_EMBEDDING = Scale("scale_embedding", "embed_scale")
NORM_PLUS_ONE = Add("norm_plus_one", 1.0)
NORM_MINUS_ONE = NORM_PLUS_ONE.inverse()
RESIZE_VOCAB = Resize("resize_vocab", 0, "maxtext_vocab")


def query_scale(head_dim: int) -> float:
    """MaxText's Llama-style attention expects queries pre-scaled by 1/sqrt(head_dim) in the weights."""
    return 1.0 / math.sqrt(head_dim)


# --- Chains -------------------------------------------------------------------------------

def output_shape(shape: Shape, steps: tuple[Step, ...], spec: ModelSpec) -> Shape:
    """The shape ``steps`` turn ``shape`` into, computed without touching data."""
    for step in steps:
        shape = step.shape(shape, spec)
    return shape


def forward_boxes(box: Box, shape: Shape, steps: tuple[Step, ...], spec: ModelSpec) -> list[Box]:
    """The box after each step for an input region ``box`` of a tensor of ``shape``."""
    boxes = []
    for step in steps:
        box = step.forward(box, shape, spec)
        shape = step.shape(shape, spec)
        boxes.append(box)
    return boxes


def chain_quantum(axis: int, shape: Shape, steps: tuple[Step, ...], spec: ModelSpec) -> tuple[int, int]:
    """(quantum, image axis): how finely input ``axis`` may be cut, and the output axis it becomes.

    A quantum of ``WHOLE`` means the axis may not be cut at all. Cuts must be multiples of the
    quantum; a cut of ``k * quantum`` input units covers ``k * quantum / per_unit`` units of
    the image axis.
    """
    quantum, per_unit = 1, 1
    for step in steps:
        q = step.quantum(axis, shape, spec)
        if q == WHOLE:
            return WHOLE, axis
        quantum = math.lcm(quantum, q * per_unit)
        axis, factor = step.axis_image(axis, shape, spec)
        per_unit *= factor
        shape = step.shape(shape, spec)
    return quantum, axis


def inverse_steps(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """The chain that undoes ``steps`` (MaxText -> HF): each step's inverse, in reverse order."""
    return tuple(step.inverse() for step in reversed(steps))


def inverse_boxes(box: Box, shape: Shape, steps: tuple[Step, ...], spec: ModelSpec) -> list[Box]:
    """The box after each step of :func:`inverse_steps` for the HF region ``box``: the forward
    boxes walked back, ending at ``box`` itself."""
    forward = [box, *forward_boxes(box, shape, steps, spec)]
    return forward[-2::-1]


def apply_inverse(leaf: np.ndarray, steps: tuple[Step, ...], spec: ModelSpec, boxes: list[Box],
                  out: np.ndarray) -> None:
    """Undo ``steps`` on a leaf region and write the HF region into ``out`` (cast to its dtype).

    ``boxes`` from :func:`inverse_boxes`. A trailing :class:`PutRanges` (a join) fills only its
    ranges of ``out``; every other chain fills ``out`` whole.
    """
    chain = inverse_steps(steps)
    last = chain[-1] if chain else None
    body = chain[:-1] if isinstance(last, PutRanges) else chain
    if any(isinstance(step, PutRanges) for step in body):
        raise ValueError(f"steps {[s.name for s in steps]}: a range take must be the first step")
    values = apply_steps(leaf, body, spec, boxes[:len(body)]) if body else leaf
    if isinstance(last, PutRanges):
        last.place(out, values.astype(out.dtype, copy=False), spec)
    else:
        out[...] = values.astype(out.dtype, copy=False).reshape(out.shape)


def apply_steps(x: np.ndarray, steps: tuple[Step, ...], spec: ModelSpec, boxes: list[Box] | None = None) -> np.ndarray:
    """Apply ``steps`` to a region ``x``; ``boxes`` (from :func:`forward_boxes`) tell each step
    its output region (only :class:`Resize` needs it; whole tensors by default).

    Value-changing steps run in float32 (as MaxText's converter computes them).
    """
    if boxes is None:
        shape, boxes = x.shape, []
        for step in steps:
            shape = step.shape(shape, spec)
            boxes.append(full_box(shape))
    if not all(step.exact for step in steps) and x.dtype != np.float32:
        x = buffers.cast(x, np.float32)
    for step, box in zip(steps, boxes):
        x = step.apply(x, spec, box)
    return x
