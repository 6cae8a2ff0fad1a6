"""Runs the reward server: its FastAPI app (reward_server/app.py) under uvicorn, until SIGTERM or Ctrl-C.

python -m reward_server [--port 8001] [--workers 2] ...
"""

from __future__ import annotations

import logging

from reward_server.app import build_app
from reward_server.settings import RewardSettings
from services.web import serve

log = logging.getLogger(__name__)


def run(settings: RewardSettings) -> None:
    log.info("settings: %s", settings.redacted())
    serve(build_app(settings), settings)  # uvicorn handles the signals: it drains requests, then the pool stops
