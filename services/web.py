"""What every HTTP service has: /healthz, /readyz, /metrics, /config, bearer-token auth, uvicorn.

registry = CollectorRegistry()
app = create_app("reward", settings, registry, ready=lambda: (pool_alive(), "process pool"))
app.include_router(my_router, dependencies=[Depends(require_token)])      # the mesh administration's token
@app.post("/v1/score", dependencies=[Depends(require_role("reward_token"))])  # a role's own token (docs: security)
serve(app, settings)
"""

from __future__ import annotations

import hmac
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest
from pydantic import BaseModel

from services.settings import ServiceSettings, role_token

log = logging.getLogger(__name__)
disable_created_metrics()  # the *_created series double every counter for no use here

ReadyCheck = Callable[[], tuple[bool, str] | Awaitable[tuple[bool, str]]]


class Health(BaseModel):
    status: str
    service: str
    detail: str = ""


def _check(token: Any, authorization: str | None, name: str) -> None:
    """Bearer-token check (constant-time compare); open when no token is set."""
    if token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            f"missing or wrong bearer token: send `Authorization: Bearer <{name}>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_token(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """The mesh administration's token (DAPO_AUTH_TOKEN); open when the service has none."""
    _check(request.app.state.settings.auth_token, authorization, "DAPO_AUTH_TOKEN")


class require_role:  # noqa: N801 (a dependency, used as `Depends(require_role("reward_token"))`)
    """A dependency wanting a role's token (`reward_token`: DAPO_REWARD_TOKEN), or the auth token while the role
    has none of its own: the administration's token does not open a role's routes once the role has its own."""

    def __init__(self, field: str):
        self.field = field

    async def __call__(self, request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
        settings = request.app.state.settings
        own = getattr(settings, self.field) is not None
        name = f"DAPO_{self.field.upper()}" if own else "DAPO_AUTH_TOKEN"
        _check(role_token(settings, self.field), authorization, name)


Authorized = Annotated[None, Depends(require_token)]


class BodySizeLimit:
    """ASGI middleware: answer 413 to a request body over `max_bytes` (declared or streamed)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen, rejected = 0, False

        async def limited_receive() -> Any:
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # answer now; the app sees the client go away
                rejected = True
                await self._reject(send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Any) -> None:
            if not rejected:  # whatever the app answers after our 413 is dropped
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send: Any) -> None:
        body = json.dumps({"detail": f"request body is larger than {self.max_bytes} bytes"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def create_app(
    service: str,
    settings: ServiceSettings,
    registry: CollectorRegistry,
    *,
    ready: ReadyCheck | None = None,
    **fastapi_kwargs: Any,
) -> FastAPI:
    """A FastAPI app with the standard endpoints; add the service's own routes to it. The API schema and its
    pages are off unless `settings.api_docs`, and then behind the token like everything but /healthz."""
    app = FastAPI(title=f"dapo-mesh {service}", docs_url=None, redoc_url=None, openapi_url=None, **fastapi_kwargs)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.state.settings = settings
    app.state.registry = registry

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz() -> Health:
        """Liveness: the process serves HTTP. No auth, so probes need no secret."""
        return Health(status="ok", service=service)

    @app.get("/readyz", response_model=Health, tags=["ops"], responses={503: {"model": Health}})
    async def readyz(_: Authorized, response: Response) -> Health:
        """Readiness: the service can do real work now."""
        result = ready() if ready else (True, "")
        ok, detail = await result if inspect.isawaitable(result) else result
        if not ok:
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return Health(status="ready" if ok else "not ready", service=service, detail=detail)

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics(_: Authorized) -> Response:
        """Prometheus text format, from this service's own registry."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/config", tags=["ops"])
    def config(_: Authorized) -> dict[str, Any]:
        """The resolved settings, secrets redacted."""
        return settings.redacted()

    if settings.api_docs:
        _add_docs(app)
    return app


def _add_docs(app: FastAPI) -> None:
    """/openapi.json, /docs and /redoc, each wanting the token (a browser page fetches the schema without it:
    with a token set, read the schema with curl or a client that sends the header)."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import HTMLResponse, JSONResponse

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(_: Authorized) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    def docs(_: Authorized) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/redoc", include_in_schema=False)
    def redoc(_: Authorized) -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)


def serve_in_thread(app: FastAPI, settings: ServiceSettings, port: int | None = None) -> Any:
    """Serve from a daemon thread (for processes whose main thread does the work, like the learner), on the
    settings' address (`port`: another port of the same host, e.g. a replica's gateway).
    Returns the uvicorn Server: set `.should_exit = True` to stop it."""
    import threading

    import uvicorn

    port = settings.port if port is None else port
    config = uvicorn.Config(app, host=settings.host, port=port, log_config=None, access_log=False, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, name="http", daemon=True).start()
    log.info("listening on http://%s:%d", settings.host, port)
    return server


def serve(app: FastAPI, settings: ServiceSettings) -> None:
    """Run under uvicorn with the settings' bind address; logs go through our handlers."""
    import uvicorn

    log.info("listening on http://%s:%d", settings.host, settings.port)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=10,
    )
