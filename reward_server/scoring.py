"""Turns score requests into results: cache, inline or pooled verification, overlong shaping.

Only bounded work runs inline, in the event loop: dapo_math on the response's last 300 characters and a ground
truth of at most INLINE_MAX_GROUND_TRUTH characters (linear time). Everything else goes to the worker pool, each
item under `item_timeout_s`, so no request can keep /healthz or another request waiting.

Verdicts are cached by (verifier, ground truth, what of the response the verifier reads): the last
300 characters for dapo_math, a hash of the whole response otherwise. Timeouts and errors are not
cached. The overlong penalty depends on the item's token count, so it is added after the cache.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from typing import Any

from cachetools import LRUCache
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reward_server.code_runner import CodeRunner
from reward_server.overlong import overlong_penalty
from reward_server.pool import JobTimeout, VerifierPool, WorkerDied
from reward_server.settings import RewardSettings
from reward_server.verifiers import INLINE, SANDBOXED, Verdict, run_verifier
from reward_server.verifiers.dapo_math import INLINE_MAX_GROUND_TRUTH, TAIL_CHARS
from services.schemas import ScoreItem, ScoreResult

log = logging.getLogger(__name__)


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("dapo_reward_requests", "Score requests.", ["status"], registry=registry)
        self.items = Counter(
            "dapo_reward_items", "Items scored.", ["verifier", "outcome"], registry=registry
        )  # outcome: correct | wrong | timeout | error
        self.request_seconds = Histogram(
            "dapo_reward_request_latency_seconds",
            "Latency of a score request.",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.verify_seconds = Histogram(
            "dapo_reward_verify_latency_seconds",
            "Latency of one pooled verification, queue wait included.",
            ["verifier"],
            registry=registry,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )
        self.timeouts = Counter(
            "dapo_reward_timeouts", "Verifications over the limit.", ["verifier"], registry=registry
        )
        self.cache_hits = Counter("dapo_reward_cache_hits", "Verdicts served from the cache.", registry=registry)
        self.cache_misses = Counter("dapo_reward_cache_misses", "Verdicts computed.", registry=registry)
        self.pool_workers = Gauge("dapo_reward_pool_workers", "Live verifier workers.", registry=registry)
        self.pool_restarts = Counter("dapo_reward_pool_restarts", "Workers replaced.", registry=registry)


class Scorer:
    def __init__(
        self, settings: RewardSettings, pool: VerifierPool, metrics: RewardMetrics, code: CodeRunner | None = None
    ):
        self.settings, self.pool, self.metrics, self.code = settings, pool, metrics, code
        self.cache: LRUCache[tuple[str, str, Any], Verdict] | None = (
            LRUCache(settings.cache_size) if settings.cache_size else None
        )

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """Cached and inline verdicts right away; pooled ones concurrently, each under its limit."""
        verdicts: list[Verdict | None] = [None] * len(items)
        pooled: list[tuple[int, Any]] = []
        hits = 0
        for i, item in enumerate(items):
            key = (item.verifier, item.ground_truth, _response_key(item))
            if self.cache is not None and (hit := self.cache.get(key)) is not None:
                verdicts[i] = hit
                hits += 1
            elif item.verifier in INLINE and len(item.ground_truth) <= INLINE_MAX_GROUND_TRUTH:
                verdicts[i] = self._remember(key, self._inline(item))  # linear in <= 300 + 4096 characters
            else:
                pooled.append((i, key))
        if pooled:
            found = await asyncio.gather(*(self._pooled_timed(items[i]) for i, _ in pooled))
            for (i, key), v in zip(pooled, found, strict=True):
                verdicts[i] = self._remember(key, v)
        self.metrics.cache_hits.inc(hits)
        self.metrics.cache_misses.inc(len(items) - hits)
        done = [v for v in verdicts if v is not None]
        outcomes = collections.Counter((it.verifier, _outcome(v)) for it, v in zip(items, done, strict=True))
        for (verifier, outcome), n in outcomes.items():
            self.metrics.items.labels(verifier, outcome).inc(n)
        return [self._result(it, v) for it, v in zip(items, done, strict=True)]

    def _remember(self, key: tuple[str, str, Any], v: Verdict) -> Verdict:
        if self.cache is not None and not (v.timed_out or v.error):
            self.cache[key] = v
        return v

    async def _pooled_timed(self, item: ScoreItem) -> Verdict:
        t0 = time.perf_counter()
        v = await self._pooled(item)
        self.metrics.verify_seconds.labels(item.verifier).observe(time.perf_counter() - t0)
        return v

    def _inline(self, item: ScoreItem) -> Verdict:
        try:
            return run_verifier(item.verifier, item.response, item.ground_truth, **self._options())
        except Exception as e:  # never a 500 for one bad item
            log.exception("verifier %s failed", item.verifier)
            return Verdict(-1.0, False, error=f"{type(e).__name__}: {e}")

    async def _pooled(self, item: ScoreItem) -> Verdict:
        if item.verifier in SANDBOXED:  # I/O, not CPU: awaited here, under its own time limits
            assert self.code is not None, "the app refuses code items without a sandbox (422)"
            return await self.code.verify(item.response, item.ground_truth)
        job = {"verifier": item.verifier, "response": item.response, "ground_truth": item.ground_truth}
        for attempt in (1, 2):  # a worker found dead is replaced; the job gets one more worker
            try:
                r = await self.pool.run(job | self._options(), timeout_s=self.settings.item_timeout_s)
                return Verdict(float(r["score"]), bool(r["acc"]), pred=r["pred"], error=r["error"])
            except JobTimeout:
                self.metrics.timeouts.labels(item.verifier).inc()
                limit = self.settings.item_timeout_s
                return Verdict(-1.0, False, timed_out=True, error=f"over the {limit} s limit")
            except WorkerDied as e:
                if attempt == 2:
                    return Verdict(-1.0, False, error=f"verifier process died: {e}")
                log.warning("retrying a job on another worker: %s", e)
        raise AssertionError("unreachable")

    def _options(self) -> dict[str, Any]:
        s = self.settings
        return {"timeout_s": s.item_timeout_s, "lenient": s.rg_lenient, "continuous": s.rg_continuous}

    def _result(self, item: ScoreItem, v: Verdict) -> ScoreResult:
        s = self.settings
        penalty = 0.0
        if s.overlong_shaping and item.response_tokens is not None:
            max_len = item.max_response_tokens or s.max_response_tokens
            penalty = overlong_penalty(item.response_tokens, max_len, cache_len(s, max_len), s.overlong_factor)
        return ScoreResult(
            id=item.id,
            score=v.score + penalty,
            acc=v.acc,
            pred=v.pred,
            overlong_penalty=penalty,
            timed_out=v.timed_out,
            error=v.error,
        )


def cache_len(s: RewardSettings, max_len: int) -> int:
    """L_cache for an item whose own L_max is `max_len`: the server's buffer, but never a larger share of the
    item's L_max than the server's buffer is of its L_max (DAPO: 4096 of 20480, 20%). A 128-token rollout gets
    a 26-token buffer, not a 128-token one that would penalise every response by its length."""
    share = s.overlong_buffer_tokens / s.max_response_tokens
    return max(1, min(s.overlong_buffer_tokens, round(max_len * share)))


def _outcome(v: Verdict) -> str:
    return "timeout" if v.timed_out else "error" if v.error else "correct" if v.acc else "wrong"


def _response_key(item: ScoreItem) -> str | bytes:
    if item.verifier == "dapo_math":
        return item.response[-TAIL_CHARS:]
    return hashlib.blake2b(item.response.encode(), digest_size=16).digest()
