"""Client of the reward server: one POST /v1/score per engine batch, bounded retries with backoff."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from rollout.engines.base import Completion
from services.schemas import ScoreItem, ScoreRequest, ScoreResponse, ScoreResult

log = logging.getLogger(__name__)


class RewardUnavailable(RuntimeError):
    """The reward server did not answer after the retries (down, overloaded, unreachable): an outage of a
    dependency. Keep the prompts and try again later; they are not at fault."""


class RewardRejected(RuntimeError):
    """The reward server answered 4xx: this request is at fault (too long, unknown verifier), not the server."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"reward server refused the request ({status}): {detail}")
        self.status = status


def _retryable(e: BaseException) -> bool:
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and e.response.status_code in (429, 502, 503, 504)


class RewardClient:
    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 60.0, retries: int = 5):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)
        self.retries = retries

    def score(self, items: list[ScoreItem], between_tries: Callable[[], object] = lambda: None) -> list[ScoreResult]:
        """`between_tries`: called before each wait for the next try (a replica keeps its prompts alive there: a
        server that hangs costs up to (retries + 1) x timeout_s, past the time after which they are reclaimed)."""

        def keep_alive(_: object) -> None:
            between_tries()

        call = retry(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential_jitter(multiplier=0.2, max=5.0),
            before_sleep=keep_alive,
            reraise=True,
        )(self._post)
        try:
            results = call(items)
        except (httpx.TransportError, httpx.HTTPStatusError) as e:
            raise RewardUnavailable(
                f"reward server at {self.http.base_url} failed after {self.retries} retries: {e}"
            ) from e
        if [r.id for r in results] != [it.id for it in items]:
            raise RewardUnavailable("reward server answered for other items than it was asked about")
        return results

    def _post(self, items: list[ScoreItem]) -> list[ScoreResult]:
        r = self.http.post(
            "/v1/score",
            content=ScoreRequest(items=items).model_dump_json(),
            headers={"content-type": "application/json"},
        )
        if 400 <= r.status_code < 500 and r.status_code != 429:
            raise RewardRejected(r.status_code, r.text[:500])  # retrying the same request will not help
        r.raise_for_status()
        return ScoreResponse.model_validate_json(r.content).results

    def close(self) -> None:
        self.http.close()


class Target(Protocol):
    """What a completion is scored against: a training prompt (PromptTask) or a held-out item (Item)."""

    @property
    def ground_truth(self) -> str: ...

    @property
    def verifier(self) -> str: ...


def score_items(targets: Sequence[Target], outs: Sequence[Sequence[Completion]], max_tokens: int) -> list[ScoreItem]:
    """One ScoreItem per completion, `<target index>/<sample index>`, for one request to the reward server."""
    return [
        ScoreItem(
            id=f"{i}/{j}",
            response=c.text,
            ground_truth=target.ground_truth,
            verifier=target.verifier,
            response_tokens=len(c.token_ids),
            max_response_tokens=max_tokens,
        )
        for i, (target, o) in enumerate(zip(targets, outs, strict=True))
        for j, c in enumerate(o)
    ]
