"""A constrained decision's confidence and its fallback, on the tiny random model in both runtimes.

Confidence is the product, over the steps whose constraint allowed at least two tokens (the
model's end tokens counting as one), of the temperature-1 softmax over the allowed logits at the
chosen token: 1.0 when the grammar never leaves a choice, None for free text, the same product
computed here by hand from the logits each step saw, and the same number from both runtimes. A decision below its ``min_confidence`` answers
the fallback with finish reason ``fallback``; a fallback the constraint refuses is refused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ricllm import LLM, SamplingParams
from ricllm.engine.constrained import ConstrainedDecoding, decision_shares
from ricllm.errors import InvalidRequestError
from ricllm.structured.fallback import Fallback
from ricllm.template import Template

RUNTIMES = ("native", "torch")
ACTIONS = ["offload", "hold", "escalate"]
DECISION = {"type": "object", "properties": {
    "action": {"enum": ACTIONS}, "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
    "required": ["action", "cio_delta_db"], "additionalProperties": False}
PROMPTS = ["the cell is congested", "hello world", "RLC delay 123", "The answer is"]


def tiny(path, runtime: str, **kwargs) -> LLM:
    return LLM(str(path), weights="int4", runtime=runtime, weight_cache=False, kv_cache_budget="4MiB", **kwargs)


@pytest.fixture(scope="module", params=RUNTIMES)
def llm(request, tiny_native_gguf) -> LLM:
    return tiny(tiny_native_gguf, request.param)


def test_one_allowed_token_at_every_step_is_confidence_one_and_free_text_has_none(llm):
    """``choice: [hold]`` forces the answer whole; the one step left, its end, allows the end tokens only."""
    forced, free = llm.generate(["the cell is congested"] * 2, [
        SamplingParams(max_tokens=8, structured={"choice": ["hold"]}), SamplingParams(max_tokens=8)])
    assert forced.text == "hold" and forced.finish_reason == "stop" and forced.confidence == 1.0
    assert len(forced.token_ids) == forced.num_forced_tokens + 1  # one step was sampled, and decided nothing
    assert free.confidence is None and len(free.token_ids) == 8


def test_confidence_is_the_product_of_each_choice_steps_allowed_softmax(llm, monkeypatch):
    """Recomputed by hand from the logits and allowed sets each sampling step saw."""
    steps = []
    sample = ConstrainedDecoding.sample
    ends = llm.engine.tokenizer.eos_token_ids

    def recording(self, logits, ready):
        tokens = sample(self, logits, ready)
        steps.append([(ready[r].request_id, np.asarray(a.ids),
                       np.asarray(a.logits.float().cpu() if isinstance(a.logits, torch.Tensor) else a.logits,
                                  dtype=np.float64), tokens[r])
                      for r, a in getattr(logits, "allowed", {}).items()])
        return tokens

    monkeypatch.setattr(ConstrainedDecoding, "sample", recording)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=1.0, seed=7, structured={"json": DECISION}))
    for out in outs:
        expected, choices = 1.0, 0
        for request_id, ids, values, token in (step for batch in steps for step in batch if step[0] == out.request_id):
            weight = dict(zip(ids.tolist(), np.exp(values).tolist()))
            outcomes = {"end" if i in ends else i for i in weight}
            if len(outcomes) >= 2:
                chosen = [i for i in weight if i in ends] if token in ends else [token]
                expected *= sum(weight[i] for i in chosen) / sum(weight.values())
                choices += 1
        assert out.finish_reason == "stop" and choices >= 2  # the action and the number at least
        assert out.confidence == pytest.approx(expected, rel=1e-9), out.text


def test_a_steps_share_by_hand():
    ends = np.array([48, 49])
    values = np.array([1.0, 2.0, 0.5, 0.0])
    whole = math.e + math.e ** 2 + math.e ** 0.5 + 1
    cases = [  # (allowed ids, their logits, chosen): one row each, then all in one batch
        (np.array([1, 2, 48, 49]), values, 2, math.e ** 2 / whole),
        (np.array([1, 2, 48, 49]), values, 49, (math.e ** 0.5 + 1) / whole),  # either end: one outcome
        (np.array([48, 49]), np.array([3.0, -1.0]), 49, None),  # ending, one way or another
        (np.array([7]), np.array([3.0]), 7, None),
        (np.array([0, 5, 9]), np.array([0.0, np.log(3.0), 0.0]), 5, 0.6),
    ]
    for ids, values_, chosen, share in cases:
        got = decision_shares([ids], [values_], [chosen], ends)
        assert got == [share] if share is None else got == [pytest.approx(share)]
    batch = decision_shares([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], ends)
    assert batch == [None if c[3] is None else pytest.approx(c[3]) for c in cases]


def test_both_runtimes_give_the_same_confidence(tiny_native_gguf):
    """Where both run the C decoder stack (steps of up to 64 rows) their logits are the same bits,
    and so is each decision's confidence."""
    params = SamplingParams(max_tokens=64, structured={"json": DECISION})
    native, torched = (tiny(tiny_native_gguf, runtime, max_num_batched_tokens=64).generate(PROMPTS, params)
                       for runtime in RUNTIMES)
    for a, b in zip(native, torched):
        assert a.text == b.text and a.finish_reason == "stop" and 0 < a.confidence < 1
        assert a.confidence == pytest.approx(b.confidence, rel=1e-12)


def test_a_decision_below_min_confidence_answers_the_fallback(llm):
    unsure = SamplingParams(max_tokens=8, structured={"choice": ACTIONS}, fallback=Fallback(1.0, "escalate"))
    sure = SamplingParams(max_tokens=8, structured={"choice": ACTIONS}, fallback=Fallback(1e-12, "escalate"))
    replaced, kept = llm.generate(["the cell is congested"] * 2, [unsure, sure])
    assert replaced.finish_reason == "fallback" and replaced.text == "escalate" and replaced.model_text in ACTIONS
    assert replaced.confidence < 1.0 and replaced.token_ids == kept.token_ids  # the model's own tokens
    assert kept.finish_reason == "stop" and kept.text == replaced.model_text and kept.model_text is None
    assert kept.confidence == replaced.confidence


@pytest.mark.parametrize("structured, answer, words", [
    ({"choice": ACTIONS}, "retreat", "fallback 'retreat' does not satisfy the choice constraint"),
    ({"json": DECISION}, '{"action":"hold","cio_delta_db":1', "does not satisfy the json constraint: it stops before "
                                                                "a whole answer"),
    ({"json": DECISION}, '{"action":"hold"}', "is refused from '}' on"),
])
def test_a_fallback_the_constraint_refuses_is_refused_naming_it(llm, structured, answer, words):
    params = SamplingParams(max_tokens=16, structured=structured, fallback=Fallback(0.5, answer))
    with pytest.raises(InvalidRequestError, match=words):
        llm.generate(["hello"], params)
    template = Template.build("You decide.", structured, min_confidence=0.5, fallback=answer)
    with pytest.raises(InvalidRequestError, match=words):
        llm.engine.pin_template(template)
    assert llm.generate(["hello"], SamplingParams(max_tokens=4))[0].finish_reason == "length"  # the engine goes on


@pytest.mark.parametrize("kwargs, words", [
    ({"structured": {"choice": ACTIONS}, "min_confidence": 0.5}, "fallback is missing"),
    ({"structured": {"choice": ACTIONS}, "fallback": "hold"}, "min_confidence is missing"),
    ({"min_confidence": 0.5, "fallback": "hold"}, "needs a constraint"),
    ({"structured": {"choice": ACTIONS}, "min_confidence": 1.5, "fallback": "hold"}, r"in \(0, 1\]"),
])
def test_a_template_takes_min_confidence_and_fallback_together_with_a_constraint(kwargs, words):
    with pytest.raises(InvalidRequestError, match=words):
        Template.build("You decide.", **kwargs)
