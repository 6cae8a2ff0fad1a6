"""Generated groups out: scored by the reward server, published to dapo:rollouts, their prompts acknowledged.

    publisher = Publisher(settings, consumer, reward, metrics)
    publisher.finish(runner, decode)     # either loop: the runner's finished groups out, its failed ones dead-lettered
    if publisher.holding(): ...          # a reward outage: admit nothing new
    publisher.retry_held()               # ... score them again once backed off

Groups of episodes against an environment carry the environment's reward: published as they are. Groups of
one-step episodes (single-turn prompts) are scored: one scoring request for all their samples, then one
ScoredGroup per prompt, tagged with the policy version of the
weights that generated it (and, from continuous batching, of every token: Sample schema 3's version_runs), is
published and its prompt acknowledged in the same server-side step: a prompt is never acknowledged unpublished.
If the reward server stays down past the retries, the groups are held (their prompts stay pending and are kept
alive by the loop, and between the tries of a request: no other replica reclaims them, their delivery count does
not grow) and scored again with
backoff; the loop reads nothing new meanwhile, so an outage never dead-letters a prompt. A prompt whose own
scoring request the server refuses (4xx) is dead-lettered with the answer; `dapo-mesh redrive` puts it back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rollout.engines.base import Completion
from rollout.episode_runner import EpisodeRunner
from rollout.episodes import Episode
from rollout.groups import GroupRefused, env_scores, episode_group
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient, RewardRejected, RewardUnavailable, score_items
from rollout.settings import RolloutSettings
from services.arrays import TokenIds
from services.schemas import PromptTask, Sample, Score, ScoredGroup
from services.streams import STREAM_ROLLOUTS, Delivery, StreamConsumer

log = logging.getLogger(__name__)
REWARD_BACKOFF_S, REWARD_BACKOFF_MAX_S = 1.0, 30.0  # between scoring attempts while the reward server is down


@dataclass(frozen=True)
class Generated:
    """Groups of one-step episodes (single-turn prompts' answers), until the reward server has scored them."""

    deliveries: list[Delivery[PromptTask]]
    prompts: list[list[int]]
    outs: list[list[Completion]]
    versions: list[int]  # each group's: the weights that generated it (for completions without per-token versions)

    @classmethod
    def of(cls, done: list[tuple[Delivery[PromptTask], list[Episode]]]) -> Generated:
        outs = [[e.last for e in eps if e.last is not None] for _, eps in done]
        versions = [eps[0].versions[0] if eps[0].versions else 0 for _, eps in done]
        return cls([d for d, _ in done], [eps[0].opening for _, eps in done], outs, versions)

    def part(self, i: int) -> Generated:
        return Generated([self.deliveries[i]], [self.prompts[i]], [self.outs[i]], [self.versions[i]])

    def __add__(self, other: Generated) -> Generated:
        d, p, o, v = self.deliveries, self.prompts, self.outs, self.versions
        return Generated(d + other.deliveries, p + other.prompts, o + other.outs, v + other.versions)


class Backoff:
    """Scoring again after the reward server was down: 1, 2, 4 ... 30 s apart, back to 1 s once it answers."""

    def __init__(self) -> None:
        self.at, self.delay_s = 0.0, REWARD_BACKOFF_S

    def failed(self) -> float:
        """An outage: the next try waits the current delay (returned), the one after twice as long."""
        delay, self.at = self.delay_s, time.monotonic() + self.delay_s
        self.delay_s = min(self.delay_s * 2, REWARD_BACKOFF_MAX_S)
        return delay

    def answered(self) -> None:
        self.delay_s = REWARD_BACKOFF_S

    def wait_s(self) -> float:
        """Seconds until the next try (<= 0: now)."""
        return self.at - time.monotonic()


class Rounds(Protocol):
    """Groups sampled in rounds (rollout/rounds.py, which uses this publisher's scoring: hence a protocol here)."""

    backoff: Backoff

    def settle(self, finished: list[tuple[Delivery[PromptTask], list[Episode]]], runner: Any, decode: Any) -> int: ...
    def waiting(self) -> bool: ...
    def forget(self, entry_id: str) -> None: ...


class Publisher:
    def __init__(
        self,
        s: RolloutSettings,
        consumer: StreamConsumer[PromptTask],
        reward: RewardClient,
        metrics: RolloutMetrics,
    ):
        self.s, self.consumer, self.reward, self.m = s, consumer, reward, metrics
        self.held: Generated | None = None  # generated, held while the reward server is down
        self.backoff = Backoff()  # of the held groups (held rounds keep their own)
        self.done = 0  # groups published
        self.rounds: Rounds | None = None  # groups sampled in rounds (set by the replica)

    def holding(self) -> bool:
        """Groups or rounds wait for the reward server: the loop admits nothing new."""
        return self.held is not None or (self.rounds is not None and self.rounds.waiting())

    def retry_in(self) -> float:
        """Seconds until the held groups (or held rounds) are scored again (<= 0: now)."""
        waits = [self.backoff.wait_s()] if self.held is not None else []
        if self.rounds is not None and self.rounds.waiting():
            waits.append(self.rounds.backoff.wait_s())
        return min(waits) if waits else self.backoff.wait_s()

    def retry_held(self) -> int:
        """The held groups scored and published once their backoff is over; the groups published."""
        if self.held is None or self.backoff.wait_s() > 0:  # its own backoff (held rounds keep theirs)
            return 0
        return self.publish(self.held)

    def finish(self, runner: EpisodeRunner, decode: Any) -> int:
        """The runner's failed groups dead-lettered, its finished ones published: an environment's episodes as the
        environment scored them, one-step ones scored first (held, with any held before, through a reward outage).
        `decode`: token ids -> an episode's text."""
        for d, kind, why in runner.take_failed():
            log.error("prompt %s dead-lettered: %s", d.message.task_id, why)
            self.consumer.dead_letter([d], kind, why)
            if self.rounds is not None:
                self.rounds.forget(d.entry_id)  # its earlier rounds too: nothing of the prompt is published
        done = runner.take_finished()
        published = 0
        if self.rounds is not None:  # groups sampled in rounds: judged after each (rollout/rounds.py)
            published += self.rounds.settle([x for x in done if x[0].message.budget is not None], runner, decode)
            done = [x for x in done if x[0].message.budget is None]
        scored = [(d, eps) for d, eps in done if eps and eps[0].one_step]
        published += self.publish_episodes([(d, eps) for d, eps in done if not (eps and eps[0].one_step)], decode)
        if not scored:
            return published
        gen = Generated.of(scored)
        self.m.answered(gen.outs)
        if self.held is not None:  # scored with the held groups once the reward server answers
            self.held = self.held + gen
            return published
        return published + self.publish(gen)

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
            self.held = gen
            delay = self.backoff.failed()
            log.error("%s; %d prompts held, scoring again in %.0f s", e, len(gen.deliveries), delay)
            return 0
        self.held = None
        self.backoff.answered()
        scored = {g.group_id for g in groups}
        kept = [d for d in gen.deliveries if d.message.task_id in scored]
        self.consumer.ack_and_publish([d.entry_id for d in kept], [(STREAM_ROLLOUTS, g) for g in groups])
        self.m.groups.inc(len(groups))
        self.done += len(groups)
        return len(groups)

    def publish_episodes(self, done: list[tuple[Delivery[PromptTask], list[Episode]]], decode: Any) -> int:
        """Finished episode groups published with their prompts' acknowledgement (no scoring request: the
        environment scored them); episodes that are no group (rollout/groups.py) dead-lettered with the reason."""
        if not done:
            return 0
        good = []
        for d, eps in done:
            try:
                good.append((d, episode_group(d.message, eps, env_scores(eps), self.s.replica_id, decode)))
            except GroupRefused as e:
                log.error("prompt %s dead-lettered: %s", d.message.task_id, e)
                self.consumer.dead_letter([d], "env_rejected", str(e))
        return self.send(good)

    def send(self, groups: list[tuple[Delivery[PromptTask], ScoredGroup]]) -> int:
        """Scored groups published with their prompts' acknowledgement, in one step; how many."""
        if groups:
            self.consumer.ack_and_publish([d.entry_id for d, _ in groups], [(STREAM_ROLLOUTS, g) for _, g in groups])
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

    def score(self, gen: Generated) -> list[ScoredGroup]:
        """One request to the reward server for every sample; raises RewardUnavailable / RewardRejected."""
        tasks = [d.message for d in gen.deliveries]
        t0 = time.perf_counter()
        items = score_items(tasks, gen.outs, self.s.max_response_tokens)
        results = iter(self.reward.score(items, between_tries=self.consumer.keep_alive))
        self.m.reward_seconds.observe(time.perf_counter() - t0)
        groups = []
        for task, prompt, o, version in zip(tasks, gen.prompts, gen.outs, gen.versions, strict=True):
            samples = [
                Sample(
                    response_token_ids=c.token_ids,
                    response_text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    temperature=self.s.temperature,
                    top_p=self.s.top_p,
                    **versions(c, version),
                )
                for c in o
            ]
            scores = []
            for _ in o:
                r = next(results)
                scores.append(Score(reward=r.score, acc=r.acc, overlong_penalty=r.overlong_penalty, pred=r.pred))
            update: dict[str, Any] = {"prompt_token_ids": TokenIds(prompt)}  # the learner trains on these tokens
            if task.budget is not None:  # a round of a group sampled in rounds: its own samples
                update["n_samples"] = len(samples)
            task = task.model_copy(update=update)
            groups.append(ScoredGroup(task=task, samples=samples, scores=scores, replica_id=self.s.replica_id))
        return groups


def versions(c: Completion, version: int) -> dict[str, Any]:
    """A sample's policy version (of its first token) and, from continuous batching, the version of every token."""
    if not c.versions:
        return {"policy_version": version}
    return {"policy_version": c.versions[0][0], "version_runs": [list(r) for r in c.versions]}
