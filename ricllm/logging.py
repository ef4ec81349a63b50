"""structlog set-up: key-value events on stderr for a terminal, JSON lines for a service."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure_logging(json: bool | None = None, level: str | None = None) -> None:
    """Idempotent; ``RICLLM_LOG_LEVEL`` and ``RICLLM_LOG_JSON`` override the defaults."""
    global _configured
    level_name = (level or os.environ.get("RICLLM_LOG_LEVEL", "WARNING")).upper()
    if json is None:
        json = os.environ.get("RICLLM_LOG_JSON", "0") == "1"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure_logging()
    return structlog.get_logger(name)
