"""The episodes a service holds, and the bounded worker threads their environment code runs in.

Each request that runs environment code first takes one of `workers` slots (waiting at most `queue_timeout_s`:
then `Busy`, a 429), then runs in a thread for at most `step_timeout_s`. A thread still running at its timeout
is abandoned (Python cannot stop it) but keeps its slot until it returns: the service never runs more than
`workers` threads of environment code, and /readyz says when every slot is held by a stuck one. Steps of one
episode run one at a time (a lock per episode); a sweeper drops episodes idle longer than `episode_ttl_s`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from env_server.base import Environment
from env_server.metrics import EnvMetrics
from env_server.settings import EnvSettings
from services.episodes import ResetResponse, StepResponse

log = logging.getLogger(__name__)
T = TypeVar("T")


class Busy(Exception):
    """No worker was free within the queue timeout."""


@dataclass
class Episode:
    id: str
    env: Environment
    key: str  # what the reset asked (services.episodes.ResetRequest.key)
    opening: ResetResponse
    state: Any
    turn: int = 0
    last: StepResponse | None = None
    touched: float = field(default_factory=time.monotonic)
    last_message: str = ""  # the content the last answered turn was asked with (a retry must ask the same)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: bool = False  # counted and released (a close racing a step's end must not do it twice)

    @property
    def done(self) -> bool:
        return self.last is not None and self.last.done


@dataclass
class _Call:
    late: bool = False  # ran past its timeout (counted stuck until it returns)
    freed: bool = False  # returned, its slot given back


class Workers:
    def __init__(self, n: int, queue_timeout_s: float, timeout_s: float, metrics: EnvMetrics):
        self.n, self.queue_timeout_s, self.timeout_s, self.metrics = n, queue_timeout_s, timeout_s, metrics
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="env")
        self._slots = asyncio.Semaphore(n)
        self.held = 0
        self.stuck = 0
        metrics.workers_stuck.set_function(lambda: self.stuck)

    async def call(
        self, env: str, kind: str, fn: Callable[..., T], *args: Any, abandoned: Callable[[T], None] | None = None
    ) -> T:
        """fn(*args) in a worker thread; `Busy` when none frees up in time, TimeoutError past the timeout. What fn
        returns after its caller stopped waiting (the timeout, or the client gone) goes to `abandoned` (in the
        worker's thread): a reset's state nobody will ever close, for one."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise Busy(f"all {self.n} environment workers stayed busy for {self.queue_timeout_s:g} s") from None
        loop, t0, state = asyncio.get_running_loop(), time.perf_counter(), _Call()
        self.held += 1

        def release(_: Future[T]) -> None:  # in the worker thread, when the code returns (even long after)
            loop.call_soon_threadsafe(self._free, state)

        future = self._pool.submit(fn, *args)
        future.add_done_callback(release)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if abandoned is not None:
                future.add_done_callback(lambda f: _hand_over(f, abandoned))  # runs now if fn already returned
            if isinstance(e, asyncio.CancelledError):
                raise
            if not state.freed:  # it may have returned just as the timeout fired: then it is not stuck
                state.late = True
                self.stuck += 1
            self.metrics.timeouts.labels(env).inc()
            log.warning(
                "%s %s of %s ran past %g s: the episode ends with an error", kind, fn.__name__, env, self.timeout_s
            )
            raise
        finally:
            self.metrics.step_seconds.labels(env, kind).observe(time.perf_counter() - t0)

    def _free(self, state: _Call) -> None:
        """On the event loop, as every change of `state`: the order of a timeout and a return is the loop's."""
        state.freed = True
        self.held -= 1
        if state.late:
            self.stuck -= 1
        self._slots.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def release(env: Environment, state: Any) -> None:
    """Free an episode's state (Environment.release); an environment's bug there is logged, the service goes on."""
    try:
        env.release(state)
    except Exception:
        log.exception("%s failed to release an episode's state", env.name)


def _hand_over(f: Future[T], to: Callable[[T], None]) -> None:
    if not f.cancelled() and f.exception() is None:
        try:
            to(f.result())
        except Exception:
            log.exception("freeing an abandoned result failed")


class EpisodeTable:
    def __init__(self, settings: EnvSettings, metrics: EnvMetrics):
        self.settings, self.metrics = settings, metrics
        self.episodes: dict[str, Episode] = {}
        self.opening_ids: collections.Counter[str] = collections.Counter()  # resets in flight, by episode id
        self.cancelled: dict[str, bool] = {}  # ids closed while a reset of theirs ran: not to be kept (counted?)
        metrics.episodes_open.set_function(lambda: len(self.episodes))

    def get(self, episode_id: str) -> Episode | None:
        ep = self.episodes.get(episode_id)
        if ep is not None:
            ep.touched = time.monotonic()
        return ep

    @property
    def opening(self) -> int:
        """Resets in flight: counted against max_open_episodes before they finish."""
        return sum(self.opening_ids.values())

    def full(self) -> bool:
        """Room for no more: the episodes held and those being opened (resets in flight) count."""
        return len(self.episodes) + self.opening >= self.settings.max_open_episodes

    def add(self, ep: Episode) -> None:
        self.episodes[ep.id] = ep

    def begin_opening(self, episode_id: str) -> None:
        self.opening_ids[episode_id] += 1

    def end_opening(self, env: Environment, episode_id: str) -> bool:
        """A reset of `episode_id` is over (opened or failed); whether the episode was closed meanwhile (then its
        state is not to be kept; the close is counted once, here or when an opened episode was closed)."""
        self.opening_ids[episode_id] -= 1
        cancelled = episode_id in self.cancelled
        if cancelled and not self.cancelled[episode_id]:
            self.metrics.episodes.labels(env.name, "closed").inc()
            self.cancelled[episode_id] = True
        if self.opening_ids[episode_id] <= 0:
            del self.opening_ids[episode_id]
            self.cancelled.pop(episode_id, None)
        return cancelled

    def end(self, ep: Episode, outcome: str | None = None) -> None:
        """Count a finished episode (its outcome from its last step unless given) and free its state; once."""
        if ep.ended:
            return
        ep.ended = True
        last = ep.last
        if outcome is None:
            assert last is not None and last.done
            if last.error:
                outcome = "error"
            elif last.truncated:
                outcome = "truncated"
            else:
                outcome = "success" if (last.reward or 0) > 0 else "failure"
        self.metrics.episodes.labels(ep.env.name, outcome).inc()
        release(ep.env, ep.state)
        if ep.turn:
            self.metrics.turns.labels(ep.env.name).observe(ep.turn)

    def close(self, episode_id: str) -> bool:
        """Forget an episode; one still being opened is let go when its reset ends (the client that closes it has
        given up on the reset's answer). False: no such episode here."""
        ep = self.episodes.pop(episode_id, None)
        if episode_id in self.opening_ids:  # (a retry of an opened one too: it would add it again)
            self.cancelled[episode_id] = self.cancelled.get(episode_id, False) or ep is not None
        elif ep is None:
            return False
        if ep is not None and not ep.done:
            self.end(ep, "closed")
        return True

    def sweep(self) -> int:
        """Drop the episodes idle past the TTL (a done one is kept as long, for retried steps); how many."""
        cutoff = time.monotonic() - self.settings.episode_ttl_s
        old = [ep for ep in self.episodes.values() if ep.touched < cutoff and not ep.lock.locked()]
        for ep in old:
            del self.episodes[ep.id]
            if not ep.done:
                self.end(ep, "expired")
        if old:
            log.info("dropped %d episodes idle for over %g s", len(old), self.settings.episode_ttl_s)
        return len(old)

    async def sweep_forever(self) -> None:
        period = min(self.settings.episode_ttl_s / 4, 5.0)
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(Exception):
                self.sweep()
