"""``ricllm serve``: the engine behind a ZeroMQ ROUTER socket (docs/protocol.md, docs/serve.md).

This module owns the lifecycle (bind, start, drain, wait, close) and runs on the caller's thread.
It builds one :class:`~ricllm.serve.state.ServerState` and hands it to the threads below; they
share nothing else and never see the ``Server``. Three threads (four with ``$CONFIG_FILE``), each the
only one to touch what it owns:

- the **socket thread** (:mod:`ricllm.serve.frontend`) owns the ROUTER socket. It decodes every
  frame and offers each request to the intake (:mod:`ricllm.serve.intake`), which answers at once
  what needs no engine (duplicate ids, ``ping``, ``DRAINING``, a full inbound queue) and puts the
  rest on the bounded inbound queue; it sends the replies the engine thread leaves in the outbox.
  It never waits on a model step.
- the **engine thread** (an :class:`~ricllm.engine.engine_loop.EngineLoop` with the
  :mod:`ricllm.serve.worker` plugged in) owns the engine. Between steps it takes every
  queued command (admission, templates, cancel, stats) and answers it, then runs one step and sends the
  new tokens of streaming requests and the results of finished ones along each request's route
  (:mod:`ricllm.serve.handoff`): a ZeroMQ client's through the outbox, where a message on an
  inproc PAIR socket wakes the socket thread; an HTTP request's onto the HTTP thread's loop.
- the **HTTP thread** (:mod:`ricllm.serve.http`, uvicorn's event loop) serves health, metrics and the
  effective configuration from thread-safe values, and the OpenAI API
  (:mod:`ricllm.serve.openai_routes`), which offers its requests to the same intake: no ZeroMQ
  socket between, one inbound queue and one admission for every request.
- with ``$CONFIG_FILE`` set, the **config thread** (:mod:`ricllm.serve.reload`) watches that file
  and hands the controls that may change live to the engine thread, which applies them between steps.

Invariants:

- every request id gets exactly one final reply (``protocol.is_final``): the intake keeps the
  (client, id) pairs in flight, refuses a second one with ``DUPLICATE_ID``, and forgets a pair
  only when its final reply has left; whatever the engine thread leaves unanswered when it ends
  (drain, fault) the intake answers once it has ended.
- queues are bounded: the inbound queue by ``inbound_queue_size``; what the engine holds by
  admission (``max_queue`` waiting best-effort requests, deadline requests by their KV
  reservations); the outbox by one reply per in-flight request per step plus control replies.
- a reply to a client that has gone is dropped (ROUTER_MANDATORY off); the server carries on.
"""


from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING

import zmq

from ricllm.affinity import format_cpu_list, other_cpus, threads_started_on
from ricllm.engine.engine_loop import EngineLoop
from ricllm.errors import ConfigError, RicllmError
from ricllm.config import ServeConfig, ServerOptions
from ricllm.logging import configure_logging
from ricllm.serve.frontend import Frontend
from ricllm.serve.handoff import Outbox, clock, log, new_wake_address
from ricllm.serve.http import HttpServer
from ricllm.serve.metrics import ServerMetrics
from ricllm.serve.reload import ConfigWatcher, config_body
from ricllm.serve.state import ServerState
from ricllm.serve.worker import Worker

if TYPE_CHECKING:
    from ricllm.config import EngineConfig
    from ricllm.engine.latency_model import LatencyModel


__all__ = ["Server", "serve_forever"]


class Server:
    """``ricllm serve`` in-process: ``start()``, ``wait_ready()``, ``drain()``, ``wait()``, ``stop()``.

    ``start`` binds the ROUTER socket and the HTTP port and returns; the engine loads (and
    calibrates unless ``latency_model`` or ``config.latency_fit`` is given) in the engine thread,
    after which ``/ric/v1/health/ready`` answers 200. Requests that arrive while it loads wait in
    the inbound queue. ``drain`` stops taking generates (``DRAINING``), lets admitted ones finish
    (cancelled after ``timeout_s``) and ends the threads; ``stop`` is ``drain(0)`` + ``wait``.

    ``settings``, the resolved settings ``config`` and ``options`` came from, let
    ``/ric/v1/config`` say where each control came from, and have ``$CONFIG_FILE`` watched.
    """

    def __init__(self, config: EngineConfig, options: ServerOptions | None = None,
                 latency_model: LatencyModel | None = None, settings: ServeConfig | None = None) -> None:
        self.options = options or ServerOptions()
        self.metrics = ServerMetrics()
        self._context = zmq.Context()
        self._state = ServerState(self.options, self.metrics, Outbox(self._context, new_wake_address()))
        self._state.publish_config(settings if settings is not None
                                   else ServeConfig.of_arguments(config, self.options))
        self._watcher = self._config_watcher(settings)
        self._auth = None
        self._http: HttpServer | None = None
        self._frontend: Frontend | None = None
        self._threads: list[threading.Thread] = []
        self._worker = Worker(self._state, config, latency_model)
        self._service_cpus = other_cpus(config.engine_cpus)
        self._closed = False

    # -- lifecycle

    def start(self) -> Server:
        """Bind everything, then start the threads; on a bind error nothing is left open.

        With ``engine_cpus`` set, every thread started here (socket, HTTP, CURVE, libzmq's I/O
        threads, which start with the first socket) inherits the other CPUs; the engine thread
        moves itself onto ``engine_cpus`` as it builds the engine.
        """
        with threads_started_on(self._service_cpus):
            try:
                self._start_http()
                self._start_auth()
                self._frontend = Frontend(self._state, self._context)
            except BaseException:
                self._close()
                raise
            self._state.endpoint, self._state.http_port = self.endpoint, self.http_port
            engine = EngineLoop(self._worker.load_engine, self._worker, self._state.inbound, name="ricllm-engine")
            self._threads = [threading.Thread(target=self._frontend.run, name="ricllm-socket", daemon=True),
                             engine.thread]
            for thread in self._threads:
                thread.start()
            if self._watcher is not None:
                self._watcher.start()
        log.info("server_listening", endpoint=self.endpoint, http_port=self.http_port,
                 curve=self.options.curve is not None,
                 service_cpus=format_cpu_list(self._service_cpus) if self._service_cpus else None)
        return self

    def _config_watcher(self, settings: ServeConfig | None) -> ConfigWatcher | None:
        """A watcher of ``$CONFIG_FILE`` whose live changes go to the engine thread's queue."""
        if settings is None or settings.watched_file is None:
            return None
        return ConfigWatcher(settings, self._state.live_changes.put, lambda: self._state.effective_config)

    def _start_http(self) -> None:
        if self.options.http_port is None:
            return
        openai = None
        if self.options.openai_api:
            from ricllm.serve.openai_routes import OpenAIApi

            state = self._state
            openai = OpenAIApi(state.intake, self.options.max_message_bytes, lambda: state.adapters)
        try:
            self._http = HttpServer(self.options.http_host, self.options.http_port, self._state.is_ready,
                                    self.metrics.render, openai, self._config_body)
        except OSError as exc:
            raise ConfigError(f"cannot listen for HTTP on port {self.options.http_port}: "
                              f"{exc.strerror or exc}") from None
        self._http.start()

    def _config_body(self) -> dict:
        """``/ric/v1/config`` (HTTP thread): the configuration the engine thread last published."""
        watching = self._watcher is not None and self._watcher.watching.is_set()
        return config_body(self._state.effective_config, watching)

    def _start_auth(self) -> None:
        """CURVE clients are admitted only with a public key found in ``authorized_keys_dir``."""
        curve = self.options.curve
        if curve is None:
            return
        from zmq.auth.thread import ThreadAuthenticator

        if not os.path.isdir(curve.authorized_keys_dir):
            raise ConfigError(f"CURVE authorized_keys_dir {curve.authorized_keys_dir!r} is not a folder")
        self._auth = ThreadAuthenticator(self._context, log=None)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=curve.authorized_keys_dir)

    def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new generates; admitted ones finish, or are cancelled after ``timeout_s``
        (default ``options.drain_timeout_s``; a later call may shorten it). Returns at once."""
        self._state.drain(self.options.drain_timeout_s if timeout_s is None else timeout_s)

    def wait(self, timeout: float | None = None) -> bool:
        """True once both threads have ended and everything is closed."""
        end = None if timeout is None else clock() + timeout
        for thread in self._threads:
            thread.join(None if end is None else max(end - clock(), 0.0))
            if thread.is_alive():
                return False
        self._close()
        return True

    def stop(self, timeout: float | None = 30.0) -> None:
        """Cancel whatever runs, answer everything, close."""
        self.drain(timeout_s=0.0)
        if not self.wait(timeout):
            raise RuntimeError("the server threads did not end")

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.stop()
        self._state.intake.close(self.failure, self._state.end_message())  # the socket thread's end closes it; after a fault of its own, this does
        if self._http is not None:
            self._http.stop()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        log.info("server_stopped", failure=None if self.failure is None else str(self.failure))

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- state

    @property
    def endpoint(self) -> str:
        """The bound endpoint (a ``*`` port resolved)."""
        return self._frontend.endpoint if self._frontend is not None else self.options.zmq_endpoint

    @property
    def http_port(self) -> int | None:
        return self._http.port if self._http is not None else None

    @property
    def config_watcher(self) -> ConfigWatcher | None:
        """The ``$CONFIG_FILE`` watcher (its ``watching`` event is set while changes are seen), else None."""
        return self._watcher

    @property
    def failure(self) -> BaseException | None:
        """What stopped the server (a load error, an engine or socket-thread fault), else None."""
        return self._state.failure

    @property
    def draining(self) -> bool:
        return self._state.draining.is_set()

    def ready(self) -> bool:
        """Loaded and calibrated, not draining, not failed: what the readiness probe reports."""
        return self._state.is_ready()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the engine to load; re-raises its load error."""
        state = self._state
        end = None if timeout is None else clock() + timeout
        while not state.ready.is_set() and not state.worker_done.is_set():
            if end is not None and clock() >= end:
                return False
            state.ready.wait(0.05)
        if state.failure is not None and not state.ready.is_set():
            raise state.failure
        return state.ready.is_set()


def serve_forever(settings: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain and return 0 (a second signal cancels what runs)."""
    configure_logging(settings.log_format, settings.log_level)
    server = Server(settings.engine_config(), settings.server, settings=settings)
    server.start()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        server.drain(timeout_s=0.0 if server.draining else None)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    while not server.wait(timeout=0.5):
        pass
    if server.failure is not None:
        if isinstance(server.failure, RicllmError):
            raise server.failure
        log.error("server_failed", error=f"{type(server.failure).__name__}: {server.failure}")
        return 1
    return 0
