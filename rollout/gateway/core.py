"""The gateway's state between its HTTP handlers (uvicorn's thread) and the replica's loop (the engine's thread).

    gw = Gateway(settings, tokenizer, GatewayMetrics(registry), EnvClient.of(settings))
    # handlers (rollout/gateway/app.py), any thread, each under gw.lock:
    seat = gw.seat(waiter)                   # a session for the next task the mesh hands out (or a waiter)
    gw.submit(call)                          # a model call, to the engine at the loop's next step
    gw.cancel(key)                           # a client gone: its sequences leave the engine
    # the loop (rollout/continuous_loop.py), each step:
    gw.advance(engine, consumer)             # tasks read for waiting sessions, calls submitted, idle sessions expired
    gw.finished(key, completions)            # a call's answer back to its handler
    gw.stream(engine.take_deltas())          # streamed tokens to theirs
    gw.publish(consumer)                     # ended sessions' groups published, their prompt acknowledged

Tasks come from the prompts stream (the buffer's, under its staleness bound and capacity): a task of G samples
gives G sessions, one per seat; when no task arrives within --gateway-open-wait-s the opening is a 429 (the buffer
holds back), which the OpenAI SDK and well-behaved clients retry. A client may bring its own task instead
(`OwnTask`): sessions of one task_id fill its `group_size` seats. A group is published when every seat's session
has ended or been abandoned (idle past --gateway-idle-s): with the ended ones (n_samples as many) when two or more
ended, else dead-lettered (`sessions_abandoned`), so no task is lost silently.

An environment's task (verifier `env:<name>`) is handed out as the environment opens it: each session resets its
own episode (the same seed: the same task), the client gets its opening messages and tools, runs its own agent
loop (its own tools), and at the end the environment scores its last answer (one step; an episode the environment
does not end on that answer is a failure, -1).
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
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import Completion, ContinuousBatching, RequestRefused, SamplingParams
from rollout.env_client import EnvClient
from rollout.episode_runner import env_task
from rollout.gateway.metrics import GatewayMetrics
from rollout.gateway.schemas import OwnTask
from rollout.gateway.sessions import CallRefused, ChatRenderer, Limits, Plan, Session, common_prefix, rebase
from rollout.settings import RolloutSettings
from services.arrays import TokenIds
from services.schemas import PromptTask, Score, ScoredGroup
from services.streams import STREAM_ROLLOUTS, Delivery, StreamConsumer

log = logging.getLogger(__name__)
KEY_PREFIX = "dms"
EXPIRY_EVERY_S = 1.0


class Waiter:
    """A handler waiting on the loop: its answer (a future) and, for a stream, its deltas (a queue)."""

    def __init__(self, stream: bool = False):
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()
        self.queue: asyncio.Queue[Any] | None = asyncio.Queue() if stream else None
        self.withdrawn = False  # the handler gave up (timed out, client gone): nothing more for it
        self.result: Any = None  # what the loop gave it (set under the gateway's lock)

    def resolve(self, value: Any) -> None:
        """The answer (a seat, completions, or the engine's refusal); a stream's queue gets it last."""
        self.result = value
        self.loop.call_soon_threadsafe(_set, self.future, value)
        self.push(value)

    def push(self, item: Any) -> None:
        if self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _set(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


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

    def __post_init__(self) -> None:
        self.key = self.key or self.task.task_id

    def complete(self) -> bool:
        return self.seats == 0 and all(s.state != "open" for s in self.sessions)


@dataclass
class Seat:
    session: Session
    key: str  # the session's API key (shown once)
    task: PromptTask
    messages: list[dict[str, Any]]
    env: tuple[str, dict[str, Any]] | None = None  # an environment's task: (environment, reset body)
    tools: list[dict[str, Any]] = field(default_factory=list)


class Gateway:
    def __init__(self, s: RolloutSettings, tokenizer: Any, metrics: GatewayMetrics, envs: EnvClient | None = None):
        self.s, self.tok, self.m = s, tokenizer, metrics
        self.envs = envs  # the environment service: environments' tasks open and score there
        self.render = ChatRenderer(tokenizer, s.chat_template)
        self.limits = Limits(s.gateway_max_calls, s.gateway_max_context)
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when a handler left work for the loop
        self.sessions: dict[str, Session] = {}
        self.groups: dict[str, TaskGroup] = {}  # by task id
        self.inbox: deque[Pending] = deque()  # calls for the engine
        self.cancels: deque[str] = deque()
        self.calls: dict[str, Pending] = {}  # in the engine, by key
        self.seat_waiters: deque[Waiter] = deque()
        self.dead: list[tuple[TaskGroup, str, str]] = []  # (group, kind, why) to dead-letter
        self._next_expiry = 0.0
        self.version = 0  # the engine's, as the loop last saw it

    # ------------------------------------------------------------------ handlers' side (under self.lock)

    def authenticate(self, key: str) -> Session | None:
        """The open session this key is for; None if it is no session's key (or that session is over)."""
        if not key.startswith(KEY_PREFIX + "_"):
            return None
        _, sid, secret = (key.split("_", 2) + ["", ""])[:3]
        s = self.sessions.get(sid)
        if s is None or not hmac.compare_digest(s.key_hash, _hash(secret)) or s.state != "open":
            return None
        return s

    def seat(self, waiter: Waiter, own: OwnTask | None) -> Seat | None:
        """A session now (a seat free, or the client's own task), or None: the waiter gets one from the loop."""
        if sum(s.state == "open" for s in self.sessions.values()) >= self.s.gateway_max_sessions:
            self.m.rejected.labels("sessions").inc()
            raise Busy(f"{self.s.gateway_max_sessions} sessions are open (--gateway-max-sessions)")
        if own is not None:
            if own.verifier.startswith("env:"):
                raise ValueError("an own task is scored by the reward server (or the client): not an env: verifier")
            key = f"own:{own.task_id}"
            g = self.groups.get(key)
            if g is None:
                task = PromptTask(
                    task_id=own.task_id,
                    prompt_id=own.task_id,
                    prompt=own.prompt,
                    ground_truth=own.ground_truth,
                    verifier=own.verifier,
                    data_source="gateway",
                    n_samples=own.group_size,
                    dispatch_version=self.version,
                )
                g = self.groups[key] = TaskGroup(task, None, own.group_size, key=key)
            elif g.task.prompt != own.prompt or g.task.n_samples != own.group_size or g.seats == 0:
                raise Conflict(f"task {own.task_id}: its group is full, or was opened with another prompt or size")
            return self._take(g)
        free = self._free()
        if free is not None:
            return self._take(free)
        self.seat_waiters.append(waiter)
        self.wake.set()
        return None

    def withdraw(self, waiter: Waiter) -> Seat | None:
        """The waiter gives up; the seat the loop gave it meanwhile, if any (it takes it)."""
        waiter.withdrawn = True
        return waiter.result if isinstance(waiter.result, Seat) else None

    def _take(self, g: TaskGroup) -> Seat:
        sid = uuid.uuid4().hex[:16]
        secret = secrets.token_urlsafe(24)
        session = Session(sid, _hash(secret), g.key, self.render, self.limits, time.monotonic())
        g.seats -= 1
        g.seated_at = time.monotonic()
        g.sessions.append(session)
        self.sessions[sid] = session
        self.m.open.inc()
        self.m.sessions.labels("opened").inc()
        spec = env_task(g.task)
        return Seat(session, f"{KEY_PREFIX}_{sid}_{secret}", g.task, self.messages_of(g.task), spec)

    def unseat(self, session: Session) -> None:
        """A session that could not begin (its environment did not open): its seat is free again."""
        g = self.groups.get(session.task_id)
        if g is not None and session in g.sessions:
            g.sessions.remove(session)
            g.seats += 1
        self.sessions.pop(session.sid, None)
        self._abandon(session)

    def _abandon(self, session: Session) -> None:
        """An open session over without an end (idle, never begun, its task refused): out of the open gauge."""
        if session.state == "open":
            self.m.open.dec()
            self.m.sessions.labels("abandoned").inc()
        session.state = "abandoned"

    def refuse_task(self, task_id: str, kind: str, why: str) -> None:
        """A task that cannot be handed out (its environment refuses it): dead-lettered, its sessions over."""
        g = self.groups.pop(task_id, None)
        if g is None:
            return
        for sess in g.sessions:
            self.sessions.pop(sess.sid, None)
            self._abandon(sess)
        self.dead.append((g, kind, why))

    def messages_of(self, task: PromptTask) -> list[dict[str, str]]:
        text = task.prompt
        if text is None and task.prompt_token_ids is not None:
            text = self.tok.decode(task.prompt_token_ids.tolist(), skip_special_tokens=True)
        return [{"role": "user", "content": text or ""}]

    def submit(self, p: Pending) -> None:
        if len(self.inbox) >= 4 * self.s.max_in_flight:
            self.m.rejected.labels("calls").inc()
            raise Busy(f"{len(self.inbox)} calls wait for the engine")
        self.inbox.append(p)
        self.wake.set()

    def cancel(self, key: str) -> None:
        self.cancels.append(key)
        self.wake.set()

    def end(self, session: Session, choice: int, score: Score) -> None:
        g = self.groups.get(session.task_id)
        if g is None:
            raise CallRefused(f"session {session.sid} is {session.state}")
        session.end(choice, score.reward)
        g.scores[session.sid] = score
        self.m.open.dec()
        self.m.sessions.labels("ended").inc()

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
        return next((g for g in self.groups.values() if g.seats and g.delivery is not None), None)

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
        for s in self.sessions.values():
            if s.state == "open" and not s.busy and now - s.last_seen > self.s.gateway_idle_s:
                self._abandon(s)
                log.info("gateway session %s abandoned (idle %.0f s)", s.sid, now - s.last_seen)
        for key, g in list(self.groups.items()):
            if not g.seats or now - g.seated_at <= self.s.gateway_idle_s:
                continue
            if g.sessions:
                g.seats = 0  # complete once its sessions are over
            else:
                del self.groups[key]
                if g.delivery is not None:
                    consumer.release(g.delivery.entry_id)

    def finished(self, key: str, outs: list[Completion]) -> None:
        with self.lock:
            p = self.calls.pop(key, None)
        if p is None:
            return  # cancelled meanwhile
        p.engine_s = time.monotonic() - p.submitted_at
        p.waiter.resolve(outs)

    def stream(self, deltas: list[Any]) -> None:
        for d in deltas:
            p = self.calls.get(d.key)
            if p is not None:
                p.waiter.push(d)

    def publish(self, consumer: StreamConsumer[PromptTask]) -> int:
        """Complete groups published (and their prompts acknowledged in the same step); hopeless ones
        dead-lettered."""
        with self.lock:
            done = [g for g in self.groups.values() if g.complete()]
            for g in done:
                del self.groups[g.key]
                for s in g.sessions:
                    self.sessions.pop(s.sid, None)
            dead, self.dead = self.dead, []
        published = 0
        for g in done:
            group = self.scored(g)
            if group is None:
                dead.append((g, "sessions_abandoned", f"{len(g.sessions)} sessions, too few ended to train on"))
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

    def scored(self, g: TaskGroup) -> ScoredGroup | None:
        """The group's ended sessions as one ScoredGroup sharing one prompt; None if fewer than two ended."""
        ended = [s for s in g.sessions if s.state == "ended" and s.episode is not None]
        if len(ended) < min(2, g.task.n_samples):
            return None
        eps = [s.episode for s in ended if s.episode is not None]
        n = common_prefix([e.opening for e in eps])  # within the shortest opening
        if n == 0:
            return None  # no token in common: there is no prompt the learner could give them all
        eps = [rebase(e, n) for e in eps]
        samples = []
        for s, e in zip(ended, eps, strict=True):
            t, p = s.sampling or (1.0, 1.0)
            samples.append(e.sample(t, p, self.tok.decode(e.ids, skip_special_tokens=False)))
        task = g.task.model_copy(update={"prompt_token_ids": TokenIds(eps[0].opening), "n_samples": len(ended)})
        scores = [g.scores[s.sid] for s in ended]
        return ScoredGroup(task=task, samples=samples, scores=scores, replica_id=self.s.replica_id)


class Busy(RuntimeError):
    """The gateway is at a bound: a 429 with Retry-After."""


class Conflict(ValueError):
    """A client's own task that does not fit the group of that id: a 409."""


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
