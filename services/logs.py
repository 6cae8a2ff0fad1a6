"""Structured logging for every process: plain or one JSON object per line, secrets masked.

configure_logging("reward", settings)   # level, format and secret masking from the settings
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.settings import ServiceSettings


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class SecretMask(logging.Filter):
    """Replaces every known secret value in a record's final message by '***'."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = [s for s in secrets if len(s) >= 4]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            msg = record.getMessage()
            masked = msg
            for s in self.secrets:
                masked = masked.replace(s, "***")
            if masked != msg:
                record.msg, record.args = masked, None
        return True


def configure_logging(service: str, settings: ServiceSettings | None = None) -> None:
    level = settings.log_level if settings else "INFO"
    handler = logging.StreamHandler(sys.stderr)
    if settings is not None and settings.log_json:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    handler.addFilter(SecretMask(settings.secret_values() if settings else []))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the rest
