"""Numpy arrays that start on a cache line, for the C kernels to stream through.

numpy's allocator hands out addresses 16 bytes past a 64-byte boundary (glibc's malloc header in
front of an mmap'd block), so every 64-byte vector load of a numpy row straddles two cache lines
and a 128-byte bf16 K/V row touches three. The native runtime's KV pool had exactly that while
the torch runtime's tensors (64-byte aligned) did not: the same C decoder stack took ~15% longer
per 32-stream decode step on numpy's pool. Every array the native runtime hands to C per step or
keeps for the engine's life comes from here.
"""

from __future__ import annotations

import mmap

import numpy as np

CACHE_LINE = 64  # bytes; also the alignment of an AVX-512 vector
HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def aligned_empty(shape: int | tuple[int, ...], dtype: np.typing.DTypeLike) -> np.ndarray:
    """An uninitialized C-contiguous array whose first byte is on a cache line."""
    return _on_a_line(np.empty, shape, dtype)


def aligned_zeros(shape: int | tuple[int, ...], dtype: np.typing.DTypeLike) -> np.ndarray:
    """As :func:`aligned_empty`, zero-filled (by the system for a large array: its pages come zeroed)."""
    return _on_a_line(np.zeros, shape, dtype)


def _on_a_line(allocate, shape: int | tuple[int, ...], dtype: np.typing.DTypeLike) -> np.ndarray:
    """A view, starting on a cache line, into a byte array one line longer (the view keeps it alive)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = allocate(nbytes + CACHE_LINE, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def huge_page_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` zeroed bytes starting on a 2 MiB boundary, in anonymous memory the kernel is asked
    to back with transparent huge pages where it offers them (``madvise``). Weights that a step
    reads a few KB at a time, between megabytes of other weights, then take one TLB entry per
    2 MiB instead of one per 4 KiB page: each 4 KiB page would cost a page walk on every step."""
    padded = (nbytes + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # room to start on a boundary
    memory = mmap.mmap(-1, padded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(memory, dtype=np.uint8)  # keeps the mapping alive
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes]
