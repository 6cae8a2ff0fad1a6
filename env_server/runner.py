"""Runs the environment service: its FastAPI app (env_server/app.py) under uvicorn, until SIGTERM or Ctrl-C.

python -m env_server [--port 8005] [--workers 8] ...
"""

from __future__ import annotations

import logging

from env_server.app import build_app
from env_server.settings import EnvSettings
from services.web import serve

log = logging.getLogger(__name__)


def run(settings: EnvSettings) -> None:
    log.info("settings: %s", settings.redacted())
    serve(build_app(settings), settings)  # uvicorn drains the requests in flight on SIGTERM
