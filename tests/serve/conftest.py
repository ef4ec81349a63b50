"""Fixtures for the service tests: a stored latency fit, and in-process servers on free ports."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import require_module

# a = 1 ms per step, so admission can never promise a few milliseconds to a 64-token answer
FIT_COEFFICIENTS = [1e-3, 1e-5, 1e-4, 1e-7, 0.0]


@pytest.fixture(scope="session")
def latency_fit(tmp_path_factory) -> Path:
    """A stored latency-model fit: the server loads it instead of calibrating."""
    from ricllm.engine.latency_model import LatencyModel

    path = tmp_path_factory.mktemp("fit") / "latency_fit.json"
    LatencyModel(list(FIT_COEFFICIENTS)).save(path)
    return path


@pytest.fixture(scope="session")
def engine_kwargs(tiny_gguf, latency_fit) -> dict:
    """The tiny random model on a 4 MiB KV budget (512 blocks of 16 in float32), deadline admission."""
    return dict(model=str(tiny_gguf), kv_cache_budget="4MiB", dtype="float32", admission="deadline",
                latency_fit=str(latency_fit), max_num_seqs=32, threads=2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class RunningServer:
    """A started in-process server; ``stop()`` cancels what runs, answers everything and closes."""

    server: object

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    def stop(self) -> None:
        self.server.stop()


def _start(engine_kwargs: dict, ready: bool = True, **options) -> RunningServer:
    require_module("prometheus_client")
    from ricllm.config import EngineConfig, ServerOptions
    from ricllm.serve.server import Server

    settings = dict(zmq_endpoint="tcp://127.0.0.1:*", http_port=0, http_host="127.0.0.1")
    settings.update(options)
    server = Server(EngineConfig(**engine_kwargs), ServerOptions(**settings)).start()
    if ready:
        assert server.wait_ready(60), "the tiny model did not load within 60 s"
    return RunningServer(server)


@pytest.fixture
def start_server(engine_kwargs) -> Iterator[Callable[..., RunningServer]]:
    """``start_server(**ServerOptions fields)``; every server it starts is stopped afterwards."""
    started: list[RunningServer] = []

    def start(ready: bool = True, engine: dict | None = None, **options) -> RunningServer:
        running = _start({**engine_kwargs, **(engine or {})}, ready, **options)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="module")
def server(engine_kwargs) -> Iterator[RunningServer]:
    """One server shared by a module's tests (tcp on 127.0.0.1, HTTP on a free port), warmed up."""
    from ricllm.client import RicClient

    running = _start(engine_kwargs)
    with RicClient(running.endpoint, timeout_s=30) as client:
        client.generate("warm up", max_tokens=4, ignore_eos=True)
    yield running
    running.stop()
