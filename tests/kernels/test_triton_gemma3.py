"""Gemma 3 on the GPU's decode kernel, run here through the Triton interpreter: heads 256 wide, one KV
head, five windowed layers in six beside a global one. Each decode step calls the kernel once per
layer, a sliding-window layer with its group's block tables and every sequence's window, the global
layer with none; the greedy tokens past the window are the torch reference's."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (conftest.py sets it too)

import pytest

from ricllm import LLM, SamplingParams
from ricllm import kernels
from ricllm.attention.backends import KernelAttention
from ricllm.engine.runtime import torch_runtime
from tests.helpers import require, write_tiny_gemma3_gguf
from tests.test_oracle_parity import random_prompts

WINDOW, BLOCK, VOCAB = 8, 4, 317
PROMPT_LENGTHS, MAX_TOKENS = (13, 21), 12


@pytest.fixture(scope="module")
def gemma_shaped(tmp_path_factory):
    """Gemma 3 270M's attention shape (heads 256 wide, one KV head) on the tiny model's seven layers."""
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("triton_gemma3") / "tiny.gguf", seed=4, window=WINDOW,
                                  head_dim=256, kv_heads=1)


def greedy_tokens(path) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_budget="4MiB", attention_backend="torch",
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(random_prompts(VOCAB, PROMPT_LENGTHS, seed=6), params)
    return [list(o.token_ids) for o in outputs]


def test_the_triton_kernel_attends_each_gemma_layer_in_its_window_as_the_reference_does(gemma_shaped, monkeypatch):
    require(*kernels.triton_available())
    expected = greedy_tokens(gemma_shaped)
    calls: list[tuple[int, tuple[int, ...] | None, tuple[int, ...]]] = []

    def recorded_decode(query, k_cache, v_cache, block_tables, context_lens, *args, **windows):
        held = windows.get("kv_windows")
        calls.append((query.shape[-1], None if held is None else tuple(held.tolist()), tuple(context_lens.tolist())))
        return kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, *args, **windows)

    triton = KernelAttention("triton", kernels.store_kv, recorded_decode, windowed_decode=True)
    monkeypatch.setattr(torch_runtime, "select_backend", lambda *args, **kwargs: triton)
    assert greedy_tokens(gemma_shaped) == expected
    assert calls and {width for width, _, _ in calls} == {256}
    windowed = [(w, lens) for _, w, lens in calls if w is not None]
    whole = [lens for _, w, lens in calls if w is None]
    assert len(windowed) == 6 * len(whole)  # six sliding-window layers to one global layer, every step
    assert all(set(w) == {WINDOW} for w, _ in windowed)
    assert max(max(lens) for lens in whole) > WINDOW + max(PROMPT_LENGTHS)  # decoding reached past the window
