"""Security properties checked on the code itself: every HTTP route but /healthz demands the bearer token or its
role's (reward server, environment service, and the shared app every other service is), and nothing a network peer
can reach unpickles (no pickle/marshal/dill, torch.load only with weights_only=True)."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry

from env_server.app import build_app as build_env_app
from env_server.settings import EnvSettings
from reward_server.app import build_app
from reward_server.settings import RewardSettings
from services.settings import ServiceSettings
from services.web import create_app, require_role, require_token

ROOT = Path(__file__).resolve().parents[2]
OPEN = {"/healthz"}


def guarded(route: APIRoute) -> bool:
    def walk(dep) -> bool:  # type: ignore[no-untyped-def]
        role = isinstance(dep.call, require_role)  # a role's token, or the auth token while it has none
        return dep.call is require_token or role or any(walk(d) for d in dep.dependencies)

    return walk(route.dependant)


def routes(app) -> list[APIRoute]:  # type: ignore[no-untyped-def]
    return [r for r in app.routes if isinstance(r, APIRoute)]


def test_every_route_but_healthz_wants_the_token() -> None:
    shared = create_app("x", ServiceSettings(auth_token="t"), CollectorRegistry())
    reward = build_app(RewardSettings(auth_token="t", workers=1))
    env = build_env_app(EnvSettings(auth_token="t"))
    with_docs = create_app("x", ServiceSettings(auth_token="t", api_docs=True), CollectorRegistry())
    assert {"/openapi.json", "/docs", "/redoc"} <= {r.path for r in routes(with_docs)}
    assert not {"/openapi.json", "/docs", "/redoc"} & {r.path for r in shared.routes}  # off by default
    for app in (shared, reward, env, with_docs):
        found = {r.path: guarded(r) for r in routes(app)}
        assert found["/healthz"] is False
        unguarded = sorted(p for p, g in found.items() if not g and p not in OPEN)
        assert not unguarded, f"routes without the bearer token: {unguarded}"
    assert "/v1/score" in {r.path for r in routes(reward)} and "/config" in {r.path for r in routes(shared)}


def test_nothing_unpickles() -> None:
    banned = re.compile(r"\bimport (pickle|cPickle|dill|cloudpickle|marshal)\b|\bfrom (pickle|dill|cloudpickle)\b"
                        r"|\bpickle\.loads?\(|\bmarshal\.loads?\(")  # fmt: skip
    torch_load = re.compile(r"torch\.load\((?![^)]*weights_only=True)")
    offenders = []
    for folder in ("services", "learner", "rollout", "reward_server", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if banned.search(text) or torch_load.search(text):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    assert banned.search("import pickle") and torch_load.search("torch.load(f)")  # the scan can find them
