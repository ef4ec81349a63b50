"""The int8 KV cache: rows within half a quantization step, the real bytes in the budget, attention
close to the exact cache, and an engine that serves on it without exceeding its budget."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.attention import reference
from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_cache import plan_cache
from ricllm.cache.kv_format import dequantize_rows, kv_format, quantize_rows
from ricllm.errors import ConfigError
from ricllm.plan import NAMED_SHAPES
from tests.test_budget import BLOCK, assert_budget_held, generate_checking_pool
from tests.test_oracle_parity import random_prompts

SMOLLM2 = NAMED_SHAPES["smollm2-135m"]
INT8 = kv_format("int8", "bfloat16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_comes_back_within_half_a_step_of_its_own_scale(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]).to(dtype)
    x[5] = 0  # an all-zero row stores scale 0 and comes back as zeros
    rows = quantize_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    step = x.float().abs().amax(dim=-1, keepdim=True) / 127
    assert torch.all((back - x.float()).abs() <= step / 2 * (1 + 1e-5))
    assert torch.all(back[5] == 0)
    # the largest element of every row is exact up to fp32 rounding: it is ±127 steps
    peak = x.float().abs().argmax(dim=-1, keepdim=True)
    assert torch.allclose(back.gather(-1, peak), x.float().gather(-1, peak), rtol=1e-6, atol=0)


def test_an_int8_row_costs_its_elements_and_one_fp32_scale():
    bf16 = kv_format("auto", "bfloat16")
    assert bf16.bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert INT8.bytes_per_token(SMOLLM2) == 2 * 30 * 3 * (64 + 4) == 12_240
    budget = 64 * 2**20
    exact, small = plan_cache(SMOLLM2, budget, 16, bf16), plan_cache(SMOLLM2, budget, 16, INT8)
    assert small.num_blocks == budget // (16 * 12_240) and small.allocated_bytes <= budget
    assert small.num_tokens / exact.num_tokens == pytest.approx(128 / 68, rel=0.01)


def test_a_budget_below_one_int8_block_names_the_row_with_its_scale():
    with pytest.raises(ConfigError, match=r"16 int8 tokens needs 195840 B .*\(64·1\+4\)"):
        plan_cache(SMOLLM2, 1000, 16, INT8)


def _metadata(context_lens: list[int], query_lens: list[int], block_size: int) -> AttentionMetadata:
    """Sequences laid out in consecutive blocks; each step's queries are its last ``query_len`` tokens."""
    tables, slots, first = [], [], 0
    width = max(-(-n // block_size) for n in context_lens)
    for ctx, q in zip(context_lens, query_lens):
        blocks = list(range(first, first + -(-ctx // block_size)))
        tables.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)]
        first += len(blocks)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=starts,
                             context_lens=torch.tensor(context_lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32),
                             max_query_len=max(query_lens), max_context_len=max(context_lens))


def test_attention_over_an_int8_cache_stays_close_to_the_exact_one():
    gen = torch.Generator().manual_seed(3)
    block, n_kv, heads, d = 16, 3, 9, 64
    lens, qlens = [40, 200, 17], [40, 1, 1]  # a prefill chunk and two decodes
    total = sum(lens)
    meta = _metadata(lens, qlens, block)
    blocks = sum(-(-n // block) for n in lens)
    exact = [torch.zeros(blocks, block, n_kv, d, dtype=torch.bfloat16) for _ in range(2)]
    small = [torch.zeros(blocks, block, n_kv, d + 4, dtype=torch.uint8) for _ in range(2)]
    k, v = (torch.randn(total, n_kv, d, generator=gen).bfloat16() for _ in range(2))
    all_slots = _metadata(lens, lens, block).slot_mapping
    for cache in (exact, small):
        reference.store_kv(k, v, *cache, all_slots)
    q = torch.randn(sum(qlens), heads, d, generator=gen).bfloat16()
    out_exact = reference.paged_attention(q, *exact, meta, d ** -0.5).float()
    out_small = reference.paged_attention(q, *small, meta, d ** -0.5).float()
    # each K/V element moves by at most half a step (max|row| / 254, ~0.01 here): outputs, averages of V
    # rows with weights from q·k, move by about that much, far below the values themselves (~0.1-1)
    error = (out_small - out_exact).abs()
    assert error.max() < 0.05
    assert error.mean() < 0.02 * out_exact.abs().mean()


def test_an_int8_engine_serves_within_its_budget_and_reports_its_format(tiny_gguf):
    bytes_per_token = 2 * 2 * 2 * (16 + 4)  # 2·L·n_kv·(d_h + 4) for the tiny model, int8 rows
    budget = 24 * BLOCK * bytes_per_token
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_dtype="int8", block_size=BLOCK, kv_cache_budget=budget,
              max_num_seqs=64)
    prompts = random_prompts(llm.engine.spec.vocab_size, [5 + (7 * i) % 40 for i in range(32)], seed=11)
    params = [SamplingParams(max_tokens=8 + i % 17, ignore_eos=True) for i in range(32)]
    outputs = generate_checking_pool(llm, prompts, params)
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert_budget_held(llm, 24, budget)
    stats = llm.kv_cache_stats()
    assert stats["kv_cache_dtype"] == "int8" and stats["bytes_per_block"] == BLOCK * bytes_per_token
    assert all(k.dtype == torch.uint8 and k.shape[-1] == 16 + 4 for k, _ in llm.engine.kv_cache.layers)


def test_int8_greedy_tokens_mostly_match_the_exact_cache(tiny_gguf):
    """Not equal by construction (the cache is approximate): on the tiny random model, most greedy
    tokens agree; a dequantization that dropped the scale would agree on almost none."""
    prompts = random_prompts(256, [24, 31, 40, 57], seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = [LLM(str(tiny_gguf), dtype="float32", kv_cache_dtype=kind).generate(prompts, params)
            for kind in ("auto", "int8")]
    pairs = [(a, b) for x, y in zip(*runs) for a, b in zip(x.token_ids, y.token_ids)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.8


@pytest.mark.parametrize("settings", [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "int8", "kv_window": 24}])
def test_both_runtimes_compute_the_same_bits_on_an_int8_cache(tiny_native_gguf, settings):
    """The native runtime and the torch runtime's C decoder stack store and read int8 rows (and
    windows) with the same kernels: the same logits, bit for bit, where both run the stack."""
    from tests.recorder import LogitsRecorder

    prompts = random_prompts(300, (3, 17, 40, 64), seed=2)
    recorded = []
    for runtime in ("native", "torch"):
        llm = LLM(str(tiny_native_gguf), weights="int4", runtime=runtime, kv_cache_budget="4MiB", weight_cache=False,
                  max_num_batched_tokens=64, **settings)
        assert llm.engine.runtime.name == runtime and llm.kv_cache_stats()["kv_cache_dtype"] == "int8"
        recorder = LogitsRecorder(llm.engine)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        recorded.append([recorder.stacked(o.request_id)[1] for o in outs])
    for ours, theirs in zip(*recorded):
        assert torch.equal(ours, theirs)


def test_the_cuda_kernel_refuses_an_int8_cache_by_name():
    from ricllm.attention.backends import select_backend

    with pytest.raises(ConfigError, match="attention backend 'cuda' reads bf16/fp16/fp32 caches, not kv_cache_dtype"):
        select_backend("cuda", torch.device("cuda"), torch.uint8)
