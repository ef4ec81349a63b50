"""What passes between the fronts of ``ricllm serve`` (the socket thread, the HTTP thread) and its
engine thread: checked commands in (``Command``, on the bounded inbound queue), replies out along
each command's ``Route`` (``SocketRoute``: encoded, through the ``Outbox`` to the socket thread;
``LocalRoute``: as they are, onto the HTTP thread's event loop), and the refusal they answer with
(``Refused``). The docstrings say which side calls what."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
from pydantic import BaseModel

from ricllm import protocol as p
from ricllm.logging import get_logger

log = get_logger("ricllm.serve")
clock = time.perf_counter  # the engine's default clock, so receipt stamps and engine times compare
Key = tuple[bytes, str]  # (the client's identity, its request id)
LOCAL_IDENTITY = b""  # the in-process clients' (the HTTP API): no ZeroMQ peer has an empty routing id
_wake_ids = itertools.count()


class Route(Protocol):
    """Where a command's replies go. ``identity`` names its client in the keys of requests in
    flight; ``send`` is called on the engine thread (and, after it has ended, by the intake)."""

    identity: bytes

    def send(self, reply: BaseModel) -> None: ...


class SocketRoute:
    """A ZeroMQ client's: encoded into the outbox, sent by the socket thread."""

    __slots__ = ("outbox", "identity")

    def __init__(self, outbox: Outbox, identity: bytes) -> None:
        self.outbox, self.identity = outbox, identity

    def send(self, reply: BaseModel) -> None:
        self.outbox.put(self.identity, reply)


class LocalRoute:
    """An HTTP request's: each reply, as the model it is, handed to ``deliver`` on the HTTP thread's
    event loop. A final reply frees its key at once (``release``): nothing on this route waits for a
    socket to send it. Replies after the loop has closed are dropped."""

    identity = LOCAL_IDENTITY

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[BaseModel], None],
                 release: Callable[[Key], None]) -> None:
        self._loop, self._deliver, self._release = loop, deliver, release

    def send(self, reply: BaseModel) -> None:
        if p.is_final(reply):
            self._release((LOCAL_IDENTITY, reply.id))
        try:
            self._loop.call_soon_threadsafe(self._deliver, reply)
        except RuntimeError:  # the HTTP thread's loop has closed: nobody waits for it
            log.debug("reply_dropped", client="http", id=getattr(reply, "id", None))


@dataclass(frozen=True)
class Command:
    """A checked request on its way to the engine thread; ``received`` (on :data:`clock`) is when
    its front saw it arrive, and everything about it counts from then: its deadline, its timings."""

    route: Route
    request: Any
    received: float

    @property
    def identity(self) -> bytes:
        return self.route.identity

    @property
    def key(self) -> Key:
        return (self.route.identity, self.request.id)

    def reply(self, reply: BaseModel) -> None:
        """Engine thread: send a reply to this command's client."""
        self.route.send(reply)


class Refused(Exception):
    """Raised before a generate reaches the engine's queues: answer ``rejected`` with the numbers."""

    def __init__(self, code: str, message: str, numbers: dict[str, Any] | None = None, **more: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message
        self.numbers = wire_numbers({**(numbers or {}), **more})

    def reply(self, request_id: str) -> p.Rejected:
        return p.Rejected(id=request_id, code=self.code, message=self.message, numbers=self.numbers)


def wire_numbers(numbers: dict[str, Any]) -> dict[str, int | float]:
    """The finite numbers of a refusal (the wire carries numbers only; the message names the rest)."""
    return {k: v for k, v in numbers.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def client_name(identity: bytes) -> str:
    return identity.hex() if identity else "http"


def log_refusal(command: Command, code: str, message: str, rejected: bool) -> None:
    """The one end-of-request event of a generate that never ran."""
    request = command.request
    if isinstance(request, p.GenerateRequest):
        log.info("request_done", id=request.id, client=client_name(command.identity), template=request.template_id,
                 admitted=False, reason=code, outcome="rejected" if rejected else "error", detail=message,
                 deadline_ms=request.deadline_ms)


# ------------------------------------------------------------------------------ the outbox

def new_wake_address() -> str:
    """An inproc address for one server's wake-up pair (unique within the process)."""
    return f"inproc://ricllm-wake-{os.getpid()}-{next(_wake_ids)}"


class Outbox:
    """Replies from the engine thread to the socket thread: a queue, and a wake-up message on an
    inproc PAIR socket that only the engine thread uses (it is made there, on first use).

    A batch that holds a final reply is handed over: the engine thread waits (at most
    ``HANDOFF_TIMEOUT_S``) until the socket thread has sent the queue. Why: sending needs the GIL,
    and without the wait the engine thread keeps it through the coming step's Python, until the
    step's C call lets go of it; results left 0.3-0.7 ms later than they could (measured with 16
    clients). Other replies (``accepted``, stream tokens) are not waited for: they go out while
    the step runs, and the step starts sooner.
    """

    HANDOFF_TIMEOUT_S = 0.002

    def __init__(self, context: zmq.Context, address: str) -> None:
        """``address``: the inproc address the socket thread binds its end of the wake-up pair to."""
        self.items: queue.SimpleQueue[tuple[bytes, str | None, bytes, bool]] = queue.SimpleQueue()
        self._context, self.address = context, address
        self._socket: zmq.Socket | None = None
        self._pending = False
        self._finals_pending = False
        self.sent = threading.Event()  # set by the socket thread whenever it finds the queue empty

    def put(self, identity: bytes, reply: BaseModel) -> None:
        final = p.is_final(reply)
        self.items.put((identity, getattr(reply, "id", None), p.encode(reply), final))
        self._pending = True
        self._finals_pending |= final

    def wake(self, force: bool = False) -> None:
        """One wake-up per batch of replies; a full PAIR pipe already holds one, so EAGAIN is fine."""
        if not (self._pending or force):
            return
        if self._socket is None:
            self._socket = self._context.socket(zmq.PAIR)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.address)
        hand_over = self._finals_pending
        if hand_over:
            self.sent.clear()  # the wake-up below makes the socket thread look at the queue again
        try:
            self._socket.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._pending = self._finals_pending = False
        if hand_over:
            self.sent.wait(self.HANDOFF_TIMEOUT_S)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)


