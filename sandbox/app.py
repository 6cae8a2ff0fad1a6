"""The sandbox service's HTTP app: POST /v1/run (one program), POST /v1/batch (one program, many inputs), plus the
standard ops endpoints. Each run takes a worker slot (a thread and, as root, a uid of its own) for its whole life.

Status codes: 200 a run that ran, whatever its verdict; 401 a missing or wrong token; 413 a program, its files or
inputs, or a batch over the service's size limits; 422 a body that does not validate (an unknown language, a file
outside the working directory) or a limit above the service's maximum; 429 (Retry-After) more runs waiting than
--queue; 503 the sandbox failed to start a run (bubblewrap refused: the service's own fault, never the program's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, status
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sandbox.jail import Jail, Limits, SandboxError, find_bwrap, find_python, kill_uid, self_check
from sandbox.settings import LIMITS, SandboxSettings
from services.sandbox_api import VERDICTS, BatchRequest, BatchResult, ProgramSpec, RunRequest, RunResult
from services.web import create_app, require_role

log = logging.getLogger(__name__)
Runs = Annotated[None, Depends(require_role("sandbox_token"))]  # the sandbox role's token (docs: security)
RETRY_AFTER = {"Retry-After": "1"}


class SandboxMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.runs = Counter("dapo_sandbox_runs", "Programs run, by verdict.", ["verdict"], registry=registry)
        for v in VERDICTS:
            self.runs.labels(v)
        self.run_seconds = Histogram(
            "dapo_sandbox_run_seconds",
            "Wall time of one run, sandbox included.",
            buckets=(0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.requests = Counter("dapo_sandbox_requests", "Requests answered.", ["route", "status"], registry=registry)
        self.queued = Gauge("dapo_sandbox_queued_runs", "Runs waiting for a worker.", registry=registry)
        self.running = Gauge("dapo_sandbox_running_runs", "Runs in a sandbox now.", registry=registry)
        self.leftovers = Counter(
            "dapo_sandbox_leftover_processes",
            "Processes of a run still alive after it ended, killed by the service (should stay 0: the namespace "
            "takes them with it).",
            registry=registry,
        )


def resolve_limits(spec: ProgramSpec, s: SandboxSettings) -> Limits:
    """The run's limits: each asked one, else the service's default; one above the service's maximum is a 422."""
    asked = spec.limits.model_dump()
    over = []
    for n in LIMITS:
        if asked[n] is not None and asked[n] > getattr(s, f"max_{n}"):
            over.append(f"limits.{n} = {asked[n]} is above the service's maximum {getattr(s, f'max_{n}')}")
    if over:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "; ".join(over))
    return Limits(**{n: getattr(s, n) if asked[n] is None else asked[n] for n in LIMITS})


def check_sizes(spec: ProgramSpec, inputs: list[str], s: SandboxSettings) -> None:
    def too_large(what: str) -> HTTPException:
        return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, what)

    if (n := len(spec.source.encode())) > s.max_source_bytes:
        raise too_large(f"source has {n} bytes; the limit is {s.max_source_bytes}")
    if len(spec.files) > s.max_files:
        raise too_large(f"{len(spec.files)} files; the limit is {s.max_files}")
    if len(inputs) > s.max_batch:
        raise too_large(f"{len(inputs)} inputs; the limit is {s.max_batch} per batch")
    total = sum(len(t.encode()) for t in [*spec.files.values(), *inputs])
    if total > s.max_input_bytes:
        raise too_large(f"files and inputs have {total} bytes; the limit is {s.max_input_bytes}")


class Runner:
    """The worker slots: a thread each, and the slot number that picks the run's uid. Runs wait for a slot in
    arrival order; more waiting than `queue` are refused up front (429) so a caller backs off instead of piling up."""

    def __init__(self, jail: Jail, settings: SandboxSettings, metrics: SandboxMetrics):
        self.jail, self.settings, self.metrics = jail, settings, metrics
        self.threads = ThreadPoolExecutor(settings.workers, thread_name_prefix="sandbox")
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(settings.workers):
            self.free.put_nowait(slot)
        self.waiting = 0  # runs waiting for a worker now
        self.admitted = 0  # runs of the requests in progress: waiting, running or done in an unfinished batch

    def admit(self, n: int) -> None:
        """Reserve room for a request's `n` runs (waiting or running) before any of them starts, or refuse it: 413
        when no wait would ever fit it, 429 when the workers and the queue are full now. `release` gives it back."""
        room = self.settings.queue + self.settings.workers
        if n > room:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE, f"{n} runs in one request; this service holds {room} at most"
            )
        if self.admitted + n > room:
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"{self.admitted} runs are admitted for {self.settings.workers} workers; retry later",
                headers=RETRY_AFTER,
            )
        self.admitted += n

    def release(self, n: int) -> None:
        self.admitted -= n

    async def run(self, spec: ProgramSpec, stdin: str, limits: Limits) -> RunResult:
        self.waiting += 1
        self.metrics.queued.inc()
        try:
            slot = await self.free.get()
        finally:
            self.waiting -= 1
            self.metrics.queued.dec()
        self.metrics.running.inc()
        loop = asyncio.get_running_loop()
        job = self.threads.submit(self._run, slot, spec, stdin, limits)
        # the slot (and its uid) comes back when the program has ended, not when this request does: a request
        # cancelled mid-run (its client gone) must not hand the uid to a run its after-run sweep would kill
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done, slot))
        result = await asyncio.wrap_future(job)
        self.metrics.runs.labels(result.verdict).inc()
        self.metrics.run_seconds.observe(result.wall_s)
        return result

    def _done(self, slot: int) -> None:
        self.metrics.running.dec()
        self.free.put_nowait(slot)

    def _run(self, slot: int, spec: ProgramSpec, stdin: str, limits: Limits) -> RunResult:
        try:
            return self.jail.run(slot, spec.source, stdin, spec.files, limits)
        except (OSError, SandboxError) as e:  # bwrap or setpriv could not start: ours to fix, not the program's
            log.error("a run failed to start: %s", e)
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the sandbox could not start: {e}") from e
        except Exception as e:  # a bug of ours a program found: said and logged, never a 500
            log.exception("a run failed")
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the sandbox failed: {type(e).__name__}") from e

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)


def build_app(settings: SandboxSettings) -> FastAPI:
    registry = CollectorRegistry()
    metrics = SandboxMetrics(registry)
    jail = Jail(find_bwrap(settings.bwrap), find_python(settings.python), settings.uid_base, settings.work_tmpfs_mb)
    jail.on_leftover = metrics.leftovers.inc
    state: dict[str, Runner] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for slot in range(settings.workers):  # what a service killed before left of its workers' programs
            if (uid := jail.uid(slot)) is not None:
                kill_uid(uid)
        problem = await asyncio.to_thread(self_check, jail, settings.workers)
        if problem:  # a sandbox that cannot isolate must not serve: fail at start-up, before anything runs
            raise RuntimeError(problem)
        log.info("sandbox ready: %s, %s, %d workers", jail.bwrap, jail.python, settings.workers)
        state["runner"] = Runner(jail, settings, metrics)
        try:
            yield
        finally:
            state.pop("runner").close()

    def ready() -> tuple[bool, str]:
        runner = state.get("runner")
        if runner is None:
            return False, "starting"
        return True, f"{runner.free.qsize()}/{settings.workers} workers free, {runner.waiting} runs waiting"

    app = create_app("sandbox", settings, registry, ready=ready, lifespan=lifespan)

    async def answer(route: str, spec: ProgramSpec, stdins: list[str]) -> list[RunResult]:
        try:
            check_sizes(spec, stdins, settings)
            limits = resolve_limits(spec, settings)
            runner = state["runner"]
            runner.admit(len(stdins))
            try:
                results = await asyncio.gather(*(runner.run(spec, s, limits) for s in stdins))
            finally:  # also when the client went away and the runs not started yet were cancelled
                runner.release(len(stdins))
        except HTTPException as e:
            metrics.requests.labels(route, str(e.status_code)).inc()
            raise
        metrics.requests.labels(route, "200").inc()
        return list(results)

    @app.post("/v1/run", response_model=RunResult, tags=["sandbox"])
    async def run(req: RunRequest, _: Runs) -> RunResult:
        """Run one program on one input, in a sandbox of its own; its verdict, output, time and memory."""
        (result,) = await answer("run", req, [req.stdin])
        return result

    @app.post("/v1/batch", response_model=BatchResult, tags=["sandbox"])
    async def batch(req: BatchRequest, _: Runs) -> BatchResult:
        """Run one program once per input (test cases), each in a sandbox of its own, results in input order."""
        return BatchResult(results=await answer("batch", req, req.stdins))

    return app
