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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads", [5, 6, 7])
def test_gqa_groups_split_into_row_blocks(kernel, n_heads, dtype):
    """Groups larger than the vector path's row block are attended in uneven blocks (7 -> 4 + 3)."""
    check(kernel, *make_case([1, 1, 12], [40, 129, 70], n_heads=n_heads, n_kv=1, dtype=dtype))


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
    with pytest.raises(ValueError, match=r"bf16, fp32 or int8 \(uint8 rows\) caches"):
        kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.1)


@pytest.mark.parametrize("large_prefill_in_c", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_prefill_beside_decodes_splits_sdpa_and_the_kernel(kernel, dtype, large_prefill_in_c):
    """Decodes stay in the C kernel while a prefill too large for the decode kernel goes to SDPA,
    or the whole step to C (where its prefill kernel beats SDPA): same result."""
    from ricllm.attention.backends import C_KERNEL_PREFILL_ROWS, CpuKernelAttention, c_kernel_attends

    q_lens, ctx = [1, 1, 90, 1, 70, 1], [40, 301, 150, 7, 70, 512]
    query, k_cache, v_cache, meta = make_case(q_lens, ctx, dtype=dtype, n_heads=9, n_kv=3)
    meta.prefill_rows, meta.prefill_products = 160, 90 * 150 + 70 * 70
    assert meta.prefill_rows > C_KERNEL_PREFILL_ROWS and not c_kernel_attends(meta)
    (decode_rows, _), (_, prefill_meta) = meta.split_decodes()
    assert decode_rows.tolist() == [0, 1, 92, 163] and prefill_meta.max_query_len == 90
    expected = paged_attention(query.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    got = CpuKernelAttention(dtype, large_prefill_in_c).attend(query, k_cache, v_cache, meta, 0.125)
    err = (got.float() - expected).abs().max().item()
    assert err < TOLERANCE[dtype], f"max abs error {err:.2e}"
    meta.prefill_rows = meta.prefill_products = 10  # small prefill: all in the kernel
    assert c_kernel_attends(meta)


@pytest.fixture(scope="module")
def prefill_kernel(kernel):
    from ricllm.kernels.cpu_attention import cpu_prefill_attention

    return cpu_prefill_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 512, 1000, 2048])
def test_blocked_prefill_kernel_matches_the_reference_on_whole_prompts(prefill_kernel, length, dtype):
    """Lengths around the 16-query blocks and 32-key chunks, up to a 2,048-token prompt (9:3 GQA)."""
    check(prefill_kernel, *make_case([length], [length], n_heads=9, n_kv=3, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_prefill_kernel_sees_the_cached_prefix_of_a_chunk(prefill_kernel, dtype):
    """A chunk after cached tokens: its query i sits at prefix + i and sees keys 0..prefix + i."""
    check(prefill_kernel, *make_case([512], [2048], n_heads=9, n_kv=3, dtype=dtype))
    check(prefill_kernel, *make_case([37], [37 + 301], n_heads=9, n_kv=3, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (9, 3), (4, 2), (8, 1)])
def test_blocked_prefill_kernel_takes_several_sequences_and_gqa_groups(prefill_kernel, dtype, n_heads, n_kv):
    """Sequences of different lengths (prompts, prefix chunks, decode tokens) in one call."""
    check(prefill_kernel, *make_case([100, 1, 17, 64, 3], [100, 250, 80, 64, 3], n_heads=n_heads, n_kv=n_kv,
                                     dtype=dtype))


@pytest.mark.parametrize("head_dim", [32, 80, 128, 66])
def test_blocked_prefill_kernel_head_dims_besides_64(prefill_kernel, head_dim):
    """66 is no multiple of 16: the bf16 products then fall back to the fp32 path."""
    for dtype in (torch.float32, torch.bfloat16):
        check(prefill_kernel, *make_case([40, 9], [50, 90], head_dim=head_dim, n_heads=4, n_kv=2, dtype=dtype))


def test_blocked_prefill_kernel_refuses_what_it_does_not_take(prefill_kernel):
    query, k_cache, v_cache, meta = make_case([20], [20], n_heads=16, n_kv=1)
    with pytest.raises(ValueError, match="at most 8 query heads per KV head"):
        prefill_kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompts_beside_decodes_in_the_kernel_the_c_side_picks(kernel, dtype):
    """``cpu_paged_attention`` lets C pick the kernel per sequence (prefill-shaped for the chunks of
    16+ queries of a bf16 step, the paged kernel for the rest, their rows gathered and scattered
    back): a 1,000-token prompt, a prefix chunk, a short chunk and decodes in one step."""
    check(kernel, *make_case([1, 1000, 1, 200, 5, 1], [40, 1000, 301, 700, 9, 2000], n_heads=9, n_kv=3, dtype=dtype))


def test_the_cpu_backend_attends_large_bf16_prefills_in_c_only_where_amx_runs_them(kernel):
    """SDPA stays for fp32 caches, and for bf16 ones where the prefill kernel has no AMX tiles."""
    from ricllm.kernels.cpu_library import library

    from ricllm.attention.backends import CpuKernelAttention

    amx = bool(library().ricllm_prefill_attention_uses_amx())
    assert CpuKernelAttention(torch.bfloat16).large_prefill_in_c is amx
    assert CpuKernelAttention(torch.float32).large_prefill_in_c is False


# ------------------------------------------------------------------ int8 caches and KV windows

def int8_case(q_lens, ctx_lens, *, dtype=torch.bfloat16, head_dim=64, seed=3, **kwargs):
    """``make_case`` with its K/V quantized into int8 rows (``kv_format.quantize_rows``)."""
    from ricllm.cache.kv_format import quantize_rows

    query, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, dtype=dtype, head_dim=head_dim, seed=seed, **kwargs)
    return query, quantize_rows(k_cache), quantize_rows(v_cache), meta


def check_against_reference(kernel, query, k_cache, v_cache, meta, atol):
    """Against ``reference.paged_attention`` on the same cache (int8 rows dequantized there too)."""
    expected = paged_attention(query.float(), k_cache, v_cache, meta, 0.125)
    got = kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.125,
                 meta.kv_sinks, meta.kv_windows)
    assert got.dtype == query.dtype and got.shape == query.shape
    err = (got.float() - expected).abs().max().item()
    assert err < atol, f"max abs error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_int8_rows_are_read_with_their_scales(kernel, dtype, head_dim):
    """Decodes, a chunk and a prompt long enough for the prefill kernel; 80: the portable path."""
    case = int8_case([1, 1, 9, 100], [33, 300, 140, 100], dtype=dtype, head_dim=head_dim, n_heads=9, n_kv=3)
    check_against_reference(kernel, *case, atol=TOLERANCE[dtype])


def test_an_int8_row_read_without_its_scale_would_fail(kernel):
    """The check above can fail: zero the scales and the answer moves far past the tolerance."""
    query, k_cache, v_cache, meta = int8_case([1, 1], [50, 200])
    expected = paged_attention(query.float(), k_cache, v_cache, meta, 0.125)
    v_cache.view(-1, 68)[:, 64:] = torch.tensor([1.0]).view(torch.uint8)  # every scale 1.0
    got = kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.125)
    assert (got.float() - expected).abs().max().item() > 1.0


def windowed(case, sinks, windows, poison):
    """Evict what the windows let go (table entries -1, their blocks poisoned: a read shows as NaN)."""
    from ricllm.kv_window import KVWindow

    query, k_cache, v_cache, meta = case
    meta.kv_sinks = torch.tensor(sinks, dtype=torch.int32)
    meta.kv_windows = torch.tensor(windows, dtype=torch.int32)
    starts, block = meta.query_start_loc.tolist(), k_cache.shape[1]
    for b, (s, w) in enumerate(zip(sinks, windows)):
        if not w:
            continue
        first_query = int(meta.context_lens[b]) - (starts[b + 1] - starts[b])
        for i in KVWindow(s, w).evictable(first_query, block):
            k_cache[meta.block_tables[b, i]] = poison
            v_cache[meta.block_tables[b, i]] = poison
            meta.block_tables[b, i] = -1
    return query, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_each_query_sees_its_sinks_and_window_and_nothing_evicted_is_read(kernel, dtype, head_dim):
    case = make_case([1, 1, 9, 100, 1], [600, 300, 140, 400, 70], dtype=dtype, head_dim=head_dim, n_heads=9, n_kv=3)
    case = windowed(case, sinks=[4, 0, 16, 3, 0], windows=[64, 33, 20, 100, 0], poison=float("nan"))
    check_against_reference(kernel, *case, atol=TOLERANCE[dtype])


def test_windows_over_an_int8_cache(kernel):
    case = windowed(int8_case([1, 30, 1], [700, 500, 90], n_heads=9, n_kv=3), sinks=[4, 4, 4],
                    windows=[128, 50, 0], poison=255)  # 0xFF bytes: a scale of NaN
    check_against_reference(kernel, *case, atol=TOLERANCE[torch.bfloat16])


def test_a_window_changes_the_answer(kernel):
    """The windowed check can fail: the same case read whole gives another answer."""
    query, k_cache, v_cache, meta = make_case([1], [400], n_heads=9, n_kv=3, seed=9)
    whole = kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.125)
    query, k_cache, v_cache, meta = windowed((query, k_cache, v_cache, meta), [4], [32], poison=0.0)
    part = kernel(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, 0.125,
                  meta.kv_sinks, meta.kv_windows)
    assert (part - whole).abs().max().item() > 0.05
