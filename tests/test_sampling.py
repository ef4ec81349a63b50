"""Sampling knobs: seeds reproduce, filters restrict, stops stop where they should."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.engine.runtime.sampler import filter_logits
from ricllm.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(str(tiny_gguf), dtype="float32", kv_cache_budget="8MiB")


PROMPT = [[17, 42, 99, 180, 7, 61]]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids
    batched = llm.generate(PROMPT + [[3, 4, 5]] + PROMPT, [params, SamplingParams(max_tokens=5), params])
    assert batched[0].token_ids == alone == batched[2].token_ids
    other_seed = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=5, ignore_eos=True))
    assert top1[0].token_ids == greedy


def test_filters_keep_the_right_tokens():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [True, True, False, False, False]
    # probabilities ≈ .64 .23 .09 .03 .01: top_p .8 keeps the two tokens whose mass first passes .8
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)))
    assert kept.tolist() == [True, True, False, False, False]
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.5)))
    assert kept.tolist() == [True, False, False, False, False]


def test_max_tokens_and_stop_token_ids(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stop_at = out.token_ids[3]
    first = out.token_ids.index(stop_at)
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=7, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert stopped.token_ids == out.token_ids[:first + 1] and stopped.finish_reason == "stop"


def test_stop_string_truncates_text(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    needle = out.text[5:8]
    assert len(needle) == 3
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=24, stop=[needle], ignore_eos=True))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == out.text[:out.text.index(needle)]


def test_eos_ends_generation_unless_ignored(llm, monkeypatch):
    free_run = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    eos = free_run[4]
    monkeypatch.setattr(llm.tokenizer, "eos_token_ids", {eos})
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run[:free_run.index(eos) + 1]
    assert llm.tokenizer.decode([eos]) not in stopped.text[len(llm.tokenizer.decode(stopped.token_ids[:-1])):]
    ignored = llm.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)
