"""Triton decode kernels against ``ricllm.attention.reference``, on CPU via the Triton interpreter.

Shapes stay small: the interpreter runs a kernel thousands of times slower than torch. Cache
pools are filled with NaN except the blocks the block tables name, so a read of the wrong block
or of an unmasked position shows up as NaN (int8 pools: all-0xFF bytes, whose fp32 scale is NaN).
bf16 is left to the GPU benchmark: the interpreter's ``tl.dot`` mishandles bf16 operands.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest.py sets it too)

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ricllm.attention import reference
from ricllm.attention.metadata import AttentionMetadata
from ricllm.cache.kv_format import dequantize_rows, quantize_rows
from ricllm.kernels import paged_decode_attention, store_kv, triton_available
from ricllm.kv_window import EVICTED, KVWindow
from tests.helpers import require

ROOT = Path(__file__).resolve().parents[2]
N_KV, HEAD_DIM, POOL_BLOCKS = 2, 64, 4096
CONTEXTS = (1, 17, 33, 64, 97, 300)
ATOL = {torch.float32: 1e-4, torch.float16: 1.5e-2}


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    require(*triton_available())


def make_case(*, group: int, block_size: int, dtype: torch.dtype, contexts=CONTEXTS,
              n_kv: int = N_KV, head_dim: int = HEAD_DIM, seed: int = 0, first_block: int = 0):
    """Query, NaN-poisoned K/V pools, block tables drawn without repeats from blocks
    ``first_block..`` of the pool, lengths."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(contexts)
    width = -(-max(contexts) // block_size) + 1  # one spare column past the longest context
    shape = (POOL_BLOCKS, block_size, n_kv, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    drawn = first_block + torch.randperm(POOL_BLOCKS - first_block, generator=gen)
    tables = drawn[: batch * width].view(batch, width)
    used = tables.flatten()
    k_cache[used] = torch.randn(len(used), *shape[1:], generator=gen).to(dtype)
    v_cache[used] = torch.randn(len(used), *shape[1:], generator=gen).to(dtype)
    query = torch.randn(batch, n_kv * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32)
    return query, k_cache, v_cache, tables.to(torch.int32), lens


def as_int8(case):
    """The case with its pools quantized (``quantize_rows``); the NaN blocks become 0xFF bytes,
    whose scale reads as NaN."""
    query, k_cache, v_cache, tables, lens = case
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.full((*cache.shape[:-1], cache.shape[-1] + 4), 0xFF, dtype=torch.uint8)
        written = ~cache.isnan().any(dim=-1)
        pool[written] = quantize_rows(cache[written])
        pools.append(pool)
    return query, *pools, tables, lens


def check_decode(case, num_splits, atol: float) -> None:
    query, k_cache, v_cache, tables, lens = case
    scale = query.shape[-1] ** -0.5
    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, num_splits=num_splits)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_reference(group: int, block_size: int, dtype: torch.dtype, num_splits: int) -> None:
    case = make_case(group=group, block_size=block_size, dtype=dtype, seed=group * 100 + block_size)
    check_decode(case, num_splits, ATOL[dtype])


def test_more_splits_than_tiles_leaves_empty_splits_harmless() -> None:
    case = make_case(group=3, block_size=16, dtype=torch.float32, contexts=(1, 5, 40))
    check_decode(case, 16, ATOL[torch.float32])


@pytest.mark.parametrize("head_dim", [48, 128])
def test_other_head_dims(head_dim: int) -> None:
    case = make_case(group=4, block_size=16, dtype=torch.float16, head_dim=head_dim, contexts=(3, 50))
    check_decode(case, 2, ATOL[torch.float16])


def test_fp32_query_on_fp16_cache() -> None:
    query, *rest = make_case(group=3, block_size=16, dtype=torch.float16, contexts=(9, 70))
    check_decode((query.float(), *rest), 1, ATOL[torch.float16])


def test_default_splits_on_cpu() -> None:
    case = make_case(group=2, block_size=32, dtype=torch.float32, contexts=(20, 300))
    check_decode(case, None, ATOL[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_writes_slots_and_skips_padding(block_size: int, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    shape = (POOL_BLOCKS, block_size, N_KV, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    n_tokens = 11
    slots = torch.randperm(POOL_BLOCKS * block_size, generator=gen)[:n_tokens]
    slots[[0, 4, 10]] = -1  # padding tokens
    key = torch.randn(n_tokens, N_KV, HEAD_DIM, generator=gen)  # fp32: cast to the cache dtype
    value = torch.randn(n_tokens, N_KV, HEAD_DIM, generator=gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)

    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)  # written slots match, every other slot untouched
    assert torch.equal(v_cache, expected_v)
    flat_k = k_cache.view(-1, N_KV, HEAD_DIM)
    assert torch.equal(flat_k[slots[1]], key[1].to(cache_dtype))


def test_store_kv_all_padding_is_a_no_op() -> None:
    k_cache = torch.randn(8, 16, N_KV, HEAD_DIM)
    v_cache = torch.randn(8, 16, N_KV, HEAD_DIM)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(3, N_KV, HEAD_DIM)
    store_kv(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_offsets_past_int32_in_a_large_pool() -> None:
    """Blocks at the top of a >2**31-element pool (in a subprocess: a wrapped offset segfaults)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("large_pool_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "large pool OK" in proc.stdout


# ------------------------------------------------------------------ int8 caches


def _int8_pools(block_size: int, n_kv: int, head_dim: int, blocks: int = 64):
    """Two uint8 pools of int8 rows, every byte 0xAB so an untouched row is recognisable."""
    shape = (blocks, block_size, n_kv, head_dim + 4)
    return torch.full(shape, 0xAB, dtype=torch.uint8), torch.full(shape, 0xAB, dtype=torch.uint8)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_int8_store_kv_writes_rows_within_half_a_step_and_skips_padding(src_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    block_size, n_tokens = 16, 9
    k_cache, v_cache = _int8_pools(block_size, N_KV, HEAD_DIM)
    key = (torch.randn(n_tokens, N_KV, HEAD_DIM, generator=gen) * 3).to(src_dtype)
    value = torch.randn(n_tokens, N_KV, HEAD_DIM, generator=gen).to(src_dtype)
    key[2, 0] = 0  # an all-zero row: scale 0, zeros
    key[3, 1] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -3.5] + [0.0] * (HEAD_DIM - 6))  # scale 1: exact ties
    slots = torch.randperm(k_cache.shape[0] * block_size, generator=gen)[:n_tokens]
    slots[[0, 6]] = -1  # padding tokens
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)

    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)  # quantize_rows byte for byte (ties to even); others untouched
    assert torch.equal(v_cache, expected_v)
    written = slots[slots >= 0]
    for cache, source in ((k_cache, key), (v_cache, value)):
        rows = cache.view(-1, N_KV, HEAD_DIM + 4)[written]
        x = source[slots >= 0].float()
        step = x.abs().amax(dim=-1, keepdim=True) / 127
        assert torch.all((dequantize_rows(rows, torch.float32) - x).abs() <= step / 2 * (1 + 1e-5))
    rows = k_cache.view(-1, N_KV, HEAD_DIM + 4)
    assert torch.all(rows[slots[2], 0] == 0)
    assert rows[slots[3], 1, :6].view(torch.int8).tolist() == [127, 0, 2, 2, -2, -4]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 4])
def test_int8_decode_matches_reference(group: int, query_dtype: torch.dtype, num_splits: int) -> None:
    """Same uint8 pools in both: the kernel dequantizes as the reference does (to the query's type)."""
    case = make_case(group=group, block_size=16, dtype=torch.float32, contexts=(1, 30, 77), seed=group)
    query, *rest = as_int8(case)
    check_decode((query.to(query_dtype), *rest), num_splits, ATOL[query_dtype])


# ------------------------------------------------------------------ sink + window retention


def windowed_case(dtype: torch.dtype, block_size: int, sinks_windows, contexts, seed: int = 0):
    """A decode batch whose evicted blocks (``KVWindow.evictable`` before this step) have table
    entry -1 and a NaN pool block; pool block 0 (what the reference reads for -1) is zeros."""
    case = make_case(group=2, block_size=block_size, dtype=dtype, contexts=contexts, seed=seed, first_block=1)
    query, k_cache, v_cache, tables, lens = case
    k_cache[0] = 0
    v_cache[0] = 0
    for row, (ctx, (sinks, window)) in enumerate(zip(contexts, sinks_windows)):
        if window == 0:
            continue
        evicted = list(KVWindow(sinks, window).evictable(ctx - 1, block_size))
        k_cache[tables[row, evicted].long()] = float("nan")
        v_cache[tables[row, evicted].long()] = float("nan")
        tables[row, evicted] = EVICTED
    sinks = torch.tensor([s for s, _ in sinks_windows], dtype=torch.int32)
    windows = torch.tensor([w for _, w in sinks_windows], dtype=torch.int32)
    return query, k_cache, v_cache, tables, lens, sinks, windows


def decode_metadata(tables, lens, sinks, windows) -> AttentionMetadata:
    batch = lens.shape[0]
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), context_lens=lens, block_tables=tables,
        max_query_len=1, max_context_len=int(lens.max()), kv_sinks=sinks, kv_windows=windows)


# (sinks, window) per sequence: a sink tile beside evicted blocks, a window shorter than a block, an
# exact sequence in the batch, a window past the context, no sinks, sinks reaching into the window
WINDOWS = ((5, 20), (0, 5), (3, 0), (2, 200), (0, 33), (40, 30))
WINDOW_CONTEXTS = (97, 40, 50, 70, 130, 75)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_windowed_decode_matches_reference_and_never_reads_evicted_blocks(block_size: int, num_splits: int,
                                                                          int8: bool) -> None:
    query, k_cache, v_cache, tables, lens, sinks, windows = windowed_case(torch.float32, block_size, WINDOWS,
                                                                          WINDOW_CONTEXTS, seed=block_size)
    assert (tables == EVICTED).sum() >= 5  # some in every case: the test reads around them
    if int8:
        query, k_cache, v_cache, tables, lens = as_int8((query, k_cache, v_cache, tables, lens))
        k_cache[0] = 0  # the reference reads block 0 for -1 entries: zero bytes, scale 0
        v_cache[0] = 0
    scale = HEAD_DIM ** -0.5
    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, num_splits=num_splits,
                                 kv_sinks=sinks, kv_windows=windows)
    expected = reference.paged_attention(query, k_cache, v_cache, decode_metadata(tables, lens, sinks, windows),
                                         scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
    # the exact sequence (window 0) attends to its whole context, as without windows
    exact = paged_decode_attention(query[2:3], k_cache, v_cache, tables[2:3], lens[2:3], scale, num_splits=1)
    torch.testing.assert_close(out[2:3], exact, atol=ATOL[torch.float32], rtol=0)


def test_kernel_backend_attends_a_windowed_int8_decode_step_like_the_reference() -> None:
    """``KernelAttention`` (Triton) against ``TorchAttention``: store then attend, windows passed on."""
    from ricllm import kernels
    from ricllm.attention.backends import KernelAttention, TorchAttention

    sinks_windows, contexts = ((4, 24), (0, 0)), (60, 35)
    query, k_cache, v_cache, tables, lens, sinks, windows = windowed_case(torch.float32, 16, sinks_windows,
                                                                          contexts, seed=3)
    query, k_cache, v_cache, tables, lens = as_int8((query, k_cache, v_cache, tables, lens))
    k_cache[0] = 0
    v_cache[0] = 0
    gen = torch.Generator().manual_seed(5)
    new_k, new_v = (torch.randn(2, N_KV, HEAD_DIM, generator=gen) for _ in range(2))
    meta = decode_metadata(tables, lens, sinks, windows)
    last = lens.long() - 1  # this step's token: the last position of each sequence
    meta.slot_mapping = tables.long()[torch.arange(2), last // 16] * 16 + last % 16
    backend = KernelAttention("triton", kernels.store_kv, kernels.paged_decode_attention, windowed_decode=True)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = TorchAttention().forward(query, new_k, new_v, expected_k, expected_v, meta, HEAD_DIM ** -0.5)
    meta.scratch.clear()
    out = backend.forward(query, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    torch.testing.assert_close(out, expected, atol=ATOL[torch.float32], rtol=0)
