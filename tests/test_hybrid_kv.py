"""The hybrid KV cache: Gemma 3's layers grouped by attention type in one pool, a sliding-window
group holding only the blocks its window reads, the pool's peak at the per-group equation, prefix
hits and pins served only where every group holds what they read."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ricllm import LLM, SamplingParams
from ricllm.cache.kv_cache_manager import KVCacheManager
from ricllm.cache.kv_groups import kv_cache_groups
from ricllm.engine.admission import NO_BEST_EFFORT, work_of
from ricllm.engine.latency_model import LatencyModel
from ricllm.engine.schedule_bound import schedule_bounds
from ricllm.kv_window import EVICTED, KVWindow, most_blocks
from ricllm.model.spec import ModelSpec
from ricllm.sequence import Sequence
from tests.helpers import write_tiny_gemma3_gguf
from tests.test_admission import COEFFICIENTS, drain, make_engine
from tests.test_oracle_parity import random_prompts

BLOCK = 4
WINDOW = 8  # the tiny Gemma's sliding window: six of its seven layers
VOCAB = 317


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("hybrid") / "tiny_gemma3.gguf", seed=3)


@pytest.fixture(scope="module")
def stored_fit(tmp_path_factory) -> str:
    """A latency fit to admit against: these tests count blocks, not time, so no calibration."""
    fit = tmp_path_factory.mktemp("fit") / "fit.json"
    LatencyModel(list(COEFFICIENTS)).save(fit)
    return str(fit)


def _engine(path, **settings) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_budget="4MiB", **settings)


def check_every_groups_references(engine) -> None:
    """The pool's references are exactly the blocks in every group's tables and in the pins."""
    pool, cache, scheduler = engine.cache.pool, engine.cache, engine.scheduler
    assert pool.num_used + pool.num_free == pool.num_blocks
    refs: dict[int, int] = {}
    tables = [t for seq in scheduler.running for t in (seq.block_table, *seq.group_tables)]
    for table in tables + [p.block_ids for p in cache.pins.values()]:
        for block_id in table:
            if block_id != EVICTED:
                refs[block_id] = refs.get(block_id, 0) + 1
    assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == refs


def _gemma_spec(layers: int, windows: tuple[int, ...]) -> ModelSpec:
    return ModelSpec("gemma3", 262144, 640, 2048, layers, 4, 1, 256, 32768, 1e-6, 1e6, True, layer_windows=windows)


def test_gemma3_270m_is_one_full_group_and_five_sliding_ones_of_three_layers():
    spec = _gemma_spec(18, ((512,) * 5 + (0,)) * 3)
    groups = kv_cache_groups(spec)
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.window for g in groups] == [0] + [512] * 5
    llama = ModelSpec("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192, 1e-5, 1e5, True)
    assert [g.layers for g in kv_cache_groups(llama)] == [tuple(range(30))]  # one group: the cache as it is
    # 512 tokens of window in blocks of 16: 33 blocks in decode
    assert most_blocks(4096, KVWindow(0, 512), 16, 1) == 33


def test_the_store_has_one_slot_per_layer_of_a_group_and_blocks_of_equal_bytes(tiny_gemma3):
    llm = _engine(tiny_gemma3)
    kv_cache, spec = llm.engine.kv_cache, llm.engine.spec
    assert len(kv_cache.geometry.groups) == 7 and len(kv_cache.slots) == 1  # 6 sliding layers, 1 global: gcd 1
    assert all(k is kv_cache.slots[0][0] for k, _ in kv_cache.layers)
    assert kv_cache.geometry.bytes_per_block == 2 * 1 * BLOCK * spec.num_kv_heads * spec.head_dim * 4
    assert kv_cache.total_bytes() == kv_cache.geometry.allocated_bytes


@pytest.mark.parametrize("chunk", [1, 16])
def test_a_long_sequence_keeps_only_the_windows_blocks_in_the_sliding_groups(tiny_gemma3, chunk):
    """A 60-token prompt and 40 decodes against windows of 8: the global layer's group holds every
    block, each sliding group no more than its window's, and the pool's peak is the per-group
    equation's number (reached, for one token a step)."""
    llm = _engine(tiny_gemma3, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    engine = llm.engine
    prompt, max_tokens = random_prompts(VOCAB, [60], seed=5)[0], 40
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sliding_most = KVWindow(0, WINDOW).max_blocks(chunk, BLOCK)
    while engine.has_unfinished():
        engine.step()
        check_every_groups_references(engine)
        if seq.is_finished:
            break
        assert EVICTED not in seq.block_table and len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK)
        for table in seq.group_tables:
            held = [b for b in table if b != EVICTED]
            assert len(held) <= sliding_most
            assert len(table) == len(seq.block_table)
    total = len(prompt) + max_tokens
    equation = most_blocks(total, None, BLOCK, chunk) + 6 * most_blocks(total, KVWindow(0, WINDOW), BLOCK, chunk)
    whole = 7 * -(-total // BLOCK)
    peak = engine.cache.peak_used_blocks
    assert peak <= equation < whole
    if chunk == 1:
        assert peak == equation == 25 + 6 * 3
    assert engine.cache.pool.num_used == 0


def test_admission_reserves_per_group(tiny_gemma3, stored_fit):
    llm = _engine(tiny_gemma3, admission="deadline", max_num_batched_tokens=16, latency_fit=stored_fit)
    prompt = random_prompts(VOCAB, [100], seed=6)[0]
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=20, deadline_ms=60_000, ignore_eos=True))
    assert seq.promised
    assert seq.reserved_blocks == -(-120 // BLOCK) + 6 * KVWindow(0, WINDOW).max_blocks(16, BLOCK) < 7 * 30


def test_greedy_tokens_do_not_depend_on_chunking_or_on_the_window_s_blocks_going(tiny_gemma3):
    prompts = random_prompts(VOCAB, [45, 23, 70], seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = [[o.token_ids for o in _engine(tiny_gemma3, max_num_batched_tokens=chunk).generate(prompts, params)]
            for chunk in (3, 16, 256)]
    assert runs[0] == runs[1] == runs[2]


def test_a_prefix_hit_is_served_by_every_group_and_gives_the_tokens_of_no_cache(tiny_gemma3):
    shared = random_prompts(VOCAB, [42], seed=8)[0]
    prompts = [shared + tail for tail in random_prompts(VOCAB, [5, 9], seed=9)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cached = _engine(tiny_gemma3)
    cached.generate([shared], SamplingParams(max_tokens=1))
    with_hits = [o.token_ids for o in cached.generate(prompts, params)]
    assert cached.engine.cache.prefix_hits_tokens >= 2 * 40
    fresh = [o.token_ids for o in _engine(tiny_gemma3, enable_prefix_caching=False).generate(prompts, params)]
    assert with_hits == fresh
    assert cached.engine.cache.pool.num_used == 0


def _sequence(token_ids: list[int], windows: tuple) -> Sequence:
    return Sequence(request_id="r", token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                    params=SamplingParams(max_tokens=1), arrival_time=0.0, group_windows=windows)


def test_a_prefix_the_sliding_group_dropped_is_no_hit_though_the_full_layers_still_hold_it():
    cache = KVCacheManager(num_blocks=64, block_size=BLOCK, group_windows=(WINDOW,))
    prompt = list(range(100, 140))  # 10 blocks
    seq = _sequence(prompt, (KVWindow(0, WINDOW),))
    seq.take_blocks(cache.allocate(seq, 40))
    seq.num_computed_tokens = 40
    seq.block_hashes += cache.cache_full_blocks(seq)
    seq.evict_group_blocks(cache.evict_outside_group_windows(seq))
    assert seq.group_tables[0][:8] == [EVICTED] * 8 and EVICTED not in seq.group_tables[0][8:]
    # the whole prefix: the sliding group still holds the window a next query reads
    whole = cache.find_cached_prefix(prompt + [7])
    assert len(whole) == 10 and [b.block_id for b in whole.group_blocks[0][8:]] == seq.group_tables[0][8:]
    # drain the free queue: the blocks the sliding group let go are handed out, their content lost
    taken = [cache.pool.allocate() for _ in range(cache.pool.num_free)]
    shorter = prompt[:25] + [7, 8, 9]
    held_by_full_layers = [cache.pool.lookup(h, prompt[i * BLOCK:(i + 1) * BLOCK])
                           for i, h in enumerate(seq.block_hashes[:6])]
    assert [b.block_id for b in held_by_full_layers] == seq.block_table[:6]
    assert len(cache.find_cached_prefix(shorter)) == 0  # the window of position 24 reads blocks 4 and 5: gone
    for block in taken:
        cache.pool.release(block)
    cache.free(seq)
    seq.drop_blocks()
    assert cache.pool.num_used == 0


def test_a_pinned_template_longer_than_the_window_is_a_hit_in_every_group(tiny_gemma3):
    llm = _engine(tiny_gemma3)
    template = random_prompts(VOCAB, [40], seed=11)[0]
    handle = llm.pin_prefix(template)
    # its 10 full blocks in the global layer's group, the 2 a hit's window reads in each sliding one
    assert len(handle.block_ids) == 10 + 6 * 2 == llm.engine.cache.num_pinned_blocks
    prompts = [template + tail for tail in random_prompts(VOCAB, [6, 11], seed=12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    before = llm.engine.cache.prefix_hits_tokens
    pinned = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.cache.prefix_hits_tokens - before == 2 * 40
    fresh = [o.token_ids for o in _engine(tiny_gemma3, enable_prefix_caching=False).generate(prompts, params)]
    assert pinned == fresh
    assert llm.engine.cache.pool.num_used == len(handle.block_ids)
    llm.unpin_prefix(handle)
    assert llm.engine.cache.pool.num_used == 0


def test_a_requests_own_window_applies_to_the_global_layers_and_narrows_the_sliding_ones(tiny_gemma3):
    llm = _engine(tiny_gemma3, max_num_batched_tokens=16)
    engine = llm.engine
    wide = engine.add_request(random_prompts(VOCAB, [60], seed=13)[0],
                              SamplingParams(max_tokens=8, ignore_eos=True, kv_window=20, kv_sinks=4))
    narrow = engine.add_request(random_prompts(VOCAB, [60], seed=14)[0],
                                SamplingParams(max_tokens=8, ignore_eos=True, kv_window=5, kv_sinks=0))
    assert wide.kv_window == KVWindow(4, 20) and wide.group_windows == (KVWindow(0, WINDOW),) * 6
    assert narrow.kv_window == KVWindow(0, 5) and narrow.group_windows == (KVWindow(0, 5),) * 6
    evicted = {"wide": 0, "narrow": 0}
    while not (wide.is_finished and narrow.is_finished):
        engine.step()
        evicted = {"wide": max(evicted["wide"], wide.num_evicted_blocks),
                   "narrow": max(evicted["narrow"], narrow.num_evicted_blocks)}
        check_every_groups_references(engine)
        if not wide.is_finished:
            assert wide.block_table[0] != EVICTED  # the global layer keeps its sinks
            assert len(wide.block_table) - wide.num_evicted_blocks <= KVWindow(4, 20).max_blocks(16, BLOCK)
        if not narrow.is_finished:
            assert all(len(t) - n <= KVWindow(0, 5).max_blocks(16, BLOCK)
                       for t, n in zip(narrow.group_tables, narrow.group_evicted))
    assert evicted["wide"] > 0 and evicted["narrow"] > 0  # the global layer's own window let blocks go
    prompts = random_prompts(VOCAB, [60, 33], seed=15)
    params = SamplingParams(max_tokens=16, ignore_eos=True, kv_window=20, kv_sinks=4)
    chunked = [[o.token_ids for o in _engine(tiny_gemma3, max_num_batched_tokens=c).generate(prompts, params)]
               for c in (5, 256)]
    assert chunked[0] == chunked[1]
    exact = [o.token_ids for o in _engine(tiny_gemma3).generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    assert exact != chunked[0], "the request's window changed nothing on the global layer"


def test_the_kv_stats_count_each_groups_blocks(tiny_gemma3):
    llm = _engine(tiny_gemma3, max_num_batched_tokens=16)
    engine = llm.engine
    seq = engine.add_request(random_prompts(VOCAB, [60], seed=16)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(5):
        engine.step()
    kv = engine.snapshot().kv_cache
    assert kv.group_windows == (0,) + (WINDOW,) * 6
    assert kv.group_used_blocks[0] == len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK) == 16
    assert all(used == len(t) - n <= KVWindow(0, WINDOW).max_blocks(16, BLOCK)
               for used, t, n in zip(kv.group_used_blocks[1:], seq.group_tables, seq.group_evicted))
    assert sum(kv.group_used_blocks) == kv.used_blocks


def test_gemma3_270m_holds_the_per_group_equations_blocks_at_4096_tokens():
    from ricllm.cache.kv_cache import plan_cache
    from ricllm.cache.kv_format import kv_format
    from ricllm.cache.kv_groups import sliding_windows
    from ricllm.kv_window import group_window

    spec = _gemma_spec(18, ((512,) * 5 + (0,)) * 3)
    geometry = plan_cache(spec, 64 << 20, 16, kv_format("auto", "bfloat16"))
    assert geometry.bytes_per_block == 2 * 3 * 16 * 1 * 256 * 2 == 49_152
    seq = Sequence(request_id="r", token_ids=[1] * 4000, num_prompt_tokens=4000,
                   params=SamplingParams(max_tokens=96), arrival_time=0.0,
                   group_windows=tuple(group_window(w, None) for w in sliding_windows(geometry.groups)))
    blocks = seq.most_blocks(16, 1)
    assert blocks == 256 + 5 * 33
    assert blocks * geometry.bytes_per_block == 20_692_992  # against 6 · 256 blocks with every layer whole


def test_the_admission_caps_count_every_groups_blocks(tiny_gemma3, stored_fit):
    llm = _engine(tiny_gemma3, admission="deadline", max_num_batched_tokens=16, latency_fit=stored_fit)
    admission, num_blocks = llm.engine.admission, llm.engine.kv_cache.geometry.num_blocks
    row = next(r for r in admission.caps(1000, 16, contexts=(128,)) if r["context"] == 128)
    each = -(-144 // BLOCK) + 6 * KVWindow(0, WINDOW).max_blocks(16, BLOCK)
    assert row["max_batch_memory"] == num_blocks // each


def test_a_pinned_template_shorter_than_the_window_stays_whole_in_every_group(tmp_path):
    path = write_tiny_gemma3_gguf(tmp_path / "tiny_gemma3_w32.gguf", seed=3, window=32)
    llm = _engine(path)
    template = random_prompts(VOCAB, [24], seed=17)[0]
    handle = llm.pin_prefix(template)
    assert len(handle.block_ids) == 6 * 7  # its 6 blocks in each of the 7 groups
    prompts = [template + tail for tail in random_prompts(VOCAB, [30], seed=18)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    pinned = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.cache.prefix_hits_tokens >= 24
    assert pinned == [o.token_ids for o in _engine(path, enable_prefix_caching=False).generate(prompts, params)]


def test_info_shows_the_cache_groups(tiny_gemma3):
    import subprocess
    import sys

    from tests.helpers import ROOT

    info = subprocess.run([sys.executable, "-m", "ricllm.cli", "info", str(tiny_gemma3)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert "7 of 1 layers each: 1 keeping every token, 6 keeping the last 8" in info.stdout, info.stderr[-2000:]


def test_under_more_load_than_the_pool_holds_every_request_finishes_with_its_solo_tokens(tiny_gemma3):
    """100 blocks of 2,048 B; each request holds up to 20 blocks in the global layer's group and 7 in
    each sliding one: three at once do not fit, so some are preempted and recomputed."""
    prompts = random_prompts(VOCAB, [60, 55, 62, 48], seed=19)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    tight = LLM(str(tiny_gemma3), dtype="float32", block_size=BLOCK, kv_cache_budget=100 * 2048,
                max_num_batched_tokens=16)
    engine = tight.engine
    assert engine.kv_cache.geometry.num_blocks == 100
    original = engine.step

    def checked_step():
        finished = original()
        check_every_groups_references(engine)
        assert engine.cache.pool.num_used <= 100
        return finished

    engine.step = checked_step
    together = [o.token_ids for o in tight.generate(prompts, params)]
    assert engine.scheduler.num_preemptions > 0
    roomy = _engine(tiny_gemma3, max_num_batched_tokens=16)
    assert together == [o.token_ids for o in roomy.generate(prompts, params)]
    assert engine.cache.pool.num_used == 0


def test_a_template_too_long_to_compute_in_every_group_at_once_is_refused_naming_the_groups(tiny_gemma3):
    from ricllm.errors import CapacityError

    llm = LLM(str(tiny_gemma3), dtype="float32", block_size=BLOCK, kv_cache_budget=100 * 2048)
    with pytest.raises(CapacityError, match="each of the 7 KV cache groups at once: 112 blocks"):
        llm.pin_prefix(random_prompts(VOCAB, [60], seed=20)[0])  # 16 blocks × 7 groups > 100
    handle = llm.pin_prefix(random_prompts(VOCAB, [40], seed=21)[0])  # 11 × 7 = 77 computed, 10 + 6 · 2 pinned
    assert len(handle.block_ids) == 22


def test_a_gemma_request_is_promised_what_its_groups_read_and_finishes_within_it(tiny_gemma3):
    """Admission on a clock whose steps cost the fit of what they carried: a prompt far past the
    window is promised a bound that charges the sliding groups their window, below the bound of
    every layer reading the whole context, and it finishes within it."""
    engine, clock = make_engine(tiny_gemma3, kv_cache_budget="4MiB", block_size=BLOCK)
    prompt = random_prompts(VOCAB, [200], seed=11)[0]
    seq = engine.add_request(prompt, SamplingParams(max_tokens=30, deadline_ms=60_000, ignore_eos=True))
    assert seq.promised and seq.group_reaches == (WINDOW,) * 6
    work, model, budget = work_of(seq), engine.admission.latency, engine.config.max_num_batched_tokens
    windowed = schedule_bounds([work], model, budget, clock.now, NO_BEST_EFFORT)[0]
    whole = schedule_bounds([replace(work, group_reaches=())], model, budget, clock.now, NO_BEST_EFFORT)[0]
    assert windowed < whole
    drain(engine)
    assert seq.finish_time <= seq.predicted_finish
