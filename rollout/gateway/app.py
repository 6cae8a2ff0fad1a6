"""The gateway's HTTP API: OpenAI's (models, chat completions, completions; streamed or not) and the sessions'.

    POST /v1/sessions                 mesh or session-opening token -> a session: its key, the task to do
    GET  /v1/models                   any credential
    POST /v1/chat/completions         a session's key (captured) or the mesh token (not)           calls.py
    POST /v1/completions              a session's key or the mesh token                            calls.py
    GET  /v1/sessions/{id}            its key or the mesh token  -> its state (and how it ended), calls, segments
    POST /v1/sessions/{id}/end        its key or the mesh token  -> ended with a reward, or scored

Errors are OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 a bad request (what is wrong, and
where); 401 a wrong key or a credential the route does not take; 403 a reward the client may not give (the trust
model: docs/operations/security.md); 404 an unknown model or session; 409 a second call (or an end) of a session
while one is in flight; 410 a session that is over (the message says how it ended); 429 with Retry-After when no
task is handed out in time or a bound is reached; 502 when the environment failed to score the answer (the session
is failed: not trained on); 503 with Retry-After when the environment or the reward server is down (nothing is
lost: retry) or the replica is leaving.
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
from rollout.env_calls import EnvFailure, classify, judge, result
from rollout.env_client import Opening
from rollout.gateway import calls
from rollout.gateway.auth import ApiError, Auth, Caller, leaving, mesh, opens
from rollout.gateway.core import Busy, Conflict, Gateway, Leaving, Seat, Waiter
from rollout.gateway.schemas import EndSession, OpenSession
from rollout.gateway.sessions import Session
from rollout.reward_client import RewardClient, RewardRejected, RewardUnavailable, score_items
from rollout.settings import RolloutSettings
from services.schemas import CLIENT_SCORED, PromptTask, Score
from services.web import BodySizeLimit

router = APIRouter()


def create_gateway_app(gw: Gateway, reward: RewardClient) -> FastAPI:
    app = FastAPI(
        title="dapo-mesh gateway (OpenAI-compatible)",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        exception_handlers={
            ApiError: _api_error,
            RequestValidationError: _invalid,
            StarletteHTTPException: _http_error,
        },
    )
    app.add_middleware(BodySizeLimit, max_bytes=gw.s.max_body_bytes)
    app.state.gw, app.state.reward = gw, reward
    app.include_router(router)
    app.include_router(calls.router)
    return app


async def _api_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, ApiError)
    _count(request, e.status)
    return e.response()


async def _invalid(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    _count(request, 400)
    return ApiError(400, f"{where or 'body'}: {first.get('msg')}", param=where).response()


async def _http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
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


@router.post("/v1/sessions", status_code=201, dependencies=[Depends(opens)])
async def open_session(request: Request, body: OpenSession | None = None) -> dict[str, Any]:
    """A session for the next task the mesh hands out (or the client's own): its key and its task (an
    environment's task: as its environment opens it, with its tools)."""
    gw: Gateway = request.app.state.gw
    waiter = Waiter()
    try:
        with gw.lock:
            seat = gw.seat(waiter, body.task if body else None)
    except Busy as e:
        raise ApiError(429, str(e), "rate_limit_error", code=e.code, retry_after=1) from e
    except Conflict as e:
        raise ApiError(409, str(e)) from e
    except Leaving as e:
        raise leaving(e) from e
    except ValueError as e:
        raise ApiError(400, str(e), param="task") from e
    if seat is None:
        seat = await wait_for_seat(gw, waiter)
    if seat.env is not None:
        await open_env(gw, seat)
    return session_info(gw.s, seat)


async def wait_for_seat(gw: Gateway, waiter: Waiter) -> Seat:
    """The seat the loop hands this waiter; a 429 when none comes in time. A client gone meanwhile leaves no
    session behind (a seat it was given goes back)."""
    try:
        got = await asyncio.wait_for(asyncio.shield(waiter.future), gw.s.gateway_open_wait_s)
    except TimeoutError:
        with gw.lock:
            got = gw.withdraw(waiter)
        if got is None:
            gw.m.rejected.labels("no_task").inc()
            raise ApiError(
                429,
                "no task is handed out now (the buffer holds back: staleness bound or capacity); retry",
                "rate_limit_error",
                code="no_task",
                retry_after=1,
            ) from None
    except asyncio.CancelledError:
        with gw.lock:
            if (seat := gw.withdraw(waiter)) is not None:
                gw.abandon(seat.session, "its client went away before it was opened")
        raise
    if isinstance(got, Leaving):
        raise leaving(got)
    assert isinstance(got, Seat)
    return got


async def open_env(gw: Gateway, seat: Seat) -> None:
    """An environment's task: the session's own episode, reset from the task's seed through the replica's
    environment calls (rollout/env_calls.py: one rule for what a failure means); its opening and tools."""
    assert seat.env is not None
    session = seat.session
    if gw.env is None:
        with gw.lock:
            gw.env_failed(session, EnvFailure("failed", "this replica has no environment service"), "at its opening")
        raise ApiError(503, "this replica has no environment service (--env-url)", "server_error", retry_after=5)
    name, body = seat.env
    env = gw.env
    try:
        fut = env.reset(name, body, seat.episode_id)
    except RuntimeError:  # the environment calls are shut down: the replica is leaving
        with gw.lock:
            gw.abandon(session, "its replica is leaving")
        raise leaving(Leaving("this replica is leaving the mesh; open a new session")) from None
    try:
        opening: Opening = await asyncio.shield(asyncio.wrap_future(fut))
    except asyncio.CancelledError:
        if fut.cancelled():  # cancelled by the replica leaving (its pool shut down), not by the client
            with gw.lock:
                gw.abandon(session, "its replica is leaving")
            raise leaving(Leaving("this replica is leaving the mesh; open a new session")) from None
        with gw.lock:  # the client went away: the reset's episode is closed when it answers
            gw.abandon(session, "its client went away while its environment opened")
        fut.add_done_callback(lambda f: env.close(o.base, seat.episode_id) if (o := result(f)) else None)
        raise
    except Exception as e:  # no answer, a refusal, an answer out of protocol
        failure = classify(e)
        with gw.lock:
            gw.env_failed(session, failure, "at its opening")
        retry = "retry" if failure.kind == "outage" else "retry for another session"
        raise ApiError(503, f"{failure.why}; {retry}", "server_error", retry_after=2) from None
    with gw.lock:
        ok = gw.opened(seat, opening.base, opening.response.tools)
    if not ok:  # over meanwhile (the replica left)
        env.close(opening.base, seat.episode_id)
        raise ApiError(503, f"session {session.sid} is over: {session.why}", "server_error", retry_after=1)
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
            "task_id": t.prompt_id if t.data_source == "gateway" else t.task_id,
            "prompt_id": t.prompt_id,
            "data_source": t.data_source,
            "group_size": t.n_samples,
            "messages": seat.messages,
            "tools": seat.tools,
            "client_scored": t.data_source == "gateway" or t.verifier == CLIENT_SCORED,
        },
    }


def owned(gw: Gateway, sid: str, caller: Caller) -> Session:
    """The session `sid`, for its own key or the mesh token."""
    if caller.role == "opener":
        raise ApiError(401, "the session-opening token cannot read or end sessions: use the session's key")
    with gw.lock:
        session = gw.sessions.get(sid) or gw.retired.get(sid)  # a session over is still read (how it ended)
    if session is None or (caller.session is not None and caller.session is not session):
        raise ApiError(404, f"no session {sid!r} (or not this key's)", code="session_not_found")
    return session


@router.get("/v1/sessions/{sid}")
def session_state(request: Request, sid: str, caller: Auth) -> dict[str, Any]:
    """The session: its state (and how it ended), calls, and its segments (a rewritten history starts a new one,
    and says why)."""
    gw: Gateway = request.app.state.gw
    sess = owned(gw, sid, caller)
    with gw.lock:
        segs = sess.segment_rows()
        return {
            "session_id": sid,
            "task_id": sess.task_id.removeprefix("own:"),
            "state": sess.state,
            "why": sess.why or None,
            "calls": sess.calls,
            "segments": segs,
            "reward": sess.reward,
        }


@router.post("/v1/sessions/{sid}/end")
async def end_session(request: Request, sid: str, body: EndSession, caller: Auth) -> dict[str, Any]:
    """Ended with the client's reward (its own task, or a client-scored one), or scored: by the environment for an
    environment's task, by the reward server against the task's ground truth for the others."""
    gw: Gateway = request.app.state.gw
    sess = owned(gw, sid, caller)
    if body.reward is not None:
        with gw.lock:
            if why := gw.may_set_reward(sess):
                raise ApiError(403, why, "permission_error", code="reward_not_allowed", param="reward")
            score = Score(reward=body.reward, acc=body.reward > 0)
            calls.refusals(lambda: gw.end(sess, body.choice, score))
    else:
        score = await scored(request, gw, sess, body.choice)
    gw.wake.set()
    return {"session_id": sid, "state": "ended", "reward": score.reward, "acc": score.acc}


async def scored(request: Request, gw: Gateway, sess: Session, choice: int) -> Score:
    """The session ended with its scorer's verdict on its last answer (`choice` of its last call)."""
    with gw.lock:
        task = gw.group_task(sess)
        if task is not None and task.verifier == CLIENT_SCORED:
            raise ApiError(400, f'task {task.task_id} is client-scored: end the session with {{"reward": r}}')
        answer = calls.refusals(lambda: sess.begin_scoring(choice))
    try:
        if sess.env is not None:
            score = await env_score(gw, sess, answer)
        else:
            assert task is not None
            score = await reward_score(request, task, answer)
    except EnvFailure as e:
        with gw.lock:
            if e.kind == "outage":
                sess.scoring_failed(time.monotonic())
            else:
                gw.env_failed(sess, e, "scoring its last answer")
        if e.kind == "outage":
            raise ApiError(503, f"{e.why}; end the session again", "server_error", retry_after=5) from None
        raise ApiError(502, f"{e.why}; the session is failed, not trained on", "server_error") from None
    except BaseException:  # the reward server down (503), refusing (400), the client gone: it may end it again
        with gw.lock:
            sess.scoring_failed(time.monotonic())
        raise
    with gw.lock:
        calls.refusals(lambda: gw.end(sess, choice, score, scored=True))
    return score


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
    """The environment's reward for the last answer, as its final turn (-1 if it does not end the episode);
    EnvFailure as rollout/env_calls.py classifies it."""
    assert sess.env is not None and gw.env is not None
    base, episode = sess.env
    try:
        out = await asyncio.shield(asyncio.wrap_future(gw.env.step(base, episode, 1, answer.text)))
    except Exception as e:
        raise classify(e) from None
    verdict = judge(out)
    reward = verdict.reward if verdict is not None else -1.0
    return Score(reward=reward, acc=reward > 0)
