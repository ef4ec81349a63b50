"""Sink + window retention: what a windowed request holds, what its queries see, what it must not
free, and what admission reserves for it."""

from __future__ import annotations

import itertools

import pytest

from ricllm import LLM, SamplingParams
from ricllm.errors import InvalidRequestError
from ricllm.kv_window import EVICTED, KVWindow
from tests.test_budget import check_pool_invariants
from tests.test_oracle_parity import random_prompts

BLOCK = 16


def _simulate(window: KVWindow, total: int, chunks: list[int], block_size: int):
    """Steps of the given sizes over ``total`` tokens: after each, the blocks held and the keys any
    later query may still see."""
    held, computed = set(), 0
    for chunk in itertools.cycle(chunks):
        if computed >= total:
            return
        end = min(computed + chunk, total)
        held |= set(range(computed // block_size, (end - 1) // block_size + 1))  # allocated for this step
        needed = {j // block_size for p in range(computed, end) for j in range(p + 1) if window.visible(j, p)}
        yield held, needed, end - computed
        computed = end
        held -= set(window.evictable(computed, block_size))


@pytest.mark.parametrize("sinks,window,chunks", [
    (4, 1, [1]), (0, 16, [1]), (4, 31, [7, 1]), (16, 33, [64, 1, 1]), (20, 100, [50, 3]), (1, 17, [16, 16, 1])])
def test_a_windowed_sequence_holds_what_its_queries_see_and_never_more_than_the_bound(sinks, window, chunks):
    w = KVWindow(sinks, window)
    for held, needed, chunk in _simulate(w, 400, chunks, BLOCK):
        assert needed <= held, "a query would read an evicted block"
        assert len(held) <= w.max_blocks(max(chunks), BLOCK)
    # the bound is tight: some step reaches it (the sinks apart, which small windows may overlap)
    assert max(len(h) for h, _, _ in _simulate(w, 400, chunks, BLOCK)) >= w.max_blocks(max(chunks), BLOCK) - 1 - \
        -(-sinks // BLOCK)


def _windowed_engine(tiny_gguf, **settings):
    return LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, kv_cache_budget="4MiB", **settings)


def test_the_answer_does_not_depend_on_how_the_prompt_was_chunked(tiny_gguf):
    prompts = random_prompts(256, [150, 97], seed=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True, kv_window=40, kv_sinks=5)
    answers = [[o.token_ids for o in _windowed_engine(tiny_gguf, max_num_batched_tokens=chunk).generate(prompts, params)]
               for chunk in (8, 33, 512)]
    assert answers[0] == answers[1] == answers[2]
    exact = _windowed_engine(tiny_gguf).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in exact] != answers[0], "the window changed nothing: it is not applied"


def test_held_blocks_stay_within_the_window_bound_at_every_step(tiny_gguf):
    llm = _windowed_engine(tiny_gguf, max_num_batched_tokens=24, kv_window=30, kv_sinks=3)
    engine = llm.engine
    prompts = random_prompts(256, [120, 64, 9, 200], seed=6)
    worst = {}
    original = engine.step

    def step():
        out = original()
        check_pool_invariants(engine)
        for seq in engine.scheduler.running:
            held = [b for b in seq.block_table if b != EVICTED]
            assert len(held) == seq.num_held_blocks <= seq.kv_window.max_blocks(24, BLOCK)
            worst[seq.request_id] = max(worst.get(seq.request_id, 0), len(held))
        return out

    engine.step = step
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert max(worst.values()) < -(-(200 + 40) // BLOCK), "the long request held every block: nothing evicted"
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_eviction_never_frees_a_pinned_template_block(tiny_gguf):
    llm = _windowed_engine(tiny_gguf, kv_window=20, kv_sinks=0)
    template = random_prompts(256, [64], seed=8)[0]
    handle = llm.pin_prefix(template)
    pinned = list(handle.block_ids)
    assert len(pinned) == 4
    prompts = [template + tail for tail in random_prompts(256, [50, 80], seed=9)]
    llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    pool = llm.engine.cache.pool
    assert all(pool.blocks[b].ref_count == 1 for b in pinned)  # the pin's own reference, nothing else
    assert [b.block_id for b in llm.engine.cache.find_cached_prefix(template + [1])] == pinned


def test_eviction_never_takes_a_block_another_sequence_still_reads(tiny_gguf):
    """A windowed and an exact request share a long prefix through the prefix cache: the windowed
    one drops its references as it moves on, the exact one still reads every shared block, and
    answers as it does alone."""
    shared = random_prompts(256, [96], seed=12)[0]
    prompts = [shared + tail for tail in random_prompts(256, [20, 30], seed=13)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, kv_window=0),
              SamplingParams(max_tokens=24, ignore_eos=True, kv_window=16, kv_sinks=0)]
    # 14 blocks: a shared block freed by mistake would soon be handed out again and overwritten
    llm = LLM(str(tiny_gguf), dtype="float32", block_size=BLOCK, kv_cache_budget=14 * BLOCK * 2 * 2 * 2 * 16 * 4)
    llm.generate([shared], SamplingParams(max_tokens=1))  # the shared blocks are cached before both start
    together = llm.generate(prompts, params)
    assert llm.engine.cache.prefix_hits_tokens >= 2 * 80
    alone = _windowed_engine(tiny_gguf).generate(prompts[:1], params[0])
    assert together[0].token_ids == alone[0].token_ids
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_admission_reserves_what_the_window_keeps_not_the_whole_request(tiny_gguf):
    llm = _windowed_engine(tiny_gguf, admission="deadline", max_num_batched_tokens=32, kv_window=48, kv_sinks=4)
    prompt = random_prompts(256, [300], seed=10)[0]
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=60, deadline_ms=60_000, ignore_eos=True))
    assert seq.rejection is None and seq.promised
    bound = KVWindow(4, 48).max_blocks(32, BLOCK)
    assert seq.reserved_blocks == bound == 1 + (48 + 32 - 3) // BLOCK + 2 < -(-360 // BLOCK)
    exact = llm.engine.add_request(prompt, SamplingParams(max_tokens=60, deadline_ms=60_000, kv_window=0))
    assert exact.reserved_blocks == -(-360 // BLOCK)


def test_the_native_runtime_gives_the_windowed_logits_of_the_torch_reference(tiny_native_gguf):
    """The C kernels' windows (prefill chunks and decodes) against the reference's masks: the same
    logits within bf16 noise at every step until the tokens part, and they part only at a near
    tie of the reference's two best (a window read wrong moves logits by whole units at once)."""
    from tests.recorder import LogitsRecorder

    prompts = random_prompts(300, [150, 97, 40], seed=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True, kv_window=40, kv_sinks=4)
    runs = []
    for settings in ({"runtime": "native"}, {"runtime": "torch", "attention_backend": "torch"}):
        llm = LLM(str(tiny_native_gguf), weights="int4", kv_cache_budget="4MiB", **settings)
        recorder = LogitsRecorder(llm.engine)
        runs.append([(o.token_ids, recorder.stacked(o.request_id)[1]) for o in llm.generate(prompts, params)])
    assert llm.engine.runtime.name == "torch"
    for (ours, our_logits), (theirs, their_logits) in zip(*runs):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        assert (our_logits[:same + 1] - their_logits[:same + 1]).abs().max() < 0.15
        if same < len(ours):
            best_two = their_logits[same].topk(2).values
            assert best_two[0] - best_two[1] < 0.3, f"tokens part at step {same} without a near tie"


def test_window_fields_are_checked_where_the_request_is_made():
    with pytest.raises(InvalidRequestError, match="kv_window must be an integer >= 0"):
        SamplingParams(kv_window=-1)
    with pytest.raises(ValueError, match="at least 1 recent token"):
        KVWindow(0, 0)
