"""The continuous-batching loop of a rollout replica (vLLM, the default): prompts join the running batch as room
frees up, each group is scored and published as soon as its G samples finish, weights load while sequences are
in flight.

Every prompt is rolled out as G episodes (rollout/episode_runner.py): a single-turn prompt's are one-step, an
environment task's take turns with their environment, leaving the engine while it answers. Per step: load new
weights if any (`keep`/`recompute`: now, with sequences in flight; `drain`: once none is), publish the groups that
finished (rollout/publisher.py: one scoring request for the one-step ones, then XADD + XACK in one step), submit
the episodes' next model turns, read as many prompts as fit under `max_in_flight` sequences (and `max_episodes`)
and submit their first turns, top up the held-out evaluation's share, and run one engine step
(rollout/engines/continuous.py). Prompts in flight stay pending in Redis, kept alive: a replica killed at any
point leaves them to be reclaimed. A reward outage holds the finished groups and admits nothing new until they are
scored (as the chunked loop does); sequences in flight still finish. A prompt the engine refuses (longer than the
model's context) is dead-lettered: retrying it cannot help.

The held-out evaluation shares the engine (`--eval-mode shared`, rollout/shared_evaluation.py): its prompts and
its environment tasks' episodes enter beside training's, at most `eval_share` of the sequences in flight, so
training's rollouts never stop for it. Weights may change while it
runs: it is reported as the evaluation of the version it began with, with the mean and newest versions that
sampled its tokens and the share sampled by later versions (EvalResult). Its samples are not seeded one by one
(vLLM on CPU cannot seed a request); `--eval-mode stop` drains the engine and runs the chunked, seeded evaluation
instead (rollout/evaluator.py), the numbers `dapo-mesh eval` gives.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from rollout.engines.base import Completion, ContinuousBatching
from rollout.env_client import EnvUnavailable
from rollout.episode_runner import ENV_PREFIX, EpisodeRunner
from rollout.gateway.core import Gateway
from rollout.metrics import RolloutMetrics
from rollout.replica import Replica
from rollout.shared_evaluation import EVAL_PRIORITY, SharedEvaluation
from services.schemas import PromptTask

log = logging.getLogger(__name__)
IDLE_WINDOW_S = 60.0  # dapo_rollout_idle_fraction: over the last minute


class ContinuousLoop:
    def __init__(self, replica: Replica, engine: ContinuousBatching, gateway: Gateway | None = None):
        self.r, self.engine, self.m = replica, engine, replica.metrics
        self.gateway = gateway  # the OpenAI-compatible gateway's sessions (rollout/gateway/), if served
        self.episodes = replica.episodes  # every prompt's G samples, one-step or against an environment
        self.evaluation: SharedEvaluation | None = None
        self._eval_episodes: EpisodeRunner | None = None  # the evaluations' environment tasks, made at the first
        self.waiting_load = False  # drain mode: new weights wait for the sequences in flight
        self.eval_waiting = False  # --eval-mode stop: the evaluation waits for the sequences in flight
        self.group_size = 1  # samples per prompt, as the last prompt asked: how many prompts fit
        self.idle = True  # no sequence ran in the last engine step
        self.window = IdleWindow(self.m)

    def step(self) -> int:
        self.r.membership.tokens_per_s = self.window.account(self.idle)
        self.sync_weights()
        published = self.r.publish()
        gw = self.gateway
        if gw is not None:  # its calls first: an agent waits on each
            gw.advance(self.engine, self.r.consumer, hold=self.waiting_load or self.eval_waiting)
            done = gw.publish(self.r.consumer)
            self.r.publisher.done += done  # --max-prompts counts the gateway's groups too
            published += done
        self.advance_episodes()  # episodes' next turns take the engine's room before new prompts do
        if not self.r.s.gateway_only and self.admit(wait=not published):
            self.advance_episodes()  # the new prompts' first turns
        self.wait_for_environments()
        self.advance_evaluation()
        if gw is not None and not self.engine.in_flight() and not self.episodes.pending():
            gw.idle_wait(0.1)  # a call wakes it at once
        self.idle = not self.engine.in_flight()  # then nothing runs until the next call (a read waited instead)
        finished = self.engine.step()
        if gw is not None:  # streamed tokens out first: a finished call's last ones are among them
            gw.stream(self.engine.take_deltas())
        for key, outs in finished:
            self._finished(key, outs)
        self.m.in_flight.set(self.engine.in_flight())
        return published

    def close(self) -> None:
        """Leave: the sequences in flight are dropped; their prompts stay pending for another replica. The gateway's
        sessions end first (their clients told, their environment episodes queued to close), then the episodes are
        closed on the environment service (an engine that died may not abort)."""
        if self.gateway is not None:
            self.gateway.close()
        self.episodes.close()
        if self._eval_episodes is not None:
            self._eval_episodes.close()
        self.r.evaluator.close()
        self.engine.abort()

    def sync_weights(self) -> None:
        """keep/recompute: load now, sequences in flight; drain: stop admitting, load when none is in flight."""
        if self.engine.draining:  # no load now, whatever arrives meanwhile: stop admitting once one waits
            self.waiting_load = self.r.membership.weights_waiting()
            return
        self.waiting_load = False
        self.r.membership.sync_weights()

    # ---------------------------------------------------------------- training prompts

    def admit(self, wait: bool = True) -> bool:
        """Read as many prompts as fit under the bounds on sequences in flight and on episodes, and begin their
        episodes (True: some began); none while groups are held for a reward outage or weights wait for a drain.
        An idle engine waits for prompts (up to a second), unless this step just published: then the step returns
        at once (its caller sees the groups out without a second's wait for prompts that may never come; the
        next step waits)."""
        r, runner = self.r, self.episodes
        if r.publisher.holding() or self.waiting_load or self.eval_waiting:
            r.consumer.keep_alive()
            if not self.engine.in_flight():
                time.sleep(0.1)  # held for a reward outage, nothing to step: no busy loop
            return False
        # --max-episodes bounds environments' episodes (those waiting for their environment are not in the engine)
        room = min(r.s.max_in_flight - self.engine.in_flight(), r.s.max_episodes - runner.live_env)
        count = room // self.group_size
        if count < 1:
            r.consumer.keep_alive()  # the prompts in flight stay ours
            return False
        ev_waits = self.evaluation is not None and self.evaluation.runner.pending()  # on its environment
        idle = wait and not self.engine.in_flight() and not runner.pending() and not ev_waits
        began = False
        block_ms = (50 if self.gateway is not None else 1000) if idle else 0  # the gateway's calls wait less
        for d in r.consumer.read(count=count, block_ms=block_ms):
            if r.holds(d.entry_id):
                continue  # our own entry again (a replay after a restart of the consumer): it is in flight
            if r.begin(d):
                began = True
                self.group_size = admitted_size(d.message)
        return began

    def advance_episodes(self) -> None:
        """Environment answers in, model turns submitted (none while a weight load waits for a drain: the turns in
        the engine finish, the next ones wait for the load)."""
        if not self.episodes.pending():
            return
        room = 0 if self.waiting_load else self.r.s.max_in_flight - self.engine.in_flight()
        self.episodes.advance(self.engine, room)
        self.m.in_flight.set(self.engine.in_flight())

    def wait_for_environments(self) -> None:
        """Nothing in the engine, episodes waiting for their environment: a short wait, not a busy loop."""
        runners = [self.episodes] + ([self.evaluation.runner] if self.evaluation is not None else [])
        if self.engine.in_flight() or any(r.ready for r in runners):
            return
        busy = [r for r in runners if r.calls]
        if busy:
            busy[0].wait(0.05)

    def _finished(self, key: str, outs: list[Completion]) -> None:
        """A model turn is done: its episode goes on (to its environment's step, or its end); an evaluation's
        group: kept for its report."""
        for c in outs:
            n = len(c.versions) if c.versions else 1
            self.m.versions_per_sample.observe(n)
            if n > 1:
                self.m.multi_version_samples.inc()
        if key.startswith("g/"):
            assert self.gateway is not None
            self.gateway.finished(key, outs)
            self.m.tokens.inc(sum(len(c.token_ids) for c in outs))
            return
        if key.startswith(("e/", "v/")):
            assert self.evaluation is not None
            self.evaluation.finished(key, outs)
            return
        self.episodes.engine_done(key, outs[0], self.engine.version)
        n = len(outs[0].token_ids)
        self.m.tokens.inc(n)
        self.window.tokens(n)

    # ---------------------------------------------------------------- the held-out evaluation

    def advance_evaluation(self) -> None:
        """Start a due evaluation, submit its prompts and turns as its share of the engine allows, report it once
        done (rollout/shared_evaluation.py)."""
        if self.evaluation is None and not self._start_evaluation():
            return
        ev = self.evaluation
        assert ev is not None
        if self.waiting_load:
            return
        ev.advance()
        if not ev.complete() or self.r.evaluator.retry_in() > 0:
            return
        try:
            if ev.report():
                self.evaluation = None
        except EnvUnavailable as e:
            self.r.evaluator.postpone(ev.version, e)
            self.evaluation = None

    def _start_evaluation(self) -> bool:
        """An evaluation beside training has begun (`--eval-mode shared`); `stop` drains the engine instead, then
        runs the chunked, seeded one at once."""
        version, ev = self.engine.version, self.r.evaluator
        if not ev.due(version):
            return False
        if self.r.s.eval_mode == "stop" or self.eval_waiting:  # stop the world: drain, then the seeded evaluation
            self.eval_waiting = True
            if not self.engine.in_flight() and not self.episodes.pending():  # episodes too: their prompts wait
                ev.run_seeded(self.engine.chunked)  # `dapo-mesh eval`'s numbers for these weights and seed
                self.eval_waiting = False
            return False
        items = ev.held_out(version)
        if items is None:
            return False
        if self._eval_episodes is None:
            self._eval_episodes = EpisodeRunner(
                self.r.s, self.engine.tokenizer, self.m, hold_outages=False, prefix="v/", priority=EVAL_PRIORITY
            )
        self.evaluation = SharedEvaluation(self.r, self.engine, self._eval_episodes, version, items)
        return True


def admitted_size(task: PromptTask) -> int:
    """The room a prompt takes at admission: its G samples; sampled in rounds, its first round — an environment
    task's whole budget (its later rounds' episodes begin at once on the environment service, which
    --max-episodes bounds; a single-turn prompt's later rounds wait for room in the engine)."""
    b = task.budget
    if b is None:
        return max(1, task.n_samples)
    return b.most if task.verifier.startswith(ENV_PREFIX) else b.first


class IdleWindow:
    """Idle time (no sequence in the engine) and generation speed over the last minute, as running sums: not
    summed again at every engine step."""

    def __init__(self, metrics: RolloutMetrics):
        self.m = metrics
        self.last = time.monotonic()
        self.busy: deque[tuple[float, float, bool]] = deque()  # (start, seconds, idle) over the window
        self.window_tokens: deque[tuple[float, int]] = deque()
        self.sums = [0.0, 0.0, 0.0]  # seconds, idle seconds, tokens in the window
        self.tokens_per_s = 0.0

    def tokens(self, n: int) -> None:
        self.window_tokens.append((time.monotonic(), n))
        self.sums[2] += n

    def account(self, idle: bool) -> float:
        """The time since the last call, idle or not; the generation speed over the window (tokens/s)."""
        now = time.monotonic()
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
        return self.tokens_per_s
