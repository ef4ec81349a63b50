"""The block pool's invariants: counts add up, eviction is LRU, hits are verified by tokens."""

from __future__ import annotations

import pytest

from ricllm.cache.block_pool import BlockPool, hash_block
from ricllm.units import format_bytes, parse_bytes


def test_used_plus_free_is_constant_and_release_returns_blocks():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(3)]
    assert (pool.num_used, pool.num_free) == (3, 1)
    pool.acquire(blocks[0])  # shared by a second holder
    pool.release(blocks[0])
    assert pool.num_used == 3
    for b in blocks:
        pool.release(b)
    assert (pool.num_used, pool.num_free) == (0, 4)


def test_cached_blocks_stay_findable_until_reused_lru_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    ha, hb = hash_block(None, [1, 2]), hash_block(None, [3, 4])
    pool.register(a, ha, [1, 2])
    pool.register(b, hb, [3, 4])
    for block in (b, a, c):  # released in this order: b is least recently used
        pool.release(block)
    assert pool.num_cached_free == 2
    assert pool.lookup(ha, [1, 2]) is a and pool.lookup(hb, [3, 4]) is b
    first = pool.allocate()  # evicts b, the LRU block
    assert first is b and pool.lookup(hb, [3, 4]) is None and pool.lookup(ha, [1, 2]) is a
    pool.acquire(a)  # a hit revives a free cached block: it leaves the free queue
    assert pool.num_free == 1 and pool.allocate() is c


def test_hit_is_verified_against_stored_tokens():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.register(block, 1234, [7, 8])
    assert pool.lookup(1234, [7, 8]) is block
    assert pool.lookup(1234, [7, 9]) is None  # a colliding hash with other tokens is a miss


def test_hash_chains_over_the_prefix():
    assert hash_block(hash_block(None, [1]), [2]) != hash_block(hash_block(None, [9]), [2])


def test_one_hash_maps_to_one_block():
    pool = BlockPool(2)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, 42, [1])
    pool.register(second, 42, [1])
    assert second.block_hash is None and pool.lookup(42, [1]) is first


@pytest.mark.parametrize("text, value", [
    ("256MiB", 256 * 2**20), ("1GB", 10**9), ("1.5GiB", int(1.5 * 2**30)), ("4096", 4096), (512, 512),
    ("64 KiB", 65536), ("2g", 2 * 2**30),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_format_bytes():
    assert format_bytes(256 * 2**20) == "256.0 MiB" and format_bytes(100) == "100 B"
