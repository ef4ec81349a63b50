"""Clients for a running ``ricllm serve``: blocking :class:`RicClient` and :class:`AsyncRicClient`.

Only pyzmq, pydantic and msgpack are needed (no torch), so an xApp or a test harness can talk to
the engine without carrying it. Both use one DEALER socket with LINGER 0 (closing never hangs
on a dead server) and the frame layout of :mod:`ricllm.protocol`.

A request that hears nothing within ``timeout_s`` raises :class:`TimeoutError`; the socket is
then closed and made anew, as the RAN connectors do, so queued requests to a lost server are
dropped instead of being replayed to its successor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Union

import zmq
import zmq.asyncio
import zmq.auth
from pydantic import BaseModel

from ricllm.errors import RicllmError
from ricllm.protocol import (
    DEFAULT_ENDPOINT,
    Accepted,
    Cancelled,
    CancelRequest,
    ErrorReply,
    GenerateRequest,
    PingRequest,
    Pong,
    ProtocolError,
    RegisterTemplateRequest,
    Rejected,
    Result,
    ServerStats,
    StatsReply,
    StatsRequest,
    TemplateRegistered,
    TemplateUnregistered,
    Token,
    UnregisterTemplateRequest,
    decode_reply,
    encode,
    is_final,
)

__all__ = ["RicClient", "AsyncRicClient", "RicClientError", "RejectedError", "ServerError",
           "load_public_key", "load_key_pair"]

log = logging.getLogger(__name__)
KeySource = Union[str, bytes, "os.PathLike[str]"]
MAX_REPLY_BYTES = 64 << 20  # replies come from our own server; this only stops a runaway one


class RicClientError(RicllmError):
    """A request the server answered with a refusal or an error."""


class RejectedError(RicClientError):
    """Admission refused the request (``code`` from ``REJECT_CODES``); ``numbers`` say by how much."""

    def __init__(self, code: str, message: str, numbers: dict[str, float] | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.numbers, self.request_id = code, message, numbers or {}, request_id


class ServerError(RicClientError):
    """The server could not take the request (``code`` from ``ERROR_CODES``)."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


# --------------------------------------------------------------------------------- CURVE keys

def _is_path(source: KeySource) -> bool:
    return isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.isfile(source))


def _z85_key(key: str | bytes, what: str) -> bytes:
    raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    if len(raw) != 40:
        raise ValueError(f"{what} must be a 40-character z85 key or a key file path, got {len(raw)} characters")
    return raw


def load_public_key(source: KeySource) -> bytes:
    """The server's public key: a z85 string, or a file from ``zmq.auth.create_certificates``."""
    if _is_path(source):
        public, _ = zmq.auth.load_certificate(os.fspath(source))
        return public
    return _z85_key(source, "curve_server_key")


def load_key_pair(source: KeySource | tuple[str | bytes, str | bytes]) -> tuple[bytes, bytes]:
    """The client's (public, secret) keys: a ``.key_secret`` file, or a pair of z85 strings."""
    if isinstance(source, tuple):
        return _z85_key(source[0], "client public key"), _z85_key(source[1], "client secret key")
    public, secret = zmq.auth.load_certificate(os.fspath(source))
    if secret is None:
        raise ValueError(f"{os.fspath(source)} holds no secret key; pass the .key_secret file")
    return public, secret


def _curve_options(server_key: KeySource | None, client_keys: Any) -> dict[int, bytes]:
    """Socket options for CURVE; without client keys an ephemeral pair encrypts but proves nothing."""
    if server_key is None:
        if client_keys is not None:
            raise ValueError("curve_client_keys needs curve_server_key (the server's public key)")
        return {}
    public, secret = load_key_pair(client_keys) if client_keys is not None else zmq.curve_keypair()
    return {zmq.CURVE_SERVERKEY: load_public_key(server_key), zmq.CURVE_PUBLICKEY: public,
            zmq.CURVE_SECRETKEY: secret}


# ------------------------------------------------------------------------------ shared pieces

def new_request_id() -> str:
    return uuid.uuid4().hex


def _generate_request(prompt: str | None, messages: list[dict[str, str]] | None,
                      token_ids: list[int] | None, request_id: str | None, stream: bool,
                      options: dict[str, Any]) -> GenerateRequest:
    """Validated here, so a bad parameter is a ``ValueError`` before anything is sent."""
    return GenerateRequest(id=request_id or new_request_id(), prompt=prompt, messages=messages,
                           token_ids=token_ids, stream=stream, **options)


def _register_request(system_prompt: str | None, messages: list[dict[str, str]] | None,
                      structured: dict[str, Any] | None, template_id: str | None,
                      adapter: str | None, min_confidence: float | None = None,
                      fallback: str | None = None) -> RegisterTemplateRequest:
    """Validated here too: a conversation or constraint of the wrong shape fails before it is sent."""
    return RegisterTemplateRequest(id=new_request_id(), system_prompt=system_prompt, messages=messages,
                                   structured=structured, template_id=template_id, adapter=adapter,
                                   min_confidence=min_confidence, fallback=fallback)


def _final(reply: BaseModel, expected: type[BaseModel]) -> Any:
    """Turn a final reply into the caller's value or the matching exception."""
    if isinstance(reply, Rejected):
        raise RejectedError(reply.code, reply.message, reply.numbers, reply.id)
    if isinstance(reply, ErrorReply):
        raise ServerError(reply.code, reply.message, reply.id)
    if not isinstance(reply, expected):
        raise ServerError("INTERNAL", f"expected a {expected.__name__} reply, got {type(reply).__name__}",
                          getattr(reply, "id", None))
    return reply


def _parse(frame: bytes) -> Any:
    """A reply, or None for a frame that is not one (logged: it is a server bug, not ours)."""
    try:
        return decode_reply(frame, MAX_REPLY_BYTES)
    except ProtocolError as exc:
        log.warning("dropping an unreadable reply: %s", exc)
        return None


def _dealer(context: zmq.Context, endpoint: str, curve: dict[int, bytes]) -> Any:
    """LINGER 0: closing never waits on a dead peer; CURVE options must precede connect."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    for option, value in curve.items():
        socket.setsockopt(option, value)
    socket.connect(endpoint)
    return socket


def _timeout(request_id: str, endpoint: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"request {request_id}: no reply from {endpoint} within {timeout_s:g} s "
                        "(the socket was reconnected)")


# ------------------------------------------------------------------------------- sync client

class RicClient:
    """Blocking client. One request at a time; not thread-safe (use one per thread).

    ``timeout_s`` bounds the wait for a request's final reply, or, for :meth:`stream`, for each
    next reply. CURVE is on when ``curve_server_key`` is given (z85 or a key file);
    ``curve_client_keys`` is a ``.key_secret`` file or a (public, secret) z85 pair.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 30.0,
                 curve_server_key: KeySource | None = None, curve_client_keys: Any = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._curve = _curve_options(curve_server_key, curve_client_keys)
        self._context = zmq.Context.instance()
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        return _dealer(self._context, self.endpoint, self._curve)

    def reconnect(self) -> None:
        """Drop the socket and whatever it still queues; a fresh one connects to the same endpoint."""
        self._socket.close(linger=0)
        self._socket = self._connect()

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> RicClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- public requests

    def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 token_ids: list[int] | None = None, request_id: str | None = None,
                 timeout_s: float | None = None, **options: Any) -> Result:
        """Wait for the whole output. ``options`` are :class:`GenerateRequest` fields
        (``max_tokens``, ``temperature``, ``deadline_ms``, ``priority``, ``template_id``, ``adapter``, ...);
        ``structured={"json": schema}`` (or ``choice``, ``regex``, ``grammar``) constrains the answer."""
        request = _generate_request(prompt, messages, token_ids, request_id, False, options)
        return self._call(request, Result, timeout_s)

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               token_ids: list[int] | None = None, request_id: str | None = None,
               timeout_s: float | None = None, **options: Any) -> Iterator[Token | Result]:
        """Yield each :class:`Token` as it is generated, then the :class:`Result`.

        The request is checked and sent at once; leaving the loop early cancels it on the server.
        """
        request = _generate_request(prompt, messages, token_ids, request_id, True, options)
        self._send(request, timeout_s)
        return self._stream_replies(request.id, timeout_s)

    def _stream_replies(self, request_id: str, timeout_s: float | None) -> Iterator[Token | Result]:
        try:
            for reply in self._replies(request_id, timeout_s, per_reply=True):
                if isinstance(reply, Token):
                    yield reply
                elif is_final(reply):
                    yield _final(reply, Result)
        except GeneratorExit:  # the caller stopped reading: free the server's slot
            self._cancel_quietly(request_id)
            raise

    def register_template(self, system_prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                          structured: dict[str, Any] | None = None, template_id: str | None = None,
                          adapter: str | None = None, min_confidence: float | None = None,
                          fallback: str | None = None, timeout_s: float | None = None) -> TemplateRegistered:
        """Pin a template's KV blocks on the server; use its ``template_id`` in generate.

        The conversation is a system prompt or ``messages`` (system prompt and worked-example
        turns), exactly one; ``structured`` constrains every request that uses it and names none;
        ``adapter`` (a LoRA adapter the server holds) is the one its K/V is pinned under and its
        requests are served under. ``fallback`` (with ``min_confidence``) is answered instead of
        a decision less confident than ``min_confidence``; it must satisfy ``structured``.
        """
        request = _register_request(system_prompt, messages, structured, template_id, adapter, min_confidence,
                                    fallback)
        return self._call(request, TemplateRegistered, timeout_s)

    def unregister_template(self, template_id: str, timeout_s: float | None = None) -> TemplateUnregistered:
        request = UnregisterTemplateRequest(id=new_request_id(), template_id=template_id)
        return self._call(request, TemplateUnregistered, timeout_s)

    def cancel(self, target_id: str, timeout_s: float | None = None) -> Cancelled:
        return self._call(CancelRequest(id=new_request_id(), target_id=target_id), Cancelled, timeout_s)

    def stats(self, timeout_s: float | None = None) -> ServerStats:
        return self._call(StatsRequest(id=new_request_id()), StatsReply, timeout_s).stats

    def ping(self, timeout_s: float | None = None) -> Pong:
        return self._call(PingRequest(id=new_request_id()), Pong, timeout_s)

    # -- plumbing

    def _call(self, request: BaseModel, expected: type[BaseModel], timeout_s: float | None) -> Any:
        self._send(request, timeout_s)
        for reply in self._replies(request.id, timeout_s, per_reply=False):
            if is_final(reply):
                return _final(reply, expected)
        raise AssertionError("unreachable: _replies ends after a final reply")

    def _send(self, request: BaseModel, timeout_s: float | None) -> None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self._socket.poll(int(timeout * 1000), zmq.POLLOUT):
            self.reconnect()
            raise _timeout(request.id, self.endpoint, timeout)
        try:
            self._socket.send(encode(request), zmq.NOBLOCK)
        except zmq.Again:  # the pipe went away between poll and send (e.g. a refused CURVE handshake)
            self.reconnect()
            raise _timeout(request.id, self.endpoint, timeout) from None

    def _replies(self, request_id: str, timeout_s: float | None, per_reply: bool) -> Iterator[Any]:
        """Replies to ``request_id`` up to its final one; late replies to older ids are skipped."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._socket.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                self.reconnect()
                raise _timeout(request_id, self.endpoint, timeout)
            reply = _parse(self._socket.recv())
            # an id-less error answers a frame the server could not read: with one request in
            # flight, that frame was ours
            if reply is None or reply.id not in (request_id, None):
                continue
            yield reply
            if is_final(reply):
                return
            if per_reply:
                deadline = time.monotonic() + timeout

    def _cancel_quietly(self, target_id: str) -> None:
        """Best effort: its replies are skipped by the next request's id filter."""
        try:
            self._socket.send(encode(CancelRequest(id=new_request_id(), target_id=target_id)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not cancel %s: %s", target_id, exc)


# ------------------------------------------------------------------------------ async client

class AsyncRicClient:
    """asyncio client: any number of requests in flight on one socket.

    A reader task routes each reply by id to the waiting request's queue. A request that times
    out raises :class:`TimeoutError`; the socket is remade only when no other request is waiting
    on it. Create and use it inside one event loop; ``await client.aclose()`` when done.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 30.0,
                 curve_server_key: KeySource | None = None, curve_client_keys: Any = None,
                 context: zmq.Context | None = None) -> None:
        """``context``: the ZeroMQ context to make the socket in (default the process's shared one);
        an ``inproc://`` endpoint is reached only from the context that bound it."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._curve = _curve_options(curve_server_key, curve_client_keys)
        self._context = zmq.asyncio.Context.shadow(context or zmq.Context.instance())
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Queue[Any]] = {}

    def _connected(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            self._socket = _dealer(self._context, self.endpoint, self._curve)
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(self._socket))
        return self._socket

    async def _read_loop(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            reply = _parse(await socket.recv())
            queue = self._pending.get(reply.id) if reply is not None and reply.id is not None else None
            if queue is not None:
                queue.put_nowait(reply)

    async def reconnect(self) -> None:
        """Stop the reader and drop the socket; the next request connects afresh."""
        reader, socket = self._reader, self._socket
        self._reader, self._socket = None, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if socket is not None:
            socket.close(linger=0)

    async def aclose(self) -> None:
        await self.reconnect()

    async def __aenter__(self) -> AsyncRicClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- public requests

    async def generate(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                       token_ids: list[int] | None = None, request_id: str | None = None,
                       timeout_s: float | None = None, **options: Any) -> Result:
        """As :meth:`RicClient.generate`."""
        request = _generate_request(prompt, messages, token_ids, request_id, False, options)
        return await self._call(request, Result, timeout_s)

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     token_ids: list[int] | None = None, request_id: str | None = None,
                     timeout_s: float | None = None, **options: Any) -> AsyncIterator[Token | Result]:
        """As :meth:`RicClient.stream`; leaving early (``aclose``) cancels the request."""
        request = _generate_request(prompt, messages, token_ids, request_id, True, options)
        async with contextlib.aclosing(self.submit(request, timeout_s)) as replies:
            async for reply in replies:
                if not isinstance(reply, Accepted):
                    yield reply

    async def submit(self, request: GenerateRequest, timeout_s: float | None = None,
                     ) -> AsyncIterator[Accepted | Token | Result]:
        """Send a built request; yield its ``accepted``, its ``token``s (``stream`` requests) and its
        ``result``; a refusal raises (:class:`RejectedError`, :class:`ServerError`). ``timeout_s``
        bounds each wait for the next reply. Leaving early (``aclose``) cancels the request."""
        async with contextlib.aclosing(self._exchange(request, timeout_s, per_reply=True)) as replies:
            finished = False
            try:
                async for reply in replies:
                    finished = is_final(reply)
                    yield _final(reply, Result) if finished else reply
            except (GeneratorExit, asyncio.CancelledError):  # the caller stopped reading: free the server's slot
                if not finished and self._socket is not None:
                    await self._socket.send(encode(CancelRequest(id=new_request_id(), target_id=request.id)))
                raise

    async def register_template(self, system_prompt: str | None = None, *,
                                messages: list[dict[str, str]] | None = None,
                                structured: dict[str, Any] | None = None, template_id: str | None = None,
                                adapter: str | None = None, min_confidence: float | None = None,
                                fallback: str | None = None, timeout_s: float | None = None) -> TemplateRegistered:
        """As :meth:`RicClient.register_template`."""
        request = _register_request(system_prompt, messages, structured, template_id, adapter, min_confidence,
                                    fallback)
        return await self._call(request, TemplateRegistered, timeout_s)

    async def unregister_template(self, template_id: str, timeout_s: float | None = None) -> TemplateUnregistered:
        request = UnregisterTemplateRequest(id=new_request_id(), template_id=template_id)
        return await self._call(request, TemplateUnregistered, timeout_s)

    async def cancel(self, target_id: str, timeout_s: float | None = None) -> Cancelled:
        request = CancelRequest(id=new_request_id(), target_id=target_id)
        return await self._call(request, Cancelled, timeout_s)

    async def stats(self, timeout_s: float | None = None) -> ServerStats:
        return (await self._call(StatsRequest(id=new_request_id()), StatsReply, timeout_s)).stats

    async def ping(self, timeout_s: float | None = None) -> Pong:
        return await self._call(PingRequest(id=new_request_id()), Pong, timeout_s)

    # -- plumbing

    async def _call(self, request: BaseModel, expected: type[BaseModel], timeout_s: float | None) -> Any:
        async with contextlib.aclosing(self._exchange(request, timeout_s, per_reply=False)) as replies:
            async for reply in replies:
                if is_final(reply):
                    return _final(reply, expected)
        raise AssertionError("unreachable: _exchange ends after a final reply")

    async def _exchange(self, request: BaseModel, timeout_s: float | None,
                        per_reply: bool) -> AsyncIterator[Any]:
        """Send, then yield the replies to this id until the final one."""
        if request.id in self._pending:
            raise ValueError(f"request id {request.id!r} is already in flight on this client")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[request.id] = queue
        try:
            deadline = time.monotonic() + timeout
            await asyncio.wait_for(self._connected().send(encode(request)), timeout)
            while True:
                reply = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                yield reply
                if is_final(reply):
                    return
                if per_reply:
                    deadline = time.monotonic() + timeout
        except asyncio.TimeoutError:
            self._pending.pop(request.id, None)
            if not self._pending:
                await self.reconnect()
            raise _timeout(request.id, self.endpoint, timeout) from None
        finally:
            self._pending.pop(request.id, None)
