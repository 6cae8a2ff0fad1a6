"""The chunked loop of a rollout replica (the HF engine, or vLLM with --no-stream): engine calls of up to
`prompts_per_call` prompts, weights loaded between calls.

Per step: load newer weights if any; if groups are held for a reward outage, score them again once backed off
(reading nothing new meanwhile, the held prompts kept alive); else run the held-out evaluation if one is due
(seeded, in calls of its own), read up to `prompts_per_call` PromptTasks and roll each out as G episodes
(rollout/episode_runner.py) turn by turn: every live episode's turn in one engine call, then every environment
step of the round (a single-turn prompt's one-step episodes take one round: G samples of each prompt in one
call), and hand the finished groups to the publisher (score, publish, acknowledge: rollout/publisher.py).
"""

from __future__ import annotations

import time

from rollout.engines.base import Engine
from rollout.episode_runner import run_turn_by_turn
from rollout.replica import Replica
from services.schemas import PromptTask
from services.streams import Delivery


class ChunkedLoop:
    def __init__(self, replica: Replica, engine: Engine):
        self.r, self.engine, self.m = replica, engine, replica.metrics
        self.episodes = replica.episodes

    def step(self) -> int:
        r = self.r
        r.membership.sync_weights()  # weights change only between engine calls
        if r.publisher.holding():  # the reward server was down: nothing new until these are scored
            r.consumer.keep_alive()
            if self.episodes.pending():  # episodes begun go on (an environment's need no reward server)
                self.generate()
            elif (wait := r.publisher.retry_in()) > 0:
                time.sleep(min(0.5, wait))
                return 0
            return r.publish()  # held groups and held rounds, each once its backoff is over
        r.evaluator.run_seeded(self.engine)
        for d in self.read():
            r.begin(d)
        if self.episodes.pending():
            self.generate()
        if self.episodes.env.closing.is_set():  # told to leave mid-way: nothing is published, prompts stay pending
            return 0
        return r.publish()

    def read(self) -> list[Delivery[PromptTask]]:
        wait = 0 if self.episodes.pending() else 1000  # a group's next round waits for no new prompt
        return self.r.consumer.read(count=self.r.s.prompts_per_call, block_ms=wait)

    def generate(self) -> None:
        """The episodes begun, turn by turn to their end; the generation speed measured over them."""
        r = self.r
        t0 = time.perf_counter()
        tokens = run_turn_by_turn(
            self.engine, self.episodes, keep_alive=r.consumer.keep_alive, stopped=r.evaluator.stopping
        )
        gen_s = time.perf_counter() - t0
        self.m.tokens.inc(tokens)
        r.membership.tokens_per_s = tokens / gen_s if gen_s else 0.0
        self.m.batch_seconds.observe(gen_s)
        self.m.tokens_per_second.set(r.membership.tokens_per_s)

    def close(self) -> None:
        """No engine call to drop (between two steps none is running); episodes left open by a step that raised
        are closed on the environment service."""
        self.episodes.close()
        self.r.evaluator.close()
