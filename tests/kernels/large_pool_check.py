"""Run by test_triton_kernels.py in a subprocess: kernels on a pool of more than 2**31 elements.

The pool is allocated but never touched except for the blocks in use (the OS maps the rest
lazily), so it costs a few MB. Offsets ``block * stride`` of the top blocks exceed int32: a
kernel that computes them in int32 reads or writes far outside the pool. Exits non-zero on a
mismatch; prints ``large pool OK`` on success.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from ricllm.kernels import paged_decode_attention, store_kv  # noqa: E402
from ricllm.attention import reference  # noqa: E402

BLOCK_SIZE, N_KV, HEAD_DIM, GROUP = 16, 2, 64, 3


def main() -> None:
    num_blocks = 2**31 // (BLOCK_SIZE * N_KV * HEAD_DIM) + 64
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, N_KV, HEAD_DIM, dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    gen = torch.Generator().manual_seed(0)
    tables = (num_blocks - 1 - torch.randperm(64, generator=gen)[:8]).view(2, 4).to(torch.int32)
    for cache in (k_cache, v_cache):
        cache[tables.flatten().long()] = torch.randn(8, BLOCK_SIZE, N_KV, HEAD_DIM, generator=gen).half()

    # store_kv: the new token of each sequence at position 40 and 20.
    lens = torch.tensor([41, 21], dtype=torch.int32)
    slots = torch.stack([tables[i, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE
                         for i, p in enumerate((40, 20))])
    key = torch.randn(2, N_KV, HEAD_DIM, generator=gen)
    value = torch.randn(2, N_KV, HEAD_DIM, generator=gen)
    store_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, N_KV, HEAD_DIM)
    assert torch.equal(flat_k[slots], key.half()), "store_kv wrote the wrong slots"

    query = torch.randn(2, N_KV * GROUP, HEAD_DIM, generator=gen).half()
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    for splits in (1, 2):
        out = paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, num_splits=splits)
        err = (out.float() - expected.float()).abs().max().item()
        assert err < 1.5e-2, f"num_splits={splits}: max error {err}"
    print("large pool OK")


if __name__ == "__main__":
    main()
