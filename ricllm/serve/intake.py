"""The one intake of ``ricllm serve``: every request, from the ROUTER socket or the HTTP API, meets
the same checks here, in the same order, with the same answers (docs/serve.md, "How it is built").

On arrival, on the front's own thread (:meth:`Intake.offer`): a request id still in flight from
the same client (``DUPLICATE_ID``), ``ping`` (answered at once), the engine thread gone, a generate
while draining (``DRAINING``), a full inbound queue (``QUEUE_FULL``); what passes goes on the
bounded inbound queue, the engine thread's inbox. On the engine thread, before the engine sees the
request: a deadline that passed while it waited (``DEADLINE_INFEASIBLE``, :meth:`Intake.check_deadline`)
and, without admission, a prompt and answer longer than the context (``CONTEXT_TOO_LONG``,
:meth:`Intake.check_context`). Everything else is the engine's: admission, and what its
``add_request`` refuses.

Invariant: a key (client, request id) is in flight from the moment its command is queued until
its final reply has left (:meth:`Intake.release`); while it is, that key is refused. Once the
engine thread has ended, :meth:`Intake.close` answers whatever it left (queued commands, keys in
flight) through each one's own route, and every later offer is answered at once: so each request
id gets exactly one final reply, whichever front it came by.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel

import ricllm
from ricllm import protocol as p
from ricllm.serve.handoff import Command, Key, Refused, clock, log_refusal
from ricllm.serve.metrics import deadline_class

if TYPE_CHECKING:
    from ricllm.serve.metrics import ServerMetrics

DRAINING_MESSAGE = "the server is shutting down and takes no new work"


class Intake:
    """The checks every request meets, the inbound queue (``inbound``: the engine thread's inbox) and
    the keys in flight. ``offer`` and ``release`` are called from any thread (a lock guards the keys
    and the closing); ``check_*`` on the engine thread. ``draining`` is the server's event."""

    def __init__(self, inbound_queue_size: int, metrics: ServerMetrics, draining: threading.Event) -> None:
        self.inbound: queue.Queue[Command] = queue.Queue(maxsize=inbound_queue_size)
        self.inbound_queue_size = inbound_queue_size
        self.metrics = metrics
        self.draining = draining
        self._in_flight: dict[Key, Command] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        self._end_message = ""

    # -- the fronts' threads

    def offer(self, command: Command) -> BaseModel | None:
        """The reply to give at once (a refusal, or a ``pong``), or None: queued for the engine thread.
        The front sends that reply its own way; a generate's refusal is counted and logged here."""
        with self._lock:
            answer = self._decide(command)
        if isinstance(answer, Refused):
            self._count(command, answer.code, answer.message, rejected=True)
            return answer.reply(command.request.id)
        if isinstance(answer, p.ErrorReply) and answer.code != "DUPLICATE_ID":
            self._count(command, answer.code, answer.message, rejected=False)
        return answer

    def _decide(self, command: Command) -> Refused | BaseModel | None:
        """Under the lock: the answer now, or None once queued and in flight."""
        request = command.request
        if command.key in self._in_flight:
            return p.ErrorReply(id=request.id, code="DUPLICATE_ID",
                                message=f"field 'id': request {request.id!r} of this client is still in flight")
        if isinstance(request, p.PingRequest):
            return p.Pong(id=request.id, server_time=time.time(), version=ricllm.__version__)
        if self._closed:
            return self._ended(command)
        is_generate = isinstance(request, p.GenerateRequest)
        if is_generate and self.draining.is_set():
            return Refused("DRAINING", DRAINING_MESSAGE)
        try:
            self.inbound.put_nowait(command)
        except queue.Full:
            size = self.inbound_queue_size
            message = f"the server's inbound queue already holds {size} requests (its limit); retry later"
            if is_generate:
                return Refused("QUEUE_FULL", message, inbound_queue=size)
            return p.ErrorReply(id=request.id, code="INTERNAL", message=message)
        self._in_flight[command.key] = command
        return None

    def release(self, key: Key) -> None:
        """A final reply to ``key`` has left: the id may be used again."""
        with self._lock:
            self._in_flight.pop(key, None)

    def _ended(self, command: Command) -> Refused | p.ErrorReply:
        """The answer to a command the engine thread will never take."""
        if isinstance(command.request, p.GenerateRequest) and self._failure is None:
            return Refused("DRAINING", DRAINING_MESSAGE)
        return p.ErrorReply(id=command.request.id, code="INTERNAL", message=self._end_message)

    def _count(self, command: Command, code: str, message: str, rejected: bool) -> None:
        """A generate refused before the engine: its metric and its one end-of-request log event."""
        request = command.request
        if not isinstance(request, p.GenerateRequest):
            return
        if rejected:
            self.metrics.rejected(code, deadline_class(request))
        else:
            self.metrics.error(code, deadline_class(request))
        log_refusal(command, code, message, rejected=rejected)

    # -- after the engine thread

    def close(self, failure: BaseException | None, message: str) -> None:
        """Once the engine thread has ended: answer every command still queued (``DRAINING``, or
        ``INTERNAL`` with ``message`` after a ``failure``) and every key still in flight (``INTERNAL``:
        only after an engine fault), each through its own route; later offers are answered at once."""
        with self._lock:
            if not self._closed:
                self._closed, self._failure, self._end_message = True, failure, message
            left = []
            while True:
                try:
                    left.append(self.inbound.get_nowait())
                except queue.Empty:
                    break
            for command in left:
                self._in_flight.pop(command.key, None)
            stranded = [self._in_flight[key] for key in sorted(self._in_flight)]
            self._in_flight.clear()
        for command in left:
            answer = self._ended(command)
            if isinstance(answer, Refused):
                self._count(command, answer.code, answer.message, rejected=True)
                command.reply(answer.reply(command.request.id))
            else:
                self._count(command, answer.code, answer.message, rejected=False)
                command.reply(answer)
        for command in stranded:
            command.reply(p.ErrorReply(id=command.request.id, code="INTERNAL", message=self._end_message))

    # -- the engine thread, before the engine sees a generate

    @staticmethod
    def check_deadline(request: p.GenerateRequest, received: float) -> None:
        """The deadline counts from the front's receipt: one that passed while the request waited to
        reach the engine (a slow HTTP body, the inbound queue, a step) is refused now, with how long."""
        deadline_ms = request.deadline_ms
        if deadline_ms is None:
            return
        waited_ms = (clock() - received) * 1000
        if waited_ms >= deadline_ms:
            raise Refused("DEADLINE_INFEASIBLE", f"the deadline of {deadline_ms:.1f} ms passed while the "
                          f"request was queued ({waited_ms:.1f} ms)", deadline_ms=deadline_ms,
                          waited_ms=round(waited_ms, 3))

    @staticmethod
    def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        """Without admission (which refuses this itself, with its numbers): prompt + answer must fit
        the context."""
        total = num_prompt_tokens + max_tokens
        if total > max_model_len:
            raise Refused("CONTEXT_TOO_LONG", f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                          f"= {total} tokens exceeds the context of {max_model_len} tokens",
                          prompt_tokens=num_prompt_tokens, max_tokens=max_tokens, max_model_len=max_model_len)
