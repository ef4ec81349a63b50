"""The clients against a small fake ROUTER server that speaks the real protocol (no engine, no torch)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ricllm.client import AsyncRicClient, RejectedError, RicClient, ServerError
from ricllm.protocol import (
    DEFAULT_ENDPOINT,
    DEFAULT_ZMQ_PORT,
    Accepted,
    CancelRequest,
    Cancelled,
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
    TemplateRegistered,
    TemplateUnregistered,
    Timings,
    Token,
    UnregisterTemplateRequest,
    decode_request,
    encode,
)
from tests.helpers import sample_server_stats

TIMEOUT_S = 0.5


class FakeServer:
    """A ROUTER thread that answers like ``ricllm serve`` would.

    Generate replies ``accepted``, then one ``token`` per character when streaming, then a
    ``result`` whose text is the prompt upper-cased. Prompts ``reject`` and ``silent`` get a
    rejection and no answer at all. Requests that arrive within ``window_s`` of each other are
    answered together in reverse order, so a client must route replies by id.
    """

    def __init__(self, endpoint: str, curve_secret_file: Path | None = None,
                 authorized_dir: Path | None = None, window_s: float = 0.05) -> None:
        self.context = zmq.Context()
        self.window_s = window_s
        self.batches: list[int] = []
        self.received: list[object] = []
        self.templates: set[str] = set()
        self._auth = self._start_auth(authorized_dir)
        self._socket = self.context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve_secret_file is not None:
            public, secret = zmq.auth.load_certificate(curve_secret_file)
            self._socket.curve_secretkey, self._socket.curve_publickey = secret, public
            self._socket.curve_server = True
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _start_auth(self, authorized_dir: Path | None) -> ThreadAuthenticator | None:
        if authorized_dir is None:
            return None
        auth = ThreadAuthenticator(self.context)
        auth.start()
        auth.configure_curve(domain="*", location=str(authorized_dir))
        return auth

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._auth is not None:
            self._auth.stop()
        self.context.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(10):
                continue
            time.sleep(self.window_s)
            batch = []
            while self._socket.poll(0):
                batch.append(self._socket.recv_multipart())
            self.batches.append(len(batch))
            parsed = [(identity, self._parse(frame)) for identity, frame in batch]
            for identity, request in reversed(parsed):
                for reply in self._answer(request):
                    self._socket.send_multipart([identity, encode(reply)])

    def _parse(self, frame: bytes) -> object:
        """Recorded on arrival, before any reply goes out, so a test sees all it sent."""
        try:
            request = decode_request(frame)
        except ProtocolError as exc:
            return exc.to_reply()
        self.received.append(request)
        return request

    def _answer(self, request: object) -> list[object]:
        if isinstance(request, ErrorReply):
            return [request]
        if isinstance(request, GenerateRequest):
            return self._generate(request)
        if isinstance(request, RegisterTemplateRequest):
            template_id = request.template_id or f"t-{len(self.templates) + 1}"
            self.templates.add(template_id)
            return [TemplateRegistered(id=request.id, template_id=template_id, num_tokens=20, num_pinned_tokens=16)]
        if isinstance(request, UnregisterTemplateRequest):
            if request.template_id not in self.templates:
                return [ErrorReply(id=request.id, code="UNKNOWN_TEMPLATE",
                                   message=f"field 'template_id': no template {request.template_id!r}")]
            self.templates.discard(request.template_id)
            return [TemplateUnregistered(id=request.id, template_id=request.template_id)]
        if isinstance(request, CancelRequest):
            return [Cancelled(id=request.id, target_id=request.target_id)]
        if isinstance(request, StatsRequest):
            return [StatsReply(id=request.id, stats=sample_server_stats(inbound=len(self.received)))]
        assert isinstance(request, PingRequest)
        return [Pong(id=request.id, server_time=time.time(), version="0.1.0")]

    def _generate(self, request: GenerateRequest) -> list[object]:
        text = request.prompt or ""
        if text == "silent":
            return []
        if text == "reject":
            return [Rejected(id=request.id, code="KV_BUDGET", message="needs 12000 tokens; the budget holds 11650",
                             numbers={"needed_tokens": 12000, "budget_tokens": 11650})]
        replies: list[object] = [Accepted(id=request.id, bound_ms=12.5, queue_position=0)]
        if request.stream:
            replies += [Token(id=request.id, index=i, token_id=ord(c), text=c.upper()) for i, c in enumerate(text)]
        replies.append(Result(id=request.id, text=text.upper(), token_ids=[ord(c) for c in text],
                              num_prompt_tokens=len(text), num_cached_tokens=0, finish_reason="length",
                              timings=Timings(queue_s=0.0, ttft_s=0.001, e2e_s=0.002), deadline_met=None))
        return replies


@pytest.fixture(params=["tcp", "ipc"])
def server(request, tmp_path):
    endpoint = "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{tmp_path}/ricllm.sock"
    fake = FakeServer(endpoint)
    yield fake
    fake.stop()


def test_client_imports_without_torch():
    code = ("import sys, ricllm.client, ricllm.protocol; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_default_endpoint_is_the_xapp_port():
    assert DEFAULT_ENDPOINT == f"tcp://127.0.0.1:{DEFAULT_ZMQ_PORT}"
    assert RicClient.__init__.__defaults__[0] == DEFAULT_ENDPOINT


def test_sync_generate(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        result = client.generate("cell 17", max_tokens=7, deadline_ms=100.0, priority="near_rt")
        assert isinstance(result, Result) and result.text == "CELL 17"
        chat = client.generate(messages=[{"role": "user", "content": "hi"}], request_id="mine")
        assert chat.id == "mine"
    first, second = server.received
    assert (first.max_tokens, first.deadline_ms, first.priority, first.stream) == (7, 100.0, "near_rt", False)
    assert len(first.id) == 32 and int(first.id, 16) >= 0  # uuid4 hex
    assert second.messages[0].content == "hi"


def test_sync_stream(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        replies = list(client.stream("prb"))
    assert [r.text for r in replies[:-1]] == ["P", "R", "B"]
    assert [r.index for r in replies[:-1]] == [0, 1, 2]
    assert isinstance(replies[-1], Result) and replies[-1].text == "PRB"
    assert server.received[0].stream is True


def test_leaving_a_stream_early_cancels_it(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        stream = client.stream("abcdef", request_id="s1")
        assert next(stream).text == "A"
        stream.close()
        assert client.ping().version == "0.1.0"  # late replies to s1 are skipped
    cancels = [r for r in server.received if isinstance(r, CancelRequest)]
    assert [c.target_id for c in cancels] == ["s1"]


def test_rejection_raises_with_code_and_numbers(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        with pytest.raises(RejectedError) as info:
            client.generate("reject")
        with pytest.raises(RejectedError):
            list(client.stream("reject"))
    assert info.value.code == "KV_BUDGET"
    assert info.value.numbers == {"needed_tokens": 12000, "budget_tokens": 11650}
    assert "12000" in str(info.value)


def test_templates_stats_cancel_ping(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        registered = client.register_template("You are a RAN assistant.")
        assert registered.template_id == "t-1" and registered.num_pinned_tokens == 16
        assert client.register_template("x", template_id="mine").template_id == "mine"
        assert client.unregister_template("mine").template_id == "mine"
        with pytest.raises(ServerError) as info:
            client.unregister_template("mine")
        assert info.value.code == "UNKNOWN_TEMPLATE"
        assert client.cancel("abc").target_id == "abc"
        assert client.stats() == sample_server_stats(inbound=6)
        assert client.ping().server_time > 0


def test_constraints_and_conversations_are_sent_as_given(server):
    examples = [{"role": "system", "content": "Decide."}, {"role": "user", "content": "PRB: high."},
                {"role": "assistant", "content": "offload"}]
    with RicClient(server.endpoint, timeout_s=5) as client:
        client.generate("x", structured={"choice": ["offload", "hold"]}, template_id="t")
        client.register_template(messages=examples, structured={"json": {"type": "boolean"}}, template_id="conv")
        client.register_template("A system prompt.", template_id="sys")  # the replay's positional use
    generate, conversation, lone = server.received
    assert generate.structured == {"choice": ["offload", "hold"]} and generate.template_id == "t"
    assert [m.model_dump() for m in conversation.messages] == examples and conversation.system_prompt is None
    assert conversation.structured == {"json": {"type": "boolean"}} and conversation.template_id == "conv"
    assert lone.system_prompt == "A system prompt." and lone.messages is None and lone.structured is None


def test_async_register_template_takes_a_conversation(server):
    async def run() -> None:
        async with AsyncRicClient(server.endpoint, timeout_s=5) as client:
            await client.register_template(messages=[{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": "a"}],
                                           structured={"regex": "a|b"}, template_id="conv")
            await client.register_template("A system prompt.", template_id="sys")

    asyncio.run(run())
    conversation, lone = server.received
    assert conversation.structured == {"regex": "a|b"} and len(conversation.messages) == 2
    assert lone.system_prompt == "A system prompt."


def test_a_malformed_constraint_or_conversation_fails_before_sending(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        with pytest.raises(ValueError, match="structured"):
            client.generate("x", structured={"choice": []})
        with pytest.raises(ValueError, match="exactly one of system_prompt, messages"):
            client.register_template()
        with pytest.raises(ValueError, match="exactly one of system_prompt, messages"):
            client.register_template("s", messages=[{"role": "user", "content": "u"}])
        with pytest.raises(ValueError, match="messages.0.role"):
            client.register_template(messages=[{"role": "tool", "content": "u"}])
    assert server.received == []


def test_invalid_parameters_fail_before_sending(server):
    with RicClient(server.endpoint, timeout_s=5) as client:
        with pytest.raises(ValueError, match="max_tokens"):
            client.generate("x", max_tokens=0)
        with pytest.raises(ValueError, match="exactly one"):
            client.stream("x", token_ids=[1])
    assert server.received == []


def test_timeout_then_reconnect(server):
    with RicClient(server.endpoint, timeout_s=TIMEOUT_S) as client:
        old_socket = client._socket
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="reconnected"):
            client.generate("silent")
        assert 0.9 * TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 1
        assert client._socket is not old_socket and old_socket.closed
        assert client.generate("back").text == "BACK"


def test_lost_server_does_not_wedge_the_client(tmp_path):
    endpoint = f"ipc://{tmp_path}/lost.sock"
    first = FakeServer(endpoint)
    client = RicClient(endpoint, timeout_s=TIMEOUT_S)
    try:
        assert client.ping()
        first.stop()
        with pytest.raises(TimeoutError):
            client.ping()
        second = FakeServer(endpoint)
        try:
            assert client.generate("again").text == "AGAIN"
        finally:
            second.stop()
    finally:
        client.close()


def test_async_twenty_concurrent_requests_on_one_socket(server):
    async def main() -> list[Result]:
        async with AsyncRicClient(server.endpoint, timeout_s=5) as client:
            results = await asyncio.gather(*(client.generate(f"req {i}") for i in range(20)))
            streamed = [reply.text async for reply in client.stream("ab")]
            assert (await client.ping()).version == "0.1.0"
            assert client._socket is not None and len(client._pending) == 0
            return results, streamed

    results, streamed = asyncio.run(main())
    assert [r.text for r in results] == [f"REQ {i}" for i in range(20)]
    assert streamed == ["A", "B", "AB"]
    assert max(server.batches) > 1  # several requests were in flight together


def test_async_rejection_and_timeout(server):
    async def main() -> None:
        async with AsyncRicClient(server.endpoint, timeout_s=TIMEOUT_S) as client:
            with pytest.raises(RejectedError) as info:
                await client.generate("reject")
            assert info.value.numbers["budget_tokens"] == 11650
            with pytest.raises(TimeoutError):
                await client.generate("silent")
            assert client._socket is None  # nothing else was waiting: the socket was dropped
            assert (await client.generate("ok")).text == "OK"

    asyncio.run(main())


def test_async_leaving_a_stream_early_cancels_it(server):
    async def main() -> None:
        async with AsyncRicClient(server.endpoint, timeout_s=5) as client:
            stream = client.stream("abcdef", request_id="a1")
            assert (await stream.__anext__()).text == "A"
            await stream.aclose()
            assert "a1" not in client._pending
            assert (await client.stats()).queues.inbound >= 2

    asyncio.run(main())
    assert [r.target_id for r in server.received if isinstance(r, CancelRequest)] == ["a1"]


# ------------------------------------------------------------------------------------- CURVE

@pytest.fixture
def curve_keys(tmp_path):
    assert zmq.has("curve")
    server_dir, authorized, stranger_dir = (tmp_path / n for n in ("server", "authorized", "stranger"))
    for folder in (server_dir, authorized, stranger_dir):
        folder.mkdir()
    zmq.auth.create_certificates(server_dir, "server")
    zmq.auth.create_certificates(authorized, "client")
    zmq.auth.create_certificates(stranger_dir, "stranger")
    return {"server_public": server_dir / "server.key", "server_secret": server_dir / "server.key_secret",
            "authorized": authorized, "client_secret": authorized / "client.key_secret",
            "stranger_secret": stranger_dir / "stranger.key_secret"}


def test_curve_authorized_client_is_served_and_stranger_is_not(curve_keys):
    server = FakeServer("tcp://127.0.0.1:*", curve_secret_file=curve_keys["server_secret"],
                        authorized_dir=curve_keys["authorized"])
    try:
        server_key = zmq.auth.load_certificate(curve_keys["server_public"])[0].decode()
        with RicClient(server.endpoint, timeout_s=5, curve_server_key=server_key,
                       curve_client_keys=curve_keys["client_secret"]) as client:
            assert client.generate("secure").text == "SECURE"
        public, secret = zmq.auth.load_certificate(curve_keys["stranger_secret"])
        with RicClient(server.endpoint, timeout_s=TIMEOUT_S, curve_server_key=curve_keys["server_public"],
                       curve_client_keys=(public.decode(), secret.decode())) as stranger:
            with pytest.raises(TimeoutError):
                stranger.ping()
        with RicClient(server.endpoint, timeout_s=TIMEOUT_S) as plain:
            with pytest.raises(TimeoutError):
                plain.ping()
        assert [type(r) for r in server.received] == [GenerateRequest]
    finally:
        server.stop()


def test_async_curve(curve_keys):
    server = FakeServer("tcp://127.0.0.1:*", curve_secret_file=curve_keys["server_secret"],
                        authorized_dir=curve_keys["authorized"])

    async def main() -> str:
        async with AsyncRicClient(server.endpoint, timeout_s=5, curve_server_key=curve_keys["server_public"],
                                  curve_client_keys=curve_keys["client_secret"]) as client:
            return (await client.generate("x")).text

    try:
        assert asyncio.run(main()) == "X"
    finally:
        server.stop()


def test_curve_key_errors(curve_keys):
    with pytest.raises(ValueError, match="secret"):
        RicClient(curve_server_key=curve_keys["server_public"], curve_client_keys=curve_keys["server_public"])
    with pytest.raises(ValueError, match="40-character"):
        RicClient(curve_server_key="short")
    with pytest.raises(ValueError, match="curve_server_key"):
        RicClient(curve_client_keys=curve_keys["client_secret"])
