"""What a rule reads: a stored tensor, or a logical tensor decoded from several stored ones.

The hub ships the giants quantised: DeepSeek-V3 and Kimi-K2 as FP8 (e4m3) weights with one
float32 scale per 128x128 block (``weight_scale_inv``), gpt-oss's experts as MXFP4 (two 4-bit
E2M1 values per byte in ``*_blocks``, one power-of-two scale per 32 values in ``*_scales``),
Kimi-K2-Thinking's experts as compressed-tensors ``pack-quantized`` INT4 (eight 4-bit integers
per int32 in ``weight_packed``, one bfloat16 scale per 32 of them in ``weight_scale``), Meta's
Llama-4-Maverick-FP8 as compressed-tensors ``float-quantized`` FP8 (e4m3 weights with one scale per
output row in ``weight_scale``).
MaxText's own route dequantises them to a bfloat16 copy on disk first; here each read unit
decodes just its rows, so the rules see the *logical* tensor (the one the bfloat16 copy holds)
and never the format.

Every input answers the same questions: its logical ``shape``, the ``dtype`` it decodes to, the
stored bytes it costs (``nbytes``), the order its axes are stored in (``order``, outermost
first: a read is one byte range only along that order), and ``read(source, box)``.

Decoding is bit for bit MaxText's: the product is taken in float32 and rounded once to bfloat16
(its dequantisers write bfloat16, which ``to_maxtext`` then reads). For INT4, which MaxText does
not read, it is bit for bit what compressed-tensors' own decompressor gives in bfloat16.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Callable, ClassVar, Iterable, Protocol

import ml_dtypes
import numpy as np

from ckptconv import dtypes, settings
from ckptconv.errors import BadInputError
from ckptconv.read.safetensors_io import TensorInfo, read_box
from ckptconv.read.sources import Source

Box = tuple[tuple[int, int], ...]
BF16 = dtypes.BF16
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# Each of the 256 e4m3 codes as float32, made by ml_dtypes' own cast, so a lookup gives the very bits the cast gives
# (NaN codes included). The cast itself goes one value at a time: 94 ms for 4096x4096 codes on 2 cores against 30 ms
# for the lookup, and a DeepSeek-V3 FP8 release is 671 G codes.
FP8_AS_FLOAT32 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)


def fp8_as_float32(codes: np.ndarray) -> np.ndarray:
    """``codes.astype(np.float32)`` for e4m3 ``codes``, bit for bit, by table (:data:`FP8_AS_FLOAT32`)."""
    if codes.dtype != FP8:  # another one-byte type would be read as e4m3 codes without a word
        raise TypeError(f"e4m3 codes expected, got {codes.dtype}")
    return FP8_AS_FLOAT32[codes.view(np.uint8)]


class Input(Protocol):
    """A logical tensor a rule reads (see the module docstring)."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: np.dtype
    order: tuple[int, ...]
    whole_axes: tuple[int, ...]  # axes a read may not cut (the decoder needs them whole)

    @property
    def nbytes(self) -> int: ...

    @property
    def decode_bytes(self) -> int:
        """Bytes of temporaries per logical element while decoding (0: plain reads)."""

    def read(self, source: Source, box: Box) -> np.ndarray: ...


CHECK_BYTES = 16 * 2**20  # scales read at a time by check_values (bounded memory whatever the model)


def check_values(inputs: Iterable[Input], source: Source) -> None:
    """Before anything is written: every quantised input's scales are values its format allows.

    A read would refuse them anyway, but only when the conversion reaches them, after the
    destination was cleared and half written. Scales are 1/16 (MXFP4), 1/9 (INT4: a bfloat16 per 32
    half-byte values) or 1/16384 (FP8) of the stored bytes, so this reads 6-11% more than the conversion
    itself for a release quantised throughout (less for Kimi's, whose attention and dense layers are bfloat16).
    """
    for piece in inputs:
        check = getattr(piece, "check", None)
        if check is not None:
            check(source)


@dataclass(frozen=True)
class Plain:
    """A tensor as stored."""

    info: TensorInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def file(self) -> str:
        return self.info.file

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype:
        return self.info.dtype

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(range(len(self.info.shape)))

    @property
    def whole_axes(self) -> tuple[int, ...]:
        return ()

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def decode_bytes(self) -> int:
        return 0

    def read(self, source: Source, box: Box) -> np.ndarray:
        return read_box(source, self.info, box)


FLOAT32_BYTES, BF16_BYTES = 4, 2


class _Decoded:
    """What the quantised inputs share: they decode to bfloat16, take their name (less a format
    suffix) and file from their first stored tensor, and cost the bytes of all of them. A format
    that stores its axes in another order, or needs some of them whole, says so."""

    dtype: ClassVar[np.dtype] = BF16
    suffix: ClassVar[str] = ""
    whole_axes: ClassVar[tuple[int, ...]] = ()

    def _stored(self) -> list[TensorInfo]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), TensorInfo)]

    @property
    def name(self) -> str:
        return self._stored()[0].name.removesuffix(self.suffix)

    @property
    def file(self) -> str:
        return self._stored()[0].file

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(range(len(self.shape)))

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._stored())


@dataclass(frozen=True)
class FP8Blocks(_Decoded):
    """An FP8 e4m3 matrix ``weight`` with float32 ``scale`` (``weight_scale_inv``): value =
    weight * scale[row // 128, col // 128] (DeepSeek-V3/R1, Kimi-K2 releases)."""

    weight: TensorInfo
    scale: TensorInfo
    block: int = 128

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def decode_bytes(self) -> int:
        """Beside the bfloat16 result: the e4m3 codes (one byte per value) while they are decoded,
        ``settings.IN_FLIGHT.decode_elements`` at a time through float32, so at most 4 MiB more
        whatever the read's size."""
        return 1

    def check(self, source: Source) -> None:
        """Every block scale finite: a NaN or infinite scale makes its whole block NaN or inf."""
        scale = _scales(source, self.scale)
        bad = np.argwhere(~np.isfinite(scale.astype(np.float32)))
        if len(bad):
            raise BadInputError(f"{self.scale.file}: {self.scale.name!r} holds the block scale "
                                f"{scale[tuple(bad[0])]} at block {list(map(int, bad[0]))} (and {len(bad) - 1} more); "
                                "FP8 block scales must be finite")

    def read(self, source: Source, box: Box) -> np.ndarray:
        (r0, r1), (c0, c1) = box
        codes = read_box(source, self.weight, box)
        b = self.block
        scale = _scales(source, self.scale)[r0 // b:(r1 - 1) // b + 1, c0 // b:(c1 - 1) // b + 1].astype(np.float32)
        rows = np.repeat(scale, b, axis=0)[r0 % b:r0 % b + r1 - r0]  # (rows, column blocks of the box)
        whole_blocks = c0 % b == 0 and (c1 - c0) % b == 0
        out = np.empty((r1 - r0, c1 - c0), BF16)
        step = max(1, settings.IN_FLIGHT.decode_elements // (c1 - c0))
        for r in range(0, r1 - r0, step):  # a band of rows at a time: float32 never holds the whole read
            values = fp8_as_float32(codes[r:r + step])
            if whole_blocks:  # scale whole column blocks without expanding the scales
                values.reshape(values.shape[0], -1, b)[...] *= rows[r:r + step, :, None]
            else:
                values *= np.repeat(rows[r:r + step], b, axis=1)[:, c0 % b:c0 % b + c1 - c0]
            out[r:r + step] = values  # one rounding to bfloat16, as the whole read's astype rounds
        return out


@functools.lru_cache(maxsize=8)
def _scales(source: Source, info: TensorInfo) -> np.ndarray:
    """A tensor's block scales (at most 60 KB), read once for all of its read units, not once each."""
    return read_box(source, info, tuple((0, dim) for dim in info.shape))


@dataclass(frozen=True)
class FP8Channel(_Decoded):
    """An FP8 e4m3 matrix ``weight`` (rows, cols) with one scale per row, ``scale`` (rows, 1) bfloat16 or
    float32 (``weight_scale``): value = weight * scale[row] (compressed-tensors ``float-quantized`` with the
    ``channel`` strategy: Llama-4-Maverick-17B-128E-Instruct-FP8). transformers' decoder multiplies in
    float32 and rounds once to the model's dtype; a bfloat16 scale times an e4m3 code is exact in float32,
    so that is also the bfloat16 product compressed-tensors' own decompressor takes."""

    weight: TensorInfo
    scale: TensorInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def decode_bytes(self) -> int:
        """As :class:`FP8Blocks`: the e4m3 codes beside the result, decoded a band at a time through float32."""
        return 1

    def check(self, source: Source) -> None:
        """Every row scale finite (a NaN or infinite scale makes its whole row NaN or inf), a band at a time."""
        rows = self.scale.shape[0]
        step = max(1, CHECK_BYTES // self.scale.dtype.itemsize)
        for r0 in range(0, rows, step):
            _check_row_scales(self.scale, read_box(source, self.scale, ((r0, min(rows, r0 + step)), (0, 1))), r0)

    def read(self, source: Source, box: Box) -> np.ndarray:
        (r0, r1), (c0, c1) = box
        codes = read_box(source, self.weight, box)
        scale = read_box(source, self.scale, ((r0, r1), (0, 1)))
        _check_row_scales(self.scale, scale, r0)
        scale = scale.astype(np.float32)
        out = np.empty((r1 - r0, c1 - c0), BF16)
        step = max(1, settings.IN_FLIGHT.decode_elements // max(1, c1 - c0))
        for r in range(0, r1 - r0, step):  # a band of rows at a time: float32 never holds the whole read
            values = fp8_as_float32(codes[r:r + step])
            values *= scale[r:r + step]
            out[r:r + step] = values  # one rounding to bfloat16
        return out


def _check_row_scales(info: TensorInfo, scales: np.ndarray, row: int) -> None:
    """Refuse a band of row scales (starting at ``row``) holding inf or NaN."""
    bad = np.argwhere(~np.isfinite(scales.astype(np.float32)))
    if len(bad):
        r = int(bad[0][0])
        raise BadInputError(f"{info.file}: {info.name!r} holds the row scale {scales[r, 0]} at row {row + r} "
                            f"(and {len(bad) - 1} more); FP8 row scales must be finite")


# E2M1 codes: bit 3 sign, bits 2-1 exponent, bit 0 mantissa. The sign of zero follows MaxText's
# gpt-oss dequantiser, which decodes code 0b1000 to +0.0 (not -0.0).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0_NAN = 255  # the MX specification's "not a number" scale
DECODE_ROWS = 64  # rows of codes looked up at a time


@dataclass(frozen=True)
class MXFP4(_Decoded):
    """gpt-oss's MXFP4 experts: ``blocks`` (experts, rows, groups, 16) uint8 holding two E2M1 codes
    per byte (low nibble first) and ``scales`` (experts, rows, groups) uint8 exponents (2^(s-127)).

    The logical tensor is what the bfloat16 release (and MaxText's dequantiser) holds: the decoded
    (experts, rows, groups * 32) with its last two axes swapped, i.e. (experts, cols, rows). Its
    storage order is therefore (0, 2, 1): a read takes whole stored rows, so axis 1 is never cut.
    """

    blocks: TensorInfo
    scales: TensorInfo
    suffix: ClassVar[str] = "_blocks"
    whole_axes: ClassVar[tuple[int, ...]] = (1,)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.blocks.shape[0], self.blocks.shape[2] * 32, self.blocks.shape[1])

    @property
    def order(self) -> tuple[int, ...]:
        return (0, 2, 1)

    @property
    def decode_bytes(self) -> int:
        """Beside the bfloat16 result: the float32 codes, scaled in place, then the bfloat16 values
        before their swapped copy (tracemalloc on 8 experts x 512 x 1024: 6.7 bytes per element at
        the peak, result included)."""
        return FLOAT32_BYTES + 1

    def check(self, source: Source) -> None:
        """No scale is 255 (E8M0's not-a-number), read a band of experts at a time."""
        experts, rows, groups = self.scales.shape
        step = max(1, CHECK_BYTES // max(1, rows * groups))
        for e0 in range(0, experts, step):
            e1 = min(experts, e0 + step)
            exponents = read_box(source, self.scales, ((e0, e1), (0, rows), (0, groups)))
            bad = np.argwhere(exponents == E8M0_NAN)
            if len(bad):
                e, r, _ = (int(v) for v in bad[0])
                raise BadInputError(f"{self.scales.file}: {self.scales.name!r} holds the scale 255, which MXFP4 "
                                    f"reserves for not-a-number (expert {e0 + e}, row {r})")

    def read(self, source: Source, box: Box) -> np.ndarray:
        (e0, e1), (c0, c1), (r0, r1) = box
        if (c0, c1) != (0, self.shape[1]):
            raise ValueError(f"{self.name}: MXFP4 reads take whole rows, not columns {c0}:{c1}")
        stored = ((e0, e1), (r0, r1))
        packed = read_box(source, self.blocks, stored + ((0, self.blocks.shape[2]), (0, 16)))
        exponents = read_box(source, self.scales, stored + ((0, self.scales.shape[2]),))
        if (exponents == E8M0_NAN).any():
            raise BadInputError(f"{self.scales.file}: {self.scales.name!r} holds the scale 255, which MXFP4 "
                                f"reserves for not-a-number (experts {e0}:{e1}, rows {r0}:{r1})")
        codes = np.empty(packed.shape + (2,), np.float32)  # (e, r, g, 16, 2): low nibble first
        for r in range(0, r1 - r0, DECODE_ROWS):  # table lookups index with intp: 8 bytes per code, so in slices
            part = packed[:, r:r + DECODE_ROWS]
            codes[:, r:r + DECODE_ROWS, ..., 0], codes[:, r:r + DECODE_ROWS, ..., 1] = E2M1[part & 0x0F], E2M1[part >> 4]
        del packed
        scales = np.ldexp(np.float32(1), exponents.astype(np.int32) - 127).astype(np.float32)
        with np.errstate(over="ignore"):  # 2^127 * 6 overflows to inf, as in MaxText's float32 route
            codes *= scales[..., None, None]  # in place: the products are the same numbers
        values = codes.reshape(e1 - e0, r1 - r0, -1).astype(BF16)
        del codes
        return np.ascontiguousarray(values.swapaxes(1, 2))


# MaxText's DeepSeek dequantiser (deepseek_dequantize.py) decodes code 0b1000 to -0.0, its gpt-oss one to +0.0
E2M1_SIGNED_ZERO = E2M1.copy()
E2M1_SIGNED_ZERO[8] = -0.0
FP4_GROUP = 32  # values of a row per ue8m0 scale (DeepSeek-V4's experts)


@dataclass(frozen=True)
class FP4Rows(_Decoded):
    """DeepSeek-V4's routed experts: ``weight`` int8 (rows, cols / 2), two E2M1 codes per byte (low nibble first),
    and ``scale`` (rows, cols / 32) ue8m0 (``float8_e8m0fnu``): value = code * scale[row, col // 32], the product in
    float32 rounded once to bfloat16, as MaxText's ``deepseek_dequantize.py`` computes it. Reads take whole rows."""

    weight: TensorInfo
    scale: TensorInfo
    whole_axes: ClassVar[tuple[int, ...]] = (1,)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.weight.shape[0], 2 * self.weight.shape[1])

    @property
    def decode_bytes(self) -> int:
        """Beside the bfloat16 result: the packed codes (half a byte per value) while ``DECODE_ROWS`` rows at a time
        are looked up through float32 (the band: ``plan.estimate.DECODE_BAND_BYTES`` bounds it). DeepSeek-V4-Flash's
        experts held 48-50 MiB for a 16 MiB read, its tile and its transpose (tracemalloc, no buffer pool), which 5
        bytes a value (the float32 codes of the whole read) had counted at 72."""
        return 1

    def check(self, source: Source) -> None:
        scale = _scales(source, self.scale).astype(np.float32)
        bad = np.argwhere(~np.isfinite(scale))
        if len(bad):
            raise BadInputError(f"{self.scale.file}: {self.scale.name!r} holds a not-a-number scale at "
                                f"{list(map(int, bad[0]))} (and {len(bad) - 1} more); FP4 scales must be finite")

    def read(self, source: Source, box: Box) -> np.ndarray:
        (r0, r1), (c0, c1) = box
        if (c0, c1) != (0, self.shape[1]):
            raise ValueError(f"{self.name}: FP4 reads take whole rows, not columns {c0}:{c1}")
        packed = read_box(source, self.weight, ((r0, r1), (0, self.weight.shape[1]))).view(np.uint8)
        scale = _scales(source, self.scale)[r0:r1].astype(np.float32)
        out = np.empty((r1 - r0, c1), BF16)
        for r in range(0, r1 - r0, DECODE_ROWS):
            part = packed[r:r + DECODE_ROWS]
            codes = np.stack([E2M1_SIGNED_ZERO[part & 0x0F], E2M1_SIGNED_ZERO[part >> 4]], axis=-1)
            codes = codes.reshape(part.shape[0], -1, FP4_GROUP) * scale[r:r + DECODE_ROWS, :, None]
            out[r:r + DECODE_ROWS] = codes.reshape(part.shape[0], -1)
        return out


INT4_GROUP = 32  # values per bfloat16 scale (Kimi-K2-Thinking's group_size; the config must say so)
INT4_PER_WORD = 8  # 4-bit values per int32 word
INT4_OFFSET = 8  # stored unsigned: code = value + 8


@dataclass(frozen=True)
class INT4Groups(_Decoded):
    """compressed-tensors ``pack-quantized`` INT4 weights, symmetric, grouped along the input axis
    (Kimi-K2-Thinking's experts): ``packed`` int32 (rows, cols / 8), ``scale`` bfloat16 (rows,
    cols / 32), ``shape`` int32 or int64 [rows, cols].

    Column ``c`` of a row is the 4-bit code at bits ``4 * (c % 8)`` of word ``c // 8`` (the lowest
    nibble first), stored as ``value + 8``; value = (code - 8) * scale[row, c // 32]. The decoder
    (``unpack_from_int32`` then ``dequantize``) multiplies in the scale's dtype: the bfloat16
    product of an integer in [-8, 7] and a bfloat16 scale is exact in float32, so taking it in
    float32 and rounding once to bfloat16 gives the same bits.
    """

    packed: TensorInfo
    scale: TensorInfo
    stored_shape: TensorInfo
    suffix: ClassVar[str] = "_packed"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.packed.shape[0], self.packed.shape[1] * INT4_PER_WORD)

    @property
    def decode_bytes(self) -> int:
        """Beside the bfloat16 result: the packed words (half a byte per value) while they are
        decoded, ``settings.IN_FLIGHT.decode_elements`` at a time through float32, so at most
        4.5 MiB more whatever the read's size (tracemalloc on a 2048 x 7168 read: 3.1 bytes per
        element at the peak, result included)."""
        return 1

    def check(self, source: Source) -> None:
        """The stored shape is the headers', and every group scale finite (a NaN or infinite scale makes its
        whole group NaN or inf), read a band of rows at a time."""
        _check_stored_shape(source, self.stored_shape, self.shape)
        rows, groups = self.scale.shape
        step = max(1, CHECK_BYTES // max(1, groups * BF16.itemsize))
        for r0 in range(0, rows, step):
            _check_int4_scales(self.scale, read_box(source, self.scale, ((r0, min(rows, r0 + step)), (0, groups))), r0)

    def read(self, source: Source, box: Box) -> np.ndarray:
        (r0, r1), (c0, c1) = box
        _check_stored_shape(source, self.stored_shape, self.shape)
        g = INT4_GROUP
        g0, g1 = c0 // g, -(-c1 // g)  # whole groups covering the columns: one scale each
        words = read_box(source, self.packed, ((r0, r1), (g0 * g // INT4_PER_WORD, g1 * g // INT4_PER_WORD)))
        scales = read_box(source, self.scale, ((r0, r1), (g0, g1)))
        _check_int4_scales(self.scale, scales, r0, g0)
        nibbles = words.astype("<i4", copy=False).view(np.uint8)  # (rows, 4 per word): byte k holds values 2k, 2k+1
        del words
        out = np.empty((r1 - r0, c1 - c0), BF16)
        skip = c0 - g0 * g
        step = max(1, settings.IN_FLIGHT.decode_elements // ((g1 - g0) * g))
        for r in range(0, r1 - r0, step):  # a band of rows at a time: float32 never holds the whole read
            part = nibbles[r:r + step]
            values = np.empty((part.shape[0], part.shape[1] * 2), np.float32)
            np.bitwise_and(part, 0x0F, out=values[:, 0::2], casting="unsafe")
            np.right_shift(part, 4, out=values[:, 1::2], casting="unsafe")
            values -= INT4_OFFSET
            with np.errstate(over="ignore"):  # a scale near bfloat16's largest: inf, as the bfloat16 product is
                values.reshape(part.shape[0], g1 - g0, g)[...] *= scales[r:r + step, :, None].astype(np.float32)
            out[r:r + step] = values[:, skip:skip + c1 - c0]  # one rounding, to nearest even
        return out


BF16_EXPONENT = 0x7F80  # a bfloat16 whose exponent bits are all set is inf or NaN


def _check_int4_scales(info: TensorInfo, scales: np.ndarray, row: int, group: int = 0) -> None:
    """Refuse a band of bfloat16 group scales (starting at ``row``, ``group``) holding inf or NaN."""
    bad = np.argwhere(scales.view(np.uint16) & BF16_EXPONENT == BF16_EXPONENT)
    if len(bad):
        r, g = (int(v) for v in bad[0])
        raise BadInputError(f"{info.file}: {info.name!r} holds the group scale {scales[r, g]} at "
                            f"[{row + r}, {group + g}] (and {len(bad) - 1} more); INT4 group scales must be finite")


@functools.lru_cache(maxsize=64)
def _check_stored_shape(source: Source, info: TensorInfo, shape: tuple[int, ...]) -> None:
    """``weight_shape`` (8 or 16 bytes, read once per tensor) must be the shape the headers imply."""
    stored = tuple(int(v) for v in read_box(source, info, ((0, 2),)))
    if stored != shape:
        raise BadInputError(f"{info.file}: {info.name!r} holds {list(stored)}, but its packed weight and scales "
                            f"are {list(shape)}")


@dataclass(frozen=True)
class Join:
    """A tensor MaxText holds fused that a checkpoint stores in separate ``parts``.

    ``fused``: the end of the rules' tensor name (``linear_attn.in_proj_qkvz.weight``); each part
    replaces it (``linear_attn.in_proj_qkv.weight``) and is a run of sections along axis 0, sized by
    spec dimensions (``k_dim, k_dim, v_dim``). The fused tensor holds, for each of ``groups`` groups
    in turn, every section's share of that group, in order: Qwen3.5's in_proj_qkv and in_proj_z
    become [q|k|v|z] per key head, as Qwen3-Next stores them and MaxText holds them.
    """

    fused: str
    parts: tuple[tuple[str, tuple[str, ...]], ...]
    groups: str
    # the releases that store it in parts, so that export writes it so (a conversion reads parts wherever
    # the fused tensor is absent)
    in_parts: Callable[..., bool] = lambda spec: True

    def part_names(self, name: str, spec) -> tuple[str, ...]:
        base = name[:-len(self.fused)]
        return tuple(base + suffix for suffix, _ in self.parts)

    def sections(self, spec) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(spec.dim(d) for d in dims) for _, dims in self.parts)

    def part_shapes(self, name: str, spec, shape: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Each part's name and the shape config.json implies for it, given the fused ``shape``."""
        return tuple((part, (sum(sizes), *shape[1:]))
                     for part, sizes in zip(self.part_names(name, spec), self.sections(spec)))

    def compose(self, name: str, spec, parts: tuple) -> "Joined":
        return Joined(name, parts, self.sections(spec), spec.dim(self.groups))


@dataclass(frozen=True)
class Joined:
    """The fused tensor of a :class:`Join`, read from its parts (which may themselves decode: FP8).

    Fused rows [r0, r1) are a few row ranges of the parts (one per group and section they touch);
    each is read as stored and placed, so a read costs its own size and one part's range more.
    """

    fused_name: str
    parts: tuple[Input, ...]
    sections: tuple[tuple[int, ...], ...]  # per part, its sections' sizes along axis 0
    groups: int

    @property
    def name(self) -> str:
        return self.fused_name

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(sum(s) for s in self.sections), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(range(len(self.shape)))

    @property
    def whole_axes(self) -> tuple[int, ...]:
        return tuple(sorted({a for p in self.parts for a in p.whole_axes}))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def decode_bytes(self) -> int:
        """One part range decoded and held while it is placed: at most the read's size again."""
        return self.dtype.itemsize + max(p.decode_bytes for p in self.parts)

    def runs(self) -> list[tuple[int, int, int, int]]:
        """(part, first row in the part, first fused row, rows) of every group's share of every
        section, in fused order."""
        runs = []
        for g in range(self.groups):
            for k, sections in enumerate(self.sections):
                start = 0
                for size in sections:
                    share = size // self.groups
                    runs.append((k, start + g * share, 0, share))
                    start += size
        fused = 0
        for n, (k, first, _, rows) in enumerate(runs):
            runs[n] = (k, first, fused, rows)
            fused += rows
        return runs

    def read(self, source: Source, box: Box) -> np.ndarray:
        (r0, r1), rest = box[0], box[1:]
        out = np.empty((r1 - r0, *(stop - start for start, stop in rest)), self.dtype)
        for k, first, fused, rows in self.runs():
            lo, hi = max(r0, fused), min(r1, fused + rows)
            if lo < hi:
                part_rows = (first + lo - fused, first + hi - fused)
                out[lo - r0:hi - r0] = self.parts[k].read(source, (part_rows, *rest))
        return out


@dataclass(frozen=True)
class ExpertJoin:
    """A layer's experts MaxText reads from one fused tensor (Qwen3.5's ``mlp.experts.gate_up_proj``,
    (experts, 2 * mlp, emb), gate first) that a checkpoint stores one by one
    (``mlp.experts.{e}.gate_proj.weight``, ``up_proj.weight``: its FP8 releases): expert ``e`` of the
    fused tensor is its ``parts`` stacked along their first axis."""

    fused: str  # "mlp.experts.gate_up_proj"
    parts: tuple[str, ...]  # ("gate_proj.weight", "up_proj.weight")
    inner: str = "mlp.experts."  # what precedes the expert index in a part's name
    in_parts: Callable[..., bool] = lambda spec: True  # as Join's
    # the fused tensor holds each expert (in, out) while its parts are nn.Linear weights (out, in): Llama 4's
    # experts.gate_up_proj (experts, emb, 2 * mlp) from its FP8 release's experts.{e}.gate_proj.weight (mlp, emb)
    transposed: bool = False

    def part_names(self, name: str, spec) -> tuple[str, ...]:
        base = name[:-len(self.fused)] + self.inner
        return tuple(f"{base}{e}.{part}" for e in range(spec.dim("experts")) for part in self.parts)

    def part_shapes(self, name: str, spec, shape: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        if self.transposed:
            return tuple((part, (shape[2] // len(self.parts), shape[1])) for part in self.part_names(name, spec))
        rows = shape[1] // len(self.parts)
        return tuple((part, (rows, *shape[2:])) for part in self.part_names(name, spec))

    def compose(self, name: str, spec, parts: tuple) -> "StackedExperts":
        return StackedExperts(name, parts, len(self.parts), self.transposed)


@dataclass(frozen=True)
class StackedExperts:
    """The fused tensor of an :class:`ExpertJoin`, read from its per-expert parts (expert-major); ``transposed``:
    each part is (out, in) and the fused tensor (experts, in, out * per_expert), stored in order (0, 2, 1)."""

    fused_name: str
    parts: tuple[Input, ...]
    per_expert: int
    transposed: bool = False

    @property
    def name(self) -> str:
        return self.fused_name

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def shape(self) -> tuple[int, ...]:
        rows, *rest = self.parts[0].shape
        if self.transposed:
            return (len(self.parts) // self.per_expert, *rest, rows * self.per_expert)
        return (len(self.parts) // self.per_expert, rows * self.per_expert, *rest)

    @property
    def dtype(self) -> np.dtype:
        return self.parts[0].dtype

    @property
    def order(self) -> tuple[int, ...]:
        return (0, 2, 1) if self.transposed else tuple(range(len(self.shape)))

    @property
    def whole_axes(self) -> tuple[int, ...]:
        if self.transposed:  # a part's rows are the fused tensor's axis 2, its columns axis 1
            return tuple(sorted({2 - a for p in self.parts for a in p.whole_axes}))
        return tuple(sorted({a + 1 for p in self.parts for a in p.whole_axes}))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def decode_bytes(self) -> int:
        return self.dtype.itemsize + max(p.decode_bytes for p in self.parts)

    def read(self, source: Source, box: Box) -> np.ndarray:
        if self.transposed:
            return self._read_transposed(source, box)
        (e0, e1), (r0, r1), rest = box[0], box[1], box[2:]
        rows = self.parts[0].shape[0]
        out = np.empty((e1 - e0, r1 - r0, *(stop - start for start, stop in rest)), self.dtype)
        for e in range(e0, e1):
            for k in range(self.per_expert):
                lo, hi = max(r0, k * rows), min(r1, (k + 1) * rows)
                if lo < hi:
                    part = self.parts[e * self.per_expert + k]
                    out[e - e0, lo - r0:hi - r0] = part.read(source, ((lo - k * rows, hi - k * rows), *rest))
        return out

    def check(self, source: Source) -> None:
        """Each part's own check (an FP8 expert's scales), before anything is written."""
        for part in self.parts:
            check = getattr(part, "check", None)
            if check is not None:
                check(source)

    def _read_transposed(self, source: Source, box: Box) -> np.ndarray:
        (e0, e1), (c0, c1), (r0, r1) = box
        rows = self.parts[0].shape[0]
        out = np.empty((e1 - e0, c1 - c0, r1 - r0), self.dtype)
        for e in range(e0, e1):
            for k in range(self.per_expert):
                lo, hi = max(r0, k * rows), min(r1, (k + 1) * rows)
                if lo < hi:
                    part = self.parts[e * self.per_expert + k]
                    out[e - e0, :, lo - r0:hi - r0] = part.read(source, ((lo - k * rows, hi - k * rows), (c0, c1))).T
        return out


def join_input(name: str, join: Join | ExpertJoin, spec, shape: tuple[int, ...],
               find) -> tuple[Joined | StackedExperts, tuple[str, ...]] | None:
    """The fused input of the rules' tensor ``name`` (of the ``shape`` config.json implies) read from its
    parts (``find``: a part's name -> (input, stored names) or None), each part's shape checked; None
    when no part is stored (the caller names the missing tensor)."""
    expected = join.part_shapes(name, spec, shape)
    found = [find(part) for part, _ in expected]
    if not any(found):
        return None
    missing = next((part for (part, _), hit in zip(expected, found) if hit is None), None)
    if missing is not None:
        present = next(hit[0] for hit in found if hit is not None)
        raise BadInputError(f"{present.file}: missing tensor {missing!r} (with {present.name!r}, it makes "
                            f"MaxText's {join.fused.removesuffix('.weight').split('.')[-1]})")
    inputs = tuple(hit[0] for hit in found)
    for piece, (_, want) in zip(inputs, expected):
        if piece.shape != want:
            raise BadInputError(f"{piece.file}: tensor {piece.name!r} has shape {list(piece.shape)}, config.json "
                                f"implies {list(want)}")
        if piece.dtype != inputs[0].dtype:
            raise BadInputError(f"{piece.file}: tensor {piece.name!r} has dtype {piece.dtype}, but "
                                f"{inputs[0].name!r}, which it is fused with, has {inputs[0].dtype}")
    return join.compose(name, spec, inputs), tuple(n for hit in found for n in hit[1])


# --- which stored tensors make a logical one ----------------------------------------------

# the quantisation schemes a spec may name
FP8_BLOCK, MXFP4_SCHEME, INT4_SCHEME = "fp8-block-128", "mxfp4", "int4-group-32"
FP8_CHANNEL = "fp8-channel"  # compressed-tensors float-quantized, one scale per output row (Llama 4 Maverick FP8)
# FP8 releases MaxText keeps quantised (Qwen3.5's -fp8 models): the e4m3 weights read as stored, their
# block scales (``weight_scale_inv``) by rules of their own into ``*_scale`` leaves; nothing decoded.
FP8_KEPT = "fp8-block-128-kept"


def resolve(name: str, tensors: dict[str, TensorInfo], scheme: str | None) -> tuple[Input, tuple[str, ...]] | None:
    """The input a rule's tensor ``name`` reads, and the names (keys of ``tensors``) it consumes (None: absent).

    Quantised checkpoints keep some tensors in bfloat16 (embeddings, norms, routers): a tensor
    decodes only when its companions are there.
    """
    info = tensors.get(name)
    if scheme == FP8_BLOCK and info is not None and info.dtype in (FP8, np.int8):
        # DeepSeek-V3's releases name a block scale ``<weight>_scale_inv``; DeepSeek-V4's ``<module>.scale``
        scale_name = name + "_scale_inv"
        if scale_name not in tensors and name.endswith(".weight"):
            scale_name = name.removesuffix(".weight") + ".scale"
        scale = tensors.get(scale_name)
        if scale is None:
            raise BadInputError(f"{info.file}: {'FP8' if info.dtype == FP8 else 'FP4'} tensor {name!r} has no "
                                f"{scale_name!r}")
        if info.dtype == np.int8:  # DeepSeek-V4's FP4 experts, two codes per byte
            _check_fp4(info, scale)
            return FP4Rows(info, scale), (name, scale.name)
        _check_fp8(info, scale)
        return FP8Blocks(info, scale), (name, scale.name)
    if scheme == FP8_CHANNEL and info is not None and info.dtype == FP8:
        scale = tensors.get(name + "_scale")
        if scale is None:
            raise BadInputError(f"{info.file}: FP8 tensor {name!r} has no {name + '_scale'!r}")
        _check_fp8_channel(info, scale)
        return FP8Channel(info, scale), (name, scale.name)
    if scheme == MXFP4_SCHEME and name + "_blocks" in tensors:
        blocks, scales = tensors[name + "_blocks"], tensors.get(name + "_scales")
        if scales is None:
            raise BadInputError(f"{blocks.file}: MXFP4 tensor {blocks.name!r} has no {name + '_scales'!r}")
        _check_mxfp4(blocks, scales)
        return MXFP4(blocks, scales), (name + "_blocks", name + "_scales")  # keys of tensors (canonical names)
    if scheme == INT4_SCHEME and name + "_packed" in tensors:
        parts = [tensors.get(name + suffix) for suffix in ("_packed", "_scale", "_shape")]
        if None in parts:
            absent = next(name + s for s, p in zip(("_packed", "_scale", "_shape"), parts) if p is None)
            raise BadInputError(f"{parts[0].file}: INT4 tensor {parts[0].name!r} has no {absent!r}")
        packed, scale, shape = parts
        _check_int4(packed, scale, shape)
        return INT4Groups(packed, scale, shape), (name + "_packed", name + "_scale", name + "_shape")
    if info is None:
        return None
    return Plain(info), (name,)


E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)  # DeepSeek-V4's ue8m0 scales


def _check_fp8(weight: TensorInfo, scale: TensorInfo) -> None:
    expected = tuple(math.ceil(d / 128) for d in weight.shape)
    if len(weight.shape) != 2 or scale.shape != expected or scale.dtype not in (np.float32, BF16, E8M0):
        raise BadInputError(f"{weight.file}: {scale.name!r} is {scale.dtype}{list(scale.shape)}, expected float32, "
                            f"bfloat16 or ue8m0 {list(expected)} (one scale per 128x128 block of {list(weight.shape)})")


def _check_fp4(weight: TensorInfo, scale: TensorInfo) -> None:
    rows, half = weight.shape if len(weight.shape) == 2 else (0, 0)
    expected = (rows, 2 * half // FP4_GROUP)
    if len(weight.shape) != 2 or 2 * half % FP4_GROUP or scale.shape != expected or scale.dtype != E8M0:
        raise BadInputError(f"{weight.file}: FP4 {weight.name!r} int8{list(weight.shape)} with scale {scale.dtype}"
                            f"{list(scale.shape)}: expected ue8m0 {list(expected)} (one scale per {FP4_GROUP} values "
                            "of a row)")


def _check_fp8_channel(weight: TensorInfo, scale: TensorInfo) -> None:
    expected = (weight.shape[0], 1) if len(weight.shape) == 2 else None
    if expected is None or scale.shape != expected or scale.dtype not in (np.float32, BF16):
        raise BadInputError(f"{weight.file}: {scale.name!r} is {scale.dtype}{list(scale.shape)}, expected float32 "
                            f"or bfloat16 {list(expected or ('rows', 1))} (one scale per row of "
                            f"{list(weight.shape)})")


def _check_mxfp4(blocks: TensorInfo, scales: TensorInfo) -> None:
    if (len(blocks.shape) != 4 or blocks.shape[3] != 16 or blocks.dtype != np.uint8 or scales.dtype != np.uint8
            or scales.shape != blocks.shape[:3]):
        raise BadInputError(f"{blocks.file}: MXFP4 {blocks.name!r} {blocks.dtype}{list(blocks.shape)} with scales "
                            f"{scales.dtype}{list(scales.shape)}: expected uint8 (E, rows, groups, 16) and (E, rows, groups)")


def _check_int4(packed: TensorInfo, scale: TensorInfo, shape: TensorInfo) -> None:
    rows, words = packed.shape if len(packed.shape) == 2 else (0, 0)
    expected = (rows, words * INT4_PER_WORD // INT4_GROUP)
    if (packed.dtype != np.int32 or len(packed.shape) != 2 or words * INT4_PER_WORD % INT4_GROUP
            or scale.dtype != BF16 or scale.shape != expected or shape.shape != (2,)
            or shape.dtype not in (np.int32, np.int64)):
        raise BadInputError(f"{packed.file}: INT4 {packed.name!r} {packed.dtype}{list(packed.shape)} with scale "
                            f"{scale.dtype}{list(scale.shape)} and shape {shape.dtype}{list(shape.shape)}: expected "
                            f"int32 (rows, cols/8), bfloat16 (rows, cols/{INT4_GROUP}) and int32 [2]")


@dataclass(frozen=True)
class LoraMerged:
    """A projection with a LoRA adapter folded in: ``W + (alpha / r) B A``, region by region.

    As MaxText 0.2.5's merged mode computes it (``to_maxtext.py``, ``_setup_merge_mode_getter``):
    ``B A`` in float32, times ``alpha / r`` in float32, added to ``W`` in float32 and rounded once to
    the output dtype (the dtype its getter hands the base weight in); the family's steps follow as for
    any weight. A region ``[rows, cols]`` of ``W`` needs only ``B[rows]`` and ``A[:, cols]``, read
    from the adapter beside it: the base streams in bounded memory, the adapter is never held whole.
    """

    base: Input
    a: TensorInfo  # lora_A (r, in)
    b: TensorInfo  # lora_B (out, r)
    adapter: Source
    scaling: float
    out_dtype: np.dtype

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def file(self) -> str:
        return self.base.file

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> np.dtype:
        return self.out_dtype

    @property
    def order(self) -> tuple[int, ...]:
        return self.base.order

    @property
    def whole_axes(self) -> tuple[int, ...]:
        return self.base.whole_axes

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.a.nbytes + self.b.nbytes

    @property
    def decode_bytes(self) -> int:
        """The base's own, then W and B A in float32 side by side."""
        return self.base.decode_bytes + 2 * FLOAT32_BYTES

    def check(self, source: Source) -> None:
        check = getattr(self.base, "check", None)
        if check is not None:
            check(source)

    def read(self, source: Source, box: Box) -> np.ndarray:
        (r0, r1), (c0, c1) = box
        rank = self.a.shape[0]
        # A whole (r x in: small), then its columns: a region of W cut along its columns (a band of one row)
        # would make A's columns a strided range, which is not one read
        a = read_box(self.adapter, self.a, ((0, rank), (0, self.a.shape[1])))[:, c0:c1].astype(np.float32)
        b = read_box(self.adapter, self.b, ((r0, r1), (0, rank))).astype(np.float32)
        delta = np.matmul(b, a) * np.float32(self.scaling)
        merged = self.base.read(source, box).astype(np.float32) + delta
        return merged.astype(self.out_dtype)
