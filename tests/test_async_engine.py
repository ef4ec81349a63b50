"""The online engine: requests from other threads or asyncio, one engine thread stepping."""

from __future__ import annotations

import asyncio
import threading
import time

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
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32"))

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
    worker = EngineThread(EngineConfig(model=str(tiny_gguf), dtype="float32"))
    assert worker.call(lambda engine: engine.snapshot().kv_cache.used_blocks).result(timeout=30) == 0
    bad = worker.submit([], PARAMS)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        bad.result(timeout=30)
    good = [worker.submit([5, 6, 7], PARAMS) for _ in range(3)]
    worker.stop(timeout=60)  # drains: every queued request finishes
    assert all(f.done() and len(f.result().token_ids) == 12 for f in good)


def test_the_engine_is_built_on_its_thread_and_build_errors_reach_the_caller(tiny_gguf, tmp_path):
    from ricllm.errors import RicllmError

    worker = EngineThread(lambda: LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32")))
    assert worker.engine._built_on == worker.thread.ident
    worker.stop(timeout=60)
    with pytest.raises(RicllmError, match="missing.gguf"):
        EngineThread(EngineConfig(model=str(tmp_path / "missing.gguf")))


def test_stepping_off_the_build_thread_while_it_lives_is_logged_once(tiny_gguf):
    from structlog.testing import capture_logs

    engine = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32"))  # built here, on the test's thread
    with capture_logs() as logs:
        worker = EngineThread(engine)
        [worker.submit([5, 6, 7], PARAMS) for _ in range(2)]
        worker.stop(timeout=60)
    warnings = [e for e in logs if e["event"] == "engine_stepped_off_its_build_thread"]
    assert len(warnings) == 1 and "EngineThread(EngineConfig" in warnings[0]["fix"]


def test_an_engine_fault_reaches_every_waiting_caller(tiny_gguf):
    worker = EngineThread(EngineConfig(model=str(tiny_gguf), dtype="float32"))

    def broken_step():
        raise RuntimeError("the step broke")

    both_queued = threading.Event()  # holds the engine thread, so both requests reach one step
    broken = worker.call(lambda engine: (setattr(engine, "step", broken_step), both_queued.wait(30)))
    waiting = [worker.submit([5, 6, 7], PARAMS) for _ in range(2)]
    both_queued.set()
    broken.result(timeout=30)
    with pytest.raises(RuntimeError, match="the step broke"):
        waiting[0].result(timeout=30)
    assert isinstance(waiting[1].exception(timeout=30), RuntimeError)
    worker.thread.join(30)
    assert not worker.thread.is_alive()


def test_a_deadline_counts_from_submission_not_from_the_engine_picking_it_up(tiny_gguf):
    worker = EngineThread(EngineConfig(model=str(tiny_gguf), kv_cache_budget="4MiB", dtype="float32"))
    try:
        busy = worker.call(lambda engine: time.sleep(0.3))  # the engine thread is busy for 300 ms
        out = worker.submit("hello world", SamplingParams(max_tokens=2, deadline_ms=200)).result(timeout=30)
        busy.result()
    finally:
        worker.stop()
    assert out.e2e_s >= 0.3 and out.deadline_met is False  # the 300 ms wait counts against its 200 ms
