"""The router's HTTP app: one OpenAI-compatible endpoint for every replica's gateway.

    POST /v1/sessions        placed on a replica (free seats of a task it holds first, then the most room); a
                             replica full (429 sessions_full) or unreachable: the next one
    /v1/sessions/{id}...     to the replica whose tag begins the session id
    any other /v1/...        with a session's key (Authorization: Bearer dms_<id>_...): to that session's replica;
                             with another credential (the model list, an uncaptured call): the least loaded replica
    /healthz /readyz /metrics /config   the router's own (services/web.py)

The router holds no session state and no credential: a session id names its replica (services/session_keys.py),
so any router routes any session and a restarted one loses nothing; each replica checks the credentials itself.
Answers pass through as they come (a stream as it streams; 429 and its Retry-After as they are). A session whose
replica is gone (its heartbeat expired, or its gateway takes no connection) is a 410 that says so: the session is
lost with its replica, the client opens a new one (its task goes back to the stream: another replica reclaims it).
A replica that dropped a call but takes connections (slow or busy, on a loaded machine) is a 502 (retried by the
SDK); a call of no session is sent to another replica only if the first did not take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.background import BackgroundTask

from router.replicas import Replica, Replicas
from router.settings import RouterSettings
from services.session_keys import parse_key
from services.streams import connect_from
from services.web import create_app

log = logging.getLogger(__name__)
HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
UNREACHED = (httpx.ConnectError, httpx.ConnectTimeout)  # the replica did not take the call: it is gone (or not up)
KEEPALIVE_S = 2.0


class RouterMetrics:
    def __init__(self, r: CollectorRegistry):
        self.requests = Counter(
            "dapo_router_requests", "Calls routed, by route and answer.", ["route", "status"], registry=r
        )
        self.replicas = Gauge(
            "dapo_router_replicas", "Replicas serving a gateway, as the router sees them.", registry=r
        )
        self.gone = Counter(
            "dapo_router_sessions_gone", "Calls for a session whose replica has left (410).", registry=r
        )
        self.retried = Counter(
            "dapo_router_placements_retried",
            "Session openings sent on to another replica: the first was full or did not answer.",
            registry=r,
        )
        self.seconds = Histogram(
            "dapo_router_answer_seconds",
            "Seconds from a call's arrival to the replica's answer beginning to flow back (its headers).",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )


def error(status: int, message: str, code: str, retry_after: int | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 410: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "server_error"
    )
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


class Router:
    def __init__(self, s: RouterSettings, table: Replicas, metrics: RouterMetrics):
        self.s, self.table, self.m = s, table, metrics
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self.http = client(self.s)
        await self.table.refresh()

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.s.refresh_s)
            try:
                await self.table.refresh()
            except Exception as e:  # Redis away for a moment: route by the last table read meanwhile
                log.warning("reading the replicas' heartbeats failed: %s", e)
            self.m.replicas.set(len(self.table.by_tag))

    async def send(self, request: Request, replica: Replica, body: bytes) -> httpx.Response:
        """The request as it came, to `replica`; the answer's body not read yet (a stream passes through)."""
        assert self.http is not None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        url = replica.url + target(request)
        req = self.http.build_request(request.method, url, params=request.query_params, content=body, headers=headers)
        return await self.http.send(req, stream=True)

    async def gone(self, replica: Replica) -> bool:
        """After it dropped a call: whether the replica is gone — nothing takes a connection at its gateway's address
        (killed, or its host away). Only that is proof: a gateway that takes the connection but is slow to answer,
        or answers an error, is a loaded or busy replica (its engine loop holds the GIL on a loaded machine), and
        its session is not lost: the call is retried (a 502). A replica that is really gone soon refuses
        connections or loses its heartbeat, and the retry gets the 410."""
        assert self.http is not None
        try:
            await self.http.get(replica.url + "/healthz", timeout=httpx.Timeout(10.0, connect=self.s.connect_timeout_s))
        except UNREACHED:
            return True
        except httpx.HTTPError:
            return False
        return False

    async def open_session(self, request: Request, body: bytes) -> Response:
        """A new session: the best placement first; a replica full, unreachable or failing passes it to the next
        (a session it opened without the answer reaching us expires there, its seat back to its task)."""
        last: httpx.Response | None = None
        for replica in self.table.placements():
            try:
                upstream = await self.send(request, replica, body)
                if upstream.status_code == 429 and await full(upstream):
                    last = upstream
                    self.m.retried.inc()
                    continue
            except httpx.HTTPError as e:
                log.warning("replica %s did not take a session (%s): the next one", replica.replica_id, e)
                self.table.set_aside(replica)
                self.m.retried.inc()
                continue
            return passed(upstream)
        if last is not None:
            return passed(last)
        why = "no replica serves the gateway now (none has joined, or all are leaving); retry"
        return error(503, why, "no_replica", retry_after=2)

    async def to_session(self, request: Request, sid: str, body: bytes) -> Response:
        """A call of a session: to its replica; a 410 once that replica is gone, a 502 (the SDK retries) when it
        only dropped the call."""
        replica = self.table.of_session(sid)
        if replica is None:
            self.m.gone.inc()
            return gone(sid, "its heartbeat is gone: the replica left the mesh")
        try:
            return passed(await self.send(request, replica, body))
        except UNREACHED as e:
            self.m.gone.inc()
            return gone(sid, f"replica {replica.replica_id} does not answer ({type(e).__name__})")
        except httpx.TimeoutException:
            why = f"replica {replica.replica_id} did not answer within {self.s.call_timeout_s:g} s"
            return error(504, why, "replica_timeout", retry_after=5)
        except httpx.HTTPError as e:
            if await self.gone(replica):
                self.m.gone.inc()
                return gone(sid, f"replica {replica.replica_id} dropped the call and takes no connection")
            why = f"replica {replica.replica_id} dropped the call ({type(e).__name__}); retry"
            return error(502, why, "replica_dropped", retry_after=1)

    async def to_any(self, request: Request, body: bytes) -> Response:
        """A call of no session: the least loaded replica; only one that did not take it passes it to the next (an
        uncaptured call is not sent twice)."""
        for replica in self.table.any():
            try:
                return passed(await self.send(request, replica, body))
            except UNREACHED:
                self.table.set_aside(replica)
            except httpx.TimeoutException:
                why = f"replica {replica.replica_id} did not answer within {self.s.call_timeout_s:g} s"
                return error(504, why, "replica_timeout", retry_after=5)
            except httpx.HTTPError as e:
                why = f"replica {replica.replica_id} dropped the call ({type(e).__name__}); retry"
                return error(502, why, "replica_dropped", retry_after=1)
        return error(503, "no replica serves the gateway now; retry", "no_replica", retry_after=2)


def client(s: RouterSettings, inner: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The router's client of the replicas: its timeouts, its pool, and `ClosedAsMade` around the transport (`inner`:
    a test's in place of the network's)."""
    # an idle connection is dropped before the replicas' uvicorn drops it (5 s): a call never goes out on a
    # connection the replica is closing at that moment (that would read as a replica gone)
    n = s.max_connections
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=KEEPALIVE_S)
    transport = ClosedAsMade(inner or httpx.AsyncHTTPTransport(limits=limits))
    return httpx.AsyncClient(timeout=httpx.Timeout(s.call_timeout_s, connect=s.connect_timeout_s), transport=transport)


class ClosedAsMade(httpx.AsyncBaseTransport):
    """The router's transport: `inner`'s, but a connection the replica closed while it was being made — a replica
    killed at that moment — is the ConnectError it is (nothing was sent). httpcore's anyio stream is left without a
    socket then, and reading its address raises AttributeError ('NoneType' object has no attribute 'getpeername'),
    not an httpx error; seen under the router e2e test's kill -9 on a loaded machine, a 500 before this."""

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except AttributeError as e:
            if "'NoneType' object has no attribute" not in str(e):
                raise  # any other is a bug, and says so (a 500 with its traceback)
            raise httpx.ConnectError(f"the connection closed as it was made ({e})", request=request) from e

    async def aclose(self) -> None:
        await self.inner.aclose()


async def full(upstream: httpx.Response) -> bool:
    """A replica's 429 for its session bound (the next replica may have room), not for want of a task (every
    replica reads the same stream: the client retries later)."""
    await upstream.aread()
    try:
        return bool(upstream.json()["error"]["code"] == "sessions_full")
    except (ValueError, KeyError, TypeError):
        return False


def passed(upstream: httpx.Response) -> Response:
    """The replica's answer as it is: status, headers, body (streamed as it comes)."""
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    if upstream.is_stream_consumed:
        return Response(upstream.content, status_code=upstream.status_code, headers=headers)
    done = BackgroundTask(upstream.aclose)
    return StreamingResponse(relay(upstream), status_code=upstream.status_code, headers=headers, background=done)


async def relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The body as it comes; a replica that dies mid-answer ends it — a stream with an error event in OpenAI's
    shape (the SDK raises it), any other body cut short (the client sees it incomplete), never a crash here."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        log.warning("a replica's answer broke off: %s", type(e).__name__)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            why = f"the replica stopped answering mid-stream ({type(e).__name__}): its session is lost"
            event = {"error": {"message": why, "type": "server_error", "param": None, "code": "session_replica_gone"}}
            yield f"data: {json.dumps(event)}\n\n".encode()


def gone(sid: str, why: str) -> JSONResponse:
    return error(410, f"session {sid} is lost with its replica ({why}): open a new session", "session_replica_gone")


def target(request: Request) -> str:
    """The path as the client sent it, still percent-encoded (the decoded one may hold characters no URL may: a
    `%17` in a model's name), checked as a URL; raises ValueError when it is not one."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    try:
        path = raw.decode("ascii")
        httpx.URL("http://replica" + path)
    except (UnicodeDecodeError, httpx.InvalidURL) as e:
        raise ValueError(str(e)) from None
    return path


def session_of(request: Request) -> str | None:
    """The session a call belongs to: /v1/sessions/{id}... names it, else a session's key does."""
    parts = request.url.path.split("/")
    if len(parts) > 3 and parts[1:3] == ["v1", "sessions"] and parts[3]:
        return parts[3]
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    parsed = parse_key(key.strip()) if scheme.lower() == "bearer" else None
    return parsed[0] if parsed else None


def build_app(s: RouterSettings) -> FastAPI:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(s, Replicas(connect_from(s)), metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        task = asyncio.create_task(router.refresh_forever())
        try:
            yield
        finally:
            task.cancel()
            if router.http is not None:
                await router.http.aclose()

    def ready() -> tuple[bool, str]:
        n = len(router.table.by_tag)
        if not router.table.read_at:
            return False, "the replicas' heartbeats not read yet"
        return n > 0, f"{n} replicas serve a gateway" if n else "no replica serves a gateway yet"

    app = create_app("router", s, registry, ready=ready, lifespan=lifespan)
    app.state.router = router

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def route(request: Request, path: str) -> Any:
        t0 = time.perf_counter()
        body = await request.body()
        answer: Response
        try:
            target(request)
        except ValueError as e:
            answer, kind = error(400, f"the path cannot be sent on: {e}", "invalid_path"), "other"
        else:
            answer, kind = await dispatch(request, body)
        metrics.requests.labels(kind, str(answer.status_code)).inc()
        metrics.seconds.observe(time.perf_counter() - t0)
        return answer

    async def dispatch(request: Request, body: bytes) -> tuple[Response, str]:
        if request.method == "POST" and request.url.path == "/v1/sessions":
            return await router.open_session(request, body), "open"
        if (sid := session_of(request)) is not None:
            return await router.to_session(request, sid, body), "session"
        return await router.to_any(request, body), "other"

    return app
