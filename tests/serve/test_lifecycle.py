"""``ricllm serve``'s lifecycle: ``GET /ric/v1/config``, and ``$CONFIG_FILE`` watched while it serves
(live controls apply between steps, the others are refused by name, a bad file changes nothing).

A real server in-process on the tiny model, its settings resolved from a config file the test
rewrites the way editors and config maps do (a rename over the file)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from ricllm.client import RejectedError, RicClient
from tests.serve.conftest import free_port
from tests.serve.test_server import http_get, wait_for

WAIT_S = 10.0  # the most any change may take to show; the tests poll and return as soon as it does


@dataclass
class ConfigServer:
    """A running server whose settings came from ``path`` (``$CONFIG_FILE``)."""

    server: Any
    path: Path
    controls: dict[str, Any]  # what the file holds now

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def config(self) -> dict[str, Any]:
        status, text = http_get(f"http://127.0.0.1:{self.server.http_port}/ric/v1/config")
        assert status == 200
        return json.loads(text)

    def write(self, **changes: Any) -> None:
        """The file with ``changes`` over what it holds, replaced in one rename."""
        self.controls = _merge(self.controls, changes)
        write_atomically(self.path, json.dumps({"controls": self.controls}))


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


@pytest.fixture
def config_server(engine_kwargs, tmp_path) -> Iterator[ConfigServer]:
    yield from serve_from_config_file(tmp_path, engine_kwargs)


def serve_from_config_file(tmp_path, engine_kwargs: dict, **controls_over) -> Iterator[ConfigServer]:
    """A started server whose controls (``engine_kwargs``, deadline admission, ``controls_over``) come
    from a ``$CONFIG_FILE`` it watches; stopped when the caller is done with it."""
    from ricllm.config import resolve_settings
    from ricllm.serve.server import Server

    path = tmp_path / "config-file.json"
    controls = {**engine_kwargs, "admission": {"policy": "deadline"}, "zmq_endpoint": "tcp://127.0.0.1:*",
                "http_port": free_port(), **controls_over}
    path.write_text(json.dumps({"controls": controls}))
    settings = resolve_settings(environ={"CONFIG_FILE": str(path)})
    server = Server(settings.engine_config(), replace(settings.server, http_host="127.0.0.1"), settings=settings)
    server.start()
    try:
        assert server.wait_ready(60), "the tiny model did not load within 60 s"
        assert server.config_watcher.watching.wait(WAIT_S), "the config file is not watched"
        yield ConfigServer(server, path, controls)
    finally:
        server.stop()


@pytest.fixture
def restore_logging(monkeypatch) -> Iterator[None]:
    """A test that changes the log level live puts the process's logging back as it was."""
    import ricllm.logging

    monkeypatch.setattr(ricllm.logging, "_setup", ricllm.logging._setup)
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def rejection(endpoint: str, **request: Any) -> RejectedError:
    with RicClient(endpoint, timeout_s=30) as client, pytest.raises(RejectedError) as refused:
        client.generate("hello", **request)
    return refused.value


def events(logs: list[dict], name: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] == name]


# ------------------------------------------------------------------------------ /ric/v1/config

def test_config_shows_the_running_controls_and_where_each_came_from(config_server):
    body = config_server.config()
    source = f"CONFIG_FILE={config_server.path}"
    assert body["controls"]["max_num_seqs"] == 32 and body["controls"]["admission"]["max_queue"] == 256
    assert body["controls"]["log_format"] == "json" and body["controls"]["log_level"] is None
    assert body["sources"]["max_num_seqs"] == body["sources"]["admission.policy"] == source
    assert body["sources"]["block_size"] == "default"
    assert body["config_file"] == str(config_server.path) and body["reloads"] == 0 and body["watching"] is True
    assert "admission.safety_margin" in body["live_controls"] and "block_size" not in body["live_controls"]


def test_a_server_built_from_arguments_shows_them(start_server):
    body = json.loads(http_get(start_server().http_url + "/ric/v1/config")[1])
    assert body["controls"]["admission"]["policy"] == "deadline" and body["controls"]["kv_cache_budget"] == 4 << 20
    assert set(body["sources"].values()) == {"Server arguments"} and body["config_file"] is None
    assert body["watching"] is False


# ------------------------------------------------------------------------------ live changes

def test_live_controls_apply_without_a_restart(config_server):
    """max_queue and safety_margin are what admission decides with: the next requests see them."""
    before = rejection(config_server.endpoint, max_tokens=64, deadline_ms=5)
    assert before.code == "DEADLINE_INFEASIBLE" and "10% margin" in before.message
    config_server.write(admission={"max_queue": 0, "safety_margin": 9.0, "on_late": "abort",
                                   "pace_prefill": False})
    body = wait_for(lambda: (b := config_server.config())["reloads"] == 1 and b, WAIT_S, "the live change")
    admission = body["controls"]["admission"]
    assert (admission["max_queue"], admission["safety_margin"], admission["on_late"], admission["pace_prefill"]) \
        == (0, 9.0, "abort", False)
    assert body["sources"]["admission.max_queue"] == f"CONFIG_FILE={config_server.path}"
    full = rejection(config_server.endpoint, max_tokens=4)  # best effort: waits in the queue, now of 0
    assert full.code == "QUEUE_FULL" and full.numbers["max_queue"] == 0
    late = rejection(config_server.endpoint, max_tokens=64, deadline_ms=5)
    assert late.code == "DEADLINE_INFEASIBLE" and "900% margin" in late.message
    engine_admission = config_server.server._worker.engine.admission.config  # what the engine decides with
    assert (engine_admission.on_late, engine_admission.pace_prefill) == ("abort", False)


def test_the_log_level_changes_live(config_server, restore_logging):
    from ricllm.logging import current_log_level

    config_server.write(log_level="DEBUG")
    wait_for(lambda: config_server.config()["controls"]["log_level"] == "DEBUG", WAIT_S, "the new log level")
    assert current_log_level() == "DEBUG"
    config_server.write(log_level="ERROR")
    wait_for(lambda: current_log_level() == "ERROR", WAIT_S, "the second log level")


def test_a_restart_only_change_is_refused_by_name_and_the_live_ones_still_apply(config_server):
    with capture_logs() as logs:
        config_server.write(block_size=32, kv_cache_budget="8MiB", admission={"max_queue": 3})
        body = wait_for(lambda: (b := config_server.config())["reloads"] == 1 and b, WAIT_S, "the live change")
    (refused,) = events(logs, "config_reload_refused")
    assert refused["restart_required"] == ["block_size", "kv_cache_budget"]
    assert refused["asked"] == {"block_size": 32, "kv_cache_budget": "8MiB"}
    assert body["controls"]["block_size"] == 16 and body["controls"]["kv_cache_budget"] == "4MiB"
    assert body["controls"]["admission"]["max_queue"] == 3
    assert config_server.server._worker.engine.config.block_size == 16


@pytest.mark.parametrize("text, reason", [
    ('{"controls": {"admission": {"max_queue": 1}', "is not valid JSON"),
    ('{"controls": {"admission": {"max_queue": 1, "safety_margin": -1}}}', "admission.safety_margin"),
    ('{"controls": {"admission": {"max_queue": 1}, "no_such_control": 1}}', "no_such_control"),
])
def test_a_bad_file_keeps_the_running_config_and_says_why(config_server, text, reason):
    with capture_logs() as logs:
        write_atomically(config_server.path, text)
        failed = wait_for(lambda: events(logs, "config_reload_failed"), WAIT_S, "the refusal of the bad file")
    assert reason in failed[0]["error"] and str(config_server.path) in failed[0]["error"]
    body = config_server.config()
    assert body["reloads"] == 0 and body["controls"]["admission"]["max_queue"] == 256
    config_server.write(admission={"max_queue": 2})  # the next good file applies as usual
    wait_for(lambda: config_server.config()["controls"]["admission"]["max_queue"] == 2, WAIT_S,
             "the good file after it")


def test_the_watcher_ends_with_the_server(engine_kwargs, tmp_path):
    from ricllm.serve.server import Server
    from ricllm.config import resolve_settings

    path = tmp_path / "config-file.json"
    path.write_text(json.dumps({"controls": {**engine_kwargs, "zmq_endpoint": "tcp://127.0.0.1:*",
                                             "http_port": free_port()}}))
    settings = resolve_settings(environ={"CONFIG_FILE": str(path)})
    server = Server(settings.engine_config(), replace(settings.server, http_host="127.0.0.1"), settings=settings)
    server.start()
    assert server.config_watcher.watching.wait(WAIT_S)
    server.stop()
    assert not server.config_watcher.watching.is_set()


# ------------------------------------------------------------------------------ ricllm serve itself

def test_ricllm_serve_watches_config_file_and_logs_in_the_osc_layout(engine_kwargs, tmp_path):
    """The command as deployed: settings from $CONFIG_FILE, MDC log lines, a live change and a refused one."""
    import signal
    import subprocess
    import sys

    port = free_port()
    server = ConfigServer(None, tmp_path / "config-file.json", {
        **engine_kwargs, "admission": {"policy": "deadline"}, "zmq_endpoint": f"ipc://{tmp_path}/serve.sock",
        "http_port": port, "log_format": "osc"})
    server.write()
    env = {**os.environ, "CONFIG_FILE": str(server.path)}
    env.pop("RICLLM_LOG_LEVEL", None)
    process = subprocess.Popen([sys.executable, "-m", "ricllm.cli", "serve"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(base + "/ric/v1/health/ready") == 200 or process.poll() is not None, 90, "ready")
        assert process.poll() is None
        wait_for(lambda: json.loads(http_get(base + "/ric/v1/config")[1])["watching"], WAIT_S, "the watcher")
        server.write(admission={"max_queue": 7}, max_num_seqs=8)
        wait_for(lambda: json.loads(http_get(base + "/ric/v1/config")[1])["controls"]["admission"]["max_queue"] == 7,
                 WAIT_S, "the live change")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        _, stderr = process.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert lines and all(set(line) == {"ts", "crit", "id", "mdc", "msg"} for line in lines), stderr[-2000:]
    by_name = {line["msg"]: line for line in lines}
    assert by_name["config_reload_refused"]["mdc"]["restart_required"] == ["max_num_seqs"]
    assert by_name["config_reload_refused"]["crit"] == "WARNING"
    assert by_name["config_applied"]["mdc"]["changed"] == {"admission.max_queue": 7}
    assert "server_ready" in by_name and "server_stopped" in by_name


def _status(url: str) -> int | None:
    try:
        return http_get(url)[0]
    except OSError:
        return None
