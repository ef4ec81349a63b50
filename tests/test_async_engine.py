"""The online engine: requests from other threads or asyncio, one engine thread stepping."""

from __future__ import annotations

import asyncio

import pytest

from ricllm import LLM, SamplingParams
from ricllm.config import EngineConfig
from ricllm.engine.async_engine import AsyncLLMEngine, EngineThread
from ricllm.engine.llm_engine import LLMEngine
from ricllm.errors import InvalidRequestError
from tests.test_oracle_parity import random_prompts

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_gguf):
    return random_prompts(303, (5, 17, 30, 9, 44), seed=21)


@pytest.fixture(scope="module")
def offline(tiny_gguf, prompts):
    return LLM(str(tiny_gguf), dtype="float32").generate(prompts, PARAMS)


def test_concurrent_asyncio_requests_match_offline_generate(tiny_gguf, prompts, offline):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32")))

    async def main():
        outs = await asyncio.gather(*(engine.generate(p, PARAMS) for p in prompts))
        await engine.close()
        return outs

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [o.token_ids for o in offline]


def test_stream_yields_deltas_then_the_output(tiny_gguf, prompts, offline):
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32")))

    async def main():
        items = [item async for item in engine.stream(prompts[2], PARAMS)]
        await engine.close()
        return items

    items = asyncio.run(main())
    *deltas, final = items
    assert len(deltas) > 1 and "".join(deltas) == final.text == offline[2].text


def test_thread_calls_and_malformed_requests(tiny_gguf):
    worker = EngineThread(LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32")))
    assert worker.call(lambda engine: engine.kv_cache_stats()["used_blocks"]).result(timeout=30) == 0
    bad = worker.submit([], PARAMS)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        bad.result(timeout=30)
    good = [worker.submit([5, 6, 7], PARAMS) for _ in range(3)]
    worker.stop(timeout=60)  # drains: every queued request finishes
    assert all(f.done() and len(f.result().token_ids) == 12 for f in good)
