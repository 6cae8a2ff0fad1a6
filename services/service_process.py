"""What a service process that works in its main thread has around its loop: a Redis connection, a metrics
registry, and the operational endpoints (/healthz, /readyz, /metrics, /config) served from a thread. Used by
the runners of the buffer, the rollout replica and the learner (the reward server is all HTTP: uvicorn runs it).

    with ServiceProcess("buffer", settings, loading="loading the dataset") as proc:
        buffer = Buffer(settings, proc.client, source, BufferMetrics(proc.registry))
        proc.ready_when(lambda: (buffer.status == "running", buffer.status))   # /readyz: 503 until then
        while not stop.is_set():
            buffer.step()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import redis
from prometheus_client import CollectorRegistry

from services.settings import RedisSettings, ServiceSettings
from services.streams import connect_from
from services.web import create_app, serve_in_thread

Check = Callable[[], tuple[bool, str]]


class ServiceProcess:
    def __init__(self, name: str, settings: Any, *, loading: str = "starting"):
        assert isinstance(settings, ServiceSettings) and isinstance(settings, RedisSettings), type(settings)
        self.client: redis.Redis = connect_from(settings)
        self.registry: CollectorRegistry = CollectorRegistry()
        self._loading: str = loading
        self._check: Check | None = None
        self._server: Any = serve_in_thread(create_app(name, settings, self.registry, ready=self._ready), settings)

    def _ready(self) -> tuple[bool, str]:
        return self._check() if self._check is not None else (False, self._loading)

    def ready_when(self, check: Check) -> None:
        """From now on /readyz answers what `check` says (until then: 503 with the `loading` detail)."""
        self._check = check

    def close(self) -> None:
        self._server.should_exit = True
        self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
