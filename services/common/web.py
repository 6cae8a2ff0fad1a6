"""What every HTTP service has: /healthz, /readyz, /metrics, /config, bearer-token auth, uvicorn.

registry = CollectorRegistry()
app = create_app("reward", settings, registry, ready=lambda: (pool_alive(), "process pool"))
app.include_router(my_router, dependencies=[Depends(require_token)])
serve(app, settings)
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response, status
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from services.common.settings import ServiceSettings

log = logging.getLogger(__name__)

ReadyCheck = Callable[[], tuple[bool, str]]


class Health(BaseModel):
    status: str
    service: str
    detail: str = ""


def require_token(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """Bearer-token check (constant-time compare); open when the service has no token set."""
    token = request.app.state.settings.auth_token
    if token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.encode(), token.get_secret_value().encode()
    ):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or wrong bearer token: send `Authorization: Bearer <DAPO_AUTH_TOKEN>`",
            headers={"WWW-Authenticate": "Bearer"},
        )


Authorized = Annotated[None, Depends(require_token)]


def create_app(
    service: str,
    settings: ServiceSettings,
    registry: CollectorRegistry,
    *,
    ready: ReadyCheck | None = None,
    **fastapi_kwargs: Any,
) -> FastAPI:
    """A FastAPI app with the standard endpoints; add the service's own routes to it."""
    app = FastAPI(title=f"dapo-mesh {service}", **fastapi_kwargs)
    app.state.settings = settings
    app.state.registry = registry

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz() -> Health:
        """Liveness: the process serves HTTP. No auth, so probes need no secret."""
        return Health(status="ok", service=service)

    @app.get("/readyz", response_model=Health, tags=["ops"], responses={503: {"model": Health}})
    def readyz(_: Authorized, response: Response) -> Health:
        """Readiness: the service can do real work now."""
        ok, detail = ready() if ready else (True, "")
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

    return app


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
