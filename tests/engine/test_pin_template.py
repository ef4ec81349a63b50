"""``LLMEngine.pin_template``: the one way a template is pinned (the offline API, the server's
registered templates and a replay's templates all call it): its constraint compiled, its
conversation rendered as chat requests start with it, pinned, and counted."""

from __future__ import annotations

import pytest

from ricllm.config import EngineConfig
from ricllm.engine.llm_engine import LLMEngine
from ricllm.errors import CapacityError
from ricllm.sampling_params import SamplingParams
from ricllm.template import Template

CONVERSATION = [{"role": "system", "content": "You decide for a congested RAN cell. " * 6},
                {"role": "user", "content": "PRB usage: high."}, {"role": "assistant", "content": "offload"}]


@pytest.fixture
def engine(tiny_gguf):
    return LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", kv_cache_budget=64 * 16 * 512, block_size=16))


def test_a_pinned_template_is_computed_counted_and_hit(engine):
    pinned = engine.pin_template(Template.build(CONVERSATION, {"choice": ["offload", "hold"]}))
    assert pinned.computed and engine.is_pinned(pinned.handle) and engine.constraints.num_compiled == 1
    assert pinned.num_pinned_tokens == pinned.num_tokens // 16 * 16 > 0
    assert engine.snapshot().kv_cache.pinned_blocks * 16 == pinned.num_pinned_tokens
    seq = engine.add_request(pinned.prefix.token_ids + [5, 6, 7], SamplingParams(max_tokens=16, structured={
        "choice": ["offload", "hold"]}))
    assert seq.rejection is None
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens == pinned.num_pinned_tokens and engine.constraints.num_compiled == 1


def test_without_wait_the_caller_steps_and_sees_the_pin_finish(engine):
    pinned = engine.pin_template(CONVERSATION, request_id="template:1", wait=False)
    assert not pinned.computed and pinned.num_pinned_tokens == 0
    finished = [out.request_id for out in engine.step()]
    assert finished == ["template:1"] and pinned.computed and pinned.num_pinned_tokens > 0


def test_a_template_that_does_not_fit_pins_nothing(tiny_gguf):
    small = LLMEngine(EngineConfig(model=str(tiny_gguf), dtype="float32", kv_cache_budget=4 * 16 * 512, block_size=16))
    with pytest.raises(CapacityError, match="pinning"):
        small.pin_template([{"role": "system", "content": "congested cell " * 200}])
    assert small.snapshot().kv_cache.pinned_blocks == 0
