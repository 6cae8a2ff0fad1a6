"""The environment servers of a run: the mesh's own environment service (built-ins, `[env] env_classes`, OpenEnv
servers) and servers of the user's own, named by URL in the preset (`[mesh] env_servers`), each speaking
`dapo-env/1` in whatever language it is written. Checked before anything starts:

    routes = check_env_servers(cfg)      # PresetError naming the server and what is wrong, in one line
    routes.urls                          # {"guess": "http://127.0.0.1:9000"}: the replicas' --env-routes
    routes.tokens                        # {"guess": "<its token>"}: the replicas' DAPO_ENV_ROUTE_TOKENS (secret)
    routes.own                           # the dataset's environments the mesh's own service runs (none: not started)

Each server must answer `GET /v1/envs` (with its token, read from the environment variable its `token_env`
names: a token is never written in a preset) with the protocol's EnvList; every `env:NAME` part of the dataset
must be served by exactly one of the servers or by the mesh's own service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from mesh.config import EnvServer, MeshConfig, PresetError
from services.datasets import env_names
from services.episodes import ENV_PROTOCOL, EnvList

TIMEOUT_S = 10.0


@dataclass
class EnvRoutes:
    urls: dict[str, str] = field(default_factory=dict)  # environment -> its server's URL
    tokens: dict[str, str] = field(default_factory=dict)  # environment -> its server's token (a secret)
    own: list[str] = field(default_factory=list)  # the dataset's environments the mesh's own service runs
    served: dict[str, list[str]] = field(default_factory=dict)  # server URL -> the environments it serves


def own_envs(cfg: MeshConfig) -> list[str]:
    """What the mesh's own environment service would serve: the built-ins, `[env] env_classes`, `[env] openenv`."""
    from env_server.app import load_envs

    try:
        return sorted(load_envs(cfg.env.env_classes, cfg.env.openenv))
    except SystemExit as e:  # a bad --env-classes / --openenv entry: the service would not start
        raise PresetError(f"[env]: {e}") from None


def server_envs(server: EnvServer) -> tuple[list[str], str | None]:
    """The environments one server serves, and its token; PresetError saying what is wrong, in one line."""
    token = None
    if server.token_env is not None:
        token = os.environ.get(server.token_env)
        if not token:
            raise PresetError(f"env server {server.url}: its token_env {server.token_env} is not set (export it)")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    where = f"env server {server.url}"
    try:
        r = httpx.get(f"{server.url.rstrip('/')}/v1/envs", headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as e:
        raise PresetError(f"{where}: not reachable ({type(e).__name__}: {e}); start it first") from None
    if r.status_code in (401, 403):
        given = f"the token in ${server.token_env}" if token else "a request without a token (set its token_env)"
        raise PresetError(f"{where}: refused {given} ({r.status_code})")
    if r.status_code != 200:
        raise PresetError(f"{where}: GET /v1/envs answered {r.status_code}: {r.text[:200]!r}")
    try:
        body = r.json()
    except ValueError:
        raise PresetError(f"{where}: GET /v1/envs is not JSON ({r.text[:120]!r}): is it a dapo-env/1 server?") from None
    protocol = body.get("protocol") if isinstance(body, dict) else None
    if protocol != ENV_PROTOCOL:
        raise PresetError(f"{where}: speaks {protocol!r}, the mesh speaks {ENV_PROTOCOL!r}")
    try:
        return [e.name for e in EnvList.model_validate(body).envs], token
    except ValidationError as e:
        raise PresetError(f"{where}: GET /v1/envs is not a dapo-env/1 EnvList: {str(e)[:300]}") from None


def check_env_servers(cfg: MeshConfig) -> EnvRoutes:
    """Every server reachable, speaking the protocol, with the token it is given; each environment of the dataset
    served by one of them or by the mesh's own service (module docstring)."""
    routes = EnvRoutes()
    for server in cfg.env_servers:
        names, token = server_envs(server)
        routes.served[server.url] = names
        for name in names:
            if name in routes.urls:
                raise PresetError(f"env:{name} is served by both {routes.urls[name]} and {server.url}: keep one")
            routes.urls[name] = server.url
            if token:
                routes.tokens[name] = token
    wanted = env_names(cfg.dataset)
    own = own_envs(cfg) if any(name not in routes.urls for name in wanted) else []
    for name in wanted:
        if name in routes.urls:
            continue
        if name not in own:
            theirs = "; ".join(f"{url}: {', '.join(n) or 'none'}" for url, n in routes.served.items())
            raise PresetError(
                f"dataset env:{name}: no environment server serves it (the mesh's own: {', '.join(own)}"
                + (f"; {theirs}" if theirs else "")
                + "); name your server in [mesh] env_servers, or load the class with [env] env_classes"
            )
        routes.own.append(name)
    routes.urls = {name: url for name, url in routes.urls.items() if name in wanted}  # only what the dataset uses
    routes.tokens = {name: t for name, t in routes.tokens.items() if name in routes.urls}
    return routes
