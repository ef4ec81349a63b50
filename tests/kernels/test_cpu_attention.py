"""The CPU attention kernel equals the torch reference: decode and prefill, GQA, pools, splits."""

from __future__ import annotations

import shutil

import pytest
import torch

from ricllm.attention.metadata import AttentionMetadata
from ricllm.attention.reference import paged_attention
from tests.helpers import require

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def kernel():
    require(shutil.which("cc") is not None or shutil.which("gcc") is not None, "no C compiler (cc/gcc)")
    from ricllm.kernels import cpu_attention

    ok, reason = cpu_attention.cpu_kernel_available()
    assert ok, reason
    return cpu_attention.cpu_paged_attention


def make_case(q_lens, ctx_lens, *, n_heads=6, n_kv=2, head_dim=64, block_size=16, num_blocks=4096,
              dtype=torch.float32, seed=0):
    """Random cache over a large pool, random (non-contiguous) block tables, queries at the tail."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(dtype)
    width = max(-(-c // block_size) for c in ctx_lens)
    ids = torch.randperm(num_blocks, generator=gen)[: len(ctx_lens) * width]
    tables = ids.view(len(ctx_lens), width).int()
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), n_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64), query_start_loc=starts,
                             context_lens=torch.tensor(ctx_lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=max(q_lens), max_context_len=max(ctx_lens))
    return query, k_cache, v_cache, meta


def check(kernel, query, k_cache, v_cache, meta, scale=0.125):
    expected = paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, scale)
    assert got.dtype == query.dtype and got.shape == query.shape
    err = (got.float() - expected).abs().max().item()
    assert err < TOLERANCE[query.dtype], f"max abs error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_batch_with_odd_context_lengths(kernel, dtype, block_size):
    ctx = [1, 7, 33, 100, 257, 511]
    check(kernel, *make_case([1] * len(ctx), ctx, block_size=block_size, dtype=dtype))


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (9, 3), (8, 1)])
def test_gqa_ratios_one_three_eight(kernel, n_heads, n_kv):
    check(kernel, *make_case([1, 1, 5], [40, 129, 70], n_heads=n_heads, n_kv=n_kv))


def test_prefill_chunks_and_decode_tokens_in_one_batch(kernel):
    """Causal within each sequence: a chunk's query j sees keys up to its own position only."""
    check(kernel, *make_case([1, 33, 6, 17], [100, 33, 300, 17]))


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_head_dims_besides_64(kernel, head_dim):
    check(kernel, *make_case([1, 9], [50, 90], head_dim=head_dim, n_heads=4, n_kv=2))


def test_long_context_split_across_threads_merges_exactly(kernel):
    """One sequence with a long context is split into key ranges whose softmaxes are merged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # at least two threads, so one sequence's keys are split
    try:
        check(kernel, *make_case([1], [3000], n_heads=9, n_kv=3))
        check(kernel, *make_case([3], [2049], n_heads=9, n_kv=3, dtype=torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


def test_block_size_one(kernel):
    check(kernel, *make_case([1, 4], [9, 12], block_size=1, num_blocks=64))


def test_unsupported_group_size_is_refused(kernel):
    query, k_cache, v_cache, meta = make_case([1], [10], n_heads=16, n_kv=1)
    with pytest.raises(ValueError, match="at most 8 query heads per KV head"):
        kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.1)


def test_fp16_cache_is_refused(kernel):
    query, k_cache, v_cache, meta = make_case([1], [10], dtype=torch.float16)
    with pytest.raises(ValueError, match="bf16 or fp32 caches"):
        kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_prefill_beside_decodes_splits_sdpa_and_the_kernel(kernel, dtype):
    """Decodes stay in the C kernel while a prefill too large for it goes to SDPA: same result."""
    from ricllm.attention.backends import C_KERNEL_PREFILL_ROWS, CpuKernelAttention, c_kernel_attends

    q_lens, ctx = [1, 1, 90, 1, 70, 1], [40, 301, 150, 7, 70, 512]
    query, k_cache, v_cache, meta = make_case(q_lens, ctx, dtype=dtype, n_heads=9, n_kv=3)
    meta.prefill_rows, meta.prefill_products = 160, 90 * 150 + 70 * 70
    assert meta.prefill_rows > C_KERNEL_PREFILL_ROWS and not c_kernel_attends(meta)
    (decode_rows, decode_meta), (prefill_rows, prefill_meta) = meta.split_decodes()
    assert decode_rows.tolist() == [0, 1, 92, 163] and prefill_meta.max_query_len == 90
    expected = paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    got = CpuKernelAttention(dtype).attend(query, k_cache, v_cache, meta, 0.125)
    err = (got.float() - expected).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err:.2e}"
    meta.prefill_rows = meta.prefill_products = 10  # small prefill: all in the kernel
    assert c_kernel_attends(meta)
