"""The reward server's HTTP app: POST /v1/score plus the standard ops endpoints.

app = build_app(RewardSettings())      # python -m reward_server runs it under uvicorn
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, status
from prometheus_client import CollectorRegistry

from reward_server.code_runner import CodeRunner
from reward_server.pool import VerifierPool
from reward_server.scoring import RewardMetrics, Scorer
from reward_server.settings import RewardSettings
from reward_server.verifiers import SANDBOXED, check_name, dapo_math
from services.schemas import ScoreItem, ScoreRequest, ScoreResponse
from services.web import create_app, require_role

Scores = Annotated[None, Depends(require_role("reward_token"))]  # the reward role's token (docs: security)


def _check_caps(items: list[ScoreItem], s: RewardSettings) -> None:
    if len(items) > s.max_items:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE, f"{len(items)} items; the limit is {s.max_items} per request"
        )
    for i, it in enumerate(items):
        if len(it.response) > s.max_response_chars:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                f"items[{i}].response has {len(it.response)} characters; the limit is {s.max_response_chars}",
            )
        if len(it.ground_truth) > s.max_ground_truth_chars:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                f"items[{i}].ground_truth has {len(it.ground_truth)} characters; "
                f"the limit is {s.max_ground_truth_chars}",
            )
    problems = {name: p for name in {it.verifier for it in items} if (p := check_name(name))}
    if s.sandbox_url is None and any(it.verifier in SANDBOXED for it in items):
        problems["code"] = "the code verifier runs programs in the sandbox service: start the server with --sandbox-url"
    if problems:
        where = [
            f"items[{i}].verifier: {problems[it.verifier]}" for i, it in enumerate(items) if it.verifier in problems
        ]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "; ".join(where[:5]))


def build_app(settings: RewardSettings) -> FastAPI:
    registry = CollectorRegistry()
    metrics = RewardMetrics(registry)
    pool = VerifierPool(
        settings.workers,
        start_timeout_s=settings.worker_start_timeout_s,
        memory_mb=settings.worker_memory_mb,
        on_restart=metrics.pool_restarts.inc,
    )
    code = CodeRunner(settings) if settings.sandbox_url is not None else None
    scorer = Scorer(settings, pool, metrics, code)
    metrics.pool_workers.set_function(lambda: pool.alive)

    def ready() -> tuple[bool, str]:
        """Ready when a real verification succeeds inline and the pool works: its workers are alive or being
        replaced (each passed a real verification when it started), and the last start did not fail. Answers at
        once however busy the pool is: nothing waits in its queue."""
        if not dapo_math("Answer: 2", "2").acc:
            return False, "dapo_math self-check failed"
        alive, starting = pool.alive, pool.starting
        detail = f"{alive}/{pool.size} workers" + (f", {starting} starting" if starting else "")
        if pool.spawn_failures:
            return False, f"{detail}; the last {pool.spawn_failures} worker starts failed"
        return alive + starting > 0, detail

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()
            if code is not None:
                await code.close()

    app = create_app("reward", settings, registry, ready=ready, lifespan=lifespan)
    app.state.pool = pool

    @app.post("/v1/score", response_model=ScoreResponse, tags=["reward"])
    async def score(req: ScoreRequest, _: Scores) -> ScoreResponse:
        """Score items with their verifier; results in the same order as the items."""
        t0 = time.perf_counter()
        try:
            _check_caps(req.items, settings)
        except HTTPException as e:
            metrics.requests.labels(str(e.status_code)).inc()
            raise
        results = await scorer.score(req.items)
        metrics.request_seconds.observe(time.perf_counter() - t0)
        metrics.requests.labels("200").inc()
        return ScoreResponse(results=results)

    return app
