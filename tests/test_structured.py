"""Constrained answers: every answer parses and matches its constraint, in both runtimes; forced
tokens computed as one chunk give the tokens they give one per step; unconstrained rows sharing
the batch are untouched; a bad constraint or a too-short max_tokens is refused at once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ricllm import LLM, SamplingParams
from ricllm.errors import InvalidRequestError
from ricllm.structured import bounds
from ricllm.structured.spec import StructuredSpec

RUNTIMES = ("native", "torch")
DECISION = {"type": "object", "properties": {
    "action": {"enum": ["offload", "hold", "escalate", "rebalance"]},
    "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
    "required": ["action", "cio_delta_db"], "additionalProperties": False}
PROMPTS = ["the cell is congested", "hello world", "RLC delay 123", "The answer is"]


def tiny(path: Path, runtime: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_budget", "4MiB")
    return LLM(str(path), weights="int4", runtime=runtime, weight_cache=False, **kwargs)


@pytest.fixture(scope="module", params=RUNTIMES)
def llm(request, tiny_native_gguf) -> LLM:
    return tiny(tiny_native_gguf, request.param)


# ------------------------------------------------------------------ every answer is valid

SCALARS = st.one_of(
    st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["a", "bb", "ok", "no", "x y"]),
                                                        min_size=1, max_size=4, unique=True)),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
)
SCHEMAS = st.builds(
    lambda props, n_required: {"type": "object", "properties": props,
                               "required": list(props)[:n_required], "additionalProperties": False},
    st.dictionaries(st.sampled_from(["action", "level", "cell", "ok"]), SCALARS, min_size=1, max_size=3),
    st.integers(0, 3))


def test_an_answer_forced_whole_at_arrival_is_bounded_with_its_sampled_end(llm):
    """The grammar forces every token of ``{"action":""}`` at arrival; the request still samples once
    (the end token), and the bound counts that token too."""
    schema = {"type": "object", "properties": {"action": {"type": "string", "maxLength": 0}},
              "required": ["action"], "additionalProperties": False}
    out = llm.generate(["the cell is congested"], SamplingParams(max_tokens=200, structured={"json": schema}))[0]
    compiled = llm.engine.compile_structured({"json": schema})
    assert out.text == '{"action":""}' and out.finish_reason == "stop"
    assert len(out.token_ids) == out.num_forced_tokens + 1 <= compiled.max_tokens and compiled.max_decisions == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 10_000), prompt=st.sampled_from(PROMPTS))
def test_a_constrained_answer_always_parses_and_matches_its_schema(llm, schema, seed, prompt):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured={"json": schema})
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "stop", (out.text, out.finish_reason)
    jsonschema.validate(json.loads(out.text), schema)
    compiled = llm.engine.compile_structured({"json": schema})
    assert len(out.token_ids) <= compiled.max_tokens
    if compiled.max_decisions is not None:  # admission plans one step per decision
        assert len(out.token_ids) - out.num_forced_tokens <= compiled.max_decisions


def test_choices_and_regexes_are_obeyed_greedy_and_sampled(llm):
    for seed in range(6):
        sampled = {"temperature": 1.0, "seed": seed}
        choice = llm.generate(PROMPTS[seed % 4], SamplingParams(max_tokens=20, structured={"choice": ["offload",
                              "hold", "escalate"]}, **sampled))[0]
        regex = llm.generate(PROMPTS[seed % 4], SamplingParams(max_tokens=20, structured={"regex": r"[0-9]{2}-[a-z]{1,3}"},
                             **sampled))[0]
        assert choice.text in ("offload", "hold", "escalate") and choice.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{2}-[a-z]{1,3}", regex.text), regex.text


# ------------------------------------------------------------------ forced tokens

def test_forced_tokens_as_one_chunk_give_the_tokens_they_give_one_per_step(tiny_native_gguf):
    for runtime in RUNTIMES:
        params = [SamplingParams(max_tokens=64, structured={"json": DECISION}, temperature=t, seed=3)
                  for t in (0.0, 0.8)]
        steps, tokens = {}, {}
        for jump in (True, False):
            llm = tiny(tiny_native_gguf, runtime, jump_forward=jump)
            outs = [llm.generate([p], sp)[0] for p in PROMPTS for sp in params]
            tokens[jump], steps[jump] = [o.token_ids for o in outs], llm.engine.snapshot().steps
            assert all(o.num_forced_tokens > 0 for o in outs)
        assert tokens[True] == tokens[False], runtime
        assert steps[True] < steps[False], (runtime, steps)


def test_the_forced_start_of_an_answer_costs_no_step(llm):
    before = llm.engine.snapshot().steps
    out = llm.generate(["hello world"], SamplingParams(max_tokens=64, structured={"json": DECISION}))[0]
    sampled = len(out.token_ids) - out.num_forced_tokens
    assert out.text.startswith('{"action":"')
    assert llm.engine.snapshot().steps - before <= sampled  # one step per sampling decision, forced runs ride along


# ------------------------------------------------------------------ sharing a batch

def test_unconstrained_rows_sharing_a_batch_with_constrained_ones_are_unchanged(llm):
    """Unconstrained rows sample from the model's own logits, bit for bit; a constrained row's
    sampler sees only the tokens its grammar allows."""
    raw, calls, constrained_calls = [], [], []
    engine = llm.engine
    run, sample, sample_allowed = engine.runtime.runner.run, engine.runtime.sample, engine.runtime.sample_allowed

    def recording_run(batch, *allowed):
        logits, rows = run(batch, *allowed)
        full = logits.unconstrained()[1] if allowed else logits
        raw.append(None if full is None else torch.as_tensor(full).clone().numpy())
        return logits, rows

    def recording_sample(logits, params, generators):
        calls.append((len(raw) - 1, torch.as_tensor(logits).clone().numpy(), [p.structured is not None for p in params]))
        return sample(logits, params, generators)

    def recording_sample_allowed(ids, logits, params, generator):
        token = sample_allowed(ids, logits, params, generator)
        constrained_calls.append((len(raw) - 1, ids.copy(), params.structured is not None, token))
        return token

    object.__setattr__(engine.runtime, "sample", recording_sample)  # Runtime is frozen
    object.__setattr__(engine.runtime, "sample_allowed", recording_sample_allowed)
    engine.runtime.runner.run = recording_run
    try:
        plain = SamplingParams(max_tokens=12, ignore_eos=True)
        constrained = SamplingParams(max_tokens=64, structured={"json": DECISION}, temperature=0.8, top_k=50, seed=1)
        mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 4 + [constrained] * 4)
    finally:
        object.__setattr__(engine.runtime, "sample", sample)
        object.__setattr__(engine.runtime, "sample_allowed", sample_allowed)
        del engine.runtime.runner.run
    mixed_steps = {step for step, *_ in constrained_calls} & {step for step, *_ in calls}
    assert mixed_steps
    for step, seen, constrained_rows in calls:
        assert not any(constrained_rows)
        assert np.array_equal(raw[step], seen)  # bit for bit
    vocab = engine.spec.vocab_size
    assert all(is_constrained and 0 < len(ids) < vocab and token in ids
               for _, ids, is_constrained, token in constrained_calls)  # drawn among the allowed tokens only
    assert [len(o.token_ids) for o in mixed[:4]] == [12] * 4
    assert all(json.loads(o.text)["action"] in DECISION["properties"]["action"]["enum"] for o in mixed[4:])


def test_a_sampled_constrained_row_draws_only_allowed_tokens(llm):
    """Temperature-only rows draw once over their allowed tokens: answers stay valid."""
    for seed in range(8):
        out = llm.generate(PROMPTS[seed % 4], SamplingParams(max_tokens=64, temperature=1.5, seed=seed,
                                                             structured={"json": DECISION}))[0]
        jsonschema.validate(json.loads(out.text), DECISION)


# ------------------------------------------------------------------ refused at once

@pytest.mark.parametrize("structured, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "colour"}}}}, "colour"),
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"json": True}, "structured json cannot be compiled"),
])
def test_a_constraint_that_cannot_compile_is_an_error_naming_the_problem(llm, structured, words):
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        llm.generate(["hello"], SamplingParams(structured=structured))
    assert llm.generate(["hello"], SamplingParams(max_tokens=4))[0].finish_reason == "length"  # the engine goes on


@pytest.mark.parametrize("structured", [{"jsn": {}}, {"choice": []}, {"json": {}, "regex": "a"}, {"regex": 3}])
def test_a_malformed_constraint_is_refused_when_the_params_are_made(structured):
    with pytest.raises(InvalidRequestError, match="structured"):
        SamplingParams(structured=structured)


@pytest.mark.parametrize("admission", ["off", "deadline"])
def test_max_tokens_shorter_than_any_complete_answer_is_refused_at_arrival(tiny_native_gguf, admission):
    llm = tiny(tiny_native_gguf, "native", admission=admission)
    shortest = llm.engine.compile_structured({"json": DECISION}).min_tokens
    out = llm.generate(["hello"], SamplingParams(max_tokens=shortest - 1, structured={"json": DECISION},
                                                 deadline_ms=60_000))[0]
    assert out.finish_reason == "rejected" and out.rejection.code == "OUTPUT_TOO_SHORT"
    assert out.rejection.numbers == {"max_tokens": shortest - 1, "shortest_answer_tokens": shortest}
    assert f"({shortest} tokens)" in out.rejection.message
    ok = llm.generate(["hello"], SamplingParams(max_tokens=64, structured={"json": DECISION}, deadline_ms=60_000))[0]
    assert ok.finish_reason == "stop"


def test_admission_plans_with_the_longest_answer_not_a_larger_max_tokens(tiny_native_gguf):
    llm = tiny(tiny_native_gguf, "native")
    choice = {"choice": ["yes", "no"]}
    seq = llm.engine.add_request("hello", SamplingParams(max_tokens=500, structured=choice))
    planned = seq.params.max_tokens
    assert planned <= len("yes") + 1  # three bytes, one token each at most, and the end
    outputs = llm.generate(["hello"] * 32, [SamplingParams(max_tokens=500, temperature=2.0, seed=seed,
                                                           structured=choice) for seed in range(32)])
    assert all(o.finish_reason == "stop" for o in outputs)  # no answer was cut: the plan is an upper bound
    assert max(len(o.token_ids) for o in outputs) == planned  # and a tight one: some answer takes all of it


def test_no_sampled_answer_takes_more_decisions_than_its_grammar_bound(llm):
    compiled = llm.engine.compile_structured({"json": DECISION})
    assert compiled.max_decisions is not None and compiled.max_decisions < compiled.max_tokens
    outputs = llm.generate(["hello"] * 48, [SamplingParams(max_tokens=64, temperature=2.0, seed=seed,
                                                           structured={"json": DECISION}) for seed in range(48)])
    sampled = [len(o.token_ids) - o.num_forced_tokens for o in outputs]
    assert all(o.finish_reason == "stop" for o in outputs) and max(sampled) <= compiled.max_decisions


def test_no_answer_has_steps_compute_more_than_its_grammar_bound(llm):
    """A forced token is computed with the decision before it when another decision follows; the
    forced tail that completes the answer is appended, never computed. So the steps of one answer
    compute at most its prompt, its forced start, one row per decision but the last, and
    ``max_forced_computed``; a one-decision answer computes no forced token past its start."""
    engine = llm.engine
    compiled = engine.compile_structured({"json": DECISION})
    assert compiled.max_forced_computed is not None and compiled.max_decisions > 1
    assert compiled.max_forced_computed < compiled.max_tokens - compiled.max_decisions  # the tail is left out
    assert engine.compile_structured({"choice": ["offload", "hold"]}).max_forced_computed == 0
    for seed in range(12):
        engine.step_history.clear()
        [out] = llm.generate(["hello"], SamplingParams(max_tokens=64, temperature=2.0, seed=seed,
                                                       structured={"json": DECISION}))
        computed = sum(r.features.num_prefill_tokens + r.features.num_decode_seqs for r in engine.step_history)
        sampled = len(out.token_ids) - out.num_forced_tokens
        start = len(engine.compile_structured({"json": DECISION}).new_matcher().compute_ff_tokens())
        assert computed <= len(out.prompt_token_ids) + start + sampled - 1 + compiled.max_forced_computed


def test_free_text_has_no_decision_bound_and_plans_every_token(llm):
    compiled = llm.engine.compile_structured({"json": {"type": "object", "properties": {
        "reason": {"type": "string", "maxLength": 40}}, "required": ["reason"], "additionalProperties": False}})
    assert compiled.max_tokens is not None and compiled.max_decisions is None


def test_a_constrained_answer_cut_by_max_tokens_says_length(llm):
    out = llm.generate(["hello"], SamplingParams(max_tokens=5, structured={"regex": "[a-z]{30}"}))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


# ------------------------------------------------------------------ bounds from the schema

@pytest.mark.parametrize("structured, longest", [
    ({"json": DECISION}, len('{"action":"rebalance","cio_delta_db":-6}')),
    ({"choice": ["a", "ccc", "bb"]}, 3),
    ({"regex": "[a-z]{2,5}"}, 20),  # five characters of up to four bytes
    ({"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, len("[false,false]")),
    ({"json": {"type": "string", "maxLength": 3}}, 2 + 3 * 6),
    ({"json": {"anyOf": [{"type": "boolean"}, {"const": "n/a"}]}}, len("false")),
    ({"json": {"type": ["null", "boolean"]}}, len("false")),
    ({"json": {"type": "integer"}}, None),
    ({"json": {"type": "object", "properties": {"a": {"type": "boolean"}}}}, None),  # extra properties allowed
    ({"regex": "a+"}, None),
    ({"grammar": 'start: "x"'}, None),
])
def test_the_longest_answer_is_known_only_where_the_schema_bounds_it(structured, longest):
    assert bounds.longest_bytes(StructuredSpec.parse(structured)) == longest


def test_the_shortest_answers_take_the_shortest_value_of_each_required_field():
    answers = bounds.shortest_answers(StructuredSpec.parse({"json": DECISION}))
    assert answers[0] == '{"action":"hold","cio_delta_db":0}'
    optional = {**DECISION, "required": ["action"]}
    assert bounds.shortest_answers(StructuredSpec.parse({"json": optional}))[0] == '{"action":"hold"}'


# ------------------------------------------------------------------ templates and the command line

def test_a_pinned_template_compiles_its_constraint_and_its_examples_hit_the_cache(tiny_native_gguf):
    from ricllm import Template

    llm = tiny(tiny_native_gguf, "native")
    template = Template.build([{"role": "system", "content": "Decide."}, {"role": "user", "content": "hello world"},
                               {"role": "assistant", "content": '{"action":"hold","cio_delta_db":0}'}],
                              structured={"json": DECISION})
    llm.pin_prefix(template)
    assert llm.engine.constraints.num_compiled == 1
    out = llm.chat(template.message_list + [{"role": "user", "content": "the cell is congested"}],
                   SamplingParams(max_tokens=64, structured=template.structured))[0]
    assert out.num_cached_tokens >= 16 and json.loads(out.text)["action"] in ("offload", "hold", "escalate",
                                                                              "rebalance")
    assert llm.engine.constraints.num_compiled == 1  # the request found it compiled


def test_generate_takes_a_constraint_from_the_command_line(tiny_native_gguf, tmp_path, capsys):
    from ricllm.cli import main

    schema = tmp_path / "decision.json"
    schema.write_text(json.dumps(DECISION))
    common = ["generate", "hello world", "--model", str(tiny_native_gguf), "--kv-cache-budget", "4MiB", "--json"]
    assert main(common + ["--json-schema", str(schema)]) == 0
    answer = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(answer["text"]), DECISION)
    assert answer["num_forced_tokens"] > 0
    assert main(common + ["--choice", "yes,no"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    assert main(common + ["--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(common + ["--json-schema", str(schema), "--max-tokens", "2"]) == 1
    assert "OUTPUT_TOO_SHORT" in capsys.readouterr().out


def test_a_refused_constrained_request_answers_nothing(tiny_native_gguf):
    llm = tiny(tiny_native_gguf, "native", admission="deadline")
    out = llm.generate(["hello"], SamplingParams(max_tokens=64, structured={"json": DECISION}, deadline_ms=0.001))[0]
    assert out.finish_reason == "rejected" and out.rejection.code == "DEADLINE_INFEASIBLE"
    assert out.token_ids == [] and out.text == "" and out.num_forced_tokens == 0
