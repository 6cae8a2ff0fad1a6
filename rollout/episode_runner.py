"""Every prompt's G samples as episodes — the replica's one rollout path, for the continuous-batching loop and
turn by turn.

A single-turn prompt (any verifier but `env:<name>`) is a one-step episode on a local environment: its opening is
the prompt's tokens, the model answers once, and the episode ends; the group's G answers are scored by the
reward server when it is published (rollout/publisher.py: one request for every finished group, overlong shaping),
so the samples are exactly those of a single-turn rollout. A prompt whose verifier is `env:<name>` is an
environment task: its ground truth is the reset's `{"seed": n}` or
`{"task": {...}}` (JSON), and each of its G samples is an episode (rollout/episodes.py). An episode alternates:
its environment call (reset, then a step per model turn) runs in one of `--env-concurrency` threads, and its model
turn is one request in the engine. While an episode waits for its environment it is not in the engine: the others
keep generating (continuous batching), and a weight update between two turns gives the next turn's tokens their
new version. The episode ends when the environment says done (its reward), at `max_turns` (the environment cuts
it), or when its tokens would pass `--max-episode-tokens` (cut here: `max_tokens`, the reward of a failure).

An environment that fails (a 4xx such as a lost episode after its instance died, a 500, a 504 — a reset slower
than the service allows —, or `error` in a step)
fails the episode: it is begun again from its reset, under a new id (so on another instance when there are
several), up to `--episode-retries` times; then the whole prompt is dead-lettered (`env_failed`) — nothing of a
failed episode is ever published. A service that does not answer at all after the client's retries is an outage,
not the prompt's fault: the episode is begun again after a backoff (2, 4, ... 30 s), as long as it takes, its
prompt pending and kept alive.

    runner = EpisodeRunner(settings, tokenizer, metrics)
    runner.start(delivery, params, prompt) # G episodes of the prompt, sampled with `params` (`prompt`: one-step)
    runner.advance(engine)                 # finished environment calls -> the next model turns submitted
    runner.engine_done(key, completion)    # a model turn finished (keys start with runner.prefix) -> its next step
    for delivery, episodes in runner.take_finished(): ...
    for delivery, kind, why in runner.take_failed(): ...   # kind: the dead letter's (env_failed, engine_rejected)

`run_turn_by_turn` runs episodes on an engine called in chunks, every live episode's turn in one call and every
environment step of the round before the next: the evaluation's way, and the baseline of the benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import Completion, ContinuousBatching, Engine, RequestRefused, SamplingParams
from rollout.env_calls import EnvCalls, EnvFailure, classify, judge
from rollout.env_client import EnvClient, EnvUnavailable, Opening
from rollout.episodes import Ended, Episode, Renderer
from rollout.metrics import RolloutMetrics
from rollout.settings import RolloutSettings
from services.draws import derived_seed
from services.episodes import StepResponse
from services.schemas import PromptTask
from services.streams import Delivery

log = logging.getLogger(__name__)
ENV_PREFIX = "env:"
ONE_STEP = "one-step"  # the local environment of a single-turn prompt: one model turn, the reward server's score
OUTAGE_BACKOFF_MAX_S = 30.0


def env_task(task: PromptTask) -> tuple[str, dict[str, Any]] | None:
    """(environment, reset body) of an environment task; None for a single-turn prompt; ValueError if malformed."""
    if not task.verifier.startswith(ENV_PREFIX):
        return None
    name = task.verifier[len(ENV_PREFIX) :]
    try:
        spec = json.loads(task.ground_truth)
    except json.JSONDecodeError:
        spec = None
    if not isinstance(spec, dict) or len(spec.keys() & {"seed", "task"}) != 1:
        want = '{"seed": n[, "split": s]} or {"task": {...}}'
        raise ValueError(f"{task.verifier}: the ground truth must be {want}")
    return name, {k: spec[k] for k in ("seed", "task", "split") if k in spec}


def episode_id(task_id: str, nonce: str, j: int, start: int) -> str:
    """Unique per group rollout (`nonce`) and per start of the episode: a prompt rolled out again (reclaimed by
    another replica, an evaluation retried) or an episode begun again never meets an earlier one on the service."""
    return f"{re.sub(r'[^A-Za-z0-9_.:-]', '-', task_id)[:80]}.{nonce}.{j}.{start}"


@dataclass
class _Group:
    delivery: Delivery[PromptTask]
    env: str
    body: dict[str, Any]
    params: SamplingParams
    done: list[Episode | None]
    one_step: bool = False  # a single-turn prompt's (whatever an environment task names its environment)
    failed: str | None = None
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:10])

    @property
    def dead_letter_kind(self) -> str:
        return "engine_rejected" if self.one_step else "env_failed"


@dataclass
class _Live:
    group: _Group
    j: int
    attempt: int = 0  # failures of the environment (bounded by --episode-retries)
    starts: int = 0  # times begun: failures and outages
    outages: int = 0  # the service unreachable (not bounded: an outage is not the prompt's fault)
    ep: Episode | None = None
    base: str = ""
    turn: int = 0  # model turns taken
    t0: float = field(default_factory=time.perf_counter)

    @property
    def id(self) -> str:
        return episode_id(self.group.delivery.message.task_id, self.group.nonce, self.j, self.starts)


class EpisodeRunner:
    def __init__(
        self,
        s: RolloutSettings,
        tokenizer: Any,
        metrics: RolloutMetrics,
        env: EnvCalls | None = None,
        *,
        hold_outages: bool = True,
        prefix: str = "x/",
        priority: int = 0,
    ):
        """`hold_outages`: an unreachable service begins episodes again until it answers (training); False: the
        episode fails at once (an evaluation is postponed instead). `prefix`: of the engine keys of its model
        turns; `priority`: their label in a continuous engine's book-keeping (the evaluation's share)."""
        self.s, self.m, self.tok, self.hold_outages = s, metrics, tokenizer, hold_outages
        self.prefix, self.priority = prefix, priority
        self.env = env or EnvCalls(EnvClient.of(s), s.env_concurrency, metrics)  # the gateway's too (replica.py)
        self.render = Renderer(tokenizer, s.chat_template)
        self._render_checked = False  # checked at the first environment task (one-step episodes never need it)
        self._render_problem: str | None = None
        self.calls: dict[Future[Any], _Live] = {}  # environment calls in flight
        self.ready: list[_Live] = []  # episodes whose next model turn awaits submission
        self.generating: dict[str, _Live] = {}  # engine key -> episode
        self.groups: list[_Group] = []
        self.live = 0  # episodes begun and not finished
        self.live_env = 0  # ... of them, environments' (not one-step)

    # ------------------------------------------------------------------ the environment side

    @property
    def render_problem(self) -> str | None:
        """Why the chat template cannot be continued token-exactly (None: it can); checked once, when needed."""
        if not self._render_checked:
            self._render_problem, self._render_checked = self.render.problem(), True
        return self._render_problem

    def start(
        self, d: Delivery[PromptTask], params: SamplingParams, prompt: list[int] | None = None, n: int | None = None
    ) -> None:
        """The prompt's G episodes (`n`: that many instead, a round of a group sampled in rounds: rollout/rounds.py):
        an environment task's begin with their resets; a single-turn prompt's are one-step episodes opening on
        `prompt` (its tokens), ready for their model turn at once."""
        spec = env_task(d.message)
        env, body = spec if spec is not None else (ONE_STEP, {})
        count = d.message.n_samples if n is None else n
        g = _Group(d, env, body, params, [None] * count, one_step=spec is None)
        self.groups.append(g)
        if g.one_step:
            if prompt is None:
                raise ValueError("a single-turn prompt's episodes open on its tokens: `prompt` is missing")
            for j in range(count):
                ep = Episode(ONE_STEP, list(prompt), one_step=True, temperature=params.temperature, top_p=params.top_p)
                self._begin(lv := _Live(g, j, ep=ep))
                self.ready.append(lv)
            return
        if self.render_problem:
            g.failed = self.render_problem  # dead-lettered with the reason at the next take_failed()
            return
        for j in range(count):
            self._reset(_Live(g, j))

    def _begin(self, lv: _Live) -> None:
        self.live += 1
        if not lv.group.one_step:  # the episode metrics count environments' episodes (one-step ones are samples)
            self.live_env += 1
            self.m.episodes_live.inc()  # inc/dec: training's runner and the evaluation's count into one gauge

    def _reset(self, lv: _Live, delay_s: float = 0.0) -> None:
        self._begin(lv)
        lv.ep, lv.turn, lv.t0 = None, 0, time.perf_counter()
        self.calls[self.env.reset(lv.group.env, lv.group.body, lv.id, delay_s)] = lv

    def pending(self) -> int:
        """Episodes begun and not finished."""
        return self.live

    def holds(self, entry_id: str) -> bool:
        """Whether the prompt of this stream entry is being rolled out here."""
        return any(g.delivery.entry_id == entry_id for g in self.groups)

    def wait(self, timeout_s: float) -> None:
        """Until an environment call finishes (or the timeout): for a loop with nothing in the engine."""
        if self.calls:
            wait(list(self.calls), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def collect(self) -> None:
        """Finished environment calls: an opening or a step's answer -> the next model turn, or the episode's end.
        What a failed call means is rollout/env_calls.py's rule, the gateway's too."""
        for fut in [f for f in self.calls if f.done()]:
            lv = self.calls.pop(fut)
            waited = time.perf_counter() - lv.t0
            self.m.episode_seconds.labels("env").inc(waited)
            try:
                out = fut.result()
            except Exception as e:
                failure = classify(e)
                if failure.kind == "outage":
                    self._outage(lv, failure.why)
                else:
                    self._fail(lv, failure.why)
                continue
            try:
                self._collected(lv, out, waited)
            except EnvFailure as e:  # a step answered with `error`
                self._fail(lv, f"turn {lv.turn}'s step: {e.why}")
            except Exception as e:  # our side cannot go on with the answer (a template that cannot render it):
                log.exception("episode %s failed", lv.id)  # the same again would fail the same: not retried
                self._fail(lv, f"{type(e).__name__}: {e}", retry=False)

    def _collected(self, lv: _Live, out: Any, waited: float) -> None:
        if lv.ep is not None:
            lv.ep.env_seconds += waited
        if isinstance(out, Opening):
            lv.base = out.base
            opening = self.render.opening(out.response.messages, out.response.tools)
            params = lv.group.params
            lv.ep = Episode(lv.group.env, opening, temperature=params.temperature, top_p=params.top_p)
            lv.ep.task_key = out.response.task_id
            self.ready.append(lv)
        else:
            self._answered(lv, out)

    def _answered(self, lv: _Live, out: StepResponse) -> None:
        ep = lv.ep
        assert ep is not None
        ep.count_tools(out.tools)
        for k, v in out.tools.model_dump().items():
            if v:
                self.m.tool_calls.labels(k).inc(v)
        verdict = judge(out)
        if verdict is not None:
            ep.reward = verdict.reward
            self._end(lv, verdict.ended)
        else:
            last = ep.last
            assert last is not None  # a step answers a model turn
            ids = self.render.continuation(last.token_ids, last.finish_reason, out.messages)
            if len(ep.ids) + len(ids) >= self.s.max_episode_tokens:
                self._cut(lv)
            else:
                ep.add_env(ids)
                self.ready.append(lv)

    def _cut(self, lv: _Live) -> None:
        assert lv.ep is not None
        lv.ep.reward = -1.0  # as an environment scores an episode it had to cut
        self._end(lv, "max_tokens")

    def _end(self, lv: _Live, ended: Ended) -> None:
        ep = lv.ep
        assert ep is not None
        ep.ended = ended
        lv.group.done[lv.j] = ep
        self._leave(lv, ended)
        if not lv.group.one_step:
            self.m.episode_turns.labels(lv.group.env).observe(ep.model_turns)

    def _leave(self, lv: _Live, ended: str | None) -> None:
        """An episode is no longer live (ended, failed, or dropped with its group: `ended` None, not counted); the
        service is told to forget it. Every path out of an episode comes here once."""
        self.live -= 1
        if not lv.group.one_step:
            self.live_env -= 1
            self.m.episodes_live.dec()
            if ended is not None:
                self.m.episodes.labels(lv.group.env, ended).inc()
        if lv.base:
            self.env.close(lv.base, lv.id)

    def _fail(self, lv: _Live, why: str, retry: bool = True) -> None:
        self._leave(lv, "failed")
        if retry and lv.attempt < self.s.episode_retries and lv.group.failed is None:
            log.warning("episode %s failed (%s); beginning it again", lv.id, why)
            self._reset(dataclasses.replace(lv, attempt=lv.attempt + 1, starts=lv.starts + 1, base=""))
        elif lv.group.failed is None:
            lv.group.failed = f"episode {lv.j} failed {lv.attempt + 1} times; the last: {why}"[:1000]

    def _outage(self, lv: _Live, why: str) -> None:
        """The service did not answer after the client's retries: the episode is begun again after a backoff, as
        often as it takes (its prompt stays pending and kept alive, never dead-lettered for an outage — as groups
        are held through a reward-server outage); a runner that is closing lets it go."""
        if not self.hold_outages:
            self._fail(lv, why, retry=False)
            return
        self._leave(lv, "failed")
        if self.env.closing.is_set() or lv.group.failed is not None:
            return
        delay = min(OUTAGE_BACKOFF_MAX_S, 2.0 ** min(lv.outages, 5))
        log.warning(
            "episode %s: the environment service is unreachable (%s); beginning it again in %.0f s", lv.id, why, delay
        )
        self._reset(dataclasses.replace(lv, outages=lv.outages + 1, starts=lv.starts + 1, base=""), delay)

    # ------------------------------------------------------------------ the engine side

    def advance(self, engine: ContinuousBatching, room: int | None = None) -> None:
        """Collect the environment's answers and submit the model turns that are ready, `room` at most (the others
        wait for room in the engine, first come first served)."""
        self.collect()
        ready = self.ready if room is None else self.ready[: max(0, room)]
        self.ready = self.ready[len(ready) :]
        for lv in ready:
            if lv.group.failed is not None:
                self._drop(lv)
                continue
            ep = lv.ep
            assert ep is not None
            room = self.budget(lv)
            if room <= 0:
                self._cut(lv)
                continue
            key = self.key(lv)
            try:
                params = dataclasses.replace(lv.group.params, max_tokens=room)
                engine.submit(key, ep.prompt_ids(), 1, params, priority=self.priority)
            except RequestRefused as e:  # too long for the engine's context: not retried
                what = "it" if lv.group.one_step else f"episode {lv.j}'s turn {lv.turn + 1}"
                lv.group.failed = f"the engine refused {what}: {e}"[:1000]
                self._drop(lv)
                continue
            lv.t0 = time.perf_counter()
            self.generating[key] = lv

    def key(self, lv: _Live) -> str:
        """The engine key of the episode's next model turn."""
        return f"{self.prefix}{lv.id}/{lv.turn}"

    def budget(self, lv: _Live) -> int:
        """Tokens the episode's next model turn may take: the sampling's max_tokens within --max-episode-tokens;
        a one-step answer's: max_tokens, as a single-turn sample's (L_max; overlong shaping scores its length)."""
        assert lv.ep is not None
        most = lv.group.params.max_tokens
        return most if lv.group.one_step else min(most, self.s.max_episode_tokens - len(lv.ep.ids))

    def _drop(self, lv: _Live) -> None:
        """An episode of a failed group stops where it is."""
        self._leave(lv, None)

    def engine_done(self, key: str, completion: Completion, version: int) -> None:
        lv = self.generating.pop(key)
        ep = lv.ep
        assert ep is not None
        spent = time.perf_counter() - lv.t0
        ep.generate_seconds += spent
        if not lv.group.one_step:
            self.m.episode_seconds.labels("generate").inc(spent)
        ep.add_model(completion, version)
        lv.turn += 1
        if lv.group.failed is not None:
            self._drop(lv)
            return
        if lv.group.one_step:  # answered: the reward server scores it with its group
            self._end(lv, "done")
            return
        if len(ep.ids) >= self.s.max_episode_tokens:
            self._cut(lv)
            return
        lv.t0 = time.perf_counter()
        self.calls[self.env.step(lv.base, lv.id, lv.turn, completion.text)] = lv

    # ------------------------------------------------------------------ groups out

    def take_finished(self) -> list[tuple[Delivery[PromptTask], list[Episode]]]:
        out = [g for g in self.groups if g.failed is None and all(e is not None for e in g.done)]
        self.groups = [g for g in self.groups if g not in out]
        return [(g.delivery, [e for e in g.done if e is not None]) for g in out]

    def take_failed(self) -> list[tuple[Delivery[PromptTask], str, str]]:
        """Groups with a failed episode, once none of theirs is in flight any more: (delivery, the dead letter's
        kind, why)."""
        busy = {id(lv.group) for lv in [*self.calls.values(), *self.generating.values(), *self.ready]}
        out = [g for g in self.groups if g.failed is not None and id(g) not in busy]
        self.groups = [g for g in self.groups if g not in out]
        return [(g.delivery, g.dead_letter_kind, g.failed or "") for g in out]

    def close(self, timeout_s: float = 5.0) -> None:
        """Leaving: waits and retries end at once, nothing new starts; the prompts stay pending for another replica.
        The service is told to forget the episodes opened here, in `timeout_s` at most (best effort), so they do
        not hold its sessions until its idle TTL: the live ones, those whose reset answered and was not collected
        yet, and those whose close had not gone out; a reset still running closes its episode when it answers."""
        held = {(lv.base, lv.id) for lv in [*self.ready, *self.generating.values(), *self.calls.values()] if lv.base}
        resets = [(f, lv.id) for f, lv in self.calls.items() if not lv.base]
        self.env.shutdown(held, resets, timeout_s)


def run_items(
    runner: EpisodeRunner, engine: Engine, tasks: list[PromptTask], params: SamplingParams
) -> dict[str, list[Episode]]:
    """Each task's n_samples episodes, turn by turn, to their end (the held-out evaluation): task_id -> episodes.
    EnvUnavailable when an environment failed past the retries (the evaluation is postponed)."""
    for i, task in enumerate(tasks):
        runner.start(Delivery(f"eval-{i}", task, 1), params)
    run_turn_by_turn(engine, runner)
    failed, finished = runner.take_failed(), runner.take_finished()
    if failed:
        raise EnvUnavailable(f"{len(failed)} held-out tasks' episodes failed; the first: {failed[0][2]}")
    return {d.message.task_id: eps for d, eps in finished}


def run_turn_by_turn(
    engine: Engine,
    runner: EpisodeRunner,
    keep_alive: Callable[[], object] = lambda: None,
    stopped: Callable[[], bool] = lambda: False,
) -> int:
    """Every episode the runner holds, to its end, on an engine called in chunks: each round, one engine call for
    every episode whose turn is next (sampled with the first one's group's parameters; one call per distinct
    turn budget, so no episode passes --max-episode-tokens), then every environment step of the round before the
    next round. `keep_alive` is called every round (the prompts in flight stay this replica's); once `stopped()`,
    the runner is closed and the episodes left where they are (their prompts stay pending). The model tokens
    generated."""
    tokens = 0
    while runner.pending():
        if stopped():
            runner.close()
            return tokens
        keep_alive()
        runner.wait(timeout_s=1.0)
        runner.collect()
        if runner.calls:  # the round's environment calls: all of them before the next engine call
            continue
        ready, runner.ready = runner.ready, []
        for lv in [lv for lv in ready if lv.group.failed is not None]:
            runner._drop(lv)
        ready = [lv for lv in ready if lv.group.failed is None]
        if not ready:
            continue
        order = {id(g): i for i, g in enumerate(runner.groups)}  # the tasks' order, not their resets' answers':
        ready.sort(key=lambda lv: (order[id(lv.group)], lv.j))  # a seeded round then samples the same again
        params = ready[0].group.params
        budget = {id(lv): runner.budget(lv) for lv in ready}
        for room in sorted(set(budget.values()), reverse=True):
            part = [lv for lv in ready if budget[id(lv)] == room]
            if room <= 0:
                for lv in part:
                    runner._cut(lv)
                continue
            t0 = time.perf_counter()
            prompts, n = same_prompts([lv.ep.prompt_ids() for lv in part if lv.ep])
            seed = turn_seed(params.seed, part[0].turn, room)  # each turn its own random stream, not turn 1's again
            outs = engine.generate(prompts, n, dataclasses.replace(params, max_tokens=room, seed=seed))
            for lv, out in zip(part, [c for o in outs for c in o], strict=True):
                key = runner.key(lv)
                runner.generating[key] = lv
                lv.t0 = t0
                tokens += len(out.token_ids)
                runner.engine_done(key, out, engine.version)
    return tokens


def turn_seed(seed: int | None, turn: int, room: int) -> int | None:
    """The seed of one engine call of a round: the episodes' seed for their first turn, a seed of its own for each
    later turn and turn budget (with the episodes' seed, turn k drew the same random numbers as turn 1)."""
    if seed is None or turn == 0:  # the first turn keeps it: a single-turn evaluation samples as it always did
        return seed
    return derived_seed(seed, str(turn), str(room))


def same_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Runs of the same prompt as one prompt with a count: a group's one-step episodes (or its episodes' first
    turns) are one prompt with G samples to the engine, which batches them (the HF engine: one `generate` of G
    rows; as G prompts of one sample, the HF replica's loop measured 0.38 of raw `generate` instead of 1.04)."""
    out: list[list[int]] = []
    n: list[int] = []
    for p in prompts:
        if out and out[-1] == p:
            n[-1] += 1
        else:
            out.append(p)
            n.append(1)
    return out, n
