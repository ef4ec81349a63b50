"""The wire protocol: every message survives a round trip, and bad frames get the right error code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ricllm import protocol
from ricllm.sampling_params import SamplingParams
from ricllm.protocol import (
    PROTOCOL_VERSION,
    REPLY_TYPES,
    REQUEST_TYPES,
    Accepted,
    Cancelled,
    CancelRequest,
    ChatMessage,
    ErrorReply,
    GenerateRequest,
    PingRequest,
    Pong,
    ProtocolError,
    RegisterTemplateRequest,
    Rejected,
    Result,
    StatsReply,
    StatsRequest,
    TemplateMessage,
    TemplateRegistered,
    TemplateUnregistered,
    Timings,
    Token,
    UnregisterTemplateRequest,
    decode_reply,
    decode_request,
    encode,
    is_final,
)
from ricllm.structured.spec import MAX_SPEC_BYTES
from tests.helpers import sample_server_stats

DECISION = {"type": "object", "properties": {"action": {"enum": ["offload", "hold"]},
                                             "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
            "required": ["action", "cio_delta_db"], "additionalProperties": False}
EXAMPLES = [TemplateMessage(role="system", content="Decide for the cell."),
            TemplateMessage(role="user", content="PRB usage: high."),
            TemplateMessage(role="assistant", content='{"action":"offload","cio_delta_db":3}')]

REQUESTS = [
    GenerateRequest(id="g1", prompt="Cell 17: PRB usage 92%", max_tokens=64, temperature=0.7, top_k=40,
                    top_p=0.9, seed=7, stop=["\n\n"], stop_token_ids=[2], ignore_eos=True,
                    deadline_ms=250.0, priority="near_rt", stream=True, template_id="ran-cfg"),
    GenerateRequest(id="g2", messages=[ChatMessage(role="system", content="You are a RAN assistant."),
                                       ChatMessage(role="user", content="Is cell 17 congested?")]),
    GenerateRequest(id="g3", token_ids=[1, 2, 3], priority="non_rt"),
    GenerateRequest(id="g4", prompt="Cell 17", structured={"json": DECISION}, template_id="ran-cfg"),
    GenerateRequest(id="g5", prompt="Cell 17", structured={"choice": ["offload", "hold"]}),
    GenerateRequest(id="g6", prompt="Cell 17", structured={"json_schema": '{"type": "boolean"}'}),
    RegisterTemplateRequest(id="r1", system_prompt="You are a RAN configuration assistant."),
    RegisterTemplateRequest(id="r2", template_id="mine", system_prompt="Answer in JSON."),
    RegisterTemplateRequest(id="r3", template_id="decide", messages=EXAMPLES, structured={"json": DECISION}),
    RegisterTemplateRequest(id="r4", system_prompt="Say yes or no.", structured={"regex": "yes|no"}),
    UnregisterTemplateRequest(id="u1", template_id="mine"),
    CancelRequest(id="c1", target_id="g1"),
    StatsRequest(id="s1"),
    PingRequest(id="p1"),
]

REPLIES = [
    Accepted(id="g1", bound_ms=180.5, queue_position=2),
    Accepted(id="g2"),
    Rejected(id="g1", code="DEADLINE_INFEASIBLE", message="predicted 412 ms > deadline 250 ms",
             numbers={"bound_ms": 412.0, "deadline_ms": 250, "queue_len": 3}),
    Rejected(id="g4", code="OUTPUT_TOO_SHORT", message="max_tokens 4 is shorter than the shortest complete answer",
             numbers={"max_tokens": 4, "shortest_answer_tokens": 12}),
    Token(id="g1", index=0, token_id=1234, text=" Yes"),
    Result(id="g1", text=" Yes, it is.", token_ids=[1234, 318, 13], num_prompt_tokens=40,
           num_cached_tokens=32, finish_reason="stop",
           timings=Timings(queue_s=0.001, ttft_s=0.04, e2e_s=0.09, tpot_s=0.025), deadline_met=True),
    Result(id="g2", text="", token_ids=[], num_prompt_tokens=8, num_cached_tokens=0,
           finish_reason="cancelled", timings=Timings(queue_s=0.2, e2e_s=0.2)),
    Result(id="g4", text='{"action":"hold","cio_delta_db":0}', token_ids=[5, 6, 7], num_prompt_tokens=30,
           num_cached_tokens=16, finish_reason="stop", timings=Timings(queue_s=0.0, e2e_s=0.05), num_forced_tokens=9),
    ErrorReply(id=None, code="MALFORMED", message="not a msgpack message"),
    ErrorReply(id="u1", code="UNKNOWN_TEMPLATE", message="field 'template_id': no template 'x'"),
    TemplateRegistered(id="r1", template_id="t-1", num_tokens=37, num_pinned_tokens=32),
    TemplateRegistered(id="r3", template_id="decide", num_tokens=90, num_pinned_tokens=80, num_examples=1),
    TemplateUnregistered(id="u1", template_id="mine"),
    Cancelled(id="c1", target_id="g1"),
    StatsReply(id="s1", stats=sample_server_stats()),
    Pong(id="p1", server_time=1.7e9, version="0.1.0"),
]


def _frame(**fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def _error(frame: bytes, **kwargs: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(frame, **kwargs)
    return info.value


def test_examples_cover_every_message_type():
    assert {type(m).model_fields["type"].default for m in REQUESTS} == set(REQUEST_TYPES)
    assert {type(m).model_fields["type"].default for m in REPLIES} == set(REPLY_TYPES)


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: f"{m.type}-{m.id}")
def test_request_round_trip(message):
    assert decode_request(encode(message)) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: f"{m.type}-{m.id}")
def test_reply_round_trip(message):
    decoded = decode_reply(encode(message))
    assert decoded == message
    if isinstance(message, Rejected) and "deadline_ms" in message.numbers:
        assert type(decoded.numbers["deadline_ms"]) is int


def test_frame_is_one_flat_msgpack_map_with_version_and_type():
    body = msgpack.unpackb(encode(PingRequest(id="p")))
    assert body == {"v": PROTOCOL_VERSION, "type": "ping", "id": "p"}


def test_finality():
    finals = {m.type for m in REPLIES if is_final(m)}
    assert finals == set(REPLY_TYPES) - {"accepted", "token"}


def test_requests_are_not_replies_and_back():
    with pytest.raises(ProtocolError) as info:
        decode_reply(encode(PingRequest(id="p")))
    assert info.value.code == "UNKNOWN_TYPE"
    assert _error(encode(Pong(id="p", server_time=0.0, version="x"))).code == "UNKNOWN_TYPE"


@pytest.mark.parametrize("frame", [b"\xc1", b"\x92\x01", b"", b"\x81\xa1v\x01\x00"],
                         ids=["reserved-byte", "truncated-array", "empty", "extra-data"])
def test_malformed_msgpack(frame):
    error = _error(frame)
    assert error.code == "MALFORMED" and error.request_id is None
    assert "msgpack" in error.message


@pytest.mark.parametrize("body", [[1, 2], "ping", 3, None])
def test_not_a_map(body):
    error = _error(msgpack.packb(body))
    assert error.code == "MALFORMED" and "map" in error.message


def test_non_string_keys_are_malformed():
    frame = msgpack.packb({"v": 1, "type": "ping", b"id": "x"}, use_bin_type=True)
    assert _error(frame).code == "MALFORMED"


@pytest.mark.parametrize("fields, field", [
    ({"type": "generate", "id": "x", "prompt": "p", "max_tokens": "64"}, "max_tokens"),
    ({"type": "generate", "id": "x", "prompt": "p", "max_tokens": 0}, "max_tokens"),
    ({"type": "generate", "id": "x", "prompt": "p", "max_tokens": 4.0}, "max_tokens"),
    ({"type": "generate", "id": "x", "prompt": "p", "temperature": "hot"}, "temperature"),
    ({"type": "generate", "id": "x", "prompt": "p", "top_p": 0}, "top_p"),
    ({"type": "generate", "id": "x", "prompt": "p", "deadline_ms": 0}, "deadline_ms"),
    ({"type": "generate", "id": "x", "prompt": "p", "deadline_ms": float("nan")}, "deadline_ms"),
    ({"type": "generate", "id": "x", "prompt": "p", "stream": 1}, "stream"),
    ({"type": "generate", "id": "x", "prompt": "p", "priority": "urgent"}, "priority"),
    ({"type": "generate", "id": "x", "token_ids": [1, -2]}, "token_ids.1"),
    ({"type": "generate", "id": "x", "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"type": "generate", "id": "x", "prompt": "p", "stop": [""]}, "stop.0"),
    ({"type": "register_template", "id": "x", "system_prompt": 5}, "system_prompt"),
    ({"type": "register_template", "id": "x", "messages": [{"role": "tool", "content": "c"}]}, "messages.0.role"),
    ({"type": "register_template", "id": "x", "messages": [{"role": "user", "content": ""}]}, "messages.0.content"),
    ({"type": "register_template", "id": "x", "messages": []}, "messages"),
    ({"type": "register_template", "id": "x", "system_prompt": "s", "structured": {"choice": []}}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": {"jsn": {}}}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": {"json": {}, "regex": "a"}}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": {"regex": 3}}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": ["json"]}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": {"json": {"a": b"bytes"}}}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": {"json": {"a": float("inf")}}}, "structured"),
    ({"type": "generate", "id": "x", "prompt": "p", "structured": {"json": "{not json"}}, "structured"),
    ({"type": "cancel", "id": "x"}, "target_id"),
    ({"type": "ping", "id": 7}, "id"),
    ({"type": "ping", "id": ""}, "id"),
])
def test_wrong_types_and_ranges_name_the_field(fields, field):
    error = _error(_frame(**fields))
    assert error.code == "VALIDATION"
    assert f"'{field}'" in error.message


def test_request_id_is_kept_when_usable():
    assert _error(_frame(type="generate", id="abc", prompt="p", max_tokens=-1)).request_id == "abc"
    assert _error(_frame(type="ping", id=7)).request_id is None


@pytest.mark.parametrize("inputs", [{}, {"prompt": "p", "token_ids": [1]},
                                    {"prompt": "p", "messages": [{"role": "user", "content": "c"}]}])
def test_exactly_one_input(inputs):
    error = _error(_frame(type="generate", id="x", **inputs))
    assert error.code == "VALIDATION"
    assert "exactly one of prompt, messages, token_ids" in error.message


@pytest.mark.parametrize("conversation", [{}, {"system_prompt": "s", "messages": [{"role": "user", "content": "c"}]}])
def test_a_template_is_exactly_one_of_system_prompt_or_messages(conversation):
    error = _error(_frame(type="register_template", id="x", **conversation))
    assert error.code == "VALIDATION" and "exactly one of system_prompt, messages" in error.message


def test_a_constraint_is_size_limited_as_the_engine_limits_it():
    near = "a" * (MAX_SPEC_BYTES - 100)
    assert decode_request(_frame(type="generate", id="x", prompt="p", structured={"regex": near})).structured
    error = _error(_frame(type="generate", id="x", prompt="p", structured={"regex": "a" * MAX_SPEC_BYTES}))
    assert error.code == "VALIDATION" and "'structured'" in error.message and str(MAX_SPEC_BYTES) in error.message


def test_a_template_request_describes_the_template_the_engine_builds():
    template = REQUESTS[[r.id for r in REQUESTS].index("r3")].template()
    assert template.num_examples == 1 and template.system_prompt == "Decide for the cell."
    assert template.structured.kind == "json"
    lone = RegisterTemplateRequest(id="r", system_prompt="Decide for the cell.").template()
    spelled = RegisterTemplateRequest(id="r", messages=EXAMPLES[:1]).template()
    assert lone == spelled  # a system prompt is a conversation of one message


def test_unknown_field_is_named():
    error = _error(_frame(type="generate", id="x", prompt="p", max_new_tokens=5))
    assert error.code == "VALIDATION"
    assert "'max_new_tokens'" in error.message and "unknown field" in error.message


def test_unknown_type():
    error = _error(_frame(type="train", id="x"))
    assert error.code == "UNKNOWN_TYPE" and "'train'" in error.message and error.request_id == "x"


@pytest.mark.parametrize("fields, needle", [
    ({"id": "x"}, "'type'"), ({"type": 3, "id": "x"}, "'type'"),
])
def test_missing_or_bad_type_field(fields, needle):
    error = _error(_frame(**fields))
    assert error.code == "VALIDATION" and needle in error.message


@pytest.mark.parametrize("version", [None, 2, "1", True])
def test_protocol_version_is_checked(version):
    body = {"type": "ping", "id": "x"} if version is None else {"v": version, "type": "ping", "id": "x"}
    error = _error(msgpack.packb(body))
    assert error.code == "VALIDATION" and "'v'" in error.message and error.request_id == "x"


def test_oversize_uses_the_configurable_limit(monkeypatch):
    frame = encode(GenerateRequest(id="big", prompt="x" * 2000))
    assert decode_request(frame).prompt == "x" * 2000
    error = _error(frame, max_bytes=1000)
    assert error.code == "TOO_LARGE" and str(len(frame)) in error.message and "1000" in error.message
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 1500)
    assert _error(frame).code == "TOO_LARGE"
    assert _error(b"\x00" * ((1 << 20) + 1), max_bytes=1 << 20).code == "TOO_LARGE"


def test_error_becomes_a_reply():
    error = _error(_frame(type="generate", id="abc", prompt="p", top_p=2))
    reply = decode_reply(encode(error.to_reply()))
    assert reply == ErrorReply(id="abc", code="VALIDATION", message=error.message)


def test_sampling_kwargs_match_sampling_params_fields():
    kwargs = REQUESTS[0].sampling_kwargs()
    assert kwargs == {"max_tokens": 64, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 7,
                      "stop": ["\n\n"], "stop_token_ids": [2], "ignore_eos": True, "kv_window": None, "kv_sinks": None}
    assert set(kwargs) <= {f.name for f in dataclasses.fields(SamplingParams)}


def test_models_reject_bad_values_at_construction_too():
    with pytest.raises(ValueError):
        Rejected(id="x", code="BUSY", message="m")
    with pytest.raises(ValueError):
        ErrorReply(id="x", code="OOPS", message="m")


# ------------------------------------------------------------------ properties: nothing else escapes

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
            | st.binary(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
_fields = sorted({name for model in REQUEST_TYPES.values() for name in model.model_fields} - {"v", "type"})
_chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "boss"]) | _scalars,
                                        "content": _scalars}), max_size=3)
_plausible = st.fixed_dictionaries(
    {"v": st.just(1) | _scalars, "type": st.sampled_from(sorted(REQUEST_TYPES)) | _scalars},
    optional={**{name: _values for name in _fields}, "messages": _chat | _values})


def _only_protocol_errors(frame: bytes) -> None:
    try:
        request = decode_request(frame)
    except ProtocolError as exc:
        assert exc.code in protocol.ERROR_CODES
        return
    assert decode_request(encode(request)) == request


_text = st.text(min_size=1, max_size=12)
_schema_leaf = st.one_of(
    st.builds(lambda values: {"enum": values}, st.lists(_text, min_size=1, max_size=3, unique=True)),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-100, 100), st.integers(0, 100)),
    st.just({"type": "boolean"}), st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)))
_schemas = st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props)},
                     st.dictionaries(_text, _schema_leaf, min_size=1, max_size=3))
_structured = st.one_of(
    st.builds(lambda schema, key: {key: schema}, _schemas, st.sampled_from(["json", "json_schema"])),
    st.builds(lambda choices: {"choice": choices}, st.lists(_text, min_size=1, max_size=4)),
    st.builds(lambda regex: {"regex": regex}, st.sampled_from(["yes|no", "[a-z]{1,5}", r"\d+"])),
    st.just({"grammar": 'start: "on" | "off"'}))
_template_messages = st.lists(st.builds(TemplateMessage, role=st.sampled_from(["system", "user", "assistant"]),
                                        content=_text), min_size=1, max_size=5)


@settings(max_examples=100, deadline=None)
@given(structured=_structured, template_id=st.none() | _text, stream=st.booleans())
def test_a_constrained_generate_survives_a_round_trip(structured, template_id, stream):
    request = GenerateRequest(id="g", prompt="p", structured=structured, template_id=template_id, stream=stream)
    assert decode_request(encode(request)) == request


@settings(max_examples=100, deadline=None)
@given(messages=st.none() | _template_messages, structured=st.none() | _structured, template_id=st.none() | _text)
def test_a_template_registration_survives_a_round_trip(messages, structured, template_id):
    conversation = {"messages": messages} if messages is not None else {"system_prompt": "Decide."}
    request = RegisterTemplateRequest(id="r", template_id=template_id, structured=structured, **conversation)
    decoded = decode_request(encode(request))
    assert decoded == request and decoded.template() == request.template()


@settings(max_examples=50, deadline=None)
@given(forced=st.integers(0, 64), examples=st.integers(0, 20), shortest=st.integers(1, 500))
def test_the_new_reply_fields_survive_a_round_trip(forced, examples, shortest):
    replies = [Result(id="g", text="{}", token_ids=[1], num_prompt_tokens=3, num_cached_tokens=0,
                      finish_reason="stop", timings=Timings(queue_s=0.0, e2e_s=0.1), num_forced_tokens=forced),
               TemplateRegistered(id="r", template_id="t", num_tokens=40, num_pinned_tokens=32, num_examples=examples),
               Rejected(id="g", code="OUTPUT_TOO_SHORT", message="too short",
                        numbers={"max_tokens": shortest - 1, "shortest_answer_tokens": shortest})]
    for reply in replies:
        assert decode_reply(encode(reply)) == reply


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_protocol_errors(frame):
    _only_protocol_errors(frame)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=12), _values, max_size=6) | _plausible)
def test_arbitrary_dicts_raise_only_protocol_errors(body):
    _only_protocol_errors(msgpack.packb(body, use_bin_type=True))


# ---------------------------------------------------------------------- the prose stays in sync

def _doc_section(doc: str, heading: str) -> str:
    start = doc.index(heading)
    end = doc.find("\n### ", start + 1)
    return doc[start:] if end < 0 else doc[start:end]


@pytest.mark.parametrize("model", [*REQUEST_TYPES.values(), *REPLY_TYPES.values()], ids=lambda m: m.__name__)
def test_docs_list_every_field_of_every_message(model):
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    section = _doc_section(doc, f"### `{model.model_fields['type'].default}`")
    nested = {"generate": ChatMessage, "result": Timings,
              "register_template": TemplateMessage}.get(model.model_fields["type"].default)
    names = set(model.model_fields) | (set(nested.model_fields) if nested else set())
    for name in names - {"v", "type"}:
        assert f"| `{name}` |" in section, f"docs/protocol.md does not describe {model.__name__}.{name}"


def test_docs_list_every_code():
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    for code in (*protocol.REJECT_CODES, *protocol.ERROR_CODES):
        assert f"| `{code}` |" in doc
