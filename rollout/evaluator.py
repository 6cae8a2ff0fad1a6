"""The held-out evaluation during training: when one is due, running it seeded, scoring what was sampled beside
training, and publishing the result to dapo:eval and as dapo_eval_* metrics. Both loops hold one.

    evaluator = Evaluator(settings, client, reward, metrics)
    evaluator.run_seeded(engine)              # the chunked loop (and `--eval-mode stop`, once drained)
    if evaluator.due(version):                # continuous batching, `--eval-mode shared`: its prompts and
        items = evaluator.held_out(version)   # episodes enter beside training's (rollout/shared_evaluation.py)
        evaluator.report(items, outs, version, t0, episodes, runs)   # ... scored once all have finished

With --eval-every n it evaluates at the first version served and then at the first version at or past each
multiple of n. The seeded run is rollout/evaluate.py's `evaluate`, the same function as `dapo-mesh eval`: the
same weights, items and seed give the same numbers. An evaluation that cannot go on (no held-out file yet: the
buffer writes it; the reward server down) is postponed and tried again EVAL_RETRY_S later, training meanwhile.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from rollout.engines.base import Completion, Engine, SamplingParams
from rollout.env_client import EnvUnavailable
from rollout.episode_runner import ENV_PREFIX, EpisodeRunner
from rollout.evaluate import (
    EvalReport,
    EvalSample,
    EvaluationStopped,
    evaluate,
    load_eval_items,
    score_samples,
    summarize,
)
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient, RewardRejected, RewardUnavailable
from rollout.settings import RolloutSettings
from services.datasets import Item
from services.episode_log import cut
from services.schemas import RESPONSE_CHARS, EvalResult, EvalSampleRecord
from services.streams import STREAM_EVAL, StreamProducer

log = logging.getLogger(__name__)
EVAL_RETRY_S = 10.0  # a postponed evaluation is tried again this much later (not at every step of the loop)


class Evaluator:
    def __init__(self, s: RolloutSettings, client: redis.Redis, reward: RewardClient, metrics: RolloutMetrics):
        self.s, self.reward, self.m = s, reward, metrics
        self.next_eval = 0  # the held-out evaluation runs at the first version at or past this one
        self.retry_at = 0.0  # a postponed evaluation waits until then
        self.items: list[Item] | None = None
        self.out = StreamProducer(client, STREAM_EVAL, registry=metrics.registry)
        self.stopping: Callable[[], bool] = lambda: False  # the runner's stop event: a seeded run ends between calls
        self._episodes: EpisodeRunner | None = None  # for held-out environment tasks, made at the first

    def episodes(self, engine: Engine) -> EpisodeRunner:
        if self._episodes is None:
            self._episodes = EpisodeRunner(self.s, engine.tokenizer, self.m, hold_outages=False)
        return self._episodes

    def close(self) -> None:
        """Leaving: the held-out episodes still open are closed on the environment service."""
        if self._episodes is not None:
            self._episodes.close()

    def due(self, version: int) -> bool:
        """An evaluation of the weights of this version is to run now."""
        return self.s.eval_every is not None and version >= self.next_eval and self.retry_in() <= 0

    def retry_in(self) -> float:
        """Seconds until a postponed evaluation goes on (<= 0: now)."""
        return self.retry_at - time.monotonic()

    def postpone(self, version: int, why: Exception) -> None:
        log.warning("held-out evaluation of version %d postponed: %s", version, why)
        self.retry_at = time.monotonic() + EVAL_RETRY_S

    def held_out(self, version: int) -> list[Item] | None:
        """The held-out items, read once; None: not there yet (postponed), or there are none (the evaluation is
        off for good)."""
        if self.items is None:
            try:
                items = load_eval_items(self.s.eval_data, size=self.s.eval_size, tasks=self.s.eval_tasks)
            except FileNotFoundError as e:  # no eval.jsonl yet: the buffer writes it when it starts
                self.postpone(version, e)
                return None
            except ValueError as e:  # a task the split lacks (eval_tasks), or a line that is not an item
                items, why = [], str(e)
            else:
                why = f"no held-out items in {self.s.eval_data}"
            if not items:  # said once: training goes on without evaluations
                log.error("held-out evaluation off: %s", why)
                self.next_eval = sys.maxsize
                return None
            self.items = items
        return self.items

    def params(self) -> SamplingParams:
        s = self.s
        return SamplingParams(s.temperature, s.eval_top_p, s.max_response_tokens, s.eval_seed)

    def run_seeded(self, engine: Engine) -> EvalResult | None:
        """If one is due: the held-out avg@k / pass@k of the weights `engine` holds, in seeded engine calls that
        nothing else shares; the numbers `dapo-mesh eval` gives for the same weights, items and seed."""
        version = engine.version
        if not self.due(version):
            return None
        items = self.held_out(version)
        if items is None:
            return None
        try:
            report, samples = evaluate(
                engine,
                items,
                self.reward,
                k=self.s.eval_k,
                params=self.params(),
                chat_template=self.s.chat_template,
                stopped=self.stopping,
                episodes=self.episodes(engine),
            )
        except (RewardUnavailable, RewardRejected, EnvUnavailable) as e:
            self.postpone(version, e)
            return None
        except EvaluationStopped as e:
            log.info("held-out evaluation of version %d given up: leaving (%s)", version, e)
            return None
        return self.publish(report, samples=self.records(items, samples))

    def report(
        self,
        items: Sequence[Item],
        outs: Sequence[Sequence[Completion]],
        version: int,
        t0: float,
        episodes: Sequence[EvalSample] = (),
        episode_runs: Sequence[tuple[int, int]] = (),
    ) -> EvalResult | None:
        """Samples drawn beside training, from `version` on (t0: when it began, time.perf_counter()): the
        single-turn items' `outs` (in order) scored in one request, the environment tasks' `episodes` already
        scored (their model tokens' version runs: `episode_runs`), published with the versions that sampled their
        tokens. None: postponed (reward server)."""
        plain = [it for it in items if not it.verifier.startswith(ENV_PREFIX)]
        try:
            samples = score_samples(plain, outs, self.reward, self.s.max_response_tokens) if plain else []
        except (RewardUnavailable, RewardRejected) as e:
            self.postpone(version, e)
            return None
        report = summarize(items, [*samples, *episodes], self.s.eval_k, version, time.perf_counter() - t0)
        runs = [r for o in outs for c in o for r in (c.versions or ())] + list(episode_runs)
        return self.publish(report, runs, self.records(items, [*samples, *episodes]))

    def records(self, items: Sequence[Item], samples: Sequence[EvalSample]) -> list[EvalSampleRecord]:
        """The first --eval-record-samples samples, in item order, with their items' prompt and task."""
        if not self.s.eval_record_samples:
            return []
        by_id = {it.prompt_id: it for it in items}
        order = {it.prompt_id: i for i, it in enumerate(items)}
        chosen = sorted(samples, key=lambda x: (order.get(x.prompt_id, len(order)), x.sample))
        return [
            EvalSampleRecord(
                prompt_id=x.prompt_id,
                task=by_id[x.prompt_id].data_source if x.prompt_id in by_id else "",
                prompt=cut(by_id[x.prompt_id].prompt) if x.prompt_id in by_id else None,
                sample=x.sample,
                response=cut(x.response, RESPONSE_CHARS) or "",
                response_tokens=x.response_tokens,
                finish_reason=x.finish_reason,
                acc=x.acc,
                score=x.score,
                pred=x.pred,
            )
            for x in chosen[: self.s.eval_record_samples]
        ]

    def publish(
        self, report: EvalReport, runs: list[tuple[int, int]] | None = None, samples: Sequence[EvalSampleRecord] = ()
    ) -> EvalResult:
        """`runs`: the (version, tokens) runs of every sample, from continuous batching (weights moved meanwhile);
        `samples`: what is published of the samples themselves."""
        s, version = self.s, report.version
        result = EvalResult(
            version=version,
            replica_id=s.replica_id,
            k=report.k,
            n_prompts=report.n_prompts,
            avg_at_k=report.avg_at_k,
            pass_at_k=report.pass_at_k,
            mean_response_tokens=report.mean_response_tokens,
            truncated_frac=report.truncated_frac,
            seconds=report.seconds,
            by_task=report.by_source,
            samples=list(samples),
            **token_versions(version, runs),
        )
        self.out.publish(result)
        self.next_eval = (version // s.eval_every + 1) * s.eval_every if s.eval_every else sys.maxsize
        self.m.eval_avg.set(report.avg_at_k)
        self.m.eval_pass.set(report.pass_at_k)
        self.m.eval_version.set(version)
        self.m.eval_seconds.set(report.seconds)
        for task, acc in report.by_source.items():
            self.m.eval_task_avg.labels(task).set(acc)
        log.info(
            "held-out eval of version %d: avg@%d %.3f, pass@%d %.3f (%d prompts, %.1f s)",
            version,
            report.k,
            report.avg_at_k,
            report.k,
            report.pass_at_k,
            report.n_prompts,
            report.seconds,
        )
        return result


def token_versions(version: int, runs: list[tuple[int, int]] | None) -> dict[str, Any]:
    """An evaluation's mean token version, newest version and share of tokens sampled after `version`."""
    total = sum(n for _, n in runs or [])
    if not runs or not total:
        return {}
    return {
        "mean_token_version": sum(v * n for v, n in runs) / total,
        "newest_version": max(v for v, _ in runs),
        "later_token_frac": sum(n for v, n in runs if v > version) / total,
    }
