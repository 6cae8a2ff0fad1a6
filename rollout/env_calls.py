"""The one way a replica calls environments: for its own episodes (rollout/episode_runner.py) and for the gateway's
sessions (rollout/gateway/) alike — the calls in one bounded pool of threads, every failure classified by one rule,
every step's answer judged by one rule, every episode closed.

    env = EnvCalls(EnvClient.of(settings), settings.env_concurrency, metrics)
    fut = env.reset("calculator", {"seed": 7}, "t-9.ab12.3.0")        # a Future[Opening]
    try:
        opening = fut.result()
    except Exception as e:
        failure = classify(e)                    # EnvFailure: "outage" (begin again, later) or "failed" (counted)
    verdict = judge(env.step(opening.base, "t-9.ab12.3.0", 1, text).result())   # None: the episode goes on
    env.close(opening.base, "t-9.ab12.3.0")       # in the pool; what was not sent when the replica leaves is sent then
    env.shutdown(left)                            # leaving: waits end, the episodes still open are closed

The rule (docs/services/environments.md, "what a client does"): no answer after the client's retries, or a refusal
of the replica's own credentials (401/403: a configuration to fix, not the task's fault), is an **outage** — the
episode is begun again later, its task kept; a refusal (4xx), a 500, a 504 (a reset slower than the service
allows), an answer that is not the protocol's (EnvInvalid) or a step answered with `error` is a **failure** of the
environment — the episode is over and never trained on, and it counts against the task's `--episode-retries`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rollout.env_client import EnvClient, EnvRejected, EnvUnavailable, Opening
from rollout.metrics import RolloutMetrics
from services.episodes import StepResponse

log = logging.getLogger(__name__)
T = TypeVar("T")
FailureKind = Literal["outage", "failed"]


class EnvFailure(Exception):
    """What an environment call's exception means for its episode (`kind`), and why (`why`)."""

    def __init__(self, kind: FailureKind, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


def classify(e: BaseException) -> EnvFailure:
    """An environment call's exception as an outage (the service or its credentials: not the task's fault) or a
    failure of the environment (counted against the task)."""
    if isinstance(e, EnvFailure):
        return e
    if isinstance(e, EnvUnavailable):
        return EnvFailure("outage", str(e))
    if isinstance(e, EnvRejected) and e.status in (401, 403):
        return EnvFailure("outage", f"{e} (the replica's DAPO_ENV_TOKEN is not the environment service's)")
    if isinstance(e, EnvRejected):
        return EnvFailure("failed", str(e))
    return EnvFailure("failed", f"{type(e).__name__}: {e}"[:1000])


@dataclass(frozen=True)
class Verdict:
    """How an environment ended an episode: its reward (none given: -1, a failure) and why it ended."""

    reward: float
    ended: Literal["done", "max_turns"]


def judge(out: StepResponse) -> Verdict | None:
    """A step's answer: None while the episode goes on, its Verdict once done; EnvFailure when the environment
    itself failed (`error`: the model is not to blame, the episode is not trained on)."""
    if out.error:
        raise EnvFailure("failed", f"the environment failed: {out.error}"[:1000])
    if not out.done:
        return None
    return Verdict(out.reward if out.reward is not None else -1.0, "max_turns" if out.truncated else "done")


class EnvCalls:
    def __init__(self, client: EnvClient, workers: int, metrics: RolloutMetrics):
        self.client, self.m = client, metrics
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="env")
        self._lock = threading.Lock()  # the closes are queued from the loop's thread and the gateway's
        self.closes: dict[Future[None], tuple[str, str]] = {}  # sent and not yet answered: (base, episode id)

    @property
    def closing(self) -> threading.Event:
        """Set when the replica leaves: waits and retries end at once, nothing new starts."""
        return self.client.closing

    def reset(self, env: str, body: dict[str, Any], episode_id: str, delay_s: float = 0.0) -> Future[Opening]:
        """A new episode, after `delay_s` (an outage's backoff; EnvUnavailable at once if the replica leaves)."""
        return self._submit("reset", self._later, delay_s, self.client.reset, env, body, episode_id)

    def step(self, base: str, episode_id: str, turn: int, content: str) -> Future[StepResponse]:
        return self._submit("step", self.client.step, base, episode_id, turn, content)

    def close(self, base: str, episode_id: str) -> None:
        """Tell the service to forget an episode (best effort), never blocking the caller (it may hold the gateway's
        lock or be on an event loop); one not sent by the time the replica leaves is sent then (shutdown)."""
        with self._lock:
            self.closes = {f: k for f, k in self.closes.items() if not f.done()}
            try:
                self.closes[self.pool.submit(self.client.close, base, episode_id)] = (base, episode_id)
                return
            except RuntimeError:  # the pool is shut down (the replica is leaving): a thread of its own
                pass
        threading.Thread(target=self.client.close, args=(base, episode_id), name="env-close", daemon=True).start()

    def _submit(self, kind: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self.pool.submit(self._timed, kind, fn, *args)

    def _later(self, delay_s: float, fn: Callable[..., T], *args: Any) -> T:
        if delay_s > 0 and self.closing.wait(delay_s):
            raise EnvUnavailable("leaving")
        return fn(*args)

    def _timed(self, kind: str, fn: Callable[..., T], *args: Any) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.m.env_step_seconds.labels(kind).observe(time.perf_counter() - t0)

    def shutdown(
        self, left: set[tuple[str, str]], resets: list[tuple[Future[Any], str]], timeout_s: float = 5.0
    ) -> None:
        """Leaving: waits and retries end, nothing new starts; the episodes in `left` (base, id) and the closes not
        yet sent are closed in `timeout_s` at most; each reset in `resets` (its future, its episode id) closes its
        episode when it answers, or at once if it has."""
        if self.closing.is_set():  # shut down before (a stopped round, then the loop's close)
            return
        self.closing.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            left = left | {k for f, k in self.closes.items() if f.cancelled()}
        for f, episode_id in resets:
            if f.done():
                left |= {(o.base, episode_id)} if isinstance(o := result(f), Opening) else set()
            else:
                f.add_done_callback(functools.partial(self._close_opened, episode_id=episode_id))
        if not left:
            return
        pool = ThreadPoolExecutor(min(8, len(left)), thread_name_prefix="env-close")
        wait([pool.submit(self.client.close, base, eid) for base, eid in left], timeout=timeout_s)
        pool.shutdown(wait=False, cancel_futures=True)

    def _close_opened(self, f: Future[Any], episode_id: str) -> None:
        if isinstance(o := result(f), Opening):
            self.client.close(o.base, episode_id)


def result(f: Future[Any]) -> Any:
    """A finished call's result; None when it was cancelled or raised."""
    return None if f.cancelled() or f.exception() is not None else f.result()
