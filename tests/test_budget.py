"""Under more load than the KV budget holds, every request finishes with its solo tokens,
the pool is never oversubscribed, and the preallocated pool is the only KV storage."""

from __future__ import annotations

from ricllm import LLM, SamplingParams
from tests.test_oracle_parity import random_prompts

BLOCK = 16
BYTES_PER_TOKEN_FP32 = 2 * 2 * 2 * 16 * 4  # 2·L·n_kv·d_h·4 for the tiny model
NUM_BLOCKS = 24


def check_pool_invariants(engine) -> None:
    pool, cache, scheduler = engine.cache.pool, engine.cache, engine.scheduler
    assert pool.num_used + pool.num_free == pool.num_blocks
    holders = [seq.block_table for seq in scheduler.running] + [p.block_ids for p in cache.pins.values()]
    refs = {}
    for table in holders:
        for block_id in table:
            if block_id != -1:  # EVICTED by a KV window: no reference held
                refs[block_id] = refs.get(block_id, 0) + 1
    assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == refs
    assert all(not seq.block_table for seq in scheduler.waiting)


def generate_checking_pool(llm, prompts, params):
    """``llm.generate`` with the pool invariants checked after every engine step."""
    engine = llm.engine
    original_step = engine.step

    def checked_step():
        finished = original_step()
        check_pool_invariants(engine)
        return finished

    engine.step = checked_step
    return llm.generate(prompts, params)


def assert_budget_held(llm, num_blocks: int, budget: int) -> None:
    """After a run on a tight budget: the scheduler had to wait or preempt, every block came
    back, and the KV pool tensors (the only KV storage) fit the budget."""
    stats = llm.kv_cache_stats()
    assert stats["num_blocks"] == num_blocks
    assert stats["preemptions"] + stats["waits"] > 0, "the budget never constrained the scheduler"
    assert stats["peak_used_blocks"] <= num_blocks and stats["used_blocks"] == 0
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in llm.engine.kv_cache.layers)
    assert kv_bytes == stats["allocated_bytes"] <= stats["budget_bytes"] == budget


def test_sixty_four_requests_on_a_small_budget(tiny_gguf):
    budget = NUM_BLOCKS * BLOCK * BYTES_PER_TOKEN_FP32
    llm = LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, kv_cache_budget=budget, max_num_seqs=64)
    engine = llm.engine
    prompts = random_prompts(engine.spec.vocab_size, [5 + (7 * i) % 40 for i in range(64)], seed=11)
    params = [SamplingParams(max_tokens=8 + i % 17, ignore_eos=True) for i in range(64)]

    outputs = generate_checking_pool(llm, prompts, params)

    assert_budget_held(llm, NUM_BLOCKS, budget)
    assert {name for name, _ in engine.runtime.model.named_buffers()} == {"rope.cos", "rope.sin"}

    solo = LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, kv_cache_budget="8MiB", max_num_seqs=1)
    for prompt, p, out in zip(prompts, params, outputs):
        assert len(out.token_ids) == p.max_tokens
        assert out.token_ids == solo.generate([prompt], p)[0].token_ids


def test_preemption_recomputes_to_identical_tokens(tiny_gguf):
    # 6 blocks; two requests of 40 + 40 tokens need 5 blocks each at the end: one must be preempted.
    llm = LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, kv_cache_budget=6 * BLOCK * BYTES_PER_TOKEN_FP32,
              enable_prefix_caching=False)
    prompts = random_prompts(llm.engine.spec.vocab_size, (40, 40), seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.kv_cache_stats()["preemptions"] >= 1
    solo = LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, kv_cache_budget="8MiB")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in solo.generate(prompts, params)]
