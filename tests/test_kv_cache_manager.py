"""``KVCacheManager`` hands back what a sequence takes and gives up, and never writes the sequence:
the sequence records the grant, the hashes and the evictions itself."""

from __future__ import annotations

import copy

from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.kv_window import EVICTED, window_of
from ricllm.sampling_params import SamplingParams
from ricllm.sequence import Sequence

BLOCK = 4


def _seq(tokens: list[int], **fields) -> Sequence:
    return Sequence(request_id="r", token_ids=tokens, num_prompt_tokens=len(tokens), params=SamplingParams(),
                    arrival_time=0.0, **fields)


def test_a_grant_is_recorded_by_the_sequence_and_its_hits_are_found_again():
    cache = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = _seq(list(range(10)))
    before = copy.deepcopy(first)
    grant = cache.allocate(first, 10)
    assert first.block_table == before.block_table == [] and first.num_cached_tokens == -1  # untouched
    assert len(grant.block_ids) == 3 and grant.hit_hashes == [] and grant.num_cached_tokens == 0
    first.take_blocks(grant)
    first.num_computed_tokens = 10
    hashes = cache.cache_full_blocks(first)
    assert len(hashes) == 2 and first.block_hashes == []
    first.block_hashes += hashes
    second = _seq(list(range(9)) + [99])
    hits = cache.find_cached_prefix(second.token_ids)
    grant = cache.allocate(second, 2, hits)
    assert grant.block_ids[:2] == first.block_table[:2] and grant.hit_hashes == hashes
    assert grant.num_computed_tokens == grant.num_cached_tokens == 8 and second.num_computed_tokens == 0
    second.take_blocks(grant)
    assert second.num_computed_tokens == second.num_cached_tokens == 8 and len(second.block_table) == 3
    assert cache.pool.num_used == 4  # two shared, one fresh each
    for seq in (first, second):
        cache.free(seq)
        seq.drop_blocks()
    assert cache.pool.num_used == 0 and first.block_table == second.block_table == []


def test_a_window_hands_back_the_positions_it_let_go():
    cache = KVCacheManager(num_blocks=16, block_size=BLOCK)
    seq = _seq(list(range(40)), kv_window=window_of(4, 8))
    seq.take_blocks(cache.allocate(seq, 40))
    seq.num_computed_tokens = 40
    seq.block_hashes += cache.cache_full_blocks(seq)
    gone = cache.evict_outside_window(seq)
    assert gone and seq.num_evicted_blocks == 0 and EVICTED not in seq.block_table  # not written
    seq.evict_blocks(gone)
    assert [seq.block_table[i] for i in gone] == [EVICTED] * len(gone) and seq.num_held_blocks == cache.pool.num_used
    assert cache.evict_outside_window(seq) == []  # nothing more to let go
