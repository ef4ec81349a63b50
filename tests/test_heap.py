"""Freed heap memory goes back to the system when the engine asks (after converting a model)."""

from __future__ import annotations

import pytest

from ricllm.model.heap import release_free_heap


def anon_rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status here")


def test_release_free_heap_returns_the_holes_that_freed_temporaries_leave():
    """100 KB blocks (below glibc's mmap threshold: they come from the heap) each followed by a
    small block that stays, as a conversion's temporaries sit between the packed results: freeing
    the large ones leaves holes that the heap keeps, and RSS with them, until it is trimmed."""
    kept, freed = [], []
    for _ in range(1000):
        freed.append(bytearray(100_000))
        kept.append(bytearray(1_000))
    freed.clear()
    holding = anon_rss_mib()
    if not release_free_heap():
        pytest.skip("no glibc malloc_trim here")
    assert holding - anon_rss_mib() > 50, "about 100 MB of freed blocks stayed resident after the trim"
    assert len(kept) == 1000
