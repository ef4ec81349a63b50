"""What the threads of ``ricllm serve`` share: ``ServerState``, built by the ``Server`` and handed to
the socket thread (``Frontend``), the HTTP thread (``OpenAIApi``) and the engine thread
(``Worker``), so that none of them needs the ``Server`` itself.

Every field is either safe to touch from any thread (queues, events, the outbox's own protocol,
metrics) or a plain value written once before the threads start (``endpoint``, ``http_port``) or
with a single assignment that the readers may see a moment late (``drain_deadline``,
``failure``): the GIL makes each assignment whole, and no reader needs the newest value at once.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from ricllm.config import ServeConfig, ServerOptions
from ricllm.engine.stats import AdapterStats
from ricllm.serve.handoff import Command, Outbox, clock, log
from ricllm.serve.intake import Intake
from ricllm.serve.metrics import ServerMetrics
from ricllm.serve.reload import LiveChange


@dataclass(eq=False)
class ServerState:
    """The intake and its inbound queue, the outbox, the lifecycle events, the drain deadline and
    the failure.

    Who writes what:

    - ``intake`` and ``inbound``: the fronts (socket thread, HTTP thread) offer commands to the
      intake, which puts what passes on ``inbound``; the engine thread takes them.
    - ``outbox``: the engine thread puts ZeroMQ clients' replies and wakes the socket thread, which
      sends them (HTTP requests' replies go straight to the HTTP thread's loop: ``LocalRoute``).
    - ``ready``: set by the engine thread once the engine is loaded; ``worker_done`` when it ends
      (the socket thread then sends the last replies, closes the intake, which answers what is
      left, and ends too).
    - ``draining`` and ``drain_deadline``: :meth:`drain`, from the caller's thread, a signal
      handler, or the socket thread after a fault of its own.
    - ``failure``: :meth:`record_failure`, from the engine thread (load error, engine fault) or
      the socket thread (its own fault).
    - ``live_changes``: the config watcher puts live controls, the engine thread applies them
      between steps and then replaces ``effective_config`` (:meth:`publish_config`), which the HTTP
      thread reads for ``/ric/v1/config``.
    - ``adapters``: the engine thread publishes the LoRA adapters it holds (:meth:`publish_adapters`)
      at start and after a change; the HTTP thread reads them for ``/v1/models`` and a request's ``model``.
    """

    options: ServerOptions
    metrics: ServerMetrics
    outbox: Outbox
    inbound: queue.Queue[Command] = field(init=False)
    intake: Intake = field(init=False)
    ready: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)
    worker_done: threading.Event = field(default_factory=threading.Event)
    drain_deadline: float | None = None
    failure: BaseException | None = None
    endpoint: str | None = None  # the bound endpoint, once the socket is bound (for the ready log)
    http_port: int | None = None
    live_changes: queue.SimpleQueue[LiveChange] = field(default_factory=queue.SimpleQueue)
    effective_config: ServeConfig | None = None
    adapters: tuple[AdapterStats, ...] = ()  # the LoRA adapters the engine holds, by name

    def publish_adapters(self, adapters: tuple[AdapterStats, ...]) -> None:
        """The adapters held now (engine thread, at start and after each change; one assignment)."""
        self.adapters = adapters

    def __post_init__(self) -> None:
        self.intake = Intake(self.options.inbound_queue_size, self.metrics, self.draining)
        self.inbound = self.intake.inbound

    def drain(self, timeout_s: float) -> None:
        """Refuse new generates; cancel admitted ones after ``timeout_s``. A later call may only
        bring the deadline closer. Any thread: two calls at the same moment may keep either
        deadline, a harmless race (the engine thread reads it once per round)."""
        deadline = clock() + timeout_s
        if self.drain_deadline is None or deadline < self.drain_deadline:
            self.drain_deadline = deadline
        if not self.draining.is_set():
            log.info("server_draining", timeout_s=timeout_s)
        self.draining.set()

    def publish_config(self, effective: ServeConfig) -> None:
        """The configuration running now (engine thread, once a live change applies; one assignment)."""
        self.effective_config = effective

    def is_ready(self) -> bool:
        """Loaded and calibrated, not draining, not failed (the readiness probe; any thread)."""
        return self.ready.is_set() and not self.draining.is_set() and not self.worker_done.is_set()

    def record_failure(self, exc: BaseException) -> None:
        """The first failure wins: it is what ``wait_ready`` raises and what clients are told.
        Both threads may call it; a race between two first failures keeps either, both are real."""
        if self.failure is None:
            self.failure = exc

    def end_message(self) -> str:
        """What requests left unanswered at the end are told (the intake, after the engine's end)."""
        if self.failure is not None:
            return f"the server stopped: {type(self.failure).__name__}: {self.failure}"
        return "the server is shutting down"
