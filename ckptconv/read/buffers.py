"""Large buffers handed out again once nothing refers to them, so a stream reuses memory already faulted in.

Every read unit of a conversion is read into a new buffer (16 MiB by default), transposed or cast into another, and
let go once the writer has copied its tiles. Each fresh buffer of a megabyte or more is a new mapping (glibc's mmap
threshold is 1 MiB here, :func:`ckptconv.monitor.tune_malloc`): the kernel zeroes its pages as they are first written
(huge pages, for NumPy's large arrays), and unmaps them when it is freed. For OLMo 3 32B's block (5.6 GB) that was
about a tenth of the conversion's CPU, spent on bytes the read or the transpose overwrote at once.

Within :func:`pooled` (the producer's stream), :func:`empty` hands out a view of a pooled buffer that nothing else
refers to: a buffer is free when its reference count is the pool's own, since every array, memoryview or
tensorstore write made from a view keeps the view, and so the buffer, alive (NumPy's views refer to the array that
owns the memory). No caller gives anything back, and a buffer someone still holds is never handed out twice.

What the pool keeps is bounded by what was alive at once: a buffer is made only when none that is free fits (the
size asked for, up to ``FIT`` times it), the free ones that do not fit are dropped at that moment, at most
``MAX_BUFFERS`` are kept (more are plain arrays, freed as before), and the stream's end drops them all. So the
producer's memory is not above what it held before, at any time; its buffers stay resident between units instead of
going back and coming again.
"""

from __future__ import annotations

import math
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np

MIN_BYTES = 1 << 20  # smaller buffers come from glibc's heap, whose pages are reused already
FIT = 1.25  # a free buffer serves a request of at least 1/FIT of its size
MAX_BUFFERS = 64  # kept at most (the producer's live buffers: tiles queued, in writes, reads, transforms)
ALIGN = 1 << 12  # sizes kept rounded up to a page, so a unit's last, shorter read fits its neighbours' buffers


def _free_refs() -> int:
    """The reference count a kept buffer reads when only the pool holds it, measured as :meth:`Pool._free` reads it."""
    kept = [np.empty(1, np.uint8)]
    return sys.getrefcount(kept[0])


FREE_REFS = _free_refs()
# Whether a reference count can say a buffer is free: CPython with its GIL, where it counts exactly the list's and the
# call's references (2). Elsewhere (a free-threaded build defers counts) every request gets a fresh array, as before.
COUNTS_TELL = FREE_REFS == 2 and getattr(sys, "_is_gil_enabled", lambda: True)()


class Pool:
    """Buffers of ``MIN_BYTES`` or more, reused while at least one :meth:`scope` is open."""

    def __init__(self, min_bytes: int = MIN_BYTES, max_buffers: int = MAX_BUFFERS) -> None:
        self.min_bytes, self.max_buffers = min_bytes, max_buffers
        self._kept: list[np.ndarray] = []  # uint8 arrays that own their memory
        self._lock = threading.Lock()
        self._scopes = 0
        self.made = self.reused = 0  # buffers made for the pool, and requests served by one made before

    def empty(self, shape: tuple[int, ...] | int, dtype: np.dtype | type | str = np.uint8) -> np.ndarray:
        """An uninitialised C-contiguous array, as ``np.empty(shape, dtype)``, in a pooled buffer when in scope."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or not self._scopes or not COUNTS_TELL:
            return np.empty(shape, dtype)
        with self._lock:
            buffer = self._take(nbytes)
        if buffer is None:
            return np.empty(shape, dtype)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> np.ndarray | None:
        best = None
        for i in range(len(self._kept)):
            size = self._kept[i].nbytes
            if nbytes <= size <= nbytes * FIT and self._free(i) and (best is None or size < self._kept[best].nbytes):
                best = i
        if best is not None:
            self.reused += 1
            return self._kept[best]
        self._kept = [self._kept[i] for i in range(len(self._kept)) if not self._free(i)]  # none of them fits
        if len(self._kept) >= self.max_buffers:
            return None
        self._kept.append(np.empty(-(-nbytes // ALIGN) * ALIGN, np.uint8))
        self.made += 1
        return self._kept[-1]

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._kept[i]) <= FREE_REFS

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Reuse buffers until the last open scope closes; then drop them (those still held are freed by their
        holders, as any array)."""
        with self._lock:
            self._scopes += 1
        try:
            yield
        finally:
            with self._lock:
                self._scopes -= 1
                if not self._scopes:
                    self._kept = []

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(buffer.nbytes for buffer in self._kept)


POOL = Pool()  # the process's: the producer opens its scope, the reads and transforms take from it


def empty(shape: tuple[int, ...] | int, dtype: np.dtype | type | str = np.uint8) -> np.ndarray:
    """``np.empty(shape, dtype)``, from the process's pool while a stream runs (:func:`pooled`)."""
    return POOL.empty(shape, dtype)


def pooled():
    """The scope within which :func:`empty` reuses buffers (the producer's stream)."""
    return POOL.scope()


def cast(x: np.ndarray, dtype: np.dtype | type | str) -> np.ndarray:
    """``np.ascontiguousarray(x.astype(dtype, copy=False))``: ``x`` itself where it already is that, else a copy in
    a buffer from :func:`empty` (the same cast, ``casting="unsafe"`` as ``astype``'s, so the same bits)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype and x.flags.c_contiguous:
        return x
    out = empty(x.shape, dtype)
    np.copyto(out, x, casting="unsafe")
    return out
