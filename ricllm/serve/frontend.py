"""The socket thread of ``ricllm serve`` (docs/serve.md): it owns the ROUTER socket, its end of the
wake-up pair and the set of (client, id) pairs in flight, and runs on the ``ricllm-socket`` thread.
It shares only the ``ServerState`` with the engine thread."""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING, Any

import zmq
from pydantic import BaseModel

import ricllm
from ricllm import protocol as p
from ricllm.errors import ConfigError
from ricllm.serve.handoff import Command, Key, Refused, client_name, clock, log, log_refusal
from ricllm.serve.metrics import deadline_class

if TYPE_CHECKING:
    from ricllm.config import ServerOptions
    from ricllm.serve.state import ServerState


SEND_HWM = 100_000  # replies queued per client before the ROUTER drops them


def _readable(socket: zmq.Socket) -> bool:
    """Whether a whole message waits (multipart messages arrive whole): asking is cheaper than a
    non-blocking receive that ends in ``zmq.Again``, which builds an exception each time."""
    return bool(socket.get(zmq.EVENTS) & zmq.POLLIN)


class Frontend:
    """The socket thread. Only it uses the ROUTER socket and the in-flight set."""

    RECEIVE_BATCH = 256  # frames read per poll round, so replies go out between bursts

    def __init__(self, state: ServerState, context: zmq.Context, local_address: str | None = None) -> None:
        """Binds the ROUTER socket (``ConfigError`` if it cannot) and the wake-up end of ``state.outbox``.

        ``local_address``: an inproc address the ROUTER binds too, for clients in this process (the
        HTTP API). inproc skips CURVE (libzmq applies mechanisms to stream transports only): those
        clients are the process itself.
        """
        self.state = state
        self.options = state.options
        self.in_flight: set[Key] = set()
        self.router = context.socket(zmq.ROUTER)
        try:
            self._bind(self.options)
            self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            if local_address is not None:  # after reading the endpoint: the last bind is what it reports
                self.router.bind(local_address)
        except BaseException:
            self.router.close(linger=0)
            raise
        self.wake = context.socket(zmq.PAIR)
        self.wake.setsockopt(zmq.LINGER, 0)
        self.wake.bind(state.outbox.address)

    def _bind(self, options: ServerOptions) -> None:
        """LINGER 0, no ROUTER_MANDATORY (replies to vanished clients are dropped), a size cap.

        A ROUTER also drops replies to a client whose pipe is full, so the per-client send
        high-water mark is set well above what one client can have in flight.
        """
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.router.setsockopt(zmq.MAXMSGSIZE, 2 * options.max_message_bytes)
        if options.curve is not None:
            self._curve_server(options.curve.server_secret_key_file)
        try:
            self.router.bind(options.zmq_endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind the ZeroMQ socket to {options.zmq_endpoint!r}: {exc}") from None

    def _curve_server(self, secret_file: str) -> None:
        import zmq.auth

        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the CURVE server key {secret_file!r}: {exc}") from None
        if secret is None:
            raise ConfigError(f"{secret_file!r} holds no secret key; pass the server's .key_secret file")
        self.router.curve_secretkey, self.router.curve_publickey = secret, public
        self.router.curve_server = True

    # -- the loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        try:
            while not self.state.worker_done.is_set():
                events = dict(poller.poll(50))
                if self.wake in events:
                    self._drain_wake()
                self._send_replies()
                if self.router in events:
                    self._receive()
            self._finish()
        except Exception as exc:  # a bug here: stop the engine thread too, so the process ends
            log.exception("socket_thread_fault")
            self.state.record_failure(exc)
            self.state.drain(timeout_s=0.0)
        finally:
            self.router.close(linger=self.options.drain_linger_ms)
            self.wake.close(linger=0)

    def _drain_wake(self) -> None:
        while _readable(self.wake):
            self.wake.recv(zmq.NOBLOCK)

    def _finish(self) -> None:
        """The engine thread has ended: send its last replies, answer what it left queued."""
        self._send_replies()
        while True:
            try:
                command = self.state.inbound.get_nowait()
            except queue.Empty:
                break
            self._refuse_leftover(command)
        for identity, request_id in sorted(self.in_flight):  # only after an engine fault
            self._send(identity, p.ErrorReply(id=request_id, code="INTERNAL", message=self.state.end_message()))
        self.in_flight.clear()

    def _refuse_leftover(self, command: Command) -> None:
        self.in_flight.discard(command.key)
        if isinstance(command.request, p.GenerateRequest) and self.state.failure is None:
            self._reject(command, "DRAINING", "the server is shutting down and takes no new work")
        else:
            self._error(command.identity, command.request.id, "INTERNAL", self.state.end_message(),
                        command=command)

    # -- sending

    def _send_replies(self) -> None:
        outbox = self.state.outbox
        while True:
            try:
                identity, request_id, frame, final = outbox.items.get_nowait()
            except queue.Empty:
                outbox.sent.set()  # the engine thread may be waiting to go on (Outbox)
                return
            if final:
                self.in_flight.discard((identity, request_id))
            self._send_frame(identity, frame)

    def _send(self, identity: bytes, reply: BaseModel) -> None:
        self._send_frame(identity, p.encode(reply))

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a gone or stuck peer: its reply is dropped
            log.debug("reply_dropped", client=client_name(identity), error=str(exc))

    def _error(self, identity: bytes, request_id: str | None, code: str, message: str,
               command: Command | None = None) -> None:
        self._send(identity, p.ErrorReply(id=request_id, code=code, message=message))
        if command is not None and isinstance(command.request, p.GenerateRequest):
            self.state.metrics.error(code, deadline_class(command.request))
            log_refusal(command, code, message, rejected=False)

    def _reject(self, command: Command, code: str, message: str, **numbers: Any) -> None:
        self._send(command.identity, Refused(code, message, **numbers).reply(command.request.id))
        self.state.metrics.rejected(code, deadline_class(command.request))
        log_refusal(command, code, message, rejected=True)

    # -- receiving

    def _receive(self) -> None:
        for _ in range(self.RECEIVE_BATCH):
            if not _readable(self.router):
                return
            self._on_frames(self.router.recv_multipart(zmq.NOBLOCK, copy=True))

    def _on_frames(self, frames: list[bytes]) -> None:
        identity, parts = frames[0], frames[1:]
        received = clock()
        if len(parts) != 1:
            self._send(identity, p.ErrorReply(id=None, code="MALFORMED", message=(
                f"expected exactly one frame (a msgpack map) per message, got {len(parts)}")))
            return
        try:
            request = p.decode_request(parts[0], self.options.max_message_bytes)
        except p.ProtocolError as exc:
            log.debug("request_unreadable", client=client_name(identity), code=exc.code, detail=exc.message)
            self._send(identity, exc.to_reply())
            return
        self._on_request(Command(identity, request, received))

    def _on_request(self, command: Command) -> None:
        request = command.request
        if command.key in self.in_flight:
            self._error(command.identity, request.id, "DUPLICATE_ID",
                        f"field 'id': request {request.id!r} of this client is still in flight", command=None)
        elif isinstance(request, p.PingRequest):
            self._send(command.identity, p.Pong(id=request.id, server_time=time.time(), version=ricllm.__version__))
        elif isinstance(request, p.GenerateRequest) and self.state.draining.is_set():
            self._reject(command, "DRAINING", "the server is shutting down and takes no new work")
        else:
            self._enqueue(command)

    def _enqueue(self, command: Command) -> None:
        try:
            self.state.inbound.put_nowait(command)
        except queue.Full:
            size = self.options.inbound_queue_size
            if isinstance(command.request, p.GenerateRequest):
                self._reject(command, "QUEUE_FULL", f"the server's inbound queue already holds {size} requests "
                             "(its limit); retry later", inbound_queue=size)
            else:
                self._error(command.identity, command.request.id, "INTERNAL",
                            f"the server's inbound queue already holds {size} requests (its limit); retry later")
            return
        self.in_flight.add(command.key)
