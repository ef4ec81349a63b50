"""Results do not depend on block size, batch composition or prefill chunk size."""

from __future__ import annotations

import pytest
import torch

from ricllm import LLM, SamplingParams
from tests.recorder import LogitsRecorder
from tests.test_oracle_parity import random_prompts

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def run(tiny_gguf, prompts, **engine_kwargs):
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_budget="8MiB", **engine_kwargs)
    recorder = LogitsRecorder(llm.engine)
    outputs = llm.generate(prompts, PARAMS)
    return outputs, [recorder.stacked(o.request_id)[1] for o in outputs]


@pytest.fixture(scope="module")
def prompts(tiny_gguf):
    from ricllm.model.loader import open_checkpoint

    return random_prompts(open_checkpoint(tiny_gguf).spec.vocab_size, (3, 17, 31, 64, 90), seed=7)


@pytest.fixture(scope="module")
def solo(tiny_gguf, prompts):
    """Each prompt run alone, block size 16, whole prompt in one step."""
    return [run(tiny_gguf, [p])[0][0] for p in prompts], [run(tiny_gguf, [p])[1][0] for p in prompts]


@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=1),
    dict(block_size=32),
    dict(max_num_batched_tokens=7),      # prefills split in chunks of at most 7 tokens
    dict(max_num_seqs=2),                # requests join as others leave
    dict(block_size=8, max_num_batched_tokens=20, max_num_seqs=3),
], ids=["bs1", "bs32", "chunk7", "seqs2", "mixed"])
def test_batched_equals_solo(tiny_gguf, prompts, solo, engine_kwargs):
    solo_outputs, solo_logits = solo
    outputs, logits = run(tiny_gguf, prompts, **engine_kwargs)
    for out, ref_out, ours, ref in zip(outputs, solo_outputs, logits, solo_logits):
        assert out.token_ids == ref_out.token_ids
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_batch_order_does_not_matter(tiny_gguf, prompts, solo):
    outputs, _ = run(tiny_gguf, list(reversed(prompts)))
    assert [o.token_ids for o in reversed(outputs)] == [o.token_ids for o in solo[0]]
