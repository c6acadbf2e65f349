"""The writer lets tensorstore refer to a tile instead of copying it into the transaction's chunks (``orbax._owns``):
only where the tile is the whole of its memory, and the producer's pool never hands such a buffer out again before
the data file commits (tensorstore's reference keeps its count up)."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import tensorstore as ts

from ckptconv.read import buffers
from ckptconv.write import codecs, orbax, orbax_layout

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_owns_whole_buffers_only():
    assert orbax._owns(np.empty((256, 1024), BF16))
    whole = np.empty(2 << 20, np.uint8)
    assert orbax._owns(whole.view(BF16).reshape(1024, 1024))  # a view of all of it
    assert not orbax._owns(whole[: 1 << 20])  # half of it: referring would hold the other half
    assert not orbax._owns(np.empty((1024, 1024), BF16)[:, :512])  # not contiguous
    read = np.frombuffer(memoryview(whole), dtype=BF16).reshape(1024, 1024)  # a read through a memoryview
    assert orbax._owns(read)


def test_referenced_pool_buffer_not_reused_until_commit(tmp_path):
    spec = orbax._with_checksum(codecs.with_codec(orbax_layout.array_write_spec(
        str(tmp_path), "w", shape=(1024, 1024), dtype=BF16, chunk_shape=(512, 1024), compress=True,
        process_id="0"), "zstd", BF16))

    async def run() -> None:
        store = await ts.open(ts.Spec(spec), create=True, open=True, context=orbax_layout.context(8_000_000))
        with buffers.pooled():
            tile = buffers.empty((512, 1024), BF16)
            tile[...] = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024).astype(BF16)
            address = tile.ctypes.data
            assert orbax._owns(tile)
            txn = ts.Transaction(atomic=True)
            write = store.with_transaction(txn)[:512].write(tile, can_reference_source_data_indefinitely=True)
            await write.copy
            del tile
            other = buffers.empty((512, 1024), BF16)  # the first is still referred to by the transaction
            assert other.ctypes.data != address
            other[...] = 0  # had the pool handed the first buffer out again, the stored tile would read zeros
            addresses = (address, other.ctypes.data)
            await txn.commit_async()
            await write
            del write, txn, other
            again = buffers.empty((512, 1024), BF16)
            assert again.ctypes.data in addresses  # committed: the buffers are free again
        stored = await store[:512].read()
        expected = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024).astype(BF16)
        assert np.array_equal(stored.view(np.uint16), expected.view(np.uint16))

    if buffers.COUNTS_TELL:
        asyncio.run(run())


def test_let_go_buffer_is_not_kept_or_handed_out_again():
    """A buffer written by reference leaves the producer's pool (the writer calls ``let_go``): it is freed once the
    write lets go, and the pool keeps only what the stream holds itself."""
    if not buffers.COUNTS_TELL:
        return
    with buffers.pooled():
        tile = buffers.empty((1024, 1024), BF16)
        read = np.frombuffer(memoryview(buffers.empty(2 << 20)), dtype=BF16).reshape(1024, 1024)
        kept = buffers.POOL.kept_bytes()
        assert buffers.POOL.let_go(tile) and buffers.POOL.let_go(read)  # a view, and a read through a memoryview
        assert buffers.POOL.kept_bytes() == kept - 2 * (2 << 20)
        assert not buffers.POOL.let_go(np.empty((1024, 1024), BF16))  # never the pool's
        del tile, read
        made = buffers.POOL.made
        buffers.empty((1024, 1024), BF16)
        assert buffers.POOL.made == made + 1  # a new buffer: the one let go was not the pool's to hand out
