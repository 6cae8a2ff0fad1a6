"""Client of an environment service (the dapo-env/1 protocol, services/episodes.py), as the replica uses it.

    envs = EnvClient("http://env-server:8005", token=..., timeout_s=60, retries=4,
                     routes={"guess": ("http://my-env:9000", token)})     # environments served elsewhere
    opening = envs.reset("calculator", {"seed": 17}, episode_id="t-9.ab12.3.0")  # its instance: opening.base
    out = envs.step(opening.base, "t-9.ab12.3.0", turn=1, content=text)
    envs.close(opening.base, "t-9.ab12.3.0")

Every call has a timeout and bounded retries with backoff on a transport error, a 429 and a 502/503 (a 500 is
the environment's own failure, a 504 a reset slower than the service allows: not retried, the episode is begun
again, and counts against the prompt's retries — a reset that always hangs must not hold its prompt, and the
service's workers, for ever as an outage would); resets and steps are safe to retry (the protocol answers a
repeated one the same). An episode lives in one instance: its steps go to the address its reset went to. When the
service's host name resolves to several addresses (a headless Service, compose replicas), each reset goes to the
next one, so the episodes spread and an episode begun again after its instance died goes elsewhere. A reset given
up without an answer is closed where it went (it may have opened the episode there). `EnvUnavailable`: no answer
after the retries; `EnvRejected`: a 4xx, a 500 or a 504 (a task the environment refuses, an episode the instance
no longer has, an environment that failed or is too slow); `EnvInvalid` (an EnvRejected): a 200 whose body is not
the route's answer (not JSON, a wrong shape). rollout/env_calls.py says what each means for an episode.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from services.episodes import ResetResponse, StepResponse
from services.settings import role_token

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class EnvUnavailable(RuntimeError):
    """The environment service did not answer after the retries."""


class EnvRejected(RuntimeError):
    def __init__(self, status: int, detail: str):
        super().__init__(f"environment service refused the request ({status}): {detail}")
        self.status = status


class EnvInvalid(EnvRejected):
    """An answer that is not the protocol's (not JSON, or not the shape of its route): a proxy's page, a server's
    bug. The environment's failure, as a 500 is."""

    def __init__(self, url: str, what: str, detail: str):
        RuntimeError.__init__(
            self, f"environment service at {url} answered with something that is not {what}: {detail}"
        )
        self.status = 200


_RETRIED = (429, 502, 503)  # no room, an upstream (OpenEnv) or the service not there: an outage


def _retryable(e: BaseException) -> bool:
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code in _RETRIED


@dataclass(frozen=True)
class Opening:
    base: str  # the instance that holds the episode
    response: ResetResponse


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class EnvClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 4,
        routes: dict[str, tuple[str, str | None]] | None = None,
    ):
        """`routes`: environments served by another dapo-env/1 server than `url`'s: name -> (its URL, its token)."""
        self.url = url.rstrip("/")
        self.token = token
        self.routes = {name: (u.rstrip("/"), t) for name, (u, t) in (routes or {}).items()}
        self.http = httpx.Client(timeout=timeout_s)
        self.retries = retries
        self._lock = threading.Lock()
        self._next = itertools.count()
        self._headers: dict[str, dict[str, str]] = {}  # instance base URL -> its server's token header
        self.closing = threading.Event()  # set: retries stop waiting (the replica is leaving)

    def _sleep(self, seconds: float) -> None:
        if self.closing.wait(seconds):
            raise EnvUnavailable("leaving")

    def instances(self, url: str | None = None) -> list[str]:
        """The base URL of each instance behind a server's name (just the URL when it names one address)."""
        url = url or self.url
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        try:
            found = sorted({str(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        except OSError:
            return [url]
        if len(found) <= 1 or parts.scheme == "https":  # TLS wants the name: leave balancing to the service
            return [url]
        hosts = [f"[{a}]" if ":" in a else a for a in found]
        return [urlunsplit(parts._replace(netloc=f"{h}:{port}")) for h in hosts]

    def server(self, env: str) -> tuple[str, str | None]:
        """(URL, token) of the server of environment `env`: its route, else the environment service."""
        return self.routes.get(env, (self.url, self.token))

    def _pick(self, env: str) -> str:
        url, token = self.server(env)
        found = self.instances(url)
        with self._lock:
            base = found[next(self._next) % len(found)]
            self._headers[base] = _auth(token)
        return base

    def headers(self, base: str) -> dict[str, str]:
        """The token header of the server an instance belongs to."""
        return self._headers.get(base, _auth(self.token))

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None, *, base: str = "") -> Any:
        @retry(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(multiplier=0.5, max=10),
            sleep=self._sleep,
            reraise=True,
        )
        def once() -> Any:
            r = self.http.request(method, url, json=body, headers=self.headers(base))
            if r.status_code in _RETRIED:
                r.raise_for_status()
            return r

        try:
            r = once()
        except (httpx.TransportError, httpx.HTTPStatusError) as e:
            raise EnvUnavailable(f"environment service at {url}: no answer after {self.retries + 1} tries: {e}") from e
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except (ValueError, AttributeError):
                detail = r.text
            raise EnvRejected(r.status_code, str(detail)[:1000])
        try:
            return r.json()
        except ValueError:
            raise EnvInvalid(
                url, "JSON", f"{r.headers.get('content-type', 'no content type')}: {r.text[:200]!r}"
            ) from None

    def _parse(self, model: type[M], url: str, body: Any) -> M:
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise EnvInvalid(url, f"a dapo-env/1 {model.__name__}", str(e)[:800]) from None

    def reset(self, env: str, task: dict[str, Any], episode_id: str) -> Opening:
        """`task`: {"seed": n} or {"task": {...}}. A retry after a transport error goes to the same instance (the
        reset may have happened there); a new episode goes to the next instance."""
        base = self._pick(env)
        body = {"env": env, "episode_id": episode_id, **task}
        url = f"{base}/v1/episodes"
        try:
            return Opening(base, self._parse(ResetResponse, url, self._call("POST", url, body, base=base)))
        except Exception:  # no answer, one that does not read, or a refusal after a try whose answer was lost: the
            self.close(base, episode_id)  # instance may hold the episode, so close it (not left to its idle TTL)
            raise

    def step(self, base: str, episode_id: str, turn: int, content: str) -> StepResponse:
        body = {"turn": turn, "message": {"role": "assistant", "content": content}}
        url = f"{base}/v1/episodes/{episode_id}/step"
        return self._parse(StepResponse, url, self._call("POST", url, body, base=base))

    @classmethod
    def of(cls, s: Any) -> EnvClient:
        """The client a replica's settings describe (env_url and env_token, env_routes and env_route_tokens,
        env_timeout_s, env_retries)."""
        secret = role_token(s, "env_token")
        token = secret.get_secret_value() if secret else None
        tokens = getattr(s, "env_route_tokens", {})
        routes = {
            name: (url, tokens[name].get_secret_value() if name in tokens else None)
            for name, url in getattr(s, "env_routes", {}).items()
        }
        return cls(s.env_url, token=token, timeout_s=s.env_timeout_s, retries=s.env_retries, routes=routes)

    def close(self, base: str, episode_id: str) -> None:
        """Best effort: an episode not closed expires on the service."""
        try:
            self.http.delete(f"{base}/v1/episodes/{episode_id}", timeout=5, headers=self.headers(base))
        except httpx.HTTPError as e:
            log.debug("closing episode %s: %s", episode_id, e)
