"""Handing freed heap memory back to the system, so that RSS follows what the process holds."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the heap's free pages to the system; False where that is not possible.

    glibc keeps freed allocations below its mmap threshold in the heap for reuse. Converting a
    model frees a burst of temporaries (each layer's dequantized tensors, between the packed
    results that stay), and the heap keeps them: SmolLM2's first start held 200-300 MB more RSS
    than its live tensors when the KV pool was allocated after it. ``malloc_trim(0)`` gives those
    pages back; it costs a few milliseconds, so the engine calls it after each converted layer
    and once the model file is closed, never per step.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
