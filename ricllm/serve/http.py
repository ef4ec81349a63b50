"""HTTP for ``ricllm serve``: O-RAN health and metrics, and the OpenAI-compatible API, on one port.

A Starlette app served by uvicorn on its own event loop, in the ``ricllm-http`` daemon thread:

- ``GET /ric/v1/health/alive``: 200 as soon as the process is up (the liveness probe);
- ``GET /ric/v1/health/ready``: 200 only once the model is loaded and the latency model is
  calibrated or loaded, 503 before that and while draining (the readiness probe);
- ``GET /ric/v1/metrics``: Prometheus text format;
- ``GET /ric/v1/config``: the configuration running now, with where each control came from
  (:mod:`ricllm.serve.reload`);
- ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (:mod:`ricllm.serve.openai_routes`),
  unless the API is off.

Anything else is 404 (405 for another method on a known path). The health and metrics handlers
only read thread-safe callables given by the server; the OpenAI handlers offer their requests to
the server's intake, which hands them to the engine thread. The port is bound before the thread starts, so a busy port fails ``start`` and
port 0 resolves at once.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ricllm.logging import get_logger

if TYPE_CHECKING:
    from ricllm.serve.openai_routes import OpenAIApi

log = get_logger("ricllm.serve.http")

ALIVE_PATH = "/ric/v1/health/alive"
READY_PATH = "/ric/v1/health/ready"
METRICS_PATH = "/ric/v1/metrics"
CONFIG_PATH = "/ric/v1/config"
RIC_PATHS = [ALIVE_PATH, READY_PATH, METRICS_PATH, CONFIG_PATH]
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
GRACEFUL_SHUTDOWN_S = 2.0  # open responses get this long once stopping: by then every request has its final reply


class _Json(JSONResponse):
    """Today's probe bodies, byte for byte: ``json.dumps`` with its default separators and a newline."""

    def render(self, content: object) -> bytes:
        return json.dumps(content).encode() + b"\n"


def build_app(ready: Callable[[], bool], metrics: Callable[[], tuple[bytes, str]],
              openai: OpenAIApi | None, config: Callable[[], dict] | None = None) -> Starlette:
    """The routes; ``openai`` None serves health and metrics only; ``config`` gives /ric/v1/config's body."""

    async def alive(request: Request) -> Response:
        return _Json({"status": "alive"})

    async def readiness(request: Request) -> Response:
        is_ready = ready()
        return _Json({"status": "ready" if is_ready else "not ready"}, status_code=200 if is_ready else 503)

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics()
        return Response(body, media_type=None, headers={"Content-Type": content_type})

    async def configuration(request: Request) -> Response:
        return JSONResponse(config() if config is not None else {})

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            return _Json({"status": "method not allowed"}, status_code=405)
        if request.url.path.startswith("/v1/") and openai is not None:
            return JSONResponse({"error": {"message": f"no route {request.method} {request.url.path}",
                                           "type": "invalid_request_error", "code": "not_found", "param": None}},
                                status_code=exc.status_code)
        return _Json({"status": "not found", "paths": RIC_PATHS}, status_code=exc.status_code)

    routes = [Route(ALIVE_PATH, alive, methods=["GET"]), Route(READY_PATH, readiness, methods=["GET"]),
              Route(METRICS_PATH, prometheus, methods=["GET"]), Route(CONFIG_PATH, configuration, methods=["GET"])]
    routes += openai.routes() if openai is not None else []
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket. Its protocol is named: asyncio sets TCP_NODELAY only on connections of a
    socket whose ``proto`` is IPPROTO_TCP, and without it a response's header and body segments wait
    on the client's delayed ACK (40 ms per request, measured with the ``openai`` client)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


class HttpServer:
    """uvicorn in a thread. ``ready()`` says whether to answer 200 on the readiness path;
    ``metrics()`` gives (body, content type); ``openai`` adds the OpenAI API's routes; ``config()``
    gives the effective configuration."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool],
                 metrics: Callable[[], tuple[bytes, str]], openai: OpenAIApi | None = None,
                 config: Callable[[], dict] | None = None) -> None:
        self._socket = _listen(host, port)  # OSError: the server names the port
        served = uvicorn.Config(build_app(ready, metrics, openai, config), log_config=None, access_log=False,
                                lifespan="on", loop="asyncio", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self._uvicorn = uvicorn.Server(served)
        self._openai = openai is not None
        self._thread = threading.Thread(target=self._run, name="ricllm-http", daemon=True)

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    def _run(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._socket])
        except BaseException:  # the probes go dark: say why, the server's own threads carry on
            log.exception("http_thread_fault")

    def start(self) -> None:
        """Start serving; returns once uvicorn listens, so the probes answer from the first moment."""
        self._thread.start()
        self._wait(lambda: self._uvicorn.started or not self._thread.is_alive(), START_TIMEOUT_S)
        paths = RIC_PATHS + (["/v1/models", "/v1/completions", "/v1/chat/completions"] if self._openai else [])
        log.info("http_listening", port=self.port, paths=paths)

    def stop(self) -> bool:
        """Close open responses (after ``GRACEFUL_SHUTDOWN_S``), then the port. False if the thread did not end."""
        if self._thread.is_alive():
            self._uvicorn.should_exit = True
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("http_stop_timeout", timeout_s=STOP_TIMEOUT_S)
                return False
        self._socket.close()
        return True

    @staticmethod
    def _wait(condition: Callable[[], bool], timeout_s: float) -> None:
        event = threading.Event()
        for _ in range(int(timeout_s / 0.005)):
            if condition():
                return
            event.wait(0.005)
