"""Client of an environment service (the dapo-env/1 protocol, services/episodes.py), as the replica uses it.

    envs = EnvClient("http://env-server:8005", token=..., timeout_s=60, retries=4)
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
no longer has, an environment that failed or is too slow).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from services.episodes import ResetResponse, StepResponse

log = logging.getLogger(__name__)


class EnvUnavailable(RuntimeError):
    """The environment service did not answer after the retries."""


class EnvRejected(RuntimeError):
    def __init__(self, status: int, detail: str):
        super().__init__(f"environment service refused the request ({status}): {detail}")
        self.status = status


_RETRIED = (429, 502, 503)  # no room, an upstream (OpenEnv) or the service not there: an outage


def _retryable(e: BaseException) -> bool:
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code in _RETRIED


@dataclass(frozen=True)
class Opening:
    base: str  # the instance that holds the episode
    response: ResetResponse


class EnvClient:
    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0, retries: int = 4):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=self.headers, timeout=timeout_s)
        self.retries = retries
        self._lock = threading.Lock()
        self._next = itertools.count()
        self.closing = threading.Event()  # set: retries stop waiting (the replica is leaving)

    def _sleep(self, seconds: float) -> None:
        if self.closing.wait(seconds):
            raise EnvUnavailable("leaving")

    def instances(self) -> list[str]:
        """The base URL of each instance behind the service's name (just the URL when it names one address)."""
        parts = urlsplit(self.url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        try:
            found = sorted({str(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        except OSError:
            return [self.url]
        if len(found) <= 1 or parts.scheme == "https":  # TLS wants the name: leave balancing to the service
            return [self.url]
        hosts = [f"[{a}]" if ":" in a else a for a in found]
        return [urlunsplit(parts._replace(netloc=f"{h}:{port}")) for h in hosts]

    def _pick(self) -> str:
        found = self.instances()
        with self._lock:
            return found[next(self._next) % len(found)]

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        @retry(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(multiplier=0.5, max=10),
            sleep=self._sleep,
            reraise=True,
        )
        def once() -> Any:
            r = self.http.request(method, url, json=body)
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
            except ValueError:
                detail = r.text
            raise EnvRejected(r.status_code, str(detail)[:1000])
        return r.json()

    def reset(self, env: str, task: dict[str, Any], episode_id: str) -> Opening:
        """`task`: {"seed": n} or {"task": {...}}. A retry after a transport error goes to the same instance (the
        reset may have happened there); a new episode goes to the next instance."""
        base = self._pick()
        body = {"env": env, "episode_id": episode_id, **task}
        try:
            return Opening(base, ResetResponse.model_validate(self._call("POST", f"{base}/v1/episodes", body)))
        except Exception:  # no answer, one that does not read, or a refusal after a try whose answer was lost: the
            self.close(base, episode_id)  # instance may hold the episode, so close it (not left to its idle TTL)
            raise

    def step(self, base: str, episode_id: str, turn: int, content: str) -> StepResponse:
        body = {"turn": turn, "message": {"role": "assistant", "content": content}}
        return StepResponse.model_validate(self._call("POST", f"{base}/v1/episodes/{episode_id}/step", body))

    @classmethod
    def of(cls, s: Any) -> EnvClient:
        """The client a replica's settings describe (env_url, env_token, env_timeout_s, env_retries)."""
        token = s.env_token.get_secret_value() if s.env_token else None
        return cls(s.env_url, token=token, timeout_s=s.env_timeout_s, retries=s.env_retries)

    def close(self, base: str, episode_id: str) -> None:
        """Best effort: an episode not closed expires on the service."""
        try:
            self.http.delete(f"{base}/v1/episodes/{episode_id}", timeout=5)
        except httpx.HTTPError as e:
            log.debug("closing episode %s: %s", episode_id, e)
