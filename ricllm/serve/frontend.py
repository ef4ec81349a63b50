"""The socket thread of ``ricllm serve`` (docs/serve.md): it owns the ROUTER socket and its end of
the wake-up pair, and runs on the ``ricllm-socket`` thread. It offers each request to the intake
(``ServerState.intake``, shared with the HTTP API) and sends the replies the engine thread leaves
in the outbox."""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING

import zmq
from pydantic import BaseModel

from ricllm import protocol as p
from ricllm.errors import ConfigError
from ricllm.serve.handoff import Command, SocketRoute, client_name, clock, log

if TYPE_CHECKING:
    from ricllm.config import ServerOptions
    from ricllm.serve.state import ServerState


SEND_HWM = 100_000  # replies queued per client before the ROUTER drops them


def _readable(socket: zmq.Socket) -> bool:
    """Whether a whole message waits (multipart messages arrive whole): asking is cheaper than a
    non-blocking receive that ends in ``zmq.Again``, which builds an exception each time."""
    return bool(socket.get(zmq.EVENTS) & zmq.POLLIN)


class Frontend:
    """The socket thread. Only it uses the ROUTER socket."""

    RECEIVE_BATCH = 256  # frames read per poll round, so replies go out between bursts

    def __init__(self, state: ServerState, context: zmq.Context) -> None:
        """Binds the ROUTER socket (``ConfigError`` if it cannot) and the wake-up end of ``state.outbox``."""
        self.state = state
        self.options = state.options
        self.intake = state.intake
        self.router = context.socket(zmq.ROUTER)
        try:
            self._bind(self.options)
            self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
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
        """The engine thread has ended: send its last replies; the intake answers what it left."""
        self._send_replies()
        self.intake.close(self.state.failure, self.state.end_message())
        self._send_replies()

    # -- sending

    def _send_replies(self) -> None:
        outbox = self.state.outbox
        while True:
            try:
                identity, request_id, frame, final = outbox.items.get_nowait()
            except queue.Empty:
                outbox.sent.set()  # the engine thread may be waiting to go on (Outbox)
                return
            self._send_frame(identity, frame)
            if final:
                self.intake.release((identity, request_id))

    def _send(self, identity: bytes, reply: BaseModel) -> None:
        self._send_frame(identity, p.encode(reply))

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a gone or stuck peer: its reply is dropped
            log.debug("reply_dropped", client=client_name(identity), error=str(exc))

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
        command = Command(SocketRoute(self.state.outbox, identity), request, received)
        answer = self.intake.offer(command)
        if answer is not None:
            self._send(identity, answer)
