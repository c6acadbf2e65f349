"""Each transform step against a from-scratch restatement, against its inverse, and region by region.

The region property is what lets the converter stream: transforming a cut of the source must
give exactly the cut of the transformed tensor that ``forward`` names.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from ckptconv.families import transforms as t
from ckptconv.read.spec import ModelSpec


def spec(interleave: bool = True, **dims) -> ModelSpec:
    base = {"emb": 16, "heads": 4, "kv_heads": 2, "hd": 8, "maxtext_vocab": 40, "qkv": 48, "group": 12, "one": 1}
    return ModelSpec("llama", "llama", 2, {**base, **dims},
                     {"interleave_rope": interleave, "query_scale": t.query_scale(8), "embed_scale": 4.0})


def test_rope_interleave_matches_index_formula():
    d = 8
    x = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    out = t.ROPE_TO_MAXTEXT.apply(x, spec(), t.full_box(x.shape))
    for j in range(d):  # MaxText position j takes HF position j//2 + (j%2)*d/2
        np.testing.assert_array_equal(out[:, j], x[:, j // 2 + (j % 2) * d // 2])


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_rope_interleave_is_the_swapped_axes_both_ways(dtype):
    """Pairs made from halves (HF -> MaxText) and halves from pairs (back), on a stack of heads, in any dtype: the
    index formula's restatement as NumPy's swapped axes, and each the other's inverse."""
    x = np.random.default_rng(0).standard_normal((3, 5, 8)).astype(dtype)
    to_pairs = t.ROPE_TO_MAXTEXT.apply(x, spec(), t.full_box(x.shape))
    want = np.ascontiguousarray(x.reshape(3, 5, 2, 4).swapaxes(-1, -2).reshape(x.shape))
    assert to_pairs.dtype == x.dtype
    np.testing.assert_array_equal(to_pairs.view(np.uint8), want.view(np.uint8))
    back = t.ROPE_TO_MAXTEXT.inverse().apply(to_pairs, spec(), t.full_box(x.shape))
    np.testing.assert_array_equal(back.view(np.uint8), x.view(np.uint8))
    assert t.ROPE_TO_MAXTEXT.apply(x, spec(interleave=False), t.full_box(x.shape)) is x


@pytest.mark.parametrize("perm", [(1, 0), (0, 2, 1), (0, 1, 3, 2), (1, 0, 2), (2, 1, 0)])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float32, np.int64])
def test_permute_is_numpys_transpose(perm, dtype):
    """Every permutation equals NumPy's, whichever copy makes it: a stack of matrices is transposed band by band
    (rows not a multiple of the band, a stack of one, an empty matrix), others in one strided copy."""
    rng = np.random.default_rng(0)
    for shape in ((37, 21, 5, 3)[:len(perm)], (1, 50, 17, 2)[:len(perm)], (3, 0, 4, 1)[:len(perm)]):
        x = rng.integers(0, 120, shape).astype(dtype)
        out = t.Permute("p", perm).apply(x, spec(), t.full_box(shape))
        assert out.dtype == x.dtype and out.flags.c_contiguous
        np.testing.assert_array_equal(out.view(np.uint8), np.ascontiguousarray(np.transpose(x, perm)).view(np.uint8))


@pytest.mark.parametrize("forward", [t.ROPE_TO_MAXTEXT, t.SCALE_QUERY, t.NORM_PLUS_ONE, t.SCALE_EMBEDDING,
                                     t.TRANSPOSE, t.split_last("heads")],
                         ids=lambda s: s.name)
def test_steps_invert(forward):
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    s = spec()
    y = t.apply_steps(x, (forward,), s)
    back = t.apply_steps(y, (forward.inverse(),), s)
    np.testing.assert_allclose(back, x, rtol=1e-6, atol=1e-6)
    assert t.output_shape(y.shape, (forward.inverse(),), s) == x.shape


def test_rope_is_identity_without_interleave():
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_array_equal(t.ROPE_TO_MAXTEXT.apply(x, spec(interleave=False), t.full_box(x.shape)), x)


def test_query_kernel_chain_equals_restatement():
    s = spec()
    w = np.random.default_rng(1).standard_normal((4 * 8, 16)).astype(np.float32)
    steps = (t.TRANSPOSE, t.split_last("heads"), t.ROPE_TO_MAXTEXT, t.SCALE_QUERY)
    out = t.apply_steps(w, steps, s)
    expected = w.T.reshape(16, 4, 8)
    perm = [j // 2 + (j % 2) * 4 for j in range(8)]
    expected = expected[:, :, perm] / math.sqrt(8)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert t.output_shape(w.shape, steps, s) == out.shape


def test_out_kernel_shape_and_values():
    s = spec()
    w = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    steps = (t.TRANSPOSE, t.split_first("heads"))
    out = t.apply_steps(w, steps, s)
    assert out.shape == (4, 8, 16) == t.output_shape(w.shape, steps, s)
    np.testing.assert_array_equal(out[1, 2, 3], w[3, 1 * 8 + 2])


def test_value_changing_steps_compute_in_float32():
    w = np.full((4, 4), 3.0, dtype=ml_dtypes.bfloat16)
    out = t.apply_steps(w, (t.SCALE_QUERY,), spec())
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, 3.0 / math.sqrt(8), rtol=1e-7)
    assert t.apply_steps(w, (t.TRANSPOSE,), spec()).dtype == w.dtype  # pure moves keep the dtype


def test_resize_pads_with_zeros_and_truncates():
    s = spec()
    x = np.arange(30 * 2, dtype=np.float32).reshape(30, 2)
    padded = t.apply_steps(x, (t.RESIZE_VOCAB,), s)
    assert padded.shape == (40, 2) and (padded[:30] == x).all() and (padded[30:] == 0).all()
    cut = t.apply_steps(np.arange(50 * 2, dtype=np.float32).reshape(50, 2), (t.RESIZE_VOCAB,), s)
    assert cut.shape == (40, 2) and cut[-1, 1] == 79


def test_take_strided_splits_interleaved_columns():
    x = np.arange(24, dtype=np.float32).reshape(2, 12)
    even = t.apply_steps(x, (t.TakeStrided("even", -1, 0, 2),), spec())
    odd = t.apply_steps(x, (t.TakeStrided("odd", -1, 1, 2),), spec())
    np.testing.assert_array_equal(even, x[:, 0::2])
    np.testing.assert_array_equal(odd, x[:, 1::2])


CHAINS = {
    "q kernel": ((32, 16), (t.TRANSPOSE, t.split_last("heads"), t.ROPE_TO_MAXTEXT, t.SCALE_QUERY)),
    "out kernel": ((16, 32), (t.TRANSPOSE, t.split_first("heads"))),
    "mlp kernel": ((24, 16), (t.TRANSPOSE,)),
    "embedding pad": ((30, 16), (t.RESIZE_VOCAB, t.SCALE_EMBEDDING)),
    "embedding cut": ((50, 16), (t.SCALE_EMBEDDING, t.RESIZE_VOCAB)),
    "bias": ((32,), (t.split_last("heads"),)),
    "fused experts": ((3, 16, 12), (t.Permute("swap", (0, 2, 1)), t.TakeStrided("odd", -1, 1, 2))),
    # k of a fused [q (32) | k (8) | v (8)] projection: one period, the whole axis
    "fused projection": ((48, 16), (t.TakeRanges("k", 0, "qkv", 32, 8), t.TRANSPOSE, t.split_last("kv_heads"))),
    # v of head groups regrouped [q (4) | k (4) | v (4)] x 4: the same range of every group
    "regrouped heads": ((48, 16), (t.TakeRanges("v", 0, "group", 8, 4), t.TRANSPOSE)),
}


@pytest.mark.parametrize("name", CHAINS)
def test_regions_transform_to_the_forward_box(name):
    """For every band a chain allows, transforming the band = the band's box of the whole transform."""
    shape, steps = CHAINS[name]
    s = spec()
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    whole = t.apply_steps(x, steps, s)
    for axis in range(len(shape)):
        quantum, _ = t.chain_quantum(axis, shape, steps, s)
        if quantum == t.WHOLE:
            break
        if any(t.chain_quantum(a, shape, steps, s)[0] != 1 for a in range(axis)):
            break  # earlier axes cannot be fixed to single indices: no band on this axis
        for band in {quantum, 2 * quantum}:
            for start in range(0, shape[axis], band):
                prefix = tuple((0, 1) for _ in shape[:axis])
                box = prefix + ((start, min(start + band, shape[axis])),) + t.full_box(shape[axis + 1:])
                boxes = t.forward_boxes(box, shape, steps, s)
                part = t.apply_steps(x[t.box_slices(box)], steps, s, boxes)
                np.testing.assert_array_equal(part, whole[t.box_slices(boxes[-1])], err_msg=f"{name} {box}")


def test_misaligned_cut_is_refused():
    s = spec()
    with pytest.raises(t.Misaligned):
        t.forward_boxes(((0, 5), (0, 16)), (32, 16), (t.TRANSPOSE, t.split_last("heads")), s)
    quantum, axis = t.chain_quantum(0, (32, 16), (t.TRANSPOSE, t.split_last("heads")), s)
    assert (quantum, axis) == (8, 1)
    assert t.chain_quantum(1, (32, 16), (t.TRANSPOSE, t.split_last("heads")), s) == (1, 0)


@pytest.mark.parametrize("name", [n for n in CHAINS if n not in ("fused experts", "fused projection",
                                                                  "regrouped heads")])
def test_regions_invert_to_the_source_band(name):
    """What export does: the forward box of a band, read from the whole transform and undone,
    is the band itself (rows a truncating Resize dropped come back as zeros)."""
    shape, steps = CHAINS[name]
    s = spec(vocab=shape[0])
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    whole = t.apply_steps(x, steps, s)
    quantum, _ = t.chain_quantum(0, shape, steps, s)
    for start in range(0, shape[0], 2 * quantum):
        box = ((start, min(start + 2 * quantum, shape[0])),) + t.full_box(shape[1:])
        leaf = whole[t.box_slices(t.forward_boxes(box, shape, steps, s)[-1])]
        out = np.empty(t.box_shape(box), np.float32)
        t.apply_inverse(leaf, steps, s, t.inverse_boxes(box, shape, steps, s), out)
        kept = min(box[0][1], s.dim("maxtext_vocab")) - start if any(isinstance(p, t.Resize) for p in steps) else None
        want = x[t.box_slices(box)].copy()
        if kept is not None and kept < len(want):
            want[max(kept, 0):] = 0
        np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=f"{name} {box}")


def test_put_strided_assembles_the_fused_tensor_from_both_leaves():
    x = np.arange(3 * 16 * 12, dtype=np.float32).reshape(3, 16, 12)
    swap = t.Permute("swap", (0, 2, 1))
    halves = [(t.TakeStrided(n, -1, start, 2), swap) for n, start in (("even", 0), ("odd", 1))]
    out = np.full(x.shape, np.nan, np.float32)
    for steps in halves:
        leaf = t.apply_steps(x, steps, spec())
        t.apply_inverse(leaf, steps, spec(), t.inverse_boxes(t.full_box(x.shape), x.shape, steps, spec()), out)
    np.testing.assert_array_equal(out, x)
    with pytest.raises(NotImplementedError):
        t.apply_steps(x, (t.TakeStrided("odd", -1, 1, 2).inverse(),), spec())


def test_take_ranges_is_the_restated_split_and_its_inverse_the_join():
    """A fused projection and regrouped heads split into their parts (against plain slicing), and the parts'
    inverses join them back into the fused tensor, whole."""
    x = np.arange(48 * 16, dtype=np.float32).reshape(48, 16)
    fused = {"q": (0, 32), "k": (32, 8), "v": (40, 8)}  # one period: the whole axis
    grouped = {"q": (0, 4), "k": (4, 4), "v": (8, 4)}  # every period of 12
    for parts, period, restate in ((fused, "qkv", lambda a, b: x[a:a + b]),
                                   (grouped, "group", lambda a, b: x.reshape(4, 12, 16)[:, a:a + b].reshape(-1, 16))):
        out = np.full(x.shape, np.nan, np.float32)
        for name, (start, width) in parts.items():
            steps = (t.TakeRanges(name, 0, period, start, width), t.TRANSPOSE)
            leaf = t.apply_steps(x, steps, spec())
            np.testing.assert_array_equal(leaf, restate(start, width).T)
            assert t.output_shape(x.shape, steps, spec()) == leaf.shape
            t.apply_inverse(leaf, steps, spec(), t.inverse_boxes(t.full_box(x.shape), x.shape, steps, spec()), out)
        np.testing.assert_array_equal(out, x)
    assert t.TakeStrided("odd", -1, 1, 2) == t.TakeRanges("odd", -1, 2, 1, 1)  # interleaved: ranges one wide
    with pytest.raises(t.Misaligned):
        t.TakeRanges("k", 0, 10, 8, 4).shape((48, 16), spec())  # a range beyond its period


def _maxtext_dequantize(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MaxText 0.2.5's ``dequantize_weight`` block path (layers/quantizations.py L131-139), restated: each kernel
    axis cut into ``dim / scale dim`` equal blocks, refused unless every axis divides."""
    assert scale.ndim == w.ndim and all(d % s == 0 for d, s in zip(w.shape, scale.shape)), (w.shape, scale.shape)
    interleaved = tuple(dim for s, d in zip(scale.shape, w.shape) for dim in (s, d // s))
    return (w.reshape(interleaved) * scale.reshape(tuple(dim for s in scale.shape for dim in (s, 1)))).reshape(w.shape)


# DeepSeek-V3's FP8 weights whose 128-blocks do not tile MaxText's kernel (rows, cols, HF -> MaxText steps):
# q_b_proj (heads x (128 nope + 64 rope), q_lora), kv_a_proj_with_mqa (512 + 64, emb), and a tiny model's
# (heads x 24, 192); kv_b_proj's whole blocks a head and o_proj's columns split, where regrouping is the identity
REGROUPED = {
    "q_b_proj": (4 * 192, 1536, (t.TRANSPOSE, t.split_last("heads")), "heads", None),
    "kv_a_proj": (576, 7168, (t.TRANSPOSE,), None, None),
    "tiny q_b_proj": (4 * 24, 192, (t.TRANSPOSE, t.split_last("heads")), "heads", None),
    "kv_b_proj": (4 * 256, 512, (t.TRANSPOSE, t.split_last("heads")), "heads", None),
    "o_proj": (256, 4 * 128, (t.TRANSPOSE, t.split_first("heads")), None, "heads"),
}


@pytest.mark.parametrize("name", REGROUPED)
def test_regrouped_block_scales_dequantise_as_the_release(name):
    """Regrouped block scales, through the weight's own steps, dequantise MaxText's kernel by MaxText's rule to
    exactly the release's dequantised weight through the same steps; Ungroup gives the release's scales back."""
    rows, cols, steps, row_parts, col_parts = REGROUPED[name]
    s = spec(rows=rows, cols=cols)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((rows, cols)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    blocks = rng.uniform(0.5, 2.0, (-(-rows // 128), -(-cols // 128))).astype(np.float32)
    dequantised = w * np.repeat(np.repeat(blocks, 128, 0), 128, 1)[:rows, :cols]
    regroup = (t.Regroup("rows", 0, "rows", row_parts), t.Regroup("cols", 1, "cols", col_parts))
    scale = t.apply_steps(blocks, regroup + steps, s)
    assert scale.shape == t.output_shape(blocks.shape, regroup + steps, s)
    kernel = t.apply_steps(w, steps, s)
    np.testing.assert_array_equal(_maxtext_dequantize(kernel, scale), t.apply_steps(dequantised, steps, s))
    np.testing.assert_array_equal(t.apply_steps(scale, t.inverse_steps(regroup + steps), s), blocks)
    if rows % 128 == 0 and (rows // s.dim(row_parts or "one")) % 128 == 0:
        assert t.apply_steps(blocks, regroup, s).shape == blocks.shape  # whole blocks a part: the grid itself
