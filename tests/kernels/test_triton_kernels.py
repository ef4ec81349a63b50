"""Triton decode kernels against ``ricllm.attention.reference``, on CPU via the Triton interpreter.

Shapes stay small: the interpreter runs a kernel thousands of times slower than torch. Cache
pools are filled with NaN except the blocks the block tables name, so a read of the wrong block
or of an unmasked position shows up as NaN. bf16 is left to the GPU benchmark: the interpreter's
``tl.dot`` mishandles bf16 operands.
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
from ricllm.kernels import paged_decode_attention, store_kv, triton_available
from tests.helpers import require

ROOT = Path(__file__).resolve().parents[2]
N_KV, HEAD_DIM, POOL_BLOCKS = 2, 64, 4096
CONTEXTS = (1, 17, 33, 64, 97, 300)
ATOL = {torch.float32: 1e-4, torch.float16: 1.5e-2}


@pytest.fixture(autouse=True)
def _needs_triton() -> None:
    require(*triton_available())


def make_case(*, group: int, block_size: int, dtype: torch.dtype, contexts=CONTEXTS,
              n_kv: int = N_KV, head_dim: int = HEAD_DIM, seed: int = 0):
    """Query, NaN-poisoned K/V pools, block tables drawn without repeats from the pool, lengths."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(contexts)
    width = -(-max(contexts) // block_size) + 1  # one spare column past the longest context
    shape = (POOL_BLOCKS, block_size, n_kv, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.randperm(POOL_BLOCKS, generator=gen)[: batch * width].view(batch, width)
    used = tables.flatten()
    k_cache[used] = torch.randn(len(used), *shape[1:], generator=gen).to(dtype)
    v_cache[used] = torch.randn(len(used), *shape[1:], generator=gen).to(dtype)
    query = torch.randn(batch, n_kv * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32)
    return query, k_cache, v_cache, tables.to(torch.int32), lens


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
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    script = Path(__file__).with_name("large_pool_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "large pool OK" in proc.stdout
