"""The reusable buffers of a stream (ckptconv.read.buffers): a buffer anything still refers to is never handed out
again, one nothing refers to is, and what the pool keeps is bounded."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ckptconv.read.buffers import FIT, Pool, cast

KIB = 1024


def test_a_buffer_is_reused_only_once_nothing_refers_to_it():
    pool = Pool(min_bytes=KIB)
    with pool.scope():
        first = pool.empty((64, 64), np.uint16)
        address = first.__array_interface__["data"][0]
        held = memoryview(first)
        del first
        other = pool.empty((64, 64), np.uint16)
        assert other.__array_interface__["data"][0] != address
        del held
        again = pool.empty((64, 64), np.uint16)
        assert again.__array_interface__["data"][0] == address and pool.reused == 1


def test_every_holder_keeps_its_buffer():
    pool = Pool(min_bytes=KIB)
    with pool.scope():
        for make_holder in (memoryview, lambda a: np.frombuffer(memoryview(a), np.uint16), lambda a: a.T,
                            lambda a: a[1:], lambda a: a.view(np.int16).reshape(-1)):
            first = pool.empty((64, 64), np.uint16)
            first[...] = 7
            holder = make_holder(first)
            del first
            for _ in range(3):  # free buffers of the same size are there to take: the held one is never among them
                other = pool.empty((64, 64), np.uint16)
                other[...] = 9
            assert (np.asarray(holder) == 7).all()
            del holder, other


def test_outside_a_scope_and_below_the_size_arrays_are_plain():
    pool = Pool(min_bytes=4 * KIB)
    a = pool.empty(8 * KIB)
    assert a.base is None and pool.made == 0
    with pool.scope():
        assert pool.empty(KIB).base is None  # small: plain
        pooled = pool.empty(8 * KIB)
        assert pooled.base is not None and pool.kept_bytes() == 8 * KIB
    assert pool.kept_bytes() == 0  # the scope's end drops what was kept
    del pooled


def test_what_the_pool_keeps_is_bounded():
    pool = Pool(min_bytes=KIB, max_buffers=3)
    with pool.scope():
        held = [pool.empty(64 * KIB) for _ in range(5)]  # over the cap: plain arrays beyond it
        assert pool.made == 3 and pool.kept_bytes() == 3 * 64 * KIB
        del held
        assert 64 * KIB > 40 * KIB * FIT  # free buffers over FIT times the request are not taken: dropped
        small = pool.empty(40 * KIB)
        assert pool.kept_bytes() == 40 * KIB and small.base is not None
        assert pool.empty(40 * KIB).base is not None and pool.made == 5


def test_threads_never_share_a_buffer():
    pool = Pool(min_bytes=KIB, max_buffers=8)
    failures = []

    def work(mark: int) -> None:
        for _ in range(300):
            a = pool.empty((16, 256), np.uint16)
            a[...] = mark
            if not (a == mark).all():
                failures.append(mark)
            del a

    with pool.scope():
        threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failures and pool.reused > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cast_is_astype_bit_for_bit(dtype):
    import ml_dtypes  # noqa: F401 - names bfloat16 for numpy

    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 500)).astype(np.float32) * 1e3
    for source in (x, x.T, x.astype(dtype)):
        expected = np.ascontiguousarray(source.astype(dtype, copy=False))
        got = cast(source, dtype)
        assert got.dtype == expected.dtype and got.flags.c_contiguous
        assert got.tobytes() == expected.tobytes()
    same = x.astype(dtype)
    assert cast(same, dtype) is same
