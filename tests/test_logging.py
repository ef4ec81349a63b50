"""Log formats (ricllm.logging): JSON lines keep a raised exception's traceback, the osc format is the
O-RAN SC MDC layout, and the level can change while the format stays."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import structlog

from ricllm.logging import configure_logging, current_log_level, get_logger, set_log_level


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch) -> Iterator[None]:
    import ricllm.logging

    monkeypatch.setattr(ricllm.logging, "_setup", ricllm.logging._setup)  # put back after the test
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def logged_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]


def log_a_fault() -> None:
    try:
        raise ZeroDivisionError("the step's arithmetic")
    except ZeroDivisionError:
        get_logger("ricllm.test").exception("engine_fault", step=7)


def test_a_json_exception_event_keeps_its_traceback(capsys):
    configure_logging("json", "INFO")  # after capsys took stderr: the logger writes where it points
    log_a_fault()
    (event,) = logged_lines(capsys)
    assert event["event"] == "engine_fault" and event["level"] == "error" and event["step"] == 7
    assert "exc_info" not in event
    assert event["exception"].startswith("Traceback (most recent call last):")
    assert "in log_a_fault" in event["exception"] and "ZeroDivisionError: the step's arithmetic" in event["exception"]


def test_the_osc_format_is_the_mdc_layout(capsys):
    configure_logging("osc", "INFO")
    before_ms = time.time_ns() // 1_000_000
    get_logger("ricllm.test").warning("config_reload_refused", restart_required=["block_size"], reloads=2)
    log_a_fault()
    refused, fault = logged_lines(capsys)
    assert set(refused) == {"ts", "crit", "id", "mdc", "msg"}
    assert isinstance(refused["ts"], int) and before_ms <= refused["ts"] <= time.time_ns() // 1_000_000
    assert (refused["crit"], refused["id"], refused["msg"]) == ("WARNING", "ricllm", "config_reload_refused")
    assert refused["mdc"] == {"restart_required": ["block_size"], "reloads": 2}
    assert fault["crit"] == "ERROR" and fault["mdc"]["step"] == 7
    assert "ZeroDivisionError" in fault["mdc"]["exception"]


def test_the_level_changes_and_the_format_stays(capsys):
    configure_logging("osc", "WARNING")
    log = get_logger("ricllm.test")
    log.info("hidden")
    set_log_level("DEBUG")
    log.debug("shown", n=1)
    assert current_log_level() == "DEBUG"
    (line,) = logged_lines(capsys)
    assert line["msg"] == "shown" and line["crit"] == "DEBUG"


def test_the_environment_still_chooses_json_and_the_level(capsys, monkeypatch):
    monkeypatch.setenv("RICLLM_LOG_JSON", "1")
    monkeypatch.setenv("RICLLM_LOG_LEVEL", "error")
    configure_logging()
    log = get_logger("ricllm.test")
    log.warning("hidden")
    log.error("shown")
    (line,) = logged_lines(capsys)
    assert line["event"] == "shown" and "timestamp" in line


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="console, json, osc"):
        configure_logging("xml")


LAZY_LOGGER = """
import sys
from ricllm.logging import get_logger
log = get_logger("ricllm.test")
log.info("hidden", n=1)
log.debug("hidden too")
print("structlog" in sys.modules, flush=True)
log.warning("shown", n=2)
print("structlog" in sys.modules, flush=True)
"""


def test_structlog_is_imported_only_for_an_event_at_the_level():
    """A start that logs nothing at its level (``LLM()`` at the default WARNING) never pays for
    structlog and rich (~0.1 s); the first event that passes imports it, set up as the environment says."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RICLLM_LOG_JSON="1", RICLLM_LOG_LEVEL="warning")
    done = subprocess.run([sys.executable, "-c", LAZY_LOGGER], check=False, capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    (line,) = [json.loads(text) for text in done.stderr.splitlines() if text.strip()]
    assert line["event"] == "shown" and line["n"] == 2 and line["level"] == "warning"
