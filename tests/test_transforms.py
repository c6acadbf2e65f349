"""Each transform step against a from-scratch restatement, and against its inverse."""

import math

import numpy as np
import pytest

from ckptconv import transforms as t
from ckptconv.spec import ModelSpec


def spec(**overrides) -> ModelSpec:
    base = dict(family="llama", model_type="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=24, tie_word_embeddings=False, rms_norm_eps=1e-6,
                rope_theta=1e4, rope_type="llama3", interleave_rope=True, max_position_embeddings=128)
    return ModelSpec(**{**base, **overrides})


def test_rope_interleave_matches_index_formula():
    d = 8
    x = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    out = t.ROPE_INTERLEAVE.apply(x, spec())
    for j in range(d):  # MaxText position j takes HF position j//2 + (j%2)*d/2
        np.testing.assert_array_equal(out[:, j], x[:, j // 2 + (j % 2) * d // 2])


@pytest.mark.parametrize("forward, inverse", [
    (t.ROPE_INTERLEAVE, t.ROPE_DEINTERLEAVE),
    (t.ROPE_TO_MAXTEXT, t.ROPE_FROM_MAXTEXT),
    (t.SCALE_QUERY, t.UNSCALE_QUERY),
    (t.NORM_PLUS_ONE, t.NORM_MINUS_ONE),
])
def test_steps_invert(forward, inverse):
    x = np.random.default_rng(0).standard_normal((5, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(inverse.apply(forward.apply(x, spec()), spec()), x, rtol=1e-6, atol=1e-6)


def test_rope_to_maxtext_is_identity_without_interleave():
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_array_equal(t.ROPE_TO_MAXTEXT.apply(x, spec(interleave_rope=False)), x)


def test_query_kernel_chain_equals_restatement():
    s = spec()
    w = np.random.default_rng(1).standard_normal((s.num_heads * s.head_dim, s.hidden_size)).astype(np.float32)
    steps = (t.TRANSPOSE, t.split_last(t.q_heads), t.ROPE_TO_MAXTEXT, t.SCALE_QUERY)
    out = t.apply_steps(w, steps, s)
    expected = w.T.reshape(s.hidden_size, s.num_heads, s.head_dim)
    perm = [j // 2 + (j % 2) * s.head_dim // 2 for j in range(s.head_dim)]
    expected = expected[:, :, perm] / math.sqrt(s.head_dim)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert t.output_shape(w.shape, steps, s) == out.shape


def test_out_kernel_shape_and_values():
    s = spec()
    w = np.arange(s.hidden_size * s.num_heads * s.head_dim, dtype=np.float32).reshape(s.hidden_size, -1)
    steps = (t.TRANSPOSE, t.split_first(t.q_heads))
    out = t.apply_steps(w, steps, s)
    assert out.shape == (s.num_heads, s.head_dim, s.hidden_size) == t.output_shape(w.shape, steps, s)
    np.testing.assert_array_equal(out[1, 2, 3], w[3, 1 * s.head_dim + 2])


def test_value_changing_steps_compute_in_float32():
    import ml_dtypes

    w = np.full((4, 4), 3.0, dtype=ml_dtypes.bfloat16)
    out = t.apply_steps(w, (t.SCALE_QUERY,), spec())
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, 3.0 / math.sqrt(8), rtol=1e-7)
    assert t.apply_steps(w, (t.TRANSPOSE,), spec()).dtype == w.dtype  # pure moves keep the dtype
