"""Structured logs: one line per event on stderr, text by default, JSON with `--log-json`.

Text: `2025-01-02T03:04:05.678Z info sandbox: agent sandbox ON (...) key=value ...`
JSON: `{"ts": "...", "level": "info", "event": "sandbox", "message": "...", "key": "value"}`
Other loggers (the egress driver, aiohttp) are formatted the same way, with their logger name as
the event.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any, Final

__all__ = ["LOGGER_NAME", "configure_logging", "log_event"]

LOGGER_NAME: Final = "cc_server.server"
_log = logging.getLogger(LOGGER_NAME)


def _timestamp(created: float) -> str:
    millis = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text


class _Formatter(logging.Formatter):
    def __init__(self, *, as_json: bool) -> None:
        super().__init__()
        self._json = as_json

    def format(self, record: logging.LogRecord) -> str:
        event: str = getattr(record, "event", record.name)
        fields: dict[str, Any] = getattr(record, "fields", {})
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        level = record.levelname.lower()
        if self._json:
            line = {"ts": _timestamp(record.created), "level": level, "event": event,
                    "message": message, **fields}
            return json.dumps(line, default=str)
        pairs = "".join(f" {k}={_text_value(v)}" for k, v in fields.items())
        return f"{_timestamp(record.created)} {level} {event}: {message}{pairs}".replace(
            "\n", "\n    "
        )


def configure_logging(*, as_json: bool, stream: IO[str] | None = None) -> None:
    """Send every log record (ours, the egress driver's, aiohttp's) to `stream` (stderr), one
    line per event. Replaces handlers set by an earlier call."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Formatter(as_json=as_json))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def log_event(event: str, message: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event: a short name (`listening`, `sandbox.created`, ...), a sentence, and fields."""
    _log.log(level, "%s", message, extra={"event": event, "fields": fields})
