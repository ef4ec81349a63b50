"""O-RAN health and metrics over plain HTTP (stdlib ``ThreadingHTTPServer`` in a daemon thread).

- ``GET /ric/v1/health/alive``: 200 as soon as the process is up (the liveness probe);
- ``GET /ric/v1/health/ready``: 200 only once the model is loaded and the latency model is
  calibrated or loaded, 503 before that and while draining (the readiness probe);
- ``GET /ric/v1/metrics``: Prometheus text format.

Anything else is 404 (405 for other methods). Handlers only read thread-safe callables given by
the server; they never touch the engine.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ricllm.logging import get_logger

log = get_logger("ricllm.serve.http")

ALIVE_PATH = "/ric/v1/health/alive"
READY_PATH = "/ric/v1/health/ready"
METRICS_PATH = "/ric/v1/metrics"


class HealthServer:
    """``ready()`` says whether to answer 200 on the readiness path; ``metrics()`` gives (body, type)."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool],
                 metrics: Callable[[], tuple[bytes, str]]) -> None:
        handler = type("_Handler", (_Handler,), {"ready": staticmethod(ready), "metrics": staticmethod(metrics)})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="ricllm-http", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()
        log.info("http_listening", port=self.port, paths=[ALIVE_PATH, READY_PATH, METRICS_PATH])

    def stop(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    ready: Callable[[], bool]
    metrics: Callable[[], tuple[bytes, str]]
    server_version = "ricllm"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        path = self.path.split("?", 1)[0]
        if path == ALIVE_PATH:
            self._json(200, {"status": "alive"})
        elif path == READY_PATH:
            ready = self.ready()
            self._json(200 if ready else 503, {"status": "ready" if ready else "not ready"})
        elif path == METRICS_PATH:
            body, content_type = self.metrics()
            self._send(200, body, content_type)
        else:
            self._json(404, {"status": "not found", "paths": [ALIVE_PATH, READY_PATH, METRICS_PATH]})

    def _method_not_allowed(self) -> None:
        self._json(405, {"status": "method not allowed"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed  # noqa: N815

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode() + b"\n", "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the stdlib's name)
        log.debug("http_request", client=self.client_address[0], line=format % args)
