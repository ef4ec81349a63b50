"""Attention backend selection: auto is the C kernel on CPU (torch where it cannot run); GPU backends refuse a CPU."""

from __future__ import annotations

import shutil

import pytest
import torch

from ricllm import LLM
from ricllm.attention.backends import select_backend
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
