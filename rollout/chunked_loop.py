"""The chunked loop of a rollout replica (the HF engine, or vLLM with --no-stream): engine calls of up to
`prompts_per_call` prompts, weights loaded between calls.

Per step: load newer weights if any; if groups are held for a reward outage, score them again once backed off
(reading nothing new meanwhile, the held prompts kept alive); else run the held-out evaluation if one is due
(seeded, in calls of its own), read up to `prompts_per_call` PromptTasks, generate G samples of each in one engine
call, and hand them to the publisher (score, publish, acknowledge: rollout/publisher.py). Environment tasks among
them run as episodes turn by turn (rollout/episode_runner.py): every live episode's turn in one engine call, then
every environment step of the round.
"""

from __future__ import annotations

import time

from rollout.engines.base import Engine
from rollout.episode_runner import EpisodeRunner, env_task, run_turn_by_turn
from rollout.publisher import Generated
from rollout.replica import Replica
from services.schemas import PromptTask
from services.streams import Delivery


class ChunkedLoop:
    def __init__(self, replica: Replica, engine: Engine):
        self.r, self.engine, self.m = replica, engine, replica.metrics
        self._episodes: EpisodeRunner | None = None

    def step(self) -> int:
        r = self.r
        r.membership.sync_weights()  # weights change only between engine calls
        if r.publisher.held is not None:  # the reward server was down: nothing new until these are scored
            r.consumer.keep_alive()
            if (wait := r.publisher.retry_in()) > 0:
                time.sleep(min(0.5, wait))
                return 0
            return r.publisher.retry_held()
        r.evaluator.run_seeded(self.engine)
        deliveries = r.consumer.read(count=r.s.prompts_per_call, block_ms=1000)
        plain: list[Delivery[PromptTask]] = []
        episodes: list[Delivery[PromptTask]] = []
        for d in deliveries:
            try:
                (episodes if env_task(d.message) else plain).append(d)
            except ValueError as e:  # a malformed environment task
                r.consumer.dead_letter([d], "env_task_invalid", str(e)[:500])
        published = self.run_episodes(episodes) if episodes else 0
        return published + (r.publisher.publish(self.generate(plain)) if plain else 0)

    def run_episodes(self, deliveries: list[Delivery[PromptTask]]) -> int:
        """The environment tasks' episodes, turn by turn, to their end; their groups published."""
        if self._episodes is None:
            self._episodes = EpisodeRunner(self.r.s, self.engine.tokenizer, self.m)
        runner = self._episodes
        for d in deliveries:
            runner.start(d, self.r.call_params([d.message]))
        run_turn_by_turn(self.engine, runner, keep_alive=self.r.consumer.keep_alive, stopped=self.r.evaluator.stopping)
        if runner.client.closing.is_set():  # told to leave mid-way: nothing is published, the prompts stay pending
            self._episodes = None
            return 0
        for d, why in runner.take_failed():
            self.r.consumer.dead_letter([d], "env_failed", why)
        tok = self.engine.tokenizer
        return self.r.publisher.publish_episodes(
            runner.take_finished(), lambda ids: tok.decode(ids, skip_special_tokens=False)
        )

    def generate(self, deliveries: list[Delivery[PromptTask]]) -> Generated:
        tasks = [d.message for d in deliveries]
        prompts = [self.r.prompt_ids(t, self.engine.tokenizer) for t in tasks]
        version = self.engine.version  # weights change only between engine calls
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, [t.n_samples for t in tasks], self.r.call_params(tasks))
        gen_s = time.perf_counter() - t0
        n_tokens = self.m.generated(outs)
        self.r.membership.tokens_per_s = n_tokens / gen_s if gen_s else 0.0
        self.m.batch_seconds.observe(gen_s)
        self.m.tokens_per_second.set(self.r.membership.tokens_per_s)
        return Generated(deliveries, prompts, outs, version)

    def close(self) -> None:
        """Nothing to drop: between two steps no engine call is running."""
