"""structlog set-up: key-value events on stderr for a terminal, JSON lines for a service.

Three formats (``log_format``):

- ``console``: key-value lines for a person at a terminal;
- ``json``: one JSON object per event, the event's fields at the top level, a raised exception's
  traceback as text in ``exception``;
- ``osc``: the O-RAN SC MDC layout of the OSC xApp frameworks' ``mdclogger``, one JSON object per
  event: ``ts`` (epoch milliseconds), ``crit`` (the level, upper case), ``id`` (the xApp's name),
  ``mdc`` (the event's fields, native JSON values) and ``msg`` (the event's name).

The level and the format can be set again while the process runs (``ricllm serve`` does when its
config file changes): loggers are not cached, so the next event uses the new set-up.

structlog (with rich, asyncio and ssl behind it: ~0.1 s) is imported only when an event passes the
level: until then :func:`get_logger`'s loggers drop the events below it themselves, so a start that
logs nothing at the level (``LLM()`` at the default WARNING) never imports it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # structlog is imported when logging is set up: the settings model (and the CLI's flags) read
    import structlog  # the format and level names here without it

LogFormat = Literal["console", "json", "osc"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
LOG_FORMATS: tuple[str, ...] = ("console", "json", "osc")
LOG_LEVELS: tuple[str, ...] = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
OSC_ID = "ricllm"  # the mdclogger's identity: the xApp's name, as in xapp_descriptor/config-file.json
# the numeric level of each method of structlog's filtering loggers (what make_filtering_bound_logger drops)
_METHOD_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                  "warn": logging.WARNING, "error": logging.ERROR, "err": logging.ERROR,
                  "exception": logging.ERROR, "critical": logging.CRITICAL, "fatal": logging.CRITICAL}


@dataclass
class _Setup:
    """What the last ``configure_logging`` chose, so the level can change and keep the format."""

    log_format: str
    level: str
    applied: bool = True  # False: chosen by get_logger, structlog not configured with it yet

    @property
    def level_number(self) -> int:
        number = logging.getLevelName(self.level)
        if not isinstance(number, int):  # the error structlog's make_filtering_bound_logger raises
            raise KeyError(number.lower())
        return number


_setup: _Setup | None = None
_applying = threading.Lock()


def configure_logging(log_format: str | None = None, level: str | None = None) -> None:
    """Set the format and the level; either left None: ``$RICLLM_LOG_JSON`` (1: json, else console)
    and ``$RICLLM_LOG_LEVEL`` (default WARNING). Safe to call again, from any thread."""
    global _setup
    chosen = _choose(log_format, level)
    _apply(chosen)
    _setup = chosen


def _choose(log_format: str | None, level: str | None) -> _Setup:
    """The set-up ``configure_logging`` would make of these arguments and the environment."""
    log_format = log_format or ("json" if os.environ.get("RICLLM_LOG_JSON", "0") == "1" else "console")
    level_name = (level or os.environ.get("RICLLM_LOG_LEVEL", "WARNING")).upper()
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: choose one of {', '.join(LOG_FORMATS)}")
    chosen = _Setup(log_format, level_name)
    chosen.level_number  # noqa: B018 (an unknown level name fails here, not at the first event)
    return chosen


def _apply(setup: _Setup) -> None:
    import structlog

    structlog.configure(
        processors=_processors(setup.log_format),
        wrapper_class=structlog.make_filtering_bound_logger(setup.level_number),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,  # so a later configure_logging applies to every logger at once
    )


def set_log_level(level: str) -> None:
    """A new level, the format kept (the live ``log_level`` control)."""
    configure_logging(_setup.log_format if _setup is not None else None, level)


def current_log_level() -> str:
    if _setup is None:
        configure_logging()
    return _setup.level


def _processors(log_format: str) -> list[Any]:
    """The console renderer formats tracebacks itself; the JSON layouts need the traceback as text
    first, or ``log.exception`` would write ``"exc_info": true`` and lose it."""
    import structlog

    stamped = [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True)]
    if log_format == "console":
        return [*stamped, structlog.dev.ConsoleRenderer(colors=False)]
    if log_format == "json":
        return [*stamped, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    return [structlog.processors.add_log_level, structlog.processors.format_exc_info, render_osc]


def render_osc(logger: Any, method: str, event: dict[str, Any]) -> str:
    """The MDC layout: ``{"ts": ms, "crit": "INFO", "id": "ricllm", "mdc": {...}, "msg": "event"}``."""
    fields = dict(event)
    message = fields.pop("event", "")
    level = fields.pop("level", method)
    record = {"ts": time.time_ns() // 1_000_000, "crit": _osc_level(level), "id": OSC_ID, "mdc": fields,
              "msg": str(message)}
    return json.dumps(record, default=repr)


def _osc_level(level: str) -> str:
    """structlog's names (``warning``, ``exception``, ``critical``) as the MDC layout spells them."""
    name = level.upper()
    return {"EXCEPTION": "ERROR", "WARN": "WARNING", "FATAL": "CRITICAL"}.get(name, name)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger of structlog's, imported when the logger first has an event to write; the set-up
    is the environment's unless ``configure_logging`` made one."""
    global _setup
    if _setup is None:
        setup = _choose(None, None)
        if "structlog" in sys.modules:  # imported already: configured at once
            _apply(setup)
        else:
            setup.applied = False
        _setup = setup
    return _LazyLogger(name)  # type: ignore[return-value]


def _structlog_ready() -> None:
    """Configure structlog with the set-up ``get_logger`` chose, once, unless something else in the
    process configured it meanwhile (as it would have overridden ricllm's set-up made at import)."""
    import structlog

    with _applying:
        setup = _setup
        if setup is not None and not setup.applied:
            if not structlog.is_configured():
                _apply(setup)
            setup.applied = True


class _LazyLogger:
    """Stands for ``structlog.get_logger(name)``. Before structlog is imported, a method below the
    level is a no-op here, as structlog's filtering logger makes it; anything else imports and
    configures structlog and goes to its logger."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None

    def __getattr__(self, method: str) -> Any:
        setup = _setup
        if ("structlog" not in sys.modules and setup is not None
                and _METHOD_LEVELS.get(method, logging.CRITICAL + 1) < setup.level_number):
            return _discard
        return getattr(self._structlog_logger(), method)

    def _structlog_logger(self) -> Any:
        if _setup is not None and not _setup.applied:
            _structlog_ready()
        if self._logger is None:
            import structlog

            self._logger = structlog.get_logger(self._name)
        return self._logger


def _discard(*args: Any, **kwargs: Any) -> None:
    return None
