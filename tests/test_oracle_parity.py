"""ricllm's logits equal HF transformers' on the same GGUF (fp32), prefill and decode."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM, SamplingParams
from tests.hf_oracle import load_hf_oracle
from tests.recorder import LogitsRecorder

PROMPT_LENGTHS = (1, 7, 16, 33, 50)
DECODE_STEPS = 32


def random_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def oracle_logits(oracle, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return oracle(torch.tensor([token_ids])).logits[0].float()


def assert_matches_oracle(llm: LLM, oracle, prompts, atol: float = 1e-4) -> None:
    recorder = LogitsRecorder(llm.engine)
    params = SamplingParams(max_tokens=DECODE_STEPS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        assert len(out.token_ids) == DECODE_STEPS
        full = out.prompt_token_ids + out.token_ids
        positions, ours = recorder.stacked(out.request_id)
        assert positions == list(range(len(out.prompt_token_ids) - 1, len(full) - 1))
        reference = oracle_logits(oracle, full)[positions]
        torch.testing.assert_close(ours, reference, atol=atol, rtol=0)
        # greedy: every sampled token is the oracle's argmax at that position
        assert out.token_ids == reference.argmax(-1).tolist()


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_logits_match_hf_over_prefill_and_decode(tiny_gguf, tiny_oracle, block_size):
    llm = LLM(str(tiny_gguf), dtype="float32", block_size=block_size, kv_cache_budget="8MiB")
    assert_matches_oracle(llm, tiny_oracle, random_prompts(llm.engine.spec.vocab_size))


def test_tied_quantized_model_matches_hf(tiny_tied_q8_gguf):
    oracle = load_hf_oracle(tiny_tied_q8_gguf)
    llm = LLM(str(tiny_tied_q8_gguf), dtype="float32", kv_cache_budget="8MiB")
    assert llm.engine.spec.tie_word_embeddings
    assert_matches_oracle(llm, oracle, random_prompts(llm.engine.spec.vocab_size, (5, 40)))
