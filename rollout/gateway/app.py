"""The gateway's HTTP API: OpenAI's (models, chat completions, completions; streamed or not) and the sessions'.

    POST /v1/sessions                 mesh token   -> a session: its API key, the task to do (or OpenSession.task)
    GET  /v1/models                   key or token
    POST /v1/chat/completions         key or token (a session key: captured; the mesh token: not)  calls.py
    POST /v1/completions              key or token                                                 calls.py
    GET  /v1/sessions/{id}            its key or the token  -> its state, calls, segments
    POST /v1/sessions/{id}/end        its key or the token  -> ended with a reward, or scored by the reward server

Errors are OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 for a bad request (what is
wrong, and where), 401 for a wrong or expired key, 404 for an unknown model or session, 409 for a second call of a
session while one is in flight, 429 with Retry-After when no task is handed out in time or a bound is reached,
503 with Retry-After when the reward server is down at a session's end (nothing is lost: end it again).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.engines.base import Completion
from rollout.env_client import EnvRejected, EnvUnavailable
from rollout.gateway import calls
from rollout.gateway.auth import ApiError, Auth, Caller, mesh
from rollout.gateway.core import Busy, Conflict, Gateway, Seat, Waiter
from rollout.gateway.schemas import EndSession, OpenSession
from rollout.gateway.sessions import CallRefused, Session
from rollout.reward_client import RewardClient, RewardRejected, RewardUnavailable, score_items
from rollout.settings import RolloutSettings
from services.schemas import PromptTask, Score
from services.web import BodySizeLimit

router = APIRouter()


def create_gateway_app(gw: Gateway, reward: RewardClient) -> FastAPI:
    app = FastAPI(title="dapo-mesh gateway (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=gw.s.max_body_bytes)
    app.state.gw, app.state.reward = gw, reward
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.include_router(router)
    app.include_router(calls.router)
    return app


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    _count(request, e.status)
    return e.response()


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    _count(request, 400)
    return ApiError(400, f"{where or 'body'}: {first.get('msg')}", param=where).response()


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    _count(request, e.status_code)
    return ApiError(e.status_code, str(e.detail)).response()


def _count(request: Request, status: int) -> None:
    path = request.url.path
    route = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(
        path, "sessions" if path.startswith("/v1/sessions") else "other"
    )
    request.app.state.gw.m.calls.labels(route, str(status)).inc()


@router.get("/healthz", include_in_schema=False)
def healthz() -> dict[str, str]:
    return {"status": "ok", "service": "gateway"}


@router.get("/openapi.json", include_in_schema=False, dependencies=[Depends(mesh)])
def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


def model_card(s: RolloutSettings) -> dict[str, Any]:
    return {"id": s.gateway_model, "object": "model", "created": 0, "owned_by": "dapo-mesh"}


@router.get("/v1/models")
def models(request: Request, _: Auth) -> dict[str, Any]:
    """The model served: the policy being trained."""
    return {"object": "list", "data": [model_card(request.app.state.gw.s)]}


@router.get("/v1/models/{model}")
def model(request: Request, model: str, _: Auth) -> dict[str, Any]:
    s: RolloutSettings = request.app.state.gw.s
    if model != s.gateway_model:
        raise ApiError(
            404, f"the model {model!r} does not exist; this gateway serves {s.gateway_model!r}", code="model_not_found"
        )
    return model_card(s)


@router.post("/v1/sessions", status_code=201, dependencies=[Depends(mesh)])
async def open_session(request: Request, body: OpenSession | None = None) -> dict[str, Any]:
    """A session for the next task the mesh hands out (or the client's own): its key and its task (an
    environment's task: as its environment opens it, with its tools)."""
    gw: Gateway = request.app.state.gw
    waiter = Waiter()
    try:
        with gw.lock:
            seat = gw.seat(waiter, body.task if body else None)
    except Busy as e:
        raise ApiError(429, str(e), "rate_limit_error", retry_after=1) from e
    except Conflict as e:
        raise ApiError(409, str(e)) from e
    except ValueError as e:
        raise ApiError(400, str(e), param="task") from e
    if seat is None:
        try:
            seat = await asyncio.wait_for(asyncio.shield(waiter.future), gw.s.gateway_open_wait_s)
        except TimeoutError:
            with gw.lock:
                seat = gw.withdraw(waiter)
            if seat is None:
                gw.m.rejected.labels("no_task").inc()
                raise ApiError(
                    429,
                    "no task is handed out now (the buffer holds back: staleness bound or capacity); retry",
                    "rate_limit_error",
                    retry_after=1,
                ) from None
    assert seat is not None
    if seat.env is not None:
        await open_env(gw, seat)
    return session_info(gw.s, seat)


async def open_env(gw: Gateway, seat: Seat) -> None:
    """An environment's task: the session's own episode, reset from the task's seed; its opening and tools."""
    assert seat.env is not None
    name, body = seat.env
    episode = f"gw-{seat.session.sid}"
    seat.session.busy = True  # not expired while its environment opens
    try:
        if gw.envs is None:
            raise EnvRejected(400, "this replica has no environment service (--env-url)")
        opening = await run_in_threadpool(gw.envs.reset, name, body, episode)
    except EnvUnavailable as e:
        with gw.lock:
            gw.unseat(seat.session)
        raise ApiError(503, f"{e}; retry", "server_error", retry_after=2) from e
    except EnvRejected as e:
        with gw.lock:
            gw.refuse_task(seat.session.task_id, "env_rejected", str(e)[:500])
        raise ApiError(503, f"{e}; the task is dead-lettered, retry for another", "server_error", retry_after=1) from e
    with gw.lock:
        seat.session.env = (opening.base, episode)
        seat.session.failed(time.monotonic())  # not busy any more, and its idle time starts now
    seat.messages = [m.model_dump(exclude_none=True) for m in opening.response.messages]
    seat.tools = [t.model_dump() for t in opening.response.tools]


def session_info(s: RolloutSettings, seat: Seat) -> dict[str, Any]:
    t = seat.task
    return {
        "session_id": seat.session.sid,
        "api_key": seat.key,
        "model": s.gateway_model,
        "idle_expiry_s": s.gateway_idle_s,
        "max_calls": s.gateway_max_calls,
        "task": {
            "task_id": t.task_id,
            "prompt_id": t.prompt_id,
            "data_source": t.data_source,
            "group_size": t.n_samples,
            "messages": seat.messages,
            "tools": seat.tools,
        },
    }


def owned(gw: Gateway, sid: str, caller: Caller) -> Session:
    with gw.lock:
        session = gw.sessions.get(sid)
    if session is None or (caller.session is not None and caller.session is not session):
        raise ApiError(404, f"no session {sid!r} (or not this key's)", code="session_not_found")
    return session


@router.get("/v1/sessions/{sid}")
def session_state(request: Request, sid: str, caller: Auth) -> dict[str, Any]:
    """The session: its state, calls, and its segments (a rewritten history starts a new one, and says why)."""
    gw: Gateway = request.app.state.gw
    sess = owned(gw, sid, caller)
    with gw.lock:
        segs = [
            {"reason": g.reason, "prompt_tokens": len(g.episode.opening), "tokens": len(g.episode.ids)}
            for g in sess.segments
        ]
        return {
            "session_id": sid,
            "task_id": sess.task_id,
            "state": sess.state,
            "calls": sess.calls,
            "segments": segs,
            "reward": sess.reward,
        }


@router.post("/v1/sessions/{sid}/end")
async def end_session(request: Request, sid: str, body: EndSession, caller: Auth) -> dict[str, Any]:
    """Ended with the client's reward, or scored: by the environment for an environment's task, by the reward
    server against the task's ground truth for the others."""
    gw: Gateway = request.app.state.gw
    sess = owned(gw, sid, caller)
    if body.score:
        with gw.lock:
            try:
                answer = sess.last_answer(body.choice)
                task = gw.group_task(sess)
                if sess.state != "open" or task is None:
                    raise CallRefused(f"session {sid} is {sess.state}")
                if sess.busy:
                    raise CallRefused("a call of this session is in flight: end it once answered", conflict=True)
            except CallRefused as e:
                raise ApiError(409 if e.conflict else 400, str(e)) from e
            sess.busy = True  # scoring: no call, no expiry, no second end meanwhile
        try:
            score = await (env_score(gw, sess, answer) if sess.env else reward_score(request, task, answer))
        finally:
            with gw.lock:
                sess.busy = False
    else:
        assert body.reward is not None
        score = Score(reward=body.reward, acc=body.reward > 0)
    with gw.lock:
        try:
            gw.end(sess, body.choice, score)
        except CallRefused as e:
            raise ApiError(409 if e.conflict else 400, str(e)) from e
    gw.wake.set()
    return {"session_id": sid, "state": "ended", "reward": score.reward, "acc": score.acc}


async def reward_score(request: Request, task: PromptTask, answer: Completion) -> Score:
    gw: Gateway = request.app.state.gw
    try:
        items = score_items([task], [[answer]], gw.s.max_response_tokens)
        r = (await run_in_threadpool(request.app.state.reward.score, items))[0]
    except RewardUnavailable as e:
        raise ApiError(503, f"{e}; end the session again", "server_error", retry_after=5) from e
    except RewardRejected as e:
        raise ApiError(400, str(e)) from e
    return Score(reward=r.score, acc=r.acc, overlong_penalty=r.overlong_penalty, pred=r.pred)


async def env_score(gw: Gateway, sess: Session, answer: Completion) -> Score:
    """The environment's reward for the last answer, as its final turn (-1 if it does not end the episode)."""
    assert sess.env is not None and gw.envs is not None
    base, episode = sess.env
    try:
        out = await run_in_threadpool(gw.envs.step, base, episode, 1, answer.text)
    except EnvUnavailable as e:
        raise ApiError(503, f"{e}; end the session again", "server_error", retry_after=5) from e
    except EnvRejected as e:
        raise ApiError(400, f"the environment refused the answer: {e}") from e
    await run_in_threadpool(gw.envs.close, base, episode)
    reward = float(out.reward) if out.done and out.reward is not None else -1.0
    return Score(reward=reward, acc=reward > 0)
