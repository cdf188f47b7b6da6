"""structlog setup shared by every service: JSON lines when not on a terminal, a readable
console otherwise. Each service binds `service=`; request paths bind `request_id=`."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def setup_logging(service: str, level: str | None = None) -> structlog.stdlib.BoundLogger:
    level_name = (level or os.environ.get("SUPERINFER_LOG_LEVEL", "info")).upper()
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service)
