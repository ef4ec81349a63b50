"""Constrained answers over ZeroMQ: a real in-process server on the tiny random model.

A constraint travels in ``generate`` or in a template, whose requests inherit it; what the grammar
engine cannot compile is an error reply and the server goes on; a ``max_tokens`` shorter than any
complete answer is ``rejected`` with ``OUTPUT_TOO_SHORT`` and both numbers.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from ricllm.client import AsyncRicClient, RejectedError, RicClient, ServerError
from tests.serve.test_server import Dealer, generate

DECISION = {"type": "object", "properties": {
    "action": {"enum": ["offload", "hold", "escalate"]},
    "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
    "required": ["action", "cio_delta_db"], "additionalProperties": False}
ACTIONS = ["offload", "hold", "escalate"]
EXAMPLES = [
    {"role": "system", "content": "You decide for a congested RAN cell. Answer with the action only."},
    {"role": "user", "content": "PRB usage: high. RLC delay: high. SINR: positive."},
    {"role": "assistant", "content": "offload"},
    {"role": "user", "content": "PRB usage: normal. RLC delay: normal. SINR: positive."},
    {"role": "assistant", "content": "hold"},
]
QUESTION = [{"role": "user", "content": "PRB usage: high. RLC delay: normal. SINR: negative."}]


# ------------------------------------------------------------------------------ valid answers

@pytest.mark.parametrize("structured, valid", [
    ({"json": DECISION}, lambda text: jsonschema.validate(json.loads(text), DECISION) is None),
    ({"json_schema": json.dumps(DECISION)}, lambda text: jsonschema.validate(json.loads(text), DECISION) is None),
    ({"choice": ACTIONS}, lambda text: text in ACTIONS),
    ({"regex": "cell-[0-9]{2,3}"}, lambda text: re.fullmatch("cell-[0-9]{2,3}", text) is not None),
    ({"grammar": 'start: "on" | "off"'}, lambda text: text in ("on", "off")),
], ids=["json", "json_schema", "choice", "regex", "grammar"])
def test_a_constrained_generate_returns_a_valid_answer(server, structured, valid):
    with RicClient(server.endpoint, timeout_s=60) as client:
        result = client.generate("Cell 17 is congested.", structured=structured, max_tokens=64,
                                 temperature=0.8, seed=3)
    assert result.finish_reason == "stop" and valid(result.text), result.text


def test_forced_tokens_are_counted_and_streamed_like_any_other(server):
    with RicClient(server.endpoint, timeout_s=60) as client:
        replies = list(client.stream("Cell 17", structured={"json": DECISION}, max_tokens=64, deadline_ms=30_000))
    result, tokens = replies[-1], replies[:-1]
    assert json.loads(result.text)["action"] in ACTIONS and result.deadline_met is True
    assert result.num_forced_tokens > 0  # at least the braces, quotes and keys
    assert [t.token_id for t in tokens] == result.token_ids and "".join(t.text for t in tokens) == result.text


def test_a_request_compiles_its_constraint_once(start_server, monkeypatch):
    """Checked at receipt, compiled once on the engine thread: the worker hands the engine its compile."""
    from ricllm.engine.constrained import ConstrainedDecoding

    compiled, compile_once = [], ConstrainedDecoding.compile
    monkeypatch.setattr(ConstrainedDecoding, "compile",
                        lambda self, spec: compiled.append(spec) or compile_once(self, spec))
    running = start_server()
    with RicClient(running.endpoint, timeout_s=60) as client:
        result = client.generate("Cell 17 is congested.", structured={"choice": ACTIONS}, max_tokens=16)
    assert result.text in ACTIONS and len(compiled) == 1


# ------------------------------------------------------------------------------ templates

def test_a_template_with_worked_examples_and_a_constraint_constrains_its_requests(server):
    with RicClient(server.endpoint, timeout_s=60) as client:
        registered = client.register_template(messages=EXAMPLES, structured={"choice": ACTIONS},
                                              template_id="congestion")
        assert registered.num_examples == 2 and registered.num_pinned_tokens > 0
        inherited = client.generate(messages=QUESTION, template_id="congestion", max_tokens=16)
        assert inherited.text in ACTIONS and inherited.finish_reason == "stop"
        assert inherited.num_cached_tokens >= registered.num_pinned_tokens
        # the template's conversation comes first: the same as spelling it out with the same constraint
        spelled = client.generate(messages=EXAMPLES + QUESTION, structured={"choice": ACTIONS}, max_tokens=16)
        assert (spelled.num_prompt_tokens, spelled.token_ids) == (inherited.num_prompt_tokens, inherited.token_ids)
        own = client.generate(messages=QUESTION, template_id="congestion", structured={"regex": "[0-9]{3}"},
                              max_tokens=16)
        assert re.fullmatch("[0-9]{3}", own.text), own.text  # a request's own constraint wins
        raw = client.generate("PRB usage: high.", template_id="congestion", max_tokens=16)
        assert raw.text in ACTIONS
        stats = client.stats().model_dump()["templates"]["congestion"]
        assert stats["num_examples"] == 2 and stats["constraint"] == "choice" and stats["pinned"] is True
        client.unregister_template("congestion")


def test_registering_a_template_again_needs_the_same_conversation_and_constraint(server):
    with RicClient(server.endpoint, timeout_s=60) as client:
        first = client.register_template(messages=EXAMPLES, structured={"choice": ACTIONS}, template_id="again")
        same = client.register_template(messages=EXAMPLES, structured={"choice": list(ACTIONS)}, template_id="again")
        assert (same.num_tokens, same.num_examples) == (first.num_tokens, first.num_examples)
        for change in [{"messages": EXAMPLES, "structured": {"choice": ACTIONS[:2]}},
                       {"messages": EXAMPLES[:3], "structured": {"choice": ACTIONS}},
                       {"messages": EXAMPLES}]:
            with pytest.raises(ServerError) as refused:
                client.register_template(template_id="again", **change)
            assert refused.value.code == "VALIDATION" and "another conversation or constraint" in refused.value.message
        client.unregister_template("again")
        lone = client.register_template("Just a system prompt.", template_id="lone")
        spelled = client.register_template(messages=[{"role": "system", "content": "Just a system prompt."}],
                                           template_id="lone")
        assert spelled.num_tokens == lone.num_tokens and lone.num_examples == 0
        client.unregister_template("lone")


def test_a_template_with_a_fallback_answers_it_for_a_decision_below_min_confidence(server):
    with RicClient(server.endpoint, timeout_s=60) as client:
        client.register_template(messages=EXAMPLES, structured={"choice": ACTIONS}, template_id="unsure",
                                 min_confidence=1.0, fallback="escalate")
        replaced = client.generate(messages=QUESTION, template_id="unsure", max_tokens=16)
        streamed = list(client.stream(messages=QUESTION, template_id="unsure", max_tokens=16))
        own = client.generate(messages=QUESTION, template_id="unsure", structured={"choice": ACTIONS}, max_tokens=16)
        free = client.generate("Cell 17", max_tokens=4)
        client.unregister_template("unsure")
    assert replaced.finish_reason == "fallback" and replaced.text == "escalate" and replaced.model_text in ACTIONS
    assert 0 < replaced.confidence < 1
    result, tokens = streamed[-1], streamed[:-1]
    assert result.finish_reason == "fallback" and result.text == "escalate"
    assert "".join(t.text for t in tokens) == result.model_text  # the stream carried the model's own answer
    # a request with its own constraint is not judged by the template's fallback
    assert own.finish_reason == "stop" and own.text == replaced.model_text and own.confidence == replaced.confidence
    assert own.model_text is None and free.confidence is None


def test_a_template_whose_fallback_breaks_its_constraint_is_refused_and_nothing_is_pinned(server):
    with RicClient(server.endpoint, timeout_s=60) as client:
        pinned_before = client.stats().kv_cache.pinned_blocks
        with pytest.raises(ServerError) as refused:
            client.register_template(messages=EXAMPLES, structured={"choice": ACTIONS}, template_id="bad-fallback",
                                     min_confidence=0.5, fallback="retreat")
        assert refused.value.code == "VALIDATION"
        assert refused.value.message.startswith("field 'fallback': fallback 'retreat' does not satisfy the choice "
                                                "constraint")
        stats = client.stats()
        assert "bad-fallback" not in stats.templates and stats.kv_cache.pinned_blocks == pinned_before
    dealer = Dealer(server.endpoint)
    try:
        dealer.send({"v": 1, "type": "register_template", "id": "free", "system_prompt": "s",
                     "min_confidence": 0.5, "fallback": "hold"})
        [free] = dealer.until_final("free")
        dealer.send({"v": 1, "type": "register_template", "id": "half", "system_prompt": "s",
                     "structured": {"choice": ACTIONS}, "fallback": "hold"})
        [half] = dealer.until_final("half")
    finally:
        dealer.close()
    assert free.code == "VALIDATION" and "fallback needs structured" in free.message
    assert half.code == "VALIDATION" and "min_confidence is missing" in half.message


def test_a_template_whose_constraint_cannot_compile_is_refused_and_nothing_is_pinned(server):
    with RicClient(server.endpoint, timeout_s=60) as client:
        pinned_before = client.stats().kv_cache.pinned_blocks
        with pytest.raises(ServerError) as refused:
            client.register_template(messages=EXAMPLES, structured={"json": {"type": "colour"}}, template_id="bad")
        assert refused.value.code == "VALIDATION"
        assert "'structured'" in refused.value.message and "colour" in refused.value.message
        stats = client.stats()
        assert "bad" not in stats.templates and stats.kv_cache.pinned_blocks == pinned_before
        with pytest.raises(ServerError) as unknown:
            client.generate(messages=QUESTION, template_id="bad")
        assert unknown.value.code == "UNKNOWN_TEMPLATE"


# ------------------------------------------------------------------------------ errors and refusals

@pytest.mark.parametrize("structured, words", [
    ({"json": {"type": "colour"}}, "colour"),
    ({"json": True}, "structured"),  # a boolean schema: the grammar engine's own ValueError
    ({"regex": "(ab"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
], ids=["unknown-type", "boolean-schema", "regex", "grammar"])
def test_a_constraint_that_cannot_compile_is_an_error_and_the_server_keeps_serving(server, structured, words):
    with RicClient(server.endpoint, timeout_s=60) as client:
        with pytest.raises(ServerError) as error:
            client.generate("Cell 17", structured=structured, max_tokens=16)
        assert error.value.code == "VALIDATION"
        assert error.value.message.startswith("field 'structured': ") and words in error.value.message
        after = client.generate("Cell 17", structured={"choice": ACTIONS}, max_tokens=16)
        assert after.text in ACTIONS
        assert client.stats().queues.in_flight == 0


def test_a_malformed_constraint_is_refused_at_receipt_naming_the_field(server):
    dealer = Dealer(server.endpoint)
    try:
        dealer.send(generate("shape", prompt="x", structured={"choices": ["a"]}))
        [shape] = dealer.until_final("shape")
        dealer.send(generate("big", prompt="x", structured={"regex": "a" * 70_000}))
        [big] = dealer.until_final("big")
        dealer.send({"v": 1, "type": "register_template", "id": "both", "system_prompt": "s",
                     "messages": [{"role": "user", "content": "u"}]})
        [both] = dealer.until_final("both")
    finally:
        dealer.close()
    assert shape.type == "error" and shape.code == "VALIDATION" and "'structured'" in shape.message
    assert "unknown structured output kind 'choices'" in shape.message
    assert big.code == "VALIDATION" and "'structured'" in big.message and "65536 bytes" in big.message
    assert both.code == "VALIDATION" and "exactly one of system_prompt, messages" in both.message


def test_max_tokens_below_the_shortest_answer_is_rejected_with_both_numbers(server):
    dealer = Dealer(server.endpoint)
    try:
        dealer.send(generate("short", prompt="Cell 17", structured={"json": DECISION}, max_tokens=3,
                             deadline_ms=10_000.0))
        [rejected] = dealer.until_final("short", 30)
    finally:
        dealer.close()
    assert rejected.type == "rejected" and rejected.code == "OUTPUT_TOO_SHORT"
    assert rejected.numbers["max_tokens"] == 3 and rejected.numbers["shortest_answer_tokens"] > 3
    assert f"({rejected.numbers['shortest_answer_tokens']} tokens)" in rejected.message
    with RicClient(server.endpoint, timeout_s=60) as client:
        with pytest.raises(RejectedError) as raised:
            client.generate("Cell 17", structured={"json": DECISION}, max_tokens=1)
        assert raised.value.code == "OUTPUT_TOO_SHORT" and raised.value.numbers["max_tokens"] == 1
        assert client.stats().admission.counts["OUTPUT_TOO_SHORT"] >= 2


# ------------------------------------------------------------------------------ the clients

def test_the_async_client_registers_a_conversation_and_constrains_answers(server):
    async def run() -> tuple:
        async with AsyncRicClient(server.endpoint, timeout_s=60) as client:
            registered = await client.register_template(messages=EXAMPLES, structured={"json": DECISION},
                                                        template_id="async-decision")
            answers = await asyncio.gather(*[client.generate(messages=QUESTION, template_id="async-decision",
                                                             max_tokens=64, temperature=1.0, seed=seed)
                                             for seed in range(4)])
            await client.unregister_template("async-decision")
            return registered, answers

    registered, answers = asyncio.run(run())
    assert registered.num_examples == 2
    for answer in answers:
        jsonschema.validate(json.loads(answer.text), DECISION)


def test_the_client_command_constrains_answers_and_registers_conversations(server, tmp_path, capsys):
    from ricllm.cli import main

    endpoint = ["--endpoint", server.endpoint]
    schema = tmp_path / "decision.json"
    schema.write_text(json.dumps(DECISION))
    conversation = tmp_path / "congestion.json"
    conversation.write_text(json.dumps(EXAMPLES))
    assert main(["client", "generate", "Cell 17", "--json-schema", str(schema), "--max-tokens", "64", *endpoint]) == 0
    out = capsys.readouterr()
    jsonschema.validate(json.loads(out.out), DECISION)
    assert "forced)" in out.err
    assert main(["client", "generate", "Cell 17", "--choice", "yes,no", *endpoint]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main(["client", "generate", "Cell 17", "--regex", "[a-c]{4}", "--json", *endpoint]) == 0
    assert re.fullmatch("[a-c]{4}", json.loads(capsys.readouterr().out)["text"])
    grammar = tmp_path / "switch.lark"
    grammar.write_text('start: "on" | "off"\n')
    assert main(["client", "generate", "Cell 17", "--grammar", str(grammar), *endpoint]) == 0
    assert capsys.readouterr().out.strip() in ("on", "off")
    assert main(["client", "register-template", "--messages", str(conversation), "--choice", ",".join(ACTIONS),
                 "--template-id", "cli-congestion", *endpoint]) == 0
    assert capsys.readouterr().out.startswith("cli-congestion  (")
    assert main(["client", "generate", QUESTION[0]["content"], "--chat", "--template-id", "cli-congestion",
                 *endpoint]) == 0
    assert capsys.readouterr().out.strip() in ACTIONS
    assert main(["client", "unregister-template", "cli-congestion", *endpoint]) == 0
    capsys.readouterr()


def test_the_client_command_registers_a_fallback_and_says_when_it_answered(server, tmp_path, capsys):
    from ricllm.cli import main

    endpoint = ["--endpoint", server.endpoint]
    conversation = tmp_path / "congestion.json"
    conversation.write_text(json.dumps(EXAMPLES))
    register = ["client", "register-template", "--messages", str(conversation), "--choice", ",".join(ACTIONS),
                "--template-id", "cli-careful", "--min-confidence", "1", *endpoint]
    assert main([*register, "--fallback", "retreat"]) == 2
    assert "VALIDATION: field 'fallback': fallback 'retreat' does not satisfy the choice constraint" in capsys.readouterr().err
    assert main([*register, "--fallback", "escalate"]) == 0
    capsys.readouterr()
    assert main(["client", "generate", QUESTION[0]["content"], "--chat", "--template-id", "cli-careful", *endpoint]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "escalate" and "finish: fallback" in out.err and "confidence 0." in out.err
    assert "the model answered" in out.err
    assert main(["client", "unregister-template", "cli-careful", *endpoint]) == 0
    capsys.readouterr()


def test_the_client_command_says_what_is_wrong_with_a_constraint(server, tmp_path, capsys):
    from ricllm.cli import main

    endpoint = ["--endpoint", server.endpoint]
    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": "colour"}))
    assert main(["client", "generate", "x", "--json-schema", str(schema), *endpoint]) == 2
    assert "VALIDATION: field 'structured'" in capsys.readouterr().err
    schema.write_text("{not json")
    assert main(["client", "generate", "x", "--json-schema", str(schema), *endpoint]) == 2
    assert "is not JSON" in capsys.readouterr().err
    schema.write_text(json.dumps(DECISION))
    assert main(["client", "generate", "x", "--json-schema", str(schema), "--max-tokens", "2", *endpoint]) == 3
    assert "rejected: OUTPUT_TOO_SHORT" in capsys.readouterr().err
    assert main(["client", "register-template", *endpoint]) == 2
    assert "exactly one" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: one constraint at most
        main(["client", "generate", "x", "--choice", "a,b", "--regex", "a", *endpoint])
