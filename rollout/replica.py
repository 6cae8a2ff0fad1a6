"""A rollout replica's parts that do not depend on how it batches, and the interface of its two loops.

    replica = Replica.build(settings, client, engine, reward, metrics, receiver)
    loop = ChunkedLoop(replica, engine)            # rollout/chunked_loop.py: engine calls, weights between them
    loop = ContinuousLoop(replica, engine)         # rollout/continuous_loop.py: continuous batching (vLLM)
    while running:
        loop.step()
    loop.close()

    membership   the heartbeat and the weights served (rollout/membership.py)
    episodes     every prompt's G samples as episodes: one-step for a single-turn prompt, against the
                 environment service for an env task (rollout/episode_runner.py): the one rollout path
    publisher    scoring, publishing with the acknowledgement, the reward-outage hold, dead letters
                 (rollout/publisher.py); a task with a budget sampled in rounds (rollout/rounds.py)
    evaluator    the held-out evaluation beside training (rollout/evaluator.py)
    consumer     the prompts (dapo:prompts, consumer group `rollout`): own pending entries first after a restart,
                 then entries another replica left idle, then new ones

Both loops hold the same parts, so the rollout of a prompt, the reward-outage hold, the sample metrics and the
evaluation's postponement are written once; a loop only decides when prompts are read and when the engine runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from rollout.engines.base import Engine, SamplingParams, encode_prompt
from rollout.episode_runner import EpisodeRunner, env_task
from rollout.evaluator import Evaluator
from rollout.membership import Membership
from rollout.metrics import RolloutMetrics
from rollout.publisher import Publisher
from rollout.reward_client import RewardClient
from rollout.rounds import Rounds
from rollout.settings import RolloutSettings
from rollout.weight_receiver import WeightReceiver
from services.schemas import CLIENT_SCORED, PromptTask
from services.streams import GROUP_ROLLOUT, STREAM_PROMPTS, Delivery, StreamConsumer

log = logging.getLogger(__name__)


class Loop(Protocol):
    def step(self) -> int:
        """One turn of the loop; the groups it published."""
        ...

    def close(self) -> None:
        """Leave: whatever is in flight is dropped, its prompts stay pending for another replica."""
        ...


@dataclass
class Replica:
    s: RolloutSettings
    consumer: StreamConsumer[PromptTask]
    membership: Membership
    publisher: Publisher
    evaluator: Evaluator
    metrics: RolloutMetrics
    episodes: EpisodeRunner
    rounds: Rounds | None = None  # tasks with a budget, sampled in rounds (set by build)

    @classmethod
    def build(
        cls,
        s: RolloutSettings,
        client: redis.Redis,
        engine: Engine,
        reward: RewardClient,
        metrics: RolloutMetrics,
        receiver: WeightReceiver | None = None,
    ) -> Replica:
        consumer = StreamConsumer(
            client,
            STREAM_PROMPTS,
            GROUP_ROLLOUT,
            s.replica_id,
            PromptTask,
            claim_idle_ms=s.claim_idle_ms,
            registry=metrics.registry,
        )
        replica = cls(
            s,
            consumer,
            Membership(s, client, engine, metrics, receiver),
            Publisher(s, consumer, reward, metrics),
            Evaluator(s, client, reward, metrics),
            metrics,
            EpisodeRunner(s, engine.tokenizer, metrics),
        )
        replica.rounds = Rounds(s, replica.publisher, metrics, lambda t: replica.call_params([t]))
        replica.publisher.rounds = replica.rounds  # the publisher hands it the rounds that finish
        return replica

    def begin(self, d: Delivery[PromptTask]) -> bool:
        """The prompt's G episodes begun (True); a malformed environment task, or a client-scored one (only a
        gateway session's client can score it), dead-lettered instead (False)."""
        if d.message.verifier == CLIENT_SCORED:
            why = "a client-scored task is rolled out by gateway sessions only (run the replica with --gateway-only)"
            log.error("prompt %s dead-lettered: %s", d.message.task_id, why)
            self.consumer.dead_letter([d], "client_scored", why)
            return False
        try:
            spec = env_task(d.message)
        except ValueError as e:
            log.error("prompt %s dead-lettered: %s", d.message.task_id, e)
            self.consumer.dead_letter([d], "env_task_invalid", str(e)[:500])
            return False
        prompt = None if spec is not None else self.prompt_ids(d.message, self.episodes.tok)
        if d.message.budget is not None and self.rounds is not None:
            self.rounds.begin(self.episodes, d, prompt)  # sampled in rounds (rollout/rounds.py)
        else:
            self.episodes.start(d, self.call_params([d.message]), prompt)
        return True

    def holds(self, entry_id: str) -> bool:
        """Whether the prompt of this stream entry is being rolled out here (in a round, or between two)."""
        return self.episodes.holds(entry_id) or (self.rounds is not None and self.rounds.holds(entry_id))

    def publish(self) -> int:
        """Groups held for a reward outage scored again once backed off; then the groups the episodes finished,
        published, and the failed ones dead-lettered (held too while the outage lasts)."""
        tok = self.episodes.tok
        published = self.publisher.retry_held()
        return published + self.publisher.finish(self.episodes, lambda ids: tok.decode(ids, skip_special_tokens=False))

    def call_params(self, tasks: list[PromptTask]) -> SamplingParams:
        """How these training prompts are sampled (seeded by them, with --seed)."""
        s = self.s
        return seeded(
            SamplingParams(s.temperature, s.top_p, s.max_response_tokens, s.seed), s.seed, [t.task_id for t in tasks]
        )

    def prompt_ids(self, task: PromptTask, tokenizer: Any) -> list[int]:
        """The prompt's tokens: as the buffer sent them, else its text encoded (in the chat template, unless off)."""
        if task.prompt_token_ids is not None:
            return task.prompt_token_ids.tolist()
        return encode_prompt(tokenizer, task.prompt or "", self.s.chat_template)


def seeded(params: SamplingParams, seed: int | None, task_ids: list[str]) -> SamplingParams:
    """With a seed, each engine call is seeded from the seed and its tasks: the same prompts and weights give the
    same samples (a seeded run can be repeated), and no two calls share a random sequence."""
    if seed is None:
        return params
    digest = hashlib.blake2b(f"{seed}:{','.join(task_ids)}".encode(), digest_size=4).digest()
    return dataclasses.replace(params, seed=int.from_bytes(digest) >> 1)
