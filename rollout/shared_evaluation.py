"""The held-out evaluation beside training's sequences (`--eval-mode shared`, continuous batching).

    ev = SharedEvaluation(replica, engine, version, items)   # an evaluation is due: its items, as of `version`
    ev.advance(room)                      # its prompts and episodes' turns submitted, within its share
    ev.finished(key, outs)                # an engine key of its ("e/..." or "v/...") finished
    if ev.complete() and ev.report(): ... # scored and published (False: postponed, or failed and dropped)

Single-turn items: k samples each, one engine request per item (`e/<version>/<i>`), scored by the reward server
in one request once all have finished. Environment tasks: k episodes each on a runner of the evaluation's own
(`v/` keys, the evaluation's priority in the engine's book-keeping, outages failing fast), so while an episode
waits for its environment, training's sequences and the other episodes keep generating — the same path as
training's episodes (rollout/episode_runner.py); an episode's success is a positive reward. Weights may change
while it runs: it is reported as the evaluation of the version it began with, with the mean and newest versions
that sampled its tokens (the model's tokens of the episodes) and the share sampled by later versions. An
environment that fails past the runner's retries drops the evaluation: it is postponed, as when the reward server
is down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollout.engines.base import Completion, ContinuousBatching, encode_prompt
from rollout.env_client import EnvUnavailable
from rollout.episode_runner import ENV_PREFIX, EpisodeRunner
from rollout.evaluate import EvalSample, episode_eval_samples, eval_tasks
from rollout.replica import Replica
from services.datasets import Item
from services.streams import Delivery

EVAL_PRIORITY = 1  # a label in the engine's book-keeping: which sequences are the evaluation's


@dataclass
class _Episodes:
    samples: list[EvalSample] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)  # (version, model tokens) of every episode


class SharedEvaluation:
    def __init__(
        self, replica: Replica, engine: ContinuousBatching, runner: EpisodeRunner, version: int, items: list[Item]
    ):
        """`runner`: the evaluation's episode runner (prefix "v/", priority EVAL_PRIORITY), kept across them."""
        self.r, self.engine, self.runner, self.version, self.items = replica, engine, runner, version, items
        self.plain = [it for it in items if not it.verifier.startswith(ENV_PREFIX)]
        self.tasks = eval_tasks([it for it in items if it.verifier.startswith(ENV_PREFIX)], replica.s.eval_k, version)
        self.t0 = time.perf_counter()
        self.submitted = 0
        self.outs: dict[int, list[Completion]] = {}
        self.episodes: _Episodes | None = None  # the environment tasks' results, once all have ended
        params = replica.evaluator.params()
        for i, task in enumerate(self.tasks):
            runner.start(Delivery(f"eval-{version}-{i}", task, 1), params)

    def advance(self) -> None:
        """Submit single-turn prompts and episodes' turns while the evaluation's share of the engine allows."""
        s = self.r.s
        share = max(s.eval_k, int(s.max_in_flight * s.eval_share))
        while self.submitted < len(self.plain) and self.engine.in_flight(EVAL_PRIORITY) + s.eval_k <= share:
            prompt = encode_prompt(self.engine.tokenizer, self.plain[self.submitted].prompt, s.chat_template)
            key = f"e/{self.version}/{self.submitted}"
            self.engine.submit(key, prompt, s.eval_k, self.r.evaluator.params(), priority=EVAL_PRIORITY)
            self.submitted += 1
        if self.runner.pending():
            self.runner.advance(self.engine, share - self.engine.in_flight(EVAL_PRIORITY))

    def finished(self, key: str, outs: list[Completion]) -> None:
        if key.startswith("e/"):
            self.outs[int(key.rsplit("/", 1)[1])] = outs
        else:
            self.runner.engine_done(key, outs[0], self.engine.version)

    def complete(self) -> bool:
        return len(self.outs) == len(self.plain) and not self.runner.pending()

    def report(self) -> bool:
        """Scored and published (True); False: postponed (the reward server is down: report again later). An
        environment that failed past the retries raises EnvUnavailable: the evaluation is dropped, postponed."""
        if self.episodes is None:
            failed, done = self.runner.take_failed(), self.runner.take_finished()
            if failed:
                raise EnvUnavailable(f"{len(failed)} held-out tasks' episodes failed; the first: {failed[0][2]}")
            finished = {d.message.task_id: eps for d, eps in done}
            samples = episode_eval_samples(self.tasks, finished, self.engine.tokenizer)
            self.episodes = _Episodes(samples, [r for eps in finished.values() for e in eps for r in e.model_runs()])
        outs = [self.outs[i] for i in range(len(self.plain))]
        ev = self.r.evaluator
        return ev.report(self.items, outs, self.version, self.t0, self.episodes.samples, self.episodes.runs) is not None
