"""Logging set-up: one line per event, plain for people or JSON for log pipelines.

Structured fields travel as ``extra={"fields": {...}}`` and appear as keys in JSON lines and as
``key=value`` pairs in plain lines.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

__all__ = ["configure_logging"]


class _PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_plain(v)}" for k, v in fields.items())
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def _plain(value: Any) -> str:
    text = json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
    return text if " " not in text else json.dumps(text)


def configure_logging(fmt: str = "plain", level: str = "INFO") -> None:
    """Send the root logger's records to stderr in ``fmt`` ("plain" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _PlainFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
