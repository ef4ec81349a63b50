"""Attention backend selection: auto is the C kernel on CPU (torch where it cannot run); GPU backends refuse a CPU;
Triton takes int8 caches and windows, the CUDA kernel neither."""

from __future__ import annotations

import shutil

import pytest
import torch

from ricllm import LLM
from ricllm.attention import reference
from ricllm.attention.backends import select_backend
from ricllm.attention.metadata import AttentionMetadata
from ricllm.errors import ConfigError
from tests.helpers import require


def test_auto_on_cpu_is_the_c_kernel():
    require(shutil.which("cc") is not None, "no C compiler (cc)")
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16).name == "cpu"
    assert select_backend("torch", torch.device("cpu"), torch.bfloat16).name == "torch"


def test_auto_falls_back_to_torch_for_a_cache_dtype_the_kernel_lacks():
    assert select_backend("auto", torch.device("cpu"), torch.float16).name == "torch"
    with pytest.raises(ConfigError, match="attention backend 'cpu' is not available: .*not float16"):
        select_backend("cpu", torch.device("cpu"), torch.float16)


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch):
    from ricllm.kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "cpu_kernel_available", lambda: (False, "no C compiler found"))
    assert select_backend("auto", torch.device("cpu"), torch.float32).name == "torch"
    with pytest.raises(ConfigError, match="'cpu' is not available: no C compiler found"):
        select_backend("cpu", torch.device("cpu"), torch.float32)


def test_cpu_backend_refuses_a_gpu_device():
    with pytest.raises(ConfigError, match="attention backend 'cpu' runs on the CPU"):
        select_backend("cpu", torch.device("cuda"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_c_kernel_matches_torch_reference(tiny_gguf, dtype):
    """Same greedy tokens through the whole engine (chunked prefill, then decode steps on the
    kernel; the layers' fused C ops against their torch versions)."""
    require(shutil.which("cc") is not None, "no C compiler (cc)")
    from ricllm import SamplingParams

    prompts = [[5, 6, 7, 8, 9] * 9, [11, 12, 13], [20 + i for i in range(70)]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(str(tiny_gguf), attention_backend=backend, kv_cache_budget="4MiB", max_num_batched_tokens=32,
                  dtype=dtype)
        assert llm.engine.runtime.attention_backend == backend
        runs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["cpu"] == runs["torch"]


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_gpu_backend_on_cpu_is_a_clear_error(tiny_gguf, name):
    with pytest.raises(ConfigError, match=f"attention backend '{name}' needs a CUDA device"):
        LLM(str(tiny_gguf), device="cpu", attention_backend=name)


def test_unknown_backend(tiny_gguf):
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'"):
        LLM(str(tiny_gguf), attention_backend="flash")


def test_cuda_backend_refuses_an_int8_cache_by_name():
    """Checked before any CUDA call: no GPU needed."""
    with pytest.raises(ConfigError, match="attention backend 'cuda' reads bf16/fp16/fp32 caches, not kv_cache_dtype "
                                          "int8; use attention_backend triton or torch"):
        select_backend("cuda", torch.device("cuda"), torch.uint8)


@pytest.mark.parametrize("name", ["auto", "triton"])
def test_triton_serves_an_int8_cache_and_windowed_decodes(monkeypatch, name):
    from ricllm import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: (True, "triton (stub)"))
    backend = select_backend(name, torch.device("cuda"), torch.uint8)
    assert backend.name == "triton" and backend.windowed_decode


def test_auto_on_cuda_without_triton_reads_int8_in_the_reference(monkeypatch):
    from ricllm import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: (False, "no triton (stub)"))
    assert select_backend("auto", torch.device("cuda"), torch.uint8).name == "torch"
    with pytest.raises(ConfigError, match="attention backend 'triton' is not available: no triton"):
        select_backend("triton", torch.device("cuda"), torch.uint8)


def _decode_step_with_windows(windowed: bool) -> AttentionMetadata:
    lens = torch.tensor([40, 9], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor([39, 64 + 8]), query_start_loc=torch.arange(3, dtype=torch.int32),
        context_lens=lens, block_tables=torch.tensor([[0, 1, 2], [4, 0, 0]], dtype=torch.int32),
        max_query_len=1, max_context_len=40,
        kv_sinks=torch.tensor([4, 0], dtype=torch.int32) if windowed else None,
        kv_windows=torch.tensor([16, 0], dtype=torch.int32) if windowed else None)


@pytest.mark.parametrize("windowed_decode", [True, False], ids=["triton", "cuda"])
def test_kernel_backend_routes_windowed_decodes_to_a_kernel_that_takes_them(windowed_decode):
    """The Triton decode gets the step's windows; a decode kernel without them (CUDA) is bypassed
    for the reference on windowed steps, and still serves exact ones."""
    from ricllm.attention.backends import KernelAttention

    calls = []

    def decode(q, k_cache, v_cache, tables, lens, scale, max_len, **windows):
        calls.append(windows)
        return torch.zeros_like(q)

    backend = KernelAttention("stub", reference.store_kv, decode, windowed_decode=windowed_decode)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    k_cache, v_cache = torch.randn(8, 16, 2, 8), torch.randn(8, 16, 2, 8)
    meta = _decode_step_with_windows(True)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.3)
    if windowed_decode:
        assert torch.equal(out, torch.zeros_like(q))
        assert calls[0]["kv_sinks"] is meta.kv_sinks and calls[0]["kv_windows"] is meta.kv_windows
    else:
        assert not calls
        meta.scratch.clear()
        assert torch.equal(out, reference.paged_attention(q, k_cache, v_cache, meta, 0.3))
    backend.forward(q, k, v, k_cache, v_cache, _decode_step_with_windows(False), 0.3)
    assert calls[-1] == {}
