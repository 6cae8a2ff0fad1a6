"""The gateway's state between its HTTP handlers (uvicorn's thread) and the replica's loop (the engine's thread).

    gw = Gateway(settings, tokenizer, GatewayMetrics(registry), env_calls)
    # handlers (rollout/gateway/app.py, calls.py), any thread, each under gw.lock:
    seat = gw.seat(waiter, own)              # a session for the next task the mesh hands out (or a waiter)
    gw.submit(call)                          # a model call, to the engine at the loop's next step
    gw.cancel(key)                           # a client gone: its sequences leave the engine
    gw.end(session, choice, score)           # an ended session, its score kept for its group
    # the loop (rollout/continuous_loop.py), each step:
    gw.advance(engine, consumer)             # tasks read for waiting sessions, calls submitted, idle sessions expired
    gw.finished(key, completions)            # a call's answer kept in its session, then back to its handler
    gw.stream(engine.take_deltas())          # streamed tokens to theirs
    gw.publish(consumer)                     # complete groups published, their prompt acknowledged (or dead letters)
    gw.close()                               # the replica leaves: every session over, every waiter answered

Tasks come from the prompts stream (the buffer's, under its staleness bound and capacity): a task of G samples
gives G sessions, one per seat; when no task arrives within --gateway-open-wait-s the opening is a 429 (the buffer
holds back), which the OpenAI SDK and well-behaved clients retry. A client may bring its own task instead
(`OwnTask`): sessions of one task_id fill its `group_size` seats; each group of it is published under its own id
(a task id used again after its group was trained makes a new group, never a duplicate the buffer drops).

Every session ends in a named state (rollout/gateway/sessions.py) and each ending has one consequence here
(`_over`): the open-sessions gauge, its environment episode closed, and — unless it ended with a reward — its seat
given back to its group, for another client, while the group still takes seats. A group is published when every
seat's session is over and no seat is free: with its ended sessions when two or more ended (its `n_samples` says
how many), else dead-lettered (`sessions_abandoned`). A group whose free seats nobody took for --gateway-idle-s
closes with the sessions it has (none: a task from Redis is given back, for any replica to take).

An environment's task (verifier `env:<name>`) is handed out as the environment opens it: each session resets its
own episode (the same seed: the same task) through the replica's one environment-call path (rollout/env_calls.py),
the client gets its opening messages and tools, runs its own agent loop, and at the end the environment scores its
last answer (one step; an episode the environment does not end on that answer is a failure, -1). An environment
that fails a session (a reset refused or answered out of protocol, `error` in the scoring step) fails it — never
trained on — and counts against the task as the replica's own episodes do: past --episode-retries the task is
dead-lettered (`env_failed`) and its other sessions are failed with it. An outage (no answer, credentials refused)
counts against nothing: the seat is given back and the client told to retry.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import Completion, ContinuousBatching, RequestRefused, SamplingParams
from rollout.env_calls import EnvCalls, EnvFailure
from rollout.episode_runner import env_task
from rollout.gateway.metrics import GatewayMetrics
from rollout.gateway.schemas import OwnTask
from rollout.gateway.sessions import CallRefused, ChatRenderer, Choice, Limits, Plan, Session, assistant_message
from rollout.groups import GroupRefused, episode_group
from rollout.settings import RolloutSettings
from services.episodes import ToolSpec
from services.schemas import CLIENT_SCORED, PromptTask, Score
from services.session_keys import new_session_id, parse_key, replica_tag, session_key, tag_of
from services.streams import STREAM_ROLLOUTS, Delivery, StreamConsumer

log = logging.getLogger(__name__)
EXPIRY_EVERY_S = 1.0
RETIRED_KEPT = 4096  # sessions remembered once their group is out: a late call is told how its session ended


class Waiter:
    """A handler waiting on the loop: its answer (a future) and, for a stream, its deltas (a queue)."""

    def __init__(self, stream: bool = False):
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()
        self.queue: asyncio.Queue[Any] | None = asyncio.Queue() if stream else None
        self.withdrawn = False  # the handler gave up (timed out, client gone): nothing more for it
        self.result: Any = None  # what the loop gave it (set under the gateway's lock)

    def resolve(self, value: Any) -> None:
        """The answer (a seat, choices, the engine's refusal, Leaving); a stream's queue gets it last."""
        self.result = value
        self._soon(_set, self.future, value)
        self.push(value)

    def push(self, item: Any) -> None:
        if self.queue is not None:
            self._soon(self.queue.put_nowait, item)

    def _soon(self, fn: Any, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed (the server stopped): nobody waits any more
            pass


def _set(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


class Leaving(RuntimeError):
    """The replica is leaving: what a waiting handler gets (a 503 for the client)."""


@dataclass
class Pending:
    """A model call on its way through the engine."""

    key: str
    prompt: list[int]
    n: int
    params: SamplingParams
    waiter: Waiter
    stream: bool = False
    session: Session | None = None
    plan: Plan | None = None
    tools: bool = False  # chat with tools offered: calls are parsed from the answer's text
    chat: bool = False
    version: int = 0  # the engine's when submitted
    submitted_at: float = 0.0
    engine_s: float = 0.0  # seconds from submission to its last sequence's end


@dataclass
class TaskGroup:
    task: PromptTask
    delivery: Delivery[PromptTask] | None  # None: a client's own task
    seats: int  # sessions still to open
    sessions: list[Session] = field(default_factory=list)
    scores: dict[str, Score] = field(default_factory=dict)  # by session id, once ended
    seated_at: float = field(default_factory=time.monotonic)  # when a seat was last taken (or the group began)
    key: str = ""  # in Gateway.groups: the task id, "own:<task id>" for a client's own task
    failures: int = 0  # sessions its environment failed
    failed: str | None = None  # given up (dead-lettered once its sessions are over): why
    closed: bool = False  # takes no more seats

    def __post_init__(self) -> None:
        self.key = self.key or self.task.task_id

    def complete(self) -> bool:
        return (self.seats == 0 or self.closed) and all(s.over for s in self.sessions)

    def client_scores(self) -> bool:
        """The client may give this task's reward: its own task, or one its dataset declares client-scored."""
        return self.delivery is None or self.task.verifier == CLIENT_SCORED


@dataclass
class Seat:
    session: Session
    key: str  # the session's API key (shown once)
    task: PromptTask
    messages: list[dict[str, Any]]
    env: tuple[str, dict[str, Any]] | None = None  # an environment's task: (environment, reset body)
    tools: list[dict[str, Any]] = field(default_factory=list)
    episode_id: str = ""  # an environment's task: the session's episode on the environment service


class Gateway:
    def __init__(
        self, s: RolloutSettings, tokenizer: Any, metrics: GatewayMetrics, env: EnvCalls | None = None, tag: str = ""
    ):
        self.s, self.tok, self.m = s, tokenizer, metrics
        self.tag = tag or replica_tag(s.replica_id, "")  # this process's: the start of its session ids (the router's)
        self.env = env  # the replica's environment calls (shared with its own episodes): environments' tasks
        self.render = ChatRenderer(tokenizer, s.chat_template)
        self.limits = Limits(s.gateway_max_calls, s.gateway_max_context)
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when a handler left work for the loop
        self.sessions: dict[str, Session] = {}
        self.retired: OrderedDict[str, Session] = OrderedDict()  # over and published: their keys say how they ended
        self.groups: dict[str, TaskGroup] = {}  # by task id ("own:<id>" for a client's own)
        self.inbox: deque[Pending] = deque()  # calls for the engine
        self.cancels: deque[str] = deque()
        self.calls: dict[str, Pending] = {}  # in the engine, by key
        self.seat_waiters: deque[Waiter] = deque()
        self.dead: list[tuple[TaskGroup, str, str]] = []  # (group, kind, why) to dead-letter
        self._next_expiry = 0.0
        self.version = 0  # the engine's, as the loop last saw it
        self.leaving = False

    # ------------------------------------------------------------------ handlers' side (under self.lock)

    def authenticate(self, key: str) -> tuple[Session | None, str]:
        """The session this key is for, if open; else None and why (unknown, or how its session ended)."""
        parsed = parse_key(key)
        if parsed is not None and tag_of(parsed[0]) != self.tag:
            return None, (
                f"session {parsed[0]} is over: it is not this replica's (another replica opened it, or this one "
                "restarted since and lost it); open a new session"
            )
        s = (self.sessions.get(parsed[0]) or self.retired.get(parsed[0])) if parsed else None
        if s is None or parsed is None or not hmac.compare_digest(s.key_hash, _hash(parsed[1])):
            return None, "unknown session key (or wrong mesh token)"
        if s.over:
            return None, f"session {s.sid} is over: {s.state} ({s.why})"
        return s, ""

    def open_count(self) -> int:
        return sum(not s.over for s in self.sessions.values())

    def load(self) -> tuple[int, int]:
        """What the router places sessions by (the heartbeat's thread asks): sessions this replica could open now,
        and the free seats of the tasks it holds (a session placed here joins a group already begun)."""
        with self.lock:
            free = 0 if self.leaving else max(0, self.s.gateway_max_sessions - self.open_count())
            seats = sum(g.seats for g in self.groups.values() if g.delivery is not None and not g.closed)
        return free, seats

    def seat(self, waiter: Waiter, own: OwnTask | None) -> Seat | None:
        """A session now (a seat free, or the client's own task), or None: the waiter gets one from the loop."""
        if self.leaving:
            raise Leaving("this replica is leaving the mesh")
        if self.open_count() >= self.s.gateway_max_sessions:
            self.m.rejected.labels("sessions").inc()
            raise Busy(f"{self.s.gateway_max_sessions} sessions are open (--gateway-max-sessions)", "sessions_full")
        if own is not None:
            return self._take(self._own_group(own))
        free = self._free()
        if free is not None:
            return self._take(free)
        self.seat_waiters.append(waiter)
        self.wake.set()
        return None

    def _own_group(self, own: OwnTask) -> TaskGroup:
        if own.verifier.startswith("env:"):
            raise ValueError("an own task is scored by the reward server (or the client): not an env: verifier")
        key = f"own:{own.task_id}"
        g = self.groups.get(key)
        if g is None:
            task = PromptTask(
                task_id=f"{own.task_id}.{uuid.uuid4().hex[:8]}",  # this group's own: a later group of the id is new
                prompt_id=own.task_id,
                prompt=own.prompt,
                ground_truth=own.ground_truth,
                verifier=own.verifier,
                data_source="gateway",
                n_samples=own.group_size,
                dispatch_version=self.version,
            )
            g = self.groups[key] = TaskGroup(task, None, own.group_size, key=key)
        elif g.task.prompt != own.prompt or g.task.n_samples != own.group_size or not g.seats or g.closed:
            raise Conflict(f"task {own.task_id}: its group is full, or was opened with another prompt or size")
        return g

    def withdraw(self, waiter: Waiter) -> Seat | None:
        """The waiter gives up; the seat the loop gave it meanwhile, if any (it takes it)."""
        waiter.withdrawn = True
        return waiter.result if isinstance(waiter.result, Seat) else None

    def _take(self, g: TaskGroup) -> Seat:
        secret = secrets.token_urlsafe(24)
        spec = env_task(g.task)
        sid = new_session_id(self.tag)
        session = Session(sid, _hash(secret), g.key, self.render, self.limits, time.monotonic(), opening=bool(spec))
        g.seats -= 1
        g.seated_at = time.monotonic()
        g.sessions.append(session)
        self.sessions[sid] = session
        self.m.open.inc()
        self.m.sessions.labels("opened").inc()
        episode = f"gw-{sid}-{secrets.token_hex(6)}"  # unguessable: only this session drives it
        return Seat(session, session_key(sid, secret), g.task, self.messages_of(g.task), spec, episode_id=episode)

    def opened(self, seat: Seat, base: str, tools: list[ToolSpec]) -> bool:
        """Its environment episode opened: the session takes calls. False: it was over meanwhile (its client or
        the replica gone) — the caller closes the episode."""
        seat.session.taught = list(tools)
        return seat.session.opened((base, seat.episode_id), time.monotonic())

    def env_failed(self, session: Session, failure: EnvFailure, during: str) -> None:
        """Its environment failed the session (`during` its reset or its scoring): an outage gives its seat back
        and counts against nothing; a failure of the environment fails it and counts against its task."""
        if failure.kind == "outage":
            self._stop(session, "abandoned", f"the environment service was unavailable {during}: {failure.why}")
            return
        self._stop(session, "failed", f"the environment failed {during}: {failure.why}"[:1000])
        g = self.groups.get(session.task_id)
        if g is None or g.failed is not None:
            return
        g.failures += 1
        if g.failures > self.s.episode_retries:
            g.failed = f"{g.failures} sessions failed by the environment; the last {during}: {failure.why}"[:1000]
            g.closed = True  # no more seats: it is dead-lettered once its sessions are over
            for other in g.sessions:
                self._stop(other, "failed", f"its task was given up: {g.failed}")

    def abandon(self, session: Session, why: str) -> None:
        self._stop(session, "abandoned", why)

    def _stop(self, session: Session, state: Any, why: str) -> None:
        if session.stop(state, why):
            self._over(session)

    def _over(self, session: Session) -> None:
        """What every end of a session brings, once: the gauge, the outcome, its environment episode closed, and
        its seat back to its group unless it ended with a reward (while the group takes seats)."""
        self.m.open.dec()
        self.m.sessions.labels(session.state).inc()
        if session.env is not None and self.env is not None:
            self.env.close(*session.env)
        g = self.groups.get(session.task_id)
        if g is not None and session.state != "ended" and not g.closed and g.failed is None and not self.leaving:
            g.seats += 1
        if session.state != "ended":
            log.info("gateway session %s %s: %s", session.sid, session.state, session.why)

    def messages_of(self, task: PromptTask) -> list[dict[str, str]]:
        text = task.prompt
        if text is None and task.prompt_token_ids is not None:
            text = self.tok.decode(task.prompt_token_ids.tolist(), skip_special_tokens=True)
        return [{"role": "user", "content": text or ""}]

    def submit(self, p: Pending) -> None:
        if self.leaving:
            raise Leaving("this replica is leaving the mesh")
        if len(self.inbox) >= 4 * self.s.max_in_flight:
            self.m.rejected.labels("calls").inc()
            raise Busy(f"{len(self.inbox)} calls wait for the engine", "calls_full")
        self.inbox.append(p)
        self.wake.set()

    def give_up(self, p: Pending) -> None:
        """Its handler stopped waiting (a timeout, the client gone): its sequences leave the engine, its session
        is free for its next call."""
        p.waiter.withdrawn = True
        self.cancels.append(p.key)
        self.wake.set()
        if p.session is not None:
            p.session.call_failed(p.key, time.monotonic())

    def end(self, session: Session, choice: int, score: Score, *, scored: bool = False) -> None:
        """An ended session: its score (the client's, or its scorer's: `scored`) kept for its group."""
        g = self.groups.get(session.task_id)
        if g is None:
            raise CallRefused(f"session {session.sid} is over: {session.state} ({session.why})", over=True)
        session.end(choice, score.reward, scored=scored)
        g.scores[session.sid] = score
        self._over(session)

    def may_set_reward(self, session: Session) -> str | None:
        """Why the client may not give this session's reward (None: it may): the trust model
        (docs/operations/security.md). A dispatched task is scored by its verifier or its environment; the client
        scores only its own tasks and those its dataset declares client-scored."""
        g = self.groups.get(session.task_id)
        if g is None or g.client_scores():
            return None
        scorer = f"its environment ({g.task.verifier})" if g.task.verifier.startswith("env:") else g.task.verifier
        return (
            f"task {g.task.task_id} is scored by {scorer}, not by the client: end the session with "
            '{"score": true} (a client gives the reward only for its own tasks, or a dataset whose rows say '
            f'verifier "{CLIENT_SCORED}")'
        )

    def group_task(self, session: Session) -> PromptTask | None:
        g = self.groups.get(session.task_id)
        return g.task if g is not None else None

    # ------------------------------------------------------------------ the loop's side

    def idle_wait(self, timeout_s: float) -> None:
        """Nothing in the engine: wait for a handler to leave work (not a busy loop)."""
        self.wake.wait(timeout_s)
        self.wake.clear()

    def advance(self, engine: ContinuousBatching, consumer: StreamConsumer[PromptTask], hold: bool = False) -> None:
        """Cancels, tasks for waiting sessions (read from Redis outside the lock: handlers never wait on Redis),
        calls to the engine (none while `hold`: a weight load or an evaluation waits for the engine to drain),
        idle sessions and unfilled groups expired."""
        self.version = engine.version
        with self.lock:
            while self.cancels:
                key = self.cancels.popleft()
                self.calls.pop(key, None)
                if engine.cancel(key):
                    self.m.cancelled.inc()
            self.seat_waiters = deque(w for w in self.seat_waiters if not w.withdrawn)
            need = bool(self.seat_waiters) and self._free() is None
        got = consumer.read(count=1, block_ms=0) if need else []
        with self.lock:
            for d in got:
                self._place(d)
            self._hand_out()
            if not hold:
                self._submit(engine)
            self._expire(consumer)
        consumer.keep_alive()

    def _free(self) -> TaskGroup | None:
        return next((g for g in self.groups.values() if g.seats and not g.closed and g.delivery is not None), None)

    def _place(self, d: Delivery[PromptTask]) -> None:
        """A task read for the waiting sessions: a group of its G seats, or a dead letter (malformed, or a task
        already here: a second delivery of the same task id would be held by nobody)."""
        here = self.groups.get(d.message.task_id)
        if here is not None:
            if here.delivery is None or here.delivery.entry_id != d.entry_id:  # the same entry again: ours already
                self.dead.append((TaskGroup(d.message, d, 0), "duplicate_task", "a task with this id is in sessions"))
            return
        try:
            env_task(d.message)
        except ValueError as e:
            self.dead.append((TaskGroup(d.message, d, 0), "env_task_invalid", str(e)[:500]))
            return
        self.groups[d.message.task_id] = TaskGroup(d.message, d, d.message.n_samples)

    def _hand_out(self) -> None:
        """Free seats to the sessions waiting for one, in order."""
        while self.seat_waiters and (free := self._free()) is not None:
            waiter = self.seat_waiters.popleft()
            if not waiter.withdrawn:
                waiter.resolve(self._take(free))

    def _submit(self, engine: ContinuousBatching) -> None:
        while self.inbox:
            p = self.inbox[0]
            if engine.in_flight() and engine.in_flight() + p.n > self.s.max_in_flight:
                return  # waits for room
            self.inbox.popleft()
            if p.waiter.withdrawn:
                continue
            try:
                engine.submit(p.key, p.prompt, p.n, p.params, stream=p.stream)
            except RequestRefused as e:
                if p.session is not None:
                    p.session.call_failed(p.key, time.monotonic())
                p.waiter.resolve(e)
                continue
            p.version, p.submitted_at = engine.version, time.monotonic()
            self.calls[p.key] = p

    def _expire(self, consumer: StreamConsumer[PromptTask]) -> None:
        """Idle sessions abandoned; a group whose seats nobody took for --gateway-idle-s closes with the sessions it
        has (none: a task from Redis is given back, for any replica to take)."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRY_EVERY_S
        idle_s = self.s.gateway_idle_s
        opening_s = self.s.env_timeout_s * (self.s.env_retries + 1) + idle_s  # past any reset's retries
        for s in list(self.sessions.values()):
            if s.state == "idle" and now - s.last_seen > idle_s:
                self.abandon(s, f"idle for {now - s.last_seen:.0f} s (--gateway-idle-s {idle_s:g})")
            elif s.state == "opening" and now - s.last_seen > opening_s:  # a backstop: its opening never came back
                self.abandon(s, f"its environment did not open within {opening_s:.0f} s")
        for key, g in list(self.groups.items()):
            if not g.seats or g.closed or now - g.seated_at <= idle_s:
                continue
            if g.sessions:
                g.closed = True  # complete once its sessions are over
            else:
                del self.groups[key]
                if g.delivery is not None:
                    consumer.release(g.delivery.entry_id)

    def finished(self, key: str, outs: list[Completion]) -> None:
        """A call's answer: kept in its session here (the loop owns it: a handler gone meanwhile leaves no session
        waiting), then handed to its handler."""
        with self.lock:
            p = self.calls.pop(key, None)
            if p is None:
                return  # cancelled meanwhile
            p.engine_s = time.monotonic() - p.submitted_at
            choices = []
            for i, c in enumerate(outs):
                msg, _ = assistant_message(c, p.tools, f"call_{p.key[-12:]}_{i}")
                choices.append(Choice(c, p.version, msg if p.chat else None))
            if p.session is not None and p.plan is not None:
                sampling = (p.params.temperature, p.params.top_p)
                p.session.answered(p.key, p.plan, choices, sampling, time.monotonic())
                if p.plan.new and len(p.session.segments) > 1:
                    self.m.segments.inc()
        p.waiter.resolve(choices)

    def stream(self, deltas: list[Any]) -> None:
        for d in deltas:
            p = self.calls.get(d.key)
            if p is not None:
                p.waiter.push(d)

    def publish(self, consumer: StreamConsumer[PromptTask]) -> int:
        """Complete groups published (and their prompts acknowledged in the same step); the others over dead-lettered
        with why (`env_failed`, `sessions_abandoned`, or the reason episode_group refuses them). Their sessions are
        retired: a late call with their key is told how they ended, their tokens gone."""
        with self.lock:
            done = []
            for g in [g for g in self.groups.values() if g.complete()]:
                del self.groups[g.key]
                ended = [(s.episode, g.scores[s.sid]) for s in g.sessions if s.state == "ended" and s.episode]
                done.append((g, ended))
                for s in g.sessions:
                    self.retired[s.sid] = self.sessions.pop(s.sid)
                    s.retire()
            while len(self.retired) > RETIRED_KEPT:
                self.retired.popitem(last=False)
            dead, self.dead = self.dead, []
        published = 0
        for g, ended in done:
            if g.failed is not None:
                dead.append((g, "env_failed", g.failed))
                continue
            if len(ended) < min(2, g.task.n_samples):
                dead.append((g, "sessions_abandoned", f"{len(g.sessions)} sessions, {len(ended)} ended: too few"))
                continue
            try:
                eps, scores = [e for e, _ in ended], [sc for _, sc in ended]
                decode = lambda ids: self.tok.decode(ids, skip_special_tokens=False)  # noqa: E731
                group = episode_group(g.task, eps, scores, self.s.replica_id, decode)
            except GroupRefused as e:
                dead.append((g, "env_rejected", str(e)))
                continue
            consumer.ack_and_publish([g.delivery.entry_id] if g.delivery else [], [(STREAM_ROLLOUTS, group)])
            self.m.groups.labels("published").inc()
            published += 1
        for g, kind, why in dead:
            self.m.groups.labels("dead").inc()
            if g.delivery is not None:
                log.error("prompt %s dead-lettered: %s", g.task.task_id, why)
                consumer.dead_letter([g.delivery], kind, why)
            else:
                log.error("own task %s not published: %s", g.task.task_id, why)
        return published

    def close(self) -> None:
        """The replica leaves: every session over (abandoned: its client is told the replica left), every waiting
        handler answered, every environment episode closed (through the environment calls, before they shut down);
        the tasks stay pending in Redis for another replica."""
        with self.lock:
            self.leaving = True
            for s in list(self.sessions.values()):
                self.abandon(s, "its replica left the mesh")
            waiters = [*self.seat_waiters, *(p.waiter for p in self.inbox), *(p.waiter for p in self.calls.values())]
            self.seat_waiters.clear()
            self.inbox.clear()
            self.calls.clear()
        for w in waiters:
            w.resolve(Leaving("this replica is leaving the mesh; open a new session"))


class Busy(RuntimeError):
    """The gateway is at a bound: a 429 with Retry-After; `code` says which (sessions_full: a router tries another
    replica; calls_full)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class Conflict(ValueError):
    """A client's own task that does not fit the group of that id: a 409."""


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
