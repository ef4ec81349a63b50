"""The OpenAI-compatible API of ``ricllm serve``, driven by the official ``openai``
client against a real in-process server on the tiny random model: the same engine thread and
admission as the ZeroMQ socket, on the HTTP port beside the O-RAN health and metrics paths."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import jsonschema
import pytest

from ricllm.client import RicClient
from tests.helpers import require_module
from tests.serve.test_server import http_get, metric_values, wait_for

DECISION = {"type": "object", "properties": {
    "action": {"enum": ["offload", "hold", "escalate"]},
    "cio_delta_db": {"type": "integer", "minimum": -6, "maximum": 6}},
    "required": ["action", "cio_delta_db"], "additionalProperties": False}
MODEL = "tiny-random-llama"  # the tiny GGUF's general.name
LONG_PROMPT = ("You are a RAN configuration assistant for the O-RAN near-RT RIC. Cell 17 reports PRB usage "
               "of 92 percent, RLC delay high, SINR negative; decide.")


@pytest.fixture(scope="module")
def openai_client(server):
    require_module("openai")
    import openai

    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


def greedy(**more) -> dict:
    return dict(model=MODEL, temperature=0, **more)


# ------------------------------------------------------------------------------ models

def test_models_lists_the_served_model(openai_client):
    listed = openai_client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert openai_client.models.retrieve(MODEL).id == MODEL


def test_a_served_model_name_is_what_clients_and_metrics_call_the_model(start_server):
    require_module("openai")
    import openai

    running = start_server(engine={"served_model_name": "ran-decider"})
    with openai.OpenAI(base_url=running.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == ["ran-decider"]
        answer = client.completions.create(model="ran-decider", prompt="cell 17", max_tokens=2, temperature=0)
        assert answer.model == "ran-decider"
        with pytest.raises(openai.NotFoundError, match="this server serves 'ran-decider'"):
            client.completions.create(model=MODEL, prompt="cell 17", max_tokens=2)
    labels = {dict(series)["model_name"] for _, series in metric_values(running.http_url) if "model_name" in dict(series)}
    assert labels == {"ran-decider"}


def test_an_unknown_model_is_404_model_not_found(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as error:
        openai_client.completions.create(model="gpt-4o", prompt="hello", max_tokens=2)
    assert error.value.code == "model_not_found" and error.value.param == "model"
    assert MODEL in error.value.message


# ------------------------------------------------------------------------------ completions

def test_a_completion_is_the_zeromq_answer_with_usage(server, openai_client):
    completion = openai_client.completions.create(**greedy(prompt="hello world", max_tokens=6,
                                                           extra_body={"ignore_eos": True}))
    with RicClient(server.endpoint, timeout_s=30) as client:
        result = client.generate("hello world", max_tokens=6, ignore_eos=True)
    choice = completion.choices[0]
    assert choice.text == result.text and choice.finish_reason == "length" and choice.index == 0
    usage = completion.usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens == result.num_prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + 6
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion" and completion.model == MODEL
    assert completion.model_extra["ricllm"]["finish_reason"] == "length"


def test_a_token_id_prompt_is_accepted(openai_client):
    completion = openai_client.completions.create(**greedy(prompt=[1, 50, 120, 282], max_tokens=3,
                                                           extra_body={"ignore_eos": True}))
    assert completion.usage.prompt_tokens == 4 and completion.usage.completion_tokens == 3


def test_a_repeated_prompt_reports_its_cached_tokens(openai_client):
    first = openai_client.completions.create(**greedy(prompt=LONG_PROMPT, max_tokens=2))
    second = openai_client.completions.create(**greedy(prompt=LONG_PROMPT, max_tokens=2))
    assert first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # at least one whole KV block


def test_streamed_chunks_concatenate_to_the_answer(openai_client):
    request = greedy(prompt="the cell load is", max_tokens=12, extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(**request)
    chunks = list(openai_client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


# ------------------------------------------------------------------------------ chat

def test_a_chat_completion_uses_the_chat_template(server, openai_client):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Cell 17?"}]
    chat = openai_client.chat.completions.create(**greedy(messages=messages, max_completion_tokens=5,
                                                          extra_body={"ignore_eos": True}))
    with RicClient(server.endpoint, timeout_s=30) as client:
        result = client.generate(messages=messages, max_tokens=5, ignore_eos=True)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == result.text
    assert chat.usage.prompt_tokens == result.num_prompt_tokens and chat.object == "chat.completion"


def test_a_streamed_chat_concatenates_to_the_answer(openai_client):
    request = greedy(messages=[{"role": "developer", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "PRB usage 92%"}]}],
                     max_tokens=10, extra_body={"ignore_eos": True})
    whole = openai_client.chat.completions.create(**request)
    chunks = list(openai_client.chat.completions.create(**request, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


# ------------------------------------------------------------------------------ constrained answers

def test_response_format_json_schema_gives_json_that_validates(openai_client):
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Cell 17 is congested."}], max_tokens=64, temperature=0.8,
        seed=3, response_format={"type": "json_schema", "json_schema": {"name": "decision", "schema": DECISION}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), DECISION)
    assert chat.model_extra["ricllm"]["num_forced_tokens"] > 0


def test_a_constrained_answer_carries_its_confidence_beside_the_choice_not_in_logprobs(openai_client):
    constrained = openai_client.completions.create(model=MODEL, prompt="Cell 17 is congested.", max_tokens=16,
                                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    free = openai_client.completions.create(model=MODEL, prompt="Cell 17 is congested.", max_tokens=4)
    assert constrained.choices[0].text in ("yes", "no") and constrained.choices[0].logprobs is None
    assert 0.5 <= constrained.model_extra["ricllm"]["confidence"] < 1  # the greedy one of two answers
    assert free.model_extra["ricllm"]["confidence"] is None


def test_response_format_json_object_gives_an_object(openai_client):
    completion = openai_client.completions.create(model=MODEL, prompt="{", max_tokens=64, temperature=0.8, seed=1,
                                                  extra_body={"response_format": {"type": "json_object"}})
    if completion.choices[0].finish_reason == "stop":  # a random model may ramble past 64 tokens inside it
        assert isinstance(json.loads(completion.choices[0].text), dict)
    assert completion.choices[0].text.startswith("{")


@pytest.mark.parametrize("structured, valid", [
    ({"choice": ["offload", "hold"]}, lambda text: text in ("offload", "hold")),
    ({"regex": "cell-[0-9]{2}"}, lambda text: len(text) == 7 and text.startswith("cell-")),
    ({"json": DECISION}, lambda text: jsonschema.validate(json.loads(text), DECISION) is None),
], ids=["choice", "regex", "json"])
def test_vllm_structured_outputs_constrain_the_answer(openai_client, structured, valid):
    completion = openai_client.completions.create(model=MODEL, prompt="Cell 17:", max_tokens=64, temperature=0.8,
                                                  seed=2, extra_body={"structured_outputs": structured})
    assert completion.choices[0].finish_reason == "stop" and valid(completion.choices[0].text)


# ------------------------------------------------------------------------------ refusals and errors

def test_a_prompt_too_long_for_the_context_is_400_with_the_rejection(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as error:
        openai_client.completions.create(model=MODEL, prompt="long", max_tokens=600)
    assert error.value.status_code == 400 and error.value.code == "CONTEXT_TOO_LONG"
    numbers = error.value.body["numbers"]
    assert numbers["max_model_len"] == 512 and numbers["max_tokens"] == 600


def test_a_refusal_for_the_present_load_is_429_and_one_that_can_never_fit_is_400():
    from ricllm.serve.openai_replies import refusal

    reserved = refusal("KV_RESERVED", "needs 16 KV blocks (256 tokens) but only 0 of 64 are not reserved",
                       {"blocks_needed": 16, "blocks_free": 0})
    assert reserved.status == 429 and reserved.body()["error"]["numbers"]["blocks_free"] == 0
    assert refusal("KV_BUDGET", "needs 80 KV blocks but the budget holds 64").status == 400


def test_an_infeasible_deadline_is_429_with_the_rejection(openai_client):
    import openai

    with pytest.raises(openai.RateLimitError) as error:
        openai_client.completions.create(model=MODEL, prompt="urgent", max_tokens=64,
                                         extra_body={"deadline_ms": 1, "priority": "near_rt"})
    assert error.value.status_code == 429 and error.value.code == "DEADLINE_INFEASIBLE"
    # what was left of it at admission: below zero where intake took longer than the whole 1 ms
    assert isinstance(error.value.body["numbers"]["deadline_ms"], float | int)
    assert error.value.body["numbers"]["deadline_ms"] <= 1
    assert error.value.response.headers["x-should-retry"] == "false"  # the SDK must not resend a stale deadline


def test_a_streamed_refusal_is_an_http_error_before_any_chunk(openai_client):
    import openai

    with pytest.raises(openai.RateLimitError):
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "now"}],
                                              max_tokens=64, stream=True, extra_body={"deadline_ms": 1})


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"logprobs": 2}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"priority": "urgent"}}, "priority"),
    ({"extra_body": {"structured_outputs": {"choice": ["a"], "regex": "b"}}}, "structured_outputs"),
    ({"prompt": ["one", "two"]}, "prompt"),
])
def test_what_cannot_be_honoured_is_400_naming_the_field(openai_client, fields, param):
    import openai

    request = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.completions.create(**request)
    assert error.value.param == param, error.value.body


def test_a_body_that_is_not_json_is_400(server):
    request = urllib.request.Request(server.http_url + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert error.value.code == 400 and json.loads(error.value.read())["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------ one engine, one admission

def test_http_requests_count_in_the_same_metrics_as_zeromq_ones(server, openai_client):
    key = ("ricxapp_requests_total", (("outcome", "result"),))
    before = metric_values(server.http_url).get(key, 0)
    openai_client.completions.create(**greedy(prompt="count me", max_tokens=2))
    # the engine thread counts a result just after sending it
    wait_for(lambda: metric_values(server.http_url).get(key, 0) == before + 1, 5, "the result counted")


def test_a_client_that_leaves_a_stream_cancels_its_request(server, openai_client):
    key = ("ricxapp_requests_total", (("outcome", "cancelled"),))
    before = metric_values(server.http_url).get(key, 0)
    stream = openai_client.completions.create(**greedy(prompt="go on", max_tokens=400, stream=True,
                                                       extra_body={"ignore_eos": True}))
    next(iter(stream))
    stream.close()
    wait_for(lambda: metric_values(server.http_url).get(key, 0) == before + 1, 10, "the request cancelled")


def test_a_client_that_leaves_before_its_answer_cancels_its_request(server):
    """Not streamed: the server notices the closed connection while the engine generates."""
    key = ("ricxapp_requests_total", (("outcome", "cancelled"),))
    before = metric_values(server.http_url).get(key, 0)
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 480, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.05)
    wait_for(lambda: metric_values(server.http_url).get(key, 0) == before + 1, 10, "the request cancelled")


# ------------------------------------------------------------------------------ the O-RAN paths, unchanged

def test_health_and_metrics_answer_as_before(server):
    assert http_get(server.http_url + "/ric/v1/health/alive") == (200, '{"status": "alive"}\n')
    assert http_get(server.http_url + "/ric/v1/health/ready") == (200, '{"status": "ready"}\n')
    status, text = http_get(server.http_url + "/ric/v1/metrics")
    assert status == 200 and "ricxapp_requests_total" in text
    status, text = http_get(server.http_url + "/nowhere")
    assert status == 404 and json.loads(text)["paths"][0] == "/ric/v1/health/alive"


def test_a_kept_alive_connection_is_answered_without_delayed_ack_stalls(server):
    """Without TCP_NODELAY a response's header and body segments wait on the client's delayed ACK:
    40 ms a request on a reused connection (the ``openai`` client reuses its connections)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=10)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        connection.request("GET", "/ric/v1/health/alive")
        assert connection.getresponse().read() == b'{"status": "alive"}\n'
        times.append(time.perf_counter() - start)
    connection.close()
    assert sorted(times)[len(times) // 2] < 0.02, times


def test_the_openai_api_can_be_turned_off(start_server):
    running = start_server(openai_api=False)
    assert http_get(running.http_url + "/v1/models")[0] == 404
    assert http_get(running.http_url + "/ric/v1/health/ready")[0] == 200
