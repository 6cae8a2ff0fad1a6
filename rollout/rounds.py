"""Groups sampled in rounds on a replica (a PromptTask with a `budget`; the rule: rollout/budget.py): after each
round the new samples are scored, the rule decides, and the group is published, given up (published as it is:
the buffer drops and counts it), or begun again for more samples in the same runner — on the continuous-batching
loop they join the running batch at once, each with the policy version that samples it.

    rounds = Rounds(settings, publisher, metrics, params)  # params: task -> its SamplingParams
    published = rounds.settle(finished, runner, decode)   # (delivery, episodes) of a round just done, with budgets
    rounds.waiting()                                      # rounds held for a reward outage: admit nothing new

What a group holds between rounds is here, keyed by its prompt's stream entry (one owner): an environment task's
episodes (scored by their environment; the group is built from all of them at the end, so every one is re-based
on the one shared prompt), a single-turn prompt's scored samples (one scoring request per loop step for every
round that finished in it). The prompt stays pending in Redis and kept alive through every round, so a replica
killed between two rounds leaves the whole prompt to another (nothing of its rounds is published). A reward outage
holds the rounds to score (retried with backoff; the loop admits nothing new meanwhile), as the
publisher holds finished groups (with a backoff of its own). A seeded replica seeds each round apart (the first
round's seed again would draw the same answers; vLLM on CPUs cannot seed a request, the HF engine's calls are).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.budget import balanced, decide, pool_stats, round_seed
from rollout.engines.base import SamplingParams
from rollout.episode_runner import EpisodeRunner
from rollout.episodes import Episode
from rollout.groups import GroupRefused, env_scores, episode_group
from rollout.metrics import RolloutMetrics
from rollout.publisher import Backoff, Generated, Publisher
from rollout.reward_client import RewardRejected, RewardUnavailable
from rollout.settings import RolloutSettings
from services.arrays import TokenIds
from services.draws import uniform
from services.schemas import GroupSampling, PromptTask, Sample, Score, ScoredGroup
from services.streams import Delivery

log = logging.getLogger(__name__)
Finished = list[tuple[Delivery[PromptTask], list[Episode]]]


@dataclass
class _Drawn:
    """A group between its rounds: everything drawn so far."""

    rounds: int = 0
    episodes: list[Episode] = field(default_factory=list)  # an environment task's
    samples: list[Sample] = field(default_factory=list)  # a single-turn prompt's, scored
    scores: list[Score] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # a single-turn prompt's tokens (its next rounds open on them)

    def accs(self) -> list[bool]:
        return [s.acc for s in self.scores]


class Rounds:
    def __init__(
        self,
        s: RolloutSettings,
        publisher: Publisher,
        metrics: RolloutMetrics,
        params: Callable[[PromptTask], SamplingParams],
    ):
        """`params`: how a task's samples are drawn (the replica's sampling, seeded by the task)."""
        self.s, self.pub, self.m, self.params = s, publisher, metrics, params
        self.drawn: dict[str, _Drawn] = {}  # stream entry id -> what its group drew so far
        self.unscored: Finished = []  # single-turn rounds finished while the reward server was down
        self.backoff = Backoff()  # of the rounds held to score

    def begin(self, runner: EpisodeRunner, d: Delivery[PromptTask], prompt: list[int] | None) -> None:
        """The prompt's first round (its budget's `first` samples)."""
        budget = d.message.budget
        assert budget is not None
        self.drawn[d.entry_id] = _Drawn(prompt=list(prompt or []))
        runner.start(d, self.params(d.message), prompt, n=budget.first)

    def waiting(self) -> bool:
        """Rounds wait for the reward server: the loop admits nothing new."""
        return bool(self.unscored)

    def holds(self, entry_id: str) -> bool:
        return entry_id in self.drawn

    def forget(self, entry_id: str) -> None:
        """The prompt was dead-lettered in a round: what its earlier rounds drew goes with it."""
        self.drawn.pop(entry_id, None)

    def settle(self, finished: Finished, runner: EpisodeRunner, decode: Callable[[list[int]], str]) -> int:
        """Each round just finished scored and judged: the groups done published (with their prompts'
        acknowledgement), the others begun again for their next round. The groups published."""
        one_step = [(d, eps) for d, eps in finished if eps and eps[0].one_step]
        if one_step:  # the answers' metrics once, as they finish (a held round is scored again, not counted again)
            self.m.answered(Generated.of(one_step).outs)
        for d, eps in finished:
            if not (eps and eps[0].one_step):
                self.drawn[d.entry_id].episodes += eps
                self.drawn[d.entry_id].rounds += 1
        ready = [d for d, eps in finished if not (eps and eps[0].one_step)]
        if self.unscored and self.backoff.wait_s() <= 0:
            one_step, self.unscored = self.unscored + one_step, []
        elif self.unscored:
            self.unscored += one_step
            one_step = []
        ready += self.score(one_step)
        out: list[tuple[Delivery[PromptTask], ScoredGroup]] = []
        for d in ready:
            group = self.judge(d, runner, decode)
            if group is not None:
                out.append((d, group))
        return self.pub.send(out)

    def score(self, rounds: Finished) -> list[Delivery[PromptTask]]:
        """The single-turn rounds' samples scored (one request), added to their groups; the deliveries scored.
        An outage holds them all (retried with backoff); a prompt the reward server refuses is dead-lettered."""
        if not rounds:
            return []
        gen = Generated.of(rounds)
        try:
            try:
                groups = self.pub.score(gen)
            except RewardRejected:
                groups = self.pub.score_one_by_one(gen)  # a refused prompt dead-lettered
        except RewardUnavailable as e:
            self.pub.m.reward_failures.inc()
            self.unscored = rounds
            delay = self.backoff.failed()
            log.error("%s; %d rounds held, scoring again in %.0f s", e, len(rounds), delay)
            return []
        self.backoff.answered()
        by_id = {g.group_id: g for g in groups}
        scored = []
        for d in gen.deliveries:
            g = by_id.get(d.message.task_id)
            if g is None:  # refused and dead-lettered
                self.drawn.pop(d.entry_id, None)
                continue
            drawn = self.drawn[d.entry_id]
            drawn.samples += g.samples
            drawn.scores += g.scores
            drawn.rounds += 1
            scored.append(d)
        return scored

    def judge(
        self, d: Delivery[PromptTask], runner: EpisodeRunner, decode: Callable[[list[int]], str]
    ) -> ScoredGroup | None:
        """The rule after this round: the group to publish, or None (another round begun, or dead-lettered)."""
        task, drawn = d.message, self.drawn[d.entry_id]
        budget = task.budget
        assert budget is not None
        if drawn.episodes:
            scores = env_scores(drawn.episodes)
            accs = [s.acc for s in scores]
        else:
            accs = drawn.accs()
        draw = budget.draw if budget.draw is not None else uniform(None, task.task_id, "give-up")
        verdict = decide(budget, task.n_samples, accs, drawn.rounds, draw)
        if verdict.what == "more":
            params = self.params(task)
            params = dataclasses.replace(params, seed=round_seed(params.seed, drawn.rounds + 1))
            runner.start(d, params, drawn.prompt or None, n=verdict.add)
            return None
        del self.drawn[d.entry_id]
        n = len(accs)
        keep = balanced(accs, task.n_samples) if budget.rule == "balanced" else list(range(n))
        self.m.group_drawn.observe(n)
        self.m.group_rounds.observe(drawn.rounds)
        self.m.down_sampled.inc(n - len(keep))
        if verdict.what == "give_up":
            self.m.given_up.inc()
        first = accs[: budget.first]
        sampling = GroupSampling(
            rounds=drawn.rounds,
            drawn=n,
            drawn_right=sum(accs),
            gave_up=verdict.what == "give_up",
            first_agreed=all(first) or not any(first),
        )
        if budget.rule == "balanced":
            rewards = [s.reward for s in scores] if drawn.episodes else [s.reward for s in drawn.scores]
            mean, std = pool_stats(rewards)
            sampling = sampling.model_copy(update={"pool_mean": mean, "pool_std": std})
        if drawn.episodes:
            eps = [drawn.episodes[i] for i in keep]
            try:
                group = episode_group(task, eps, env_scores(eps), self.s.replica_id, decode)
            except GroupRefused as e:
                log.error("prompt %s dead-lettered: %s", task.task_id, e)
                self.pub.consumer.dead_letter([d], "env_rejected", str(e))
                return None
            return group.model_copy(update={"sampling": sampling})
        samples, group_scores = [drawn.samples[i] for i in keep], [drawn.scores[i] for i in keep]
        update = {"n_samples": len(samples), "prompt_token_ids": TokenIds(drawn.prompt)}
        return ScoredGroup(
            task=task.model_copy(update=update),
            samples=samples,
            scores=group_scores,
            replica_id=self.s.replica_id,
            sampling=sampling,
        )
