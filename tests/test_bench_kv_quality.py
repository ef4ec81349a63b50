"""benchmarks/bench_kv_quality.py measures what it says: its chunked teacher-forced pass through the
engine's cache gives what one whole-text pass gives (exact cache), the window is applied (not the
exact answer), and its passkey prompts hide the key at the asked depth. Tiny random model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

import benchmarks.bench_kv_quality as bench
from ricllm import LLM
from tests.test_oracle_parity import random_prompts


def engine(tiny_gguf, **settings) -> LLM:
    return LLM(str(tiny_gguf), dtype="float32", runtime="torch", attention_backend="torch",
               kv_cache_budget="4MiB", **settings)


def test_the_chunked_teacher_forced_pass_equals_one_whole_pass(tiny_gguf, monkeypatch):
    text = random_prompts(256, [300], seed=1)[0]
    chunked = bench.teacher_forced(engine(tiny_gguf), text)
    monkeypatch.setattr(bench, "TF_CHUNK", 1024)
    whole = bench.teacher_forced(engine(tiny_gguf), text)
    assert torch.equal(chunked[0], whole[0])
    assert torch.allclose(chunked[1], whole[1], atol=1e-4)
    assert len(chunked[0]) == len(text) - 1


def test_a_windowed_pass_is_the_same_in_any_chunking_and_differs_from_the_exact_one(tiny_gguf, monkeypatch):
    text = random_prompts(256, [300], seed=2)[0]
    windowed = bench.teacher_forced(engine(tiny_gguf, kv_window=40, kv_sinks=4), text)
    monkeypatch.setattr(bench, "TF_CHUNK", 1024)
    whole = bench.teacher_forced(engine(tiny_gguf, kv_window=40, kv_sinks=4), text)
    exact = bench.teacher_forced(engine(tiny_gguf), text)
    assert torch.allclose(windowed[1], whole[1], atol=1e-4)
    assert torch.equal(windowed[1][:40], exact[1][:40])  # within the window nothing differs
    assert not torch.allclose(windowed[1][60:], exact[1][60:], atol=1e-3)


def test_the_key_sits_at_the_asked_depth_and_the_prompt_has_the_asked_length():
    llm = LLM(kv_cache_budget="16MiB")  # the installed SmolLM2's tokenizer: the benchmark's prompts
    tokenizer = llm.engine.tokenizer
    for depth in bench.DEPTHS:
        prompt = bench.passkey_prompt(llm, 1024, depth, 54321)
        text = tokenizer.decode(prompt)
        assert abs(len(prompt) - 1024) <= 30 and text.endswith(bench.QUESTION)
        where = text.index("54321") / len(text)
        assert abs(where - depth) < 0.1
