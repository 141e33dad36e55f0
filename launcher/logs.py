"""Structured (key=value) log lines on stderr, quiet unless asked."""

from __future__ import annotations

import logging
import os


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace('"', "'")
        line = f'ts={self.formatTime(record, "%Y-%m-%dT%H:%M:%S")} level={record.levelname.lower()} ' \
               f'logger={record.name} pid={record.process} msg="{message}"'
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("PDSERVE_LOG_LEVEL", "warning")).upper()
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Libraries are chatty at INFO; keep them at WARNING unless debugging.
    for name in ("transformers", "httpx", "grpc", "aiohttp.access"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
