"""The fused CPU layer ops compute what the torch layers compute, bf16 rounding included."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from ricllm.attention.reference import store_kv
from ricllm.engine.runtime.llama import apply_rope
from tests.helpers import require

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops_for():
    require(shutil.which("cc") is not None or shutil.which("gcc") is not None, "no C compiler (cc/gcc)")
    from ricllm.kernels.cpu_fused import CpuFusedOps

    return CpuFusedOps


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Off by at most a few units in the last place of the dtype, everywhere: 2 in bf16 (one
    rounding landing the other way), 16 in fp32 (fp32 sums in another order, exp and rsqrt of
    other libraries); values below 1e-30 count as zero."""
    ulps = 2 if expected.dtype == torch.bfloat16 else 16
    eps = torch.finfo(expected.dtype).eps
    bound = (ulps * eps * expected.float().abs()).clamp_min(1e-30)
    diff = (actual.float() - expected.float()).abs()
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()} at {diff.argmax().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_add_rms_norm_matches_the_torch_norm(ops_for, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    expected_stream = x + delta
    expected = weight * F.rms_norm(expected_stream.float(), (576,), eps=1e-5).to(dtype)
    stream = x.clone()
    normed = ops_for(dtype).add_rms_norm(stream, delta, weight, 1e-5)
    assert torch.equal(stream, expected_stream)  # the residual stream is updated in place, exactly
    assert_within_ulps(normed, expected)
    alone = ops_for(dtype).add_rms_norm(expected_stream.clone(), None, weight, 1e-5)
    assert torch.equal(alone, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_rope_store_matches_apply_rope_then_store_kv(ops_for, dtype, heads, kv_heads, head_dim):
    rows, num_blocks, block_size = 37, 64, 16
    gen = torch.Generator().manual_seed(heads * head_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[3] = -1  # a padding token: nothing stored for it
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(4)]

    q, k, v = qkv.view(rows, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=1)
    expected_q = apply_rope(q, cos[:, None], sin[:, None])
    store_kv(apply_rope(k, cos[:, None], sin[:, None]), v, caches[0], caches[1], slots, has_padding=True)
    got_q = ops_for(dtype).rope_store(qkv, cos, sin, slots, caches[2], caches[3], heads)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_writes_int8_rows_as_the_reference_quantizes_them(ops_for, dtype):
    rows, heads, kv_heads, head_dim, block_size = 29, 9, 3, 64, 16
    gen = torch.Generator().manual_seed(7)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
    qkv[5, heads * head_dim:(heads + 1) * head_dim] = 0  # an all-zero key row: scale 0, zeros back
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(32 * block_size, generator=gen)[:rows]
    slots[2] = -1
    caches = [torch.zeros(32, block_size, kv_heads, head_dim + 4, dtype=torch.uint8) for _ in range(4)]
    q, k, v = qkv.view(rows, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=1)
    store_kv(apply_rope(k, cos[:, None], sin[:, None]), v, caches[0], caches[1], slots, has_padding=True)
    ops_for(dtype).rope_store(qkv, cos, sin, slots, caches[2], caches[3], heads)
    # the same bytes: C's lrintf and torch.round both round half to even, on the same fp32 products
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2].view(-1, kv_heads, head_dim + 4)[slots[slots >= 0]].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_writes_a_bf16_cache_from_fp32_activations(ops_for, dtype):
    qkv = torch.randn(3, (2 + 2) * 32)
    cos, sin = torch.ones(3, 32), torch.zeros(3, 32)  # the identity rotation
    k_cache, v_cache = (torch.zeros(4, 16, 1, 32, dtype=torch.bfloat16) for _ in range(2))
    ops_for(torch.float32).rope_store(qkv, cos, sin, torch.tensor([0, 17, 63]), k_cache, v_cache, 2)
    assert torch.equal(k_cache.view(-1, 32)[[0, 17, 63]], qkv[:, 64:96].to(torch.bfloat16))
    assert torch.equal(v_cache.view(-1, 32)[[0, 17, 63]], qkv[:, 96:].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_torch(ops_for, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536 + 2 * 7, generator=gen) * 4).to(dtype)  # odd width: a partial chunk
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp overflow on both sides
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    assert_within_ulps(ops_for(dtype).silu_mul(gate_up), expected)


def test_wrong_inputs_are_refused_by_name(ops_for):
    ops = ops_for(torch.bfloat16)
    with pytest.raises(ValueError, match="add_rms_norm takes contiguous torch.bfloat16"):
        ops.add_rms_norm(torch.zeros(2, 8), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int64"):
        caches = [torch.zeros(2, 16, 1, 32, dtype=torch.bfloat16)] * 2
        ops.rope_store(torch.zeros(1, 128, dtype=torch.bfloat16), torch.ones(1, 32, dtype=torch.bfloat16),
                       torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32), *caches, 2)
    with pytest.raises(ValueError, match="activations must be bf16 or fp32"):
        ops_for(torch.float16)
