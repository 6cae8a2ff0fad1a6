"""Who calls the gateway, and its errors in OpenAI's shape.

Three credentials (docs/operations/security.md):

    admin     the mesh token (DAPO_AUTH_TOKEN): everything — opening sessions, uncaptured model calls (an
              evaluation harness), any session's state and end, the schema
    opener    the session-opening token (DAPO_SESSION_TOKEN): POST /v1/sessions and GET /v1/models only — what an
              agent harness holds; it cannot call the model, read or end a session
    session   a session's key (dms_<session>_<secret>, given once at its opening): its own calls (captured), its
              state and its end — nothing of another session's, and no reward for a task it does not score

With no mesh token set (a local mesh on loopback), any key that is not a session's is the mesh's.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse
from pydantic import SecretStr

from rollout.gateway.core import Gateway
from rollout.gateway.schemas import error
from rollout.gateway.sessions import Session
from services.session_keys import parse_key


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
    role: Literal["admin", "opener", "session"]
    session: Session | None = None  # the session of a session's key


def _same(given: str, secret: SecretStr | None) -> bool:
    return secret is not None and hmac.compare_digest(given.encode(), secret.get_secret_value().encode())


def bearer(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    gw: Gateway = request.app.state.gw
    scheme, _, given = (authorization or "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    if _same(given, gw.s.auth_token):
        return Caller("admin")
    if _same(given, gw.s.session_token):
        return Caller("opener")
    if parse_key(given) is not None:
        with gw.lock:
            session, why = gw.authenticate(given)
        if session is not None:
            return Caller("session", session)
        if why.startswith("session "):  # a real key whose session is over: say how it ended, not "wrong key"
            raise ApiError(410, why, code="session_over")
        raise ApiError(401, why, "authentication_error", code="invalid_api_key")
    if gw.s.auth_token is None:
        return Caller("admin")
    raise ApiError(
        401,
        "send `Authorization: Bearer <session key, session-opening token or mesh token>`"
        if not given
        else "unknown key: not a session's key, the session-opening token or the mesh token",
        "authentication_error",
        code="invalid_api_key",
    )


Auth = Annotated[Caller, Depends(bearer)]


def leaving(e: Exception) -> ApiError:
    """The replica is leaving (core.Leaving): a 503 the client retries (through a router: on another replica)."""
    return ApiError(503, str(e), "server_error", code="replica_leaving", retry_after=1)


def mesh(caller: Auth) -> None:
    """The training side's routes: the mesh token only."""
    if caller.role != "admin":
        raise ApiError(401, "this route needs the mesh token", "authentication_error")


def opens(caller: Auth) -> None:
    """Opening a session: the mesh token or the session-opening token, not a session's key."""
    if caller.role == "session":
        raise ApiError(401, "a session key cannot open sessions: use the session-opening token", "authentication_error")


def calls(caller: Auth) -> Caller:
    """A model call: a session's key (captured) or the mesh token (not captured)."""
    if caller.role == "opener":
        raise ApiError(
            401,
            "the session-opening token cannot call the model: open a session (POST /v1/sessions) and call with its "
            "api_key",
            "authentication_error",
        )
    return caller


CallAuth = Annotated[Caller, Depends(calls)]
