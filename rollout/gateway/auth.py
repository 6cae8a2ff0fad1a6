"""Who calls the gateway (a session's key, or the mesh token), and its errors in OpenAI's shape."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse

from rollout.gateway.core import KEY_PREFIX, Gateway
from rollout.gateway.schemas import error
from rollout.gateway.sessions import Session


class ApiError(Exception):
    """An answer in OpenAI's error shape, with its status (and Retry-After for a 429 or a 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.code, self.param, self.retry_after = status, kind, code, param, retry_after

    def response(self) -> JSONResponse:
        body = error(str(self), self.kind, self.param)
        body["error"]["code"] = self.code
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(body, status_code=self.status, headers=headers)


@dataclass
class Caller:
    session: Session | None  # a session's key; None: the mesh token (calls not captured)


def bearer(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    """A session's key (its session, while open), or the mesh token; with no mesh token set (a local mesh), any
    key that is not a session's is the mesh's."""
    gw: Gateway = request.app.state.gw
    token = gw.s.auth_token.get_secret_value() if gw.s.auth_token else None
    scheme, _, given = (authorization or "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    if token is not None and hmac.compare_digest(given.encode(), token.encode()):
        return Caller(None)
    if given:
        with gw.lock:
            session = gw.authenticate(given)
        if session is not None:
            return Caller(session)
        if token is None and not given.startswith(KEY_PREFIX + "_"):
            return Caller(None)
        raise ApiError(
            401, "unknown or expired session key (or wrong mesh token)", "authentication_error", code="invalid_api_key"
        )
    if token is None:
        return Caller(None)
    raise ApiError(
        401, "send `Authorization: Bearer <session key or mesh token>`", "authentication_error", code="invalid_api_key"
    )


Auth = Annotated[Caller, Depends(bearer)]


def mesh(caller: Auth) -> None:
    """The training side's routes: the mesh token only."""
    if caller.session is not None:
        raise ApiError(401, "this route needs the mesh token, not a session key", "authentication_error")
