"""The environment service's HTTP app: the dapo-env/1 protocol (services/episodes.py) plus the ops endpoints.

app = build_app(EnvSettings())      # python -m env_server runs it under uvicorn

Status codes: 404 an unknown environment or episode (a reset's too, when its episode was closed while it ran); 409
a step out of order, on a finished episode, or a reset reusing an id for another task, a retried step that asks with
another message; 422 a body or task that does not validate; 429 (Retry-After) no room for another episode or no
worker free in time; 502 an upstream environment server (OpenEnv) unreachable; 504 a reset past the time limit. An
environment that fails or hangs in a step ends that episode with `error` set (200): the model is not to blame, the
episode is not to be trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, status
from prometheus_client import CollectorRegistry

from env_server import python_tool
from env_server.base import Environment
from env_server.builtins import BUILTIN
from env_server.builtins.compute import Compute
from env_server.metrics import EnvMetrics
from env_server.openenv import OpenEnv, Unreachable
from env_server.settings import EnvSettings
from env_server.table import Busy, Episode, EpisodeTable, Workers, release
from services.episodes import Closed, EnvList, ResetRequest, ResetResponse, StepRequest, StepResponse
from services.web import create_app, require_role

log = logging.getLogger(__name__)
RETRY_AFTER = {"Retry-After": "1"}
Runs = Annotated[None, Depends(require_role("env_token"))]  # the protocol's routes: the environment role's token


def load_envs(
    classes: Sequence[str], openenv: Sequence[str] = (), sandboxed: Sequence[type[Environment]] = ()
) -> dict[str, Environment]:
    """The built-ins (and those that need the sandbox, when there is one), every `module:Class` given and every
    OpenEnv server; a bad entry stops the service with a message."""
    found: list[type[Environment]] = [*BUILTIN, *sandboxed]
    for entry in classes:
        module, _, name = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise SystemExit(f"--env-classes {entry!r}: cannot load it ({e}); write module:Class") from None
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise SystemExit(f"--env-classes {entry!r} is not a subclass of env_server.base.Environment")
        found.append(cls)
    try:
        instances = [cls() for cls in found] + [OpenEnv.parse(entry) for entry in openenv]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    envs: dict[str, Environment] = {}
    for env in instances:
        if env.name in envs:
            raise SystemExit(f"two environments are named {env.name!r}")
        envs[env.name] = env
    return envs


def _open(env: Environment, req: ResetRequest, episode_id: str) -> tuple[ResetResponse, Any]:
    task = env.draw_for(req.seed, req.split) if req.seed is not None else env.check(req.task or {})
    messages, state = env.start(task)
    try:
        tools = [t.spec for t in env.tools()]
        opening = ResetResponse(
            episode_id=episode_id,
            env=env.name,
            task_id=env.task_id(task),
            messages=messages,
            tools=tools,
            max_turns=env.max_turns,
        )
    except BaseException:
        release(env, state)  # started, never to be stepped
        raise
    return opening, state


class Service:
    """What the routes do, on the table of episodes and the workers."""

    def __init__(self, settings: EnvSettings, envs: dict[str, Environment], metrics: EnvMetrics):
        self.settings, self.envs, self.metrics = settings, envs, metrics
        self.table = EpisodeTable(settings, metrics)
        self.workers: Workers | None = None  # made in the event loop (lifespan)

    def _env(self, name: str) -> Environment:
        env = self.envs.get(name)
        if env is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no environment {name!r}; there are: {sorted(self.envs)}")
        return env

    def _episode(self, episode_id: str) -> Episode:
        ep = self.table.get(episode_id)
        if ep is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND,
                f"no episode {episode_id!r}: never opened here, closed, or idle past {self.settings.episode_ttl_s:g} s",
            )
        return ep

    async def reset(self, req: ResetRequest) -> ResetResponse:
        env = self._env(req.env)
        if req.episode_id and (ep := self.table.get(req.episode_id)) is not None:
            if ep.key != req.key():
                raise HTTPException(status.HTTP_409_CONFLICT, f"episode {req.episode_id!r} exists for another task")
            return ep.opening  # a retried reset
        if self.table.full():
            full = f"{self.settings.max_open_episodes} episodes are open here"
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, full, headers=RETRY_AFTER)
        episode_id = req.episode_id or uuid.uuid4().hex
        assert self.workers is not None
        self.table.begin_opening(episode_id)
        try:
            opening, state = await self.workers.call(
                env.name, "reset", _open, env, req, episode_id, abandoned=lambda r: release(env, r[1])
            )
        except Busy as e:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(e), headers=RETRY_AFTER) from None
        except Unreachable as e:  # an upstream environment server (OpenEnv) down: the client may retry
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, str(e)[:2000]) from None
        except (ValueError, TypeError, KeyError) as e:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"task: {e}"[:2000]) from None
        except NotImplementedError:
            how = "draws no task from a seed: give a task" if req.seed is not None else "takes no explicit task"
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"{env.name} {how}") from None
        except TimeoutError:  # before Exception, which it is: a slow reset is not a bug in the environment
            late = f"{env.name} took over {self.settings.step_timeout_s:g} s to reset"
            raise HTTPException(status.HTTP_504_GATEWAY_TIMEOUT, late) from None
        except Exception as e:  # the environment's bug: said, logged, and not worth a retry (500)
            log.exception("%s failed to reset", env.name)
            raise HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, f"{env.name} failed to reset: {e}") from None
        finally:
            closed = self.table.end_opening(env, episode_id)
        if closed:  # while it was being opened: its client gave up on this answer
            release(env, state)
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"episode {episode_id!r} was closed while it was opening")
        if req.episode_id and (ep := self.table.get(req.episode_id)) is not None:  # the same reset, concurrently
            release(env, state)  # this one's state is not kept
            return ep.opening if ep.key == req.key() else await self.reset(req)
        self.table.add(Episode(episode_id, env, req.key(), opening, state))
        return opening

    async def step(self, episode_id: str, req: StepRequest) -> StepResponse:
        ep = self._episode(episode_id)
        async with ep.lock:
            if ep.last is not None and req.turn == ep.turn:
                if req.message.content != ep.last_message:
                    raise HTTPException(status.HTTP_409_CONFLICT, f"turn {req.turn} was answered for another message")
                return ep.last  # a retried step
            if ep.done:
                raise HTTPException(status.HTTP_409_CONFLICT, f"episode {episode_id!r} is done (turn {ep.turn})")
            if req.turn != ep.turn + 1:
                raise HTTPException(status.HTTP_409_CONFLICT, f"turn {req.turn}: the next turn is {ep.turn + 1}")
            out = await self._run_step(ep, req)
            ep.turn, ep.last, ep.last_message = req.turn, out, req.message.content
            self._count(ep, out)
            return out

    async def _run_step(self, ep: Episode, req: StepRequest) -> StepResponse:
        assert self.workers is not None
        try:
            return await self.workers.call(ep.env.name, "step", ep.env.step, ep.state, req.message, req.turn)
        except Busy as e:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(e), headers=RETRY_AFTER) from None
        except TimeoutError:
            return StepResponse(done=True, error=f"the environment took over {self.settings.step_timeout_s:g} s")
        except Exception as e:  # the environment's bug: this episode ends, the service goes on
            log.exception("%s failed in a step of episode %s", ep.env.name, ep.id)
            return StepResponse(done=True, error=f"the environment failed: {type(e).__name__}: {str(e)[:500]}")

    def _count(self, ep: Episode, out: StepResponse) -> None:
        for outcome, n in out.tools.model_dump().items():
            if n:
                self.metrics.tool_calls.labels(ep.env.name, outcome).inc(n)
        if out.done:
            self.table.end(ep)

    def close(self, episode_id: str) -> Closed:
        if not self.table.close(episode_id):
            self._episode(episode_id)  # raises the 404
        return Closed(episode_id=episode_id)

    def ready(self) -> tuple[bool, str]:
        w = self.workers
        if w is None:
            return False, "starting"
        detail = f"{len(self.table.episodes)} episodes open, {w.held}/{w.n} workers busy ({w.stuck} stuck)"
        return w.stuck < w.n, detail


def build_app(settings: EnvSettings) -> FastAPI:
    registry = CollectorRegistry()
    metrics = EnvMetrics(registry)
    sandboxed = (Compute,) if python_tool.configure(settings) else ()  # the python tool's environments
    svc = Service(settings, load_envs(settings.env_classes, settings.openenv, sandboxed), metrics)
    env_list = EnvList(envs=[env.spec() for env in svc.envs.values()])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        svc.workers = Workers(settings.workers, settings.queue_timeout_s, settings.step_timeout_s, metrics)
        sweeper = asyncio.create_task(svc.table.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            svc.workers.close()

    app = create_app("env", settings, registry, ready=svc.ready, lifespan=lifespan)
    app.state.service = svc

    @app.middleware("http")
    async def count(request: Any, call_next: Any) -> Any:
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(getattr(route, "path", "other"), str(response.status_code)).inc()
        return response

    @app.get("/v1/envs", response_model=EnvList, tags=["env"])
    def envs(_: Runs) -> EnvList:
        """The environments served here, their tools and turn limits."""
        return env_list

    @app.post(
        "/v1/episodes",
        response_model=ResetResponse,
        tags=["env"],
        responses={404: {}, 409: {}, 429: {}, 502: {}, 504: {}},
    )
    async def reset(req: ResetRequest, _: Runs) -> ResetResponse:
        """Open an episode of `env` on a task (or one drawn from `seed`); answers its opening messages."""
        return await svc.reset(req)

    @app.post(
        "/v1/episodes/{episode_id}/step",
        response_model=StepResponse,
        tags=["env"],
        responses={404: {}, 409: {}, 429: {}},
    )
    async def step(episode_id: str, req: StepRequest, _: Runs) -> StepResponse:
        """The model's turn `turn`: tool results or feedback back, a reward when there is one, done or not."""
        return await svc.step(episode_id, req)

    @app.delete("/v1/episodes/{episode_id}", response_model=Closed, tags=["env"], responses={404: {}})
    async def close(episode_id: str, _: Runs) -> Closed:  # on the event loop, as every change of the table
        """Forget an episode (done or not)."""
        return svc.close(episode_id)

    return app
