"""The one intake of ``ricllm serve``: the checks every request meets on arrival, whichever front it
came by, and the OpenAI API's requests reaching the engine thread without a ZeroMQ socket, their
deadline counting from their arrival over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import zmq

from ricllm import protocol as p
from ricllm.client import RicClient
from tests.helpers import require_module
from tests.serve.test_server import wait_for

MODEL = "tiny-random-llama"  # the tiny GGUF's general.name


# ------------------------------------------------------------------------------ the intake itself

@pytest.fixture
def state():
    """A server's shared state with an inbound queue of two, and no threads: what the intake answers
    is all there is to see."""
    require_module("prometheus_client")
    from ricllm.serve.handoff import Outbox, new_wake_address
    from ricllm.serve.metrics import ServerMetrics
    from ricllm.config import ServerOptions
    from ricllm.serve.state import ServerState

    context = zmq.Context()
    state = ServerState(ServerOptions(inbound_queue_size=2), ServerMetrics(), Outbox(context, new_wake_address()))
    yield state
    context.term()


def command(state, request, identity: bytes = b"\x00client"):
    from ricllm.serve.handoff import Command, SocketRoute, clock

    return Command(SocketRoute(state.outbox, identity), request, clock())


def sent(state) -> list:
    """The replies the intake sent through the outbox (to ZeroMQ clients), decoded."""
    replies = []
    while not state.outbox.items.empty():
        _, _, frame, _ = state.outbox.items.get_nowait()
        replies.append(p.decode_reply(frame, 1 << 20))
    return replies


def test_an_id_in_flight_is_refused_until_its_final_reply_has_left(state):
    first = command(state, p.GenerateRequest(id="a", prompt="x"))
    assert state.intake.offer(first) is None and state.inbound.get_nowait() is first
    again = state.intake.offer(command(state, p.StatsRequest(id="a")))
    assert again.code == "DUPLICATE_ID" and again.id == "a"
    other_client = command(state, p.StatsRequest(id="a"), identity=b"\x00other")
    assert state.intake.offer(other_client) is None  # ids are per client
    state.intake.release(first.key)
    assert state.intake.offer(command(state, p.StatsRequest(id="a"))) is None


def test_ping_is_answered_at_once_and_never_queued(state):
    pong = state.intake.offer(command(state, p.PingRequest(id="ping")))
    assert isinstance(pong, p.Pong) and state.inbound.empty()


def test_a_generate_while_draining_is_refused_and_other_requests_still_queue(state):
    state.drain(timeout_s=5.0)
    refused = state.intake.offer(command(state, p.GenerateRequest(id="g", prompt="x")))
    assert isinstance(refused, p.Rejected) and refused.code == "DRAINING"
    assert state.intake.offer(command(state, p.StatsRequest(id="s"))) is None


def test_a_full_inbound_queue_refuses_with_its_size(state):
    for i in range(2):
        assert state.intake.offer(command(state, p.GenerateRequest(id=f"g{i}", prompt="x"))) is None
    refused = state.intake.offer(command(state, p.GenerateRequest(id="g2", prompt="x")))
    assert refused.code == "QUEUE_FULL" and refused.numbers == {"inbound_queue": 2}
    error = state.intake.offer(command(state, p.StatsRequest(id="s")))
    assert error.code == "INTERNAL" and "inbound queue" in error.message


def test_closing_answers_what_the_engine_left_and_every_later_offer(state):
    queued = command(state, p.GenerateRequest(id="left", prompt="x"))
    assert state.intake.offer(queued) is None
    state.inbound.get_nowait()  # the engine thread took it, then ended without answering (a fault)
    assert state.intake.offer(command(state, p.GenerateRequest(id="queued", prompt="x"))) is None
    state.record_failure(RuntimeError("boom"))
    state.intake.close(state.failure, state.end_message())
    replies = {reply.id: reply for reply in sent(state)}
    assert replies["queued"].code == "INTERNAL" and replies["left"].code == "INTERNAL"
    assert "boom" in replies["left"].message
    later = state.intake.offer(command(state, p.StatsRequest(id="late")))
    assert later.code == "INTERNAL" and state.inbound.empty()


def test_a_local_route_frees_its_key_with_the_final_reply(state):
    from ricllm.serve.handoff import Command, LocalRoute, clock

    async def exchange() -> list:
        loop, delivered = asyncio.get_running_loop(), asyncio.Queue()
        route = LocalRoute(loop, delivered.put_nowait, state.intake.release)
        generate = Command(route, p.GenerateRequest(id="h", prompt="x"), clock())
        assert state.intake.offer(generate) is None
        assert state.intake.offer(Command(route, p.StatsRequest(id="h"), clock())).code == "DUPLICATE_ID"
        route.send(p.Accepted(id="h"))  # as the engine thread does, from another thread
        assert state.intake.offer(Command(route, p.StatsRequest(id="h"), clock())).code == "DUPLICATE_ID"
        route.send(p.ErrorReply(id="h", code="INTERNAL", message="gone"))
        replies = [await delivered.get(), await delivered.get()]
        assert state.intake.offer(Command(route, p.StatsRequest(id="h"), clock())) is None
        return replies

    assert [reply.type for reply in asyncio.run(exchange())] == ["accepted", "error"]


# ------------------------------------------------------------------------------ over HTTP

def post_slowly(port: int, body: dict, pause_s: float) -> tuple[int, dict]:
    """POST /v1/completions: the headers at once, the body ``pause_s`` later (a slow client, or a
    long path to the server). Returns the status and the JSON answer."""
    payload = json.dumps(body).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(head)
        time.sleep(pause_s)
        connection.sendall(payload)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_the_deadline_counts_from_http_arrival(server):
    """The body comes 300 ms after the headers; a 200 ms deadline has passed by the time the request
    can reach the engine, and it is refused with the numbers. Counted from the engine thread's
    (or a socket's) receipt instead, the same request would be admitted: a few milliseconds of work."""
    post_slowly(server.server.http_port, {"model": MODEL, "prompt": "warm", "max_tokens": 1}, 0.0)
    status, answer = post_slowly(server.server.http_port, {"model": MODEL, "prompt": "cell 17", "max_tokens": 2,
                                                           "deadline_ms": 200}, pause_s=0.3)
    assert status == 429, answer
    error = answer["error"]
    assert error["code"] == "DEADLINE_INFEASIBLE" and "passed while the request was queued" in error["message"]
    # stamped when the server read the headers, a little after the client sent them and began its pause
    assert error["numbers"]["deadline_ms"] == 200 and error["numbers"]["waited_ms"] >= 250


def test_the_timings_count_from_http_arrival(server):
    status, answer = post_slowly(server.server.http_port, {"model": MODEL, "prompt": "cell 17", "max_tokens": 2,
                                                           "ignore_eos": True, "deadline_ms": 5000}, pause_s=0.3)
    assert status == 200, answer
    timings = answer["ricllm"]["timings"]
    assert timings["queue_s"] >= 0.3 and timings["e2e_s"] >= 0.3
    assert answer["ricllm"]["bound_ms"] >= 300  # admission's promise counts from arrival too


def test_http_requests_cross_no_zeromq_socket(server, monkeypatch):
    """Completions, streams, chats and the model list reach the engine while the ROUTER socket sees
    no message; a ZeroMQ request afterwards is seen (what is counted can be counted)."""
    require_module("openai")
    import openai

    from ricllm.serve.frontend import Frontend

    seen = []
    on_frames = Frontend._on_frames

    def counting(self, frames):
        seen.append(frames)
        return on_frames(self, frames)

    monkeypatch.setattr(Frontend, "_on_frames", counting)
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        completion = client.completions.create(model=MODEL, prompt="cell 17", max_tokens=3, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="long", max_tokens=600)
    assert seen == []
    with RicClient(server.endpoint, timeout_s=30) as zeromq:
        zeromq.ping()
    wait_for(lambda: len(seen) == 1, 5, "the ping seen by the ROUTER")


def test_a_generate_over_http_while_draining_is_503(start_server):
    running = start_server()
    post_slowly(running.server.http_port, {"model": MODEL, "prompt": "warm", "max_tokens": 1}, 0.0)
    running.server.drain(timeout_s=5.0)
    status, answer = post_slowly(running.server.http_port, {"model": MODEL, "prompt": "late", "max_tokens": 2}, 0.0)
    assert status == 503 and answer["error"]["code"] == "DRAINING"


def test_a_body_over_max_message_bytes_is_413(start_server):
    running = start_server(max_message_bytes=4096)
    status, answer = post_slowly(running.server.http_port, {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}, 0.0)
    assert status == 413 and answer["error"]["code"] == "TOO_LARGE" and "4096" in answer["error"]["message"]
