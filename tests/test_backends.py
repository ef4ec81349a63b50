"""Attention backend selection: auto is the torch reference on CPU; GPU backends refuse a CPU."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM
from ricllm.attention.backends import select_backend
from ricllm.errors import ConfigError


def test_auto_on_cpu_is_the_torch_reference():
    assert select_backend("auto", torch.device("cpu")).name == "torch"


@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_gpu_backend_on_cpu_is_a_clear_error(tiny_gguf, name):
    with pytest.raises(ConfigError, match=f"attention backend '{name}' needs a CUDA device"):
        LLM(str(tiny_gguf), device="cpu", attention_backend=name)


def test_unknown_backend(tiny_gguf):
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'"):
        LLM(str(tiny_gguf), attention_backend="flash")
