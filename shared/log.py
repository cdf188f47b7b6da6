"""structlog setup shared by every service. Each service binds `service=`; request paths bind
`request_id=`.

Two renderings of the same events: readable console lines for a person at a terminal, JSON
lines for a log collector. `auto` (the default) picks by where the lines go: console when
that stream is a terminal, JSON otherwise (a pipe, a file, a container's log driver).
`superinfer --log-format console|json` forces one; the CLI passes the choice on to the
services `superinfer serve` starts through `SUPERINFER_LOG_FORMAT`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

LOG_FORMATS = ("auto", "console", "json")
LOG_FORMAT_ENV = "SUPERINFER_LOG_FORMAT"
LOG_LEVEL_ENV = "SUPERINFER_LOG_LEVEL"


def resolve_format(requested: str | None, stream: TextIO) -> str:
    """"console" or "json": `requested` (else $SUPERINFER_LOG_FORMAT, else auto), with auto
    decided by whether `stream` is a terminal."""
    fmt = (requested or os.environ.get(LOG_FORMAT_ENV) or "auto").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(LOG_FORMATS)})")
    if fmt != "auto":
        return fmt
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def renderer(fmt: str, stream: TextIO):
    """The last processor: key=value console lines (colored on a terminal unless $NO_COLOR
    is set) or one JSON object per line."""
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    colors = stream.isatty() and not os.environ.get("NO_COLOR")
    return structlog.dev.ConsoleRenderer(colors=colors)


def setup_logging(
    service: str, level: str | None = None, fmt: str | None = None, stream: TextIO | None = None
) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process, writing to `stream` (stderr); a logger bound to
    `service`."""
    stream = stream or sys.stderr
    level_name = (level or os.environ.get(LOG_LEVEL_ENV, "info")).upper()
    fmt = resolve_format(fmt, stream)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # JSON carries a traceback as text; the console renderer lays it out itself.
            *([structlog.processors.format_exc_info] if fmt == "json" else []),
            renderer(fmt, stream),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service)
