"""A rollout replica's loop: prompts in, scored version-tagged groups out.

    python -m rollout --model-dir DIR --redis-url URL --reward-url http://127.0.0.1:8001

Per iteration: read up to `prompts_per_call` PromptTasks (own pending first after a restart, then
prompts another replica left idle, then new ones); generate G samples each in one engine call; score
all samples in one request to the reward server; publish one ScoredGroup per prompt, tagged with the
policy version of the weights that generated it, and acknowledge the prompts in the same server-side
step. If the reward server stays down past the retries, the replica keeps the prompts and their samples
(held: no other replica reclaims them, their delivery count does not grow) and scores them again with
backoff, reading nothing new meanwhile: an outage never dead-letters a prompt. A prompt whose own scoring
request the server refuses (4xx) is dead-lettered with the answer; `dapo-mesh redrive` puts it back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from rollout.engine import Completion, Engine, SamplingParams, encode_prompt
from rollout.evaluate import EvalReport, evaluate, load_eval_items
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient, RewardRejected, RewardUnavailable
from rollout.settings import RolloutSettings
from rollout.weight_receiver import WeightReceiver
from services.arrays import TokenIds
from services.datasets import Item
from services.schemas import EvalResult, PromptTask, ReplicaHeartbeat, Sample, Score, ScoredGroup, ScoreItem
from services.snapshots import latest_snapshot
from services.streams import (
    GROUP_ROLLOUT,
    REPLICA_KEY_PREFIX,
    STREAM_EVAL,
    STREAM_PROMPTS,
    STREAM_ROLLOUTS,
    Delivery,
    RedisUnavailable,
    StreamConsumer,
    StreamProducer,
    pack,
)

log = logging.getLogger(__name__)
REWARD_BACKOFF_S, REWARD_BACKOFF_MAX_S = 1.0, 30.0  # between scoring attempts while the reward server is down


class Worker:
    def __init__(
        self,
        s: RolloutSettings,
        client: redis.Redis,
        engine: Engine,
        reward: RewardClient,
        metrics: RolloutMetrics,
        receiver: WeightReceiver | None = None,
    ):
        self.s, self.client, self.engine, self.reward, self.m = s, client, engine, reward, metrics
        self.receiver = receiver
        self.checksum: int | None = None  # of the broadcast weights the engine holds (None: from a snapshot)
        self.incarnation = receiver.incarnation if receiver is not None else uuid.uuid4().hex[:12]
        self.consumer = StreamConsumer(
            client,
            STREAM_PROMPTS,
            GROUP_ROLLOUT,
            s.replica_id,
            PromptTask,
            claim_idle_ms=s.claim_idle_ms,
            registry=metrics.registry,
        )
        self.params = SamplingParams(s.temperature, s.top_p, s.max_response_tokens, s.seed)
        self.state = "starting"
        self.tokens_per_s = 0.0
        self.done = 0
        self.unscored: Generated | None = None  # generated, held while the reward server is down
        self.retry_at, self.backoff_s = 0.0, REWARD_BACKOFF_S
        self.next_eval = 0  # the held-out evaluation runs at the first version at or past this one
        self.eval_items: list[Item] | None = None
        self.eval_out = StreamProducer(client, STREAM_EVAL, registry=metrics.registry)

    # ---------------------------------------------------------------- membership

    def heartbeat(self) -> None:
        hb = ReplicaHeartbeat(
            replica_id=self.s.replica_id,
            host=self.s.host,
            port=self.s.port,
            weight_version=self.engine.version,
            tokens_per_s=self.tokens_per_s,
            state=self.state,
            weight_checksum=self.checksum,
            sync_broadcast=self.receiver is not None,
            incarnation=self.incarnation,
        )  # type: ignore[arg-type]
        self.client.set(REPLICA_KEY_PREFIX + self.s.replica_id, pack(hb), px=int(self.s.heartbeat_ttl_s * 1000))

    def heartbeat_forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.s.heartbeat_ttl_s / 3):
            try:
                self.heartbeat()
            except (RedisUnavailable, redis.RedisError) as e:
                log.warning("heartbeat failed: %s", e)
        self.client.delete(REPLICA_KEY_PREFIX + self.s.replica_id)

    # ---------------------------------------------------------------- the loop

    def warm_up(self) -> None:
        """Ready means the engine has produced a token."""
        ids = encode_prompt(self.engine.tokenizer, "Hello", self.s.chat_template)
        self.engine.generate([ids], 1, SamplingParams(max_tokens=1))
        self.state = "ready"

    def sync_weights(self) -> bool:
        """Load the newest weights between engine calls: a verified broadcast round, else a newer snapshot."""
        if self.receiver is not None and self.receiver.ready is not None:
            t0 = time.perf_counter()
            got = self.receiver.take(self.engine.load_tensors)
            if got is not None:
                self._loaded(got.version, got.checksum, "broadcast", time.perf_counter() - t0, got.announced)
                return True
        newer = self.newer_snapshot()
        if newer is None:
            return False
        path, version, written = newer
        self.state = "syncing"
        t0 = time.perf_counter()
        self.engine.load_weights(path, version)
        announced = time.monotonic() - max(0.0, time.time() - written)
        self._loaded(version, None, f"snapshot {path.name}", time.perf_counter() - t0, announced)
        return True

    def newer_snapshot(self) -> tuple[Path, int, float] | None:
        """The learner's newest HF snapshot (folder, version, written at) if newer than the engine's weights; never
        for a member of the broadcast group (it gets every version from it)."""
        if self.s.weights_dir is None or (self.receiver is not None and self.receiver.state != "idle"):
            return None
        newest = latest_snapshot(self.s.weights_dir)
        if newest is None or newest.version <= self.engine.version:
            return None
        return newest.path, newest.version, newest.written

    def _loaded(self, version: int, checksum: int | None, source: str, seconds: float, announced: float) -> None:
        if self.state == "syncing":
            self.state = "ready"
        self.checksum = checksum
        self.m.version.set(version)
        self.m.weight_load_seconds.observe(seconds)
        self.m.weight_serve_seconds.observe(time.monotonic() - announced)
        log.info("serving weights version %d (%s), loaded in %.2f s", version, source, seconds)
        try:
            self.heartbeat()  # the learner and the buffer see the new version now, not a TTL/3 later
        except (RedisUnavailable, redis.RedisError) as e:
            log.warning("heartbeat failed: %s", e)

    def maybe_evaluate(self, engine: Engine | None = None) -> EvalResult | None:
        """With --eval-every n: the held-out avg@k / pass@k of the weights held, at the start and then at the first
        version at or past each multiple of n; published to dapo:eval and as dapo_eval_* metrics."""
        s, version = self.s, self.engine.version
        if s.eval_every is None or version < self.next_eval:
            return None
        try:
            items = self.held_out()
            if items is None:
                return None
            report, _ = evaluate(
                engine or self.engine,
                items,
                self.reward,
                k=s.eval_k,
                params=self.eval_params(),
                chat_template=s.chat_template,
            )
        except (FileNotFoundError, RewardUnavailable, RewardRejected) as e:  # no eval.jsonl yet; reward down
            log.warning("held-out evaluation of version %d postponed: %s", version, e)
            return None
        return self.publish_eval(report)

    def held_out(self) -> list[Item] | None:
        """The held-out items (read once; None: there are none, and the evaluation is off)."""
        if self.eval_items is None:
            self.eval_items = load_eval_items(self.s.eval_data, size=self.s.eval_size)
            if not self.eval_items:
                log.error("no held-out items in %s: the held-out evaluation is off", self.s.eval_data)
                self.next_eval = sys.maxsize
                return None
        return self.eval_items

    def eval_params(self) -> SamplingParams:
        s = self.s
        return SamplingParams(s.temperature, s.eval_top_p, s.max_response_tokens, s.eval_seed)

    def publish_eval(self, report: EvalReport, runs: list[tuple[int, int]] | None = None) -> EvalResult:
        """`runs`: the (version, tokens) runs of every sample, from a streaming replica (weights moved meanwhile)."""
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
            **token_versions(version, runs),
        )
        self.eval_out.publish(result)
        self.next_eval = (version // s.eval_every + 1) * s.eval_every if s.eval_every else sys.maxsize
        self.m.eval_avg.set(report.avg_at_k)
        self.m.eval_pass.set(report.pass_at_k)
        self.m.eval_version.set(version)
        self.m.eval_seconds.set(report.seconds)
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

    def step(self) -> int:
        self.sync_weights()  # weights change only between engine calls
        if self.unscored is not None:  # the reward server was down: nothing new until these are scored
            self.consumer.keep_alive()
            if time.monotonic() < self.retry_at:
                time.sleep(min(0.5, self.retry_at - time.monotonic()))
                return 0
            return self.publish(self.unscored)
        self.maybe_evaluate()
        deliveries = self.consumer.read(count=self.s.prompts_per_call, block_ms=1000)
        if not deliveries:
            return 0
        return self.publish(self.generate(deliveries))

    def publish(self, gen: Generated) -> int:
        """Score, then publish the groups and acknowledge their prompts in one step. A reward outage keeps the
        prompts (held, retried with backoff: an outage is not the prompts' fault, so they are never dead-lettered
        for it); a prompt the reward server rejects on its own is dead-lettered, the others go on."""
        try:
            try:
                groups = self.score(gen)
            except RewardRejected:
                groups = self.score_one_by_one(gen)
        except RewardUnavailable as e:
            self.m.reward_failures.inc()
            self.unscored = gen
            self.retry_at = time.monotonic() + self.backoff_s
            log.error("%s; %d prompts held, scoring again in %.0f s", e, len(gen.deliveries), self.backoff_s)
            self.backoff_s = min(self.backoff_s * 2, REWARD_BACKOFF_MAX_S)
            return 0
        self.unscored, self.backoff_s = None, REWARD_BACKOFF_S
        kept = [d for d in gen.deliveries if d.message.task_id in {g.group_id for g in groups}]
        self.consumer.ack_and_publish([d.entry_id for d in kept], [(STREAM_ROLLOUTS, g) for g in groups])
        self.m.groups.inc(len(groups))
        self.done += len(groups)
        return len(groups)

    def score_one_by_one(self, gen: Generated) -> list[ScoredGroup]:
        """After a 4xx for the whole call: each prompt's samples on their own; a prompt whose own request is
        refused is dead-lettered with the server's answer. An outage on the way raises before anything is
        dead-lettered, and the whole call is held."""
        groups: list[ScoredGroup] = []
        refused: list[tuple[Delivery[PromptTask], RewardRejected]] = []
        for i, d in enumerate(gen.deliveries):
            try:
                groups += self.score(gen.part(i))
            except RewardRejected as e:
                refused.append((d, e))
        for d, why in refused:
            log.error("prompt %s dead-lettered: %s", d.message.task_id, why)
            self.consumer.dead_letter([d], "reward_rejected", str(why))
        return groups

    def call_params(self, tasks: list[PromptTask]) -> SamplingParams:
        return seeded(self.params, self.s.seed, [t.task_id for t in tasks])

    def generate(self, deliveries: list[Delivery[PromptTask]]) -> Generated:
        tasks = [d.message for d in deliveries]
        prompts = [self.prompt_ids(t) for t in tasks]
        version = self.engine.version  # weights change only between engine calls
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, [t.n_samples for t in tasks], self.call_params(tasks))
        gen_s = time.perf_counter() - t0
        n_tokens = sum(len(c.token_ids) for o in outs for c in o)
        self.tokens_per_s = n_tokens / gen_s if gen_s else 0.0
        self.m.batch_seconds.observe(gen_s)
        self.m.tokens.inc(n_tokens)
        self.m.tokens_per_second.set(self.tokens_per_s)
        self.m.samples.inc(sum(len(o) for o in outs))
        self.m.truncated.inc(sum(c.finish_reason == "length" for o in outs for c in o))
        return Generated(deliveries, prompts, outs, version)

    def prompt_ids(self, task: PromptTask) -> list[int]:
        if task.prompt_token_ids is not None:
            return task.prompt_token_ids.tolist()
        return encode_prompt(self.engine.tokenizer, task.prompt or "", self.s.chat_template)

    def score(self, gen: Generated) -> list[ScoredGroup]:
        """One request to the reward server for every sample; raises RewardUnavailable / RewardRejected."""
        tasks = [d.message for d in gen.deliveries]
        items = [
            ScoreItem(
                id=f"{i}/{j}",
                response=c.text,
                ground_truth=t.ground_truth,
                verifier=t.verifier,
                response_tokens=len(c.token_ids),
                max_response_tokens=self.s.max_response_tokens,
            )
            for i, (t, o) in enumerate(zip(tasks, gen.outs, strict=True))
            for j, c in enumerate(o)
        ]
        t0 = time.perf_counter()
        results = iter(self.reward.score(items))
        self.m.reward_seconds.observe(time.perf_counter() - t0)
        groups = []
        for task, prompt, o in zip(tasks, gen.prompts, gen.outs, strict=True):
            samples = [
                Sample(
                    response_token_ids=c.token_ids,
                    response_text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    temperature=self.params.temperature,
                    top_p=self.params.top_p,
                    **versions(c, gen.version),
                )
                for c in o
            ]
            scores = []
            for _ in o:
                r = next(results)
                scores.append(Score(reward=r.score, acc=r.acc, overlong_penalty=r.overlong_penalty, pred=r.pred))
            task = task.model_copy(update={"prompt_token_ids": TokenIds(prompt)})  # the learner trains on these
            groups.append(ScoredGroup(task=task, samples=samples, scores=scores, replica_id=self.s.replica_id))
        return groups


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


def versions(c: Completion, version: int) -> dict[str, Any]:
    """A sample's policy version (of its first token) and, from a streaming engine, the version of every token."""
    if not c.versions:
        return {"policy_version": version}
    return {"policy_version": c.versions[0][0], "version_runs": [list(r) for r in c.versions]}


def seeded(params: SamplingParams, seed: int | None, task_ids: list[str]) -> SamplingParams:
    """With a seed, each engine call is seeded from the seed and its tasks: the same prompts and weights give the
    same samples (a seeded run can be repeated), and no two calls share a random stream."""
    if seed is None:
        return params
    digest = hashlib.blake2b(f"{seed}:{','.join(task_ids)}".encode(), digest_size=4).digest()
    return dataclasses.replace(params, seed=int.from_bytes(digest) >> 1)


@dataclass(frozen=True)
class Generated:
    """An engine call's output, until the reward server has scored it."""

    deliveries: list[Delivery[PromptTask]]
    prompts: list[list[int]]
    outs: list[list[Completion]]
    version: int  # of the weights that generated it

    def part(self, i: int) -> Generated:
        return Generated([self.deliveries[i]], [self.prompts[i]], [self.outs[i]], self.version)
