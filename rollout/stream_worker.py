"""The streaming replica's loop (vLLM): prompts enter the running batch as they come, each group is scored and
published as soon as its G samples finish, weights load while sequences are in flight.

Per iteration: load new weights if any (`keep`/`recompute`: now, with sequences in flight; `drain`: once none
is), publish the groups that finished (one scoring request, then XADD + XACK in one step), read as many prompts
as fit under `max_in_flight` sequences and submit them, top up the held-out evaluation's share, and run one
engine step (rollout/streaming.py). Prompts in flight stay pending in Redis, kept alive: a replica killed at any
point leaves them to be reclaimed. A reward outage holds the finished groups and admits nothing new until they
are scored (as the chunked loop, rollout/worker.py); sequences in flight still finish.

The held-out evaluation shares the engine (`--eval-mode shared`): its prompts enter beside training's, at most
`eval_share` of the sequences in flight, so training's rollouts never stop for it. Weights may change while it
runs: it is reported as the evaluation of the version it began with, with the mean and newest versions that
sampled its tokens and the share sampled by later versions (EvalResult). Its samples are not seeded one by one
(vLLM on CPU cannot seed a request); `--eval-mode stop` drains the engine and runs the chunked, seeded evaluation
instead, the numbers `dapo-mesh eval` gives.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import redis

from rollout.engine import Completion, encode_prompt
from rollout.evaluate import score_samples, summarize
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient, RewardRejected, RewardUnavailable
from rollout.settings import RolloutSettings
from rollout.streaming import RequestRefused, StreamingEngine
from rollout.weight_receiver import WeightReceiver
from rollout.worker import Generated, Worker
from services.datasets import Item
from services.schemas import PromptTask
from services.streams import Delivery

log = logging.getLogger(__name__)
IDLE_WINDOW_S = 60.0  # dapo_rollout_idle_fraction: over the last minute
EVAL_PRIORITY = 1  # a label in the engine's book-keeping: which sequences are the evaluation's


@dataclass
class _Evaluation:
    version: int
    items: list[Item]
    t0: float = field(default_factory=time.perf_counter)
    submitted: int = 0
    outs: dict[int, list[Completion]] = field(default_factory=dict)
    retry_at: float = 0.0


class StreamWorker(Worker):
    engine: StreamingEngine  # type: ignore[assignment]

    def __init__(
        self,
        s: RolloutSettings,
        client: redis.Redis,
        engine: StreamingEngine,
        reward: RewardClient,
        metrics: RolloutMetrics,
        receiver: WeightReceiver | None = None,
    ):
        super().__init__(s, client, engine, reward, metrics, receiver)  # type: ignore[arg-type]
        self.flight: dict[str, tuple[Delivery[PromptTask], list[int]]] = {}  # engine key -> prompt, its tokens
        self.finished: list[tuple[Delivery[PromptTask], list[int], list[Completion]]] = []  # generated, unpublished
        self.evaluation: _Evaluation | None = None
        self.waiting_load = False  # drain mode: new weights wait for the sequences in flight
        self.eval_waiting = False  # --eval-mode stop: the evaluation waits for the sequences in flight
        self.group_size = 1  # samples per prompt, as the last prompt asked: how many prompts fit
        self.last, self.idle = time.monotonic(), True
        self.busy: deque[tuple[float, float, bool]] = deque()  # (start, seconds, idle) over the idle window
        self.window_tokens: deque[tuple[float, int]] = deque()
        self.sums = [0.0, 0.0, 0.0]  # seconds, idle seconds, tokens in the window: kept, not summed every step

    def step(self) -> int:
        self._account()
        self.sync_weights()
        published = self.publish_finished()
        self.admit()
        self.advance_evaluation()
        self.idle = not self.engine.in_flight()  # then nothing runs until the next call (a read waited instead)
        for key, outs in self.engine.step():
            self._finished(key, outs)
        self.m.in_flight.set(self.engine.in_flight())
        return published

    # ---------------------------------------------------------------- weights

    def sync_weights(self) -> bool:
        """keep/recompute: load now, sequences in flight; drain: stop admitting, load when none is in flight."""
        if self.engine.draining:  # no load now, whatever arrives meanwhile: stop admitting once one waits
            self.waiting_load = self._weights_waiting()
            return False
        self.waiting_load = False
        return super().sync_weights()

    def _weights_waiting(self) -> bool:
        return (self.receiver is not None and self.receiver.ready is not None) or self.newer_snapshot() is not None

    # ---------------------------------------------------------------- training prompts

    def admit(self) -> None:
        """Read as many prompts as fit under the bound on sequences in flight; none while groups are held for a
        reward outage or weights wait for a drain."""
        if self.unscored is not None or self.finished or self.waiting_load or self.eval_waiting:
            self.consumer.keep_alive()
            if not self.engine.in_flight():
                time.sleep(0.1)  # held for a reward outage, nothing to step: no busy loop
            return
        room = self.s.max_in_flight - self.engine.in_flight()
        count = room // self.group_size
        if count < 1:
            self.consumer.keep_alive()  # the prompts in flight stay ours
            return
        idle = not self.engine.in_flight()
        for d in self.consumer.read(count=count, block_ms=1000 if idle else 0):
            task = d.message
            key = f"t/{d.entry_id}"
            if key in self.flight:
                continue  # our own entry again (a replay after a restart of the consumer): it is in flight
            prompt = self.prompt_ids(task)
            try:
                self.engine.submit(key, prompt, task.n_samples, self.call_params([task]))
            except RequestRefused as e:  # the engine refuses this prompt (too long for its context): not retried
                log.error("prompt %s dead-lettered: the engine refused it: %s", task.task_id, e)
                self.consumer.dead_letter([d], "engine_rejected", str(e)[:500])
                continue
            self.flight[key] = (d, prompt)
            self.group_size = max(1, task.n_samples)

    def _finished(self, key: str, outs: list[Completion]) -> None:
        for c in outs:
            n = len(c.versions) if c.versions else 1
            self.m.versions_per_sample.observe(n)
            if n > 1:
                self.m.multi_version_samples.inc()
        if key.startswith("e/"):
            assert self.evaluation is not None
            self.evaluation.outs[int(key.rsplit("/", 1)[1])] = outs
            return
        d, prompt = self.flight.pop(key)
        self.finished.append((d, prompt, outs))
        n_tokens = sum(len(c.token_ids) for c in outs)
        self.m.tokens.inc(n_tokens)
        self.m.samples.inc(len(outs))
        self.m.truncated.inc(sum(c.finish_reason == "length" for c in outs))
        self.window_tokens.append((time.monotonic(), n_tokens))
        self.sums[2] += n_tokens

    def publish_finished(self) -> int:
        """The finished groups: scored in one request and published (Worker.publish: a reward outage holds them,
        retried with backoff, and nothing new is read meanwhile)."""
        if self.unscored is not None:
            if time.monotonic() < self.retry_at:
                return 0
            n = self.publish(self.unscored)
            if self.unscored is not None:
                return n
        if not self.finished:
            return 0
        done, self.finished = self.finished, []
        gen = Generated([d for d, _, _ in done], [p for _, p, _ in done], [o for _, _, o in done], self.engine.version)
        return self.publish(gen)

    # ---------------------------------------------------------------- the held-out evaluation

    def advance_evaluation(self) -> None:
        s = self.s
        if self.evaluation is None:
            if s.eval_every is None or self.engine.version < self.next_eval:
                return
            if s.eval_mode == "stop":  # stop the world: drain, then the chunked, seeded evaluation
                self.eval_waiting = True
                if not self.engine.in_flight():
                    self.maybe_evaluate(self.engine.vllm)  # `dapo-mesh eval`'s numbers for these weights and seed
                    self.eval_waiting = False
                return
            try:
                items = self.held_out()
            except FileNotFoundError as e:  # no eval.jsonl yet
                log.warning("held-out evaluation of version %d postponed: %s", self.engine.version, e)
                self.next_eval = self.engine.version + 1
                return
            if items is None:
                return
            self.evaluation = _Evaluation(self.engine.version, items)
        ev = self.evaluation
        if self.waiting_load:
            return
        share = max(s.eval_k, int(s.max_in_flight * s.eval_share))
        while ev.submitted < len(ev.items) and self.engine.in_flight(EVAL_PRIORITY) + s.eval_k <= share:
            item = ev.items[ev.submitted]
            prompt = encode_prompt(self.engine.tokenizer, item.prompt, s.chat_template)
            self.engine.submit(
                f"e/{ev.version}/{ev.submitted}", prompt, s.eval_k, self.eval_params(), priority=EVAL_PRIORITY
            )
            ev.submitted += 1
        if len(ev.outs) == len(ev.items) and time.monotonic() >= ev.retry_at:
            self._report(ev)

    def _report(self, ev: _Evaluation) -> None:
        outs = [ev.outs[i] for i in range(len(ev.items))]
        try:
            samples = score_samples(ev.items, outs, self.reward, self.s.max_response_tokens)
        except (RewardUnavailable, RewardRejected) as e:
            log.warning("held-out evaluation of version %d: scoring postponed: %s", ev.version, e)
            ev.retry_at = time.monotonic() + 10.0
            return
        self.evaluation = None
        report = summarize(ev.items, samples, self.s.eval_k, ev.version, time.perf_counter() - ev.t0)
        self.publish_eval(report, [r for o in outs for c in o for r in (c.versions or ())])

    # ---------------------------------------------------------------- metrics

    def _account(self) -> None:
        """Idle time (no sequence in the engine) and generation speed, over the last minute."""
        now, idle = time.monotonic(), self.idle
        sums, sec = self.sums, now - self.last
        self.busy.append((self.last, sec, idle))
        sums[0] += sec
        if idle:
            sums[1] += sec
            self.m.idle_seconds.inc(sec)
        self.last = now
        while self.busy and self.busy[0][0] < now - IDLE_WINDOW_S:
            _, old, was = self.busy.popleft()
            sums[0] -= old
            sums[1] -= old if was else 0.0
        while self.window_tokens and self.window_tokens[0][0] < now - IDLE_WINDOW_S:
            sums[2] -= self.window_tokens.popleft()[1]
        if sums[0] > 0:
            self.m.idle_fraction.set(min(1.0, max(0.0, sums[1] / sums[0])))
            self.tokens_per_s = sums[2] / sums[0]
            self.m.tokens_per_second.set(self.tokens_per_s)

    def stop(self) -> None:
        """Leave: the sequences in flight are dropped; their prompts stay pending for another replica."""
        self.engine.abort()
        self.flight.clear()
