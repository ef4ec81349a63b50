"""Shared prompt prefixes reuse KV blocks, give the same tokens, and pins keep them resident."""

from __future__ import annotations

import pytest

from ricllm import LLM, SamplingParams
from ricllm.errors import CapacityError
from tests.test_oracle_parity import random_prompts

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
BLOCK = 16


def make_llm(tiny_gguf, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_budget", "8MiB")
    return LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, **kwargs)


@pytest.fixture(scope="module")
def system_and_questions(tiny_gguf):
    from ricllm.model.loader import open_checkpoint

    vocab = open_checkpoint(tiny_gguf).spec.vocab_size
    return random_prompts(vocab, (40, 9, 13, 84, 84), seed=3)


def test_second_request_reuses_full_blocks_of_shared_prefix(tiny_gguf, system_and_questions):
    system, q1, q2 = system_and_questions[:3]
    llm = make_llm(tiny_gguf)
    first = llm.generate([system + q1], PARAMS)[0]
    second = llm.generate([system + q2], PARAMS)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(system) // BLOCK) * BLOCK  # 32: two full blocks
    uncached = make_llm(tiny_gguf, enable_prefix_caching=False).generate([system + q2], PARAMS)[0]
    assert second.token_ids == uncached.token_ids and uncached.num_cached_tokens == 0
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_queries_tokens"] == len(system + q1) + len(system + q2)
    assert stats["prefix_cache_hits_tokens"] == 32


def test_last_prompt_token_is_always_recomputed(tiny_gguf, system_and_questions):
    system = system_and_questions[0][:2 * BLOCK]  # exactly two full blocks
    llm = make_llm(tiny_gguf)
    first = llm.generate([system], PARAMS)[0]
    again = llm.generate([system], PARAMS)[0]
    assert again.num_cached_tokens == BLOCK  # the second block holds the last token: recomputed
    assert again.token_ids == first.token_ids


def test_pinned_prefix_survives_eviction_and_unpinned_does_not(tiny_gguf, system_and_questions):
    system, q1, q2, filler_a, filler_b = system_and_questions
    for pin in (True, False):
        llm = make_llm(tiny_gguf, kv_cache_budget=12 * BLOCK * 512)  # 12 blocks of 16 fp32 tokens
        handle = llm.pin_prefix(system) if pin else None
        if not pin:
            llm.generate([system + q1], PARAMS)
        llm.generate([filler_a, filler_b], PARAMS)  # 6 blocks each: takes every unpinned block
        out = llm.generate([system + q2], PARAMS)[0]
        assert out.num_cached_tokens == (32 if pin else 0)
        if pin:
            assert llm.kv_cache_stats()["pinned_blocks"] == 2
            llm.unpin_prefix(handle)
            stats = llm.kv_cache_stats()
            assert stats["pinned_blocks"] == 0 and stats["used_blocks"] == 0
            assert stats["cached_free_blocks"] >= 2  # unpinned blocks stay findable until reused


def test_pinning_a_chat_system_prompt_pins_its_rendered_form(tiny_gguf):
    llm = make_llm(tiny_gguf)
    system = [{"role": "system", "content": "You are a RAN configuration assistant. " * 4}]
    handle = llm.pin_prefix(system)
    rendered = llm.render_chat(system, add_generation_prompt=False)
    assert len(handle.block_ids) == len(rendered) // BLOCK > 0
    out = llm.chat(system + [{"role": "user", "content": "cell 7 PRB 91%"}], PARAMS)[0]
    assert out.num_cached_tokens == len(handle.block_ids) * BLOCK


def test_pin_larger_than_budget_is_a_clear_error(tiny_gguf, system_and_questions):
    llm = make_llm(tiny_gguf, kv_cache_budget=3 * BLOCK * 512)  # 3 blocks
    with pytest.raises(CapacityError, match=r"pinning 84 tokens needs 5 full KV blocks, but only 2"):
        llm.pin_prefix(system_and_questions[3])


def test_a_prefix_cached_under_one_adapter_is_found_only_under_it():
    """K/V computed under a LoRA adapter is that adapter's: the same tokens under another adapter,
    under a replaced adapter of new content, or under none are a miss."""
    from ricllm.cache.kv_cache_manager import KVCacheManager
    from ricllm.lora_request import AdapterSlot
    from ricllm.sampling_params import SamplingParams
    from ricllm.sequence import Sequence

    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 14))  # three full blocks and a token
    first, second = AdapterSlot("congestion", 0, "a" * 64), AdapterSlot("energy", 1, "b" * 64)
    seq = Sequence("pin", list(tokens), len(tokens), SamplingParams(), 0.0, adapter=first)
    seq.take_blocks(manager.allocate(seq, len(tokens)))
    seq.num_computed_tokens = len(tokens)
    seq.block_hashes += manager.cache_full_blocks(seq)

    assert len(manager.find_cached_prefix(tokens, first)) == 3
    assert manager.find_cached_prefix(tokens, AdapterSlot("congestion", 3, "a" * 64)), "same content, any slot"
    assert manager.find_cached_prefix(tokens, second) == []
    assert manager.find_cached_prefix(tokens, AdapterSlot("congestion", 0, "c" * 64)) == [], "replaced content"
    assert manager.find_cached_prefix(tokens) == []
