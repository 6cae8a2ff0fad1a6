"""The buffer: the mesh's data controller. One loop, three jobs:

1. dispatch — publish PromptTasks (G samples each) while the staleness budget allows, every prompt in turn or, with
   the curriculum policy, skipping those predicted to be filtered (buffer/curriculum.py); the dataset cursor is
   saved in the same MULTI/EXEC as the tasks, so a restart neither repeats nor skips;
2. accept — read ScoredGroups; count each in its prompt's pass-rate state; drop stale ones and, with dynamic
   sampling, ones whose accuracy does not vary (acknowledged and counted); keep the rest, unacknowledged, in the
   carry;
3. assemble — every B kept groups become a TrainBatch with the next batch id, published and the
   groups acknowledged in one server-side step: a kept group is in exactly one batch, and after a
   crash the partial batch is rebuilt from the groups still pending.

    buffer = Buffer(settings, client, source, BufferMetrics(registry))
    while not stop.is_set():
        buffer.step()
"""

from __future__ import annotations

import collections
import json
import logging
import random
import time
from dataclasses import asdict, dataclass

import redis

from buffer.curriculum import (
    BANDS,
    ClassState,
    PromptState,
    PromptStates,
    band,
    cost_give_up,
    decide,
    difficulty_class,
    dispatch_probability,
    zero_variance_probability,
)
from buffer.dynamic_sampling import dispatch_budget, filter_group, is_stale, pass_rate, version_lag
from buffer.metrics import BufferMetrics
from buffer.settings import BufferSettings
from services.datasets import Item, Source, distinct_prompts
from services.draws import uniform
from services.episode_log import EpisodeLog, group_record
from services.lease import Lease
from services.schemas import DroppedGroup, PromptTask, SamplingBudget, ScoredGroup, TrainBatch
from services.stream_admin import safe_trim, stream_stats
from services.streams import (
    DEAD_LETTER_STREAM,
    GROUP_BUFFER,
    GROUP_LEARNER,
    GROUP_ROLLOUT,
    KEY_BATCH_ID,
    KEY_POLICY_VERSION,
    STREAM_BATCHES,
    STREAM_DROPPED,
    STREAM_PROMPTS,
    STREAM_ROLLOUTS,
    Delivery,
    Fenced,
    StreamConsumer,
    encode,
    ensure_group,
    redis_errors,
)

log = logging.getLogger(__name__)

KEY_CURSOR = "dapo:buffer:cursor"
KEY_PUBLISHED = "dapo:buffer:published"  # a set: every group id put in a batch, added with the batch itself
DISPATCH_CHUNK = 64
GAUGES_EVERY_S = 1.0  # stream depths and group backlogs for Prometheus (autoscaling, alerts)
BANDS_EVERY_S = 30.0  # prompts per difficulty band (a scan of every prompt's state)
MAX_SKIPS_PER_SLOT = 8  # curriculum: at most this many prompts looked at per prompt dispatched, per step


@dataclass
class Cursor:
    epoch: int = 0
    position: int = 0
    seed: int = 0


class Buffer:
    def __init__(
        self,
        settings: BufferSettings,
        client: redis.Redis,
        source: Source,
        metrics: BufferMetrics,
        lease: Lease | None = None,
    ):
        """With a `lease` (the runner's), every write that could repeat another buffer's work — the dispatch, a
        batch, a drop, a dead letter — happens only while the lease holds its token; without one (tests, tools),
        unfenced."""
        if lease is not None and not lease.held:
            raise Fenced(f"a buffer fenced by {lease.key} needs the lease held: acquire() it first")
        self.s, self.client, self.source, self.m, self.lease = settings, client, source, metrics, lease
        self.episodes = EpisodeLog(
            settings.run_dir / "episodes", fraction=settings.record_episodes, max_mb=settings.record_episodes_mb
        )
        ensure_group(client, STREAM_PROMPTS, GROUP_ROLLOUT)  # outstanding prompts are countable from the start
        ensure_group(client, STREAM_BATCHES, GROUP_LEARNER)  # batches are kept until the learner acknowledges them
        self.consumer = StreamConsumer(
            client,
            STREAM_ROLLOUTS,
            GROUP_BUFFER,
            settings.consumer_name,
            ScoredGroup,
            claim_idle_ms=settings.claim_idle_ms,
            registry=metrics.registry,
        )
        self.consumer.fence = (lease.key, lease.token) if lease else None
        raw = client.get(KEY_CURSOR)
        self.cursor = Cursor(**json.loads(raw)) if raw else Cursor(seed=settings.shuffle_seed)
        self._order: tuple[int, list[int]] | None = None
        self.carry: list[Delivery[ScoredGroup]] = []
        self.published: collections.OrderedDict[str, None] = collections.OrderedDict()  # recent group ids
        self.recent: collections.deque[bool] = collections.deque(maxlen=256)  # kept? of the last groups
        self.filtered_streak = 0
        self.paused_until = 0.0
        self.status = "starting"
        self.last_batch_at = self.last_trim = time.monotonic()
        self.next_gauges = self.next_bands = 0.0
        self.states = PromptStates(client, decay=settings.curriculum_decay, class_decay=settings.curriculum_class_decay)

    # ------------------------------------------------------------------ the loop

    def step(self, block_ms: int = 500) -> None:
        self.hold()
        self.dispatch()
        deliveries = self.consumer.read(count=DISPATCH_CHUNK, block_ms=block_ms)
        version = self.policy_version()  # once per step, after the read: the freshest the groups can meet
        for d in deliveries:
            self.accept(d, version)
        if len(self.carry) >= self.s.batch_size:
            self.purge_stale(version)
        while len(self.carry) >= self.s.batch_size:
            self.hold(now=True)  # checked before the batch id is taken: a fenced batch leaves no gap, mostly
            self.publish_batch()
        self.m.carry.set(len(self.carry))
        if time.monotonic() >= self.next_gauges:
            self.update_stream_gauges()
        if time.monotonic() >= self.next_bands:
            self.update_bands()
        if time.monotonic() - self.last_trim >= self.s.trim_every_s:
            self.trim()

    def hold(self, *, now: bool = False) -> None:
        """Renew the lease (at most every third of its TTL, unless `now`); Fenced if it was lost: this buffer leads
        no more."""
        if self.lease is not None and not self.lease.renew(now=now):
            raise Fenced(f"lost the lease {self.lease.key}: another buffer leads")

    def update_stream_gauges(self) -> None:
        """Depth of every stream (the dead-letter one included) and each group's backlog, every second."""
        for name in (STREAM_PROMPTS, STREAM_ROLLOUTS, STREAM_BATCHES, DEAD_LETTER_STREAM):
            st = stream_stats(self.client, name)
            self.m.stream_depth.labels(name).set(st.length)
            for g in st.groups:
                self.m.backlog.labels(name, g.name).set((g.lag or 0) + g.pending)
        self.next_gauges = time.monotonic() + GAUGES_EVERY_S

    def trim(self) -> None:
        """Bound the streams' memory: drop old entries every group has acknowledged (never others)."""
        safe_trim(self.client, STREAM_PROMPTS, keep_last=self.s.keep_prompts)
        safe_trim(self.client, STREAM_ROLLOUTS, keep_last=self.s.keep_rollouts)
        self.client.xtrim(STREAM_DROPPED, maxlen=self.s.keep_dropped, approximate=True)  # no group reads it
        self.last_trim = time.monotonic()

    # ------------------------------------------------------------------ dispatch

    def policy_version(self) -> int:
        with redis_errors(self.client):
            return int(self.client.get(KEY_POLICY_VERSION) or 0)

    def counts(self) -> tuple[int, int]:
        """(outstanding: dispatched and not yet received, waiting: received and not yet trained — in the
        carry, or in a published batch the learner has not finished: a stalled learner stops dispatch)."""
        prompts = {g.name: g for g in stream_stats(self.client, STREAM_PROMPTS).groups}
        rollouts = {g.name: g for g in stream_stats(self.client, STREAM_ROLLOUTS).groups}
        batches = {g.name: g for g in stream_stats(self.client, STREAM_BATCHES).groups}
        p, r, b = prompts.get(GROUP_ROLLOUT), rollouts.get(GROUP_BUFFER), batches.get(GROUP_LEARNER)
        outstanding = (p.lag or 0) + p.pending if p else 0
        outstanding += (r.lag or 0) if r else 0
        waiting = r.pending if r else 0
        waiting += ((b.lag or 0) + b.pending) * self.s.batch_size if b else 0
        return outstanding, waiting

    def dispatch(self) -> int:
        s = self.s
        if time.monotonic() < self.paused_until:
            return 0
        if self.paused_until:
            log.info("resuming dispatch after a degenerate-pass-rate pause")
            self.paused_until = 0.0
            self.m.paused.set(0)
        outstanding, waiting = self.counts()
        self.m.in_flight.set(outstanding)
        budget = dispatch_budget(s.max_staleness, s.batch_size, outstanding, waiting, s.prompts_per_slot)
        n = min(budget, DISPATCH_CHUNK)
        version = self.policy_version()
        tasks: list[PromptTask] = []
        scanned = 0
        exhausted = False
        while len(tasks) < n and scanned < n * MAX_SKIPS_PER_SLOT and not exhausted:
            slots = []
            for _ in range(n - len(tasks)):
                item = self._next_item()
                if item is None:
                    exhausted = True
                    break
                slots.append((item, self.cursor.epoch, self.cursor.position - 1))
            scanned += len(slots)
            for (item, epoch, position), go in zip(slots, self.choose(slots), strict=True):
                if not go:
                    self.m.skipped.labels(item.data_source).inc()
                    continue
                tasks.append(self.task(item, epoch, position, version))
        if scanned:
            self._publish_tasks(self.with_budgets(tasks))
        sent = len(tasks)
        if exhausted:
            self.status = f"dataset exhausted after {self.s.max_epochs} epochs"
        elif sent or self.status == "starting":
            self.status = "running"
        self.m.epoch.set(self.cursor.epoch)
        return sent

    def _publish_tasks(self, tasks: list[PromptTask]) -> None:
        """The tasks and the cursor past them in one MULTI/EXEC (fenced by the lease): all of it, or none."""
        pipe = self.lease.pipeline() if self.lease else self.client.pipeline(transaction=True)
        for t in tasks:
            pipe.xadd(STREAM_PROMPTS, encode(t))  # type: ignore[arg-type]
        pipe.set(KEY_CURSOR, json.dumps(asdict(self.cursor)))
        if self.lease:
            self.lease.execute(pipe)
        else:
            with redis_errors(self.client):
                pipe.execute()
        for t in tasks:
            self.m.task_dispatched.labels(t.data_source).inc()
        self.m.dispatched.inc(len(tasks))

    def task(self, item: Item, epoch: int, position: int, version: int) -> PromptTask:
        return PromptTask(
            task_id=f"{item.prompt_id}#e{epoch}p{position}",  # a mixture may hold a prompt twice in an epoch
            prompt_id=item.prompt_id,
            prompt=item.prompt,
            ground_truth=item.ground_truth,
            verifier=item.verifier,
            data_source=item.data_source,
            n_samples=self.s.n_samples,
            dispatch_version=version,
        )

    def with_budgets(self, tasks: list[PromptTask]) -> list[PromptTask]:
        """signal/balanced: each task's budget, its give-up chance never below `sampling_give_up` (docs:
        services/sampling-budgets.md)."""
        s = self.s
        if s.sampling_rule == "fixed" or not tasks:
            return tasks
        chances = self.cost_give_ups(tasks) if s.sampling_give_up_by == "cost" else self.history_give_ups(tasks)
        first = s.budget_first
        out = []
        for t, give_up in zip(tasks, chances, strict=True):
            budget = SamplingBudget(
                rule=s.sampling_rule,
                first=first,
                round=s.sampling_round or first,
                most=s.budget_most,
                give_up=give_up,
                draw=uniform(self.cursor.seed, t.task_id, "give-up"),  # the buffer's: every replica decides the same
            )
            out.append(t.model_copy(update={"budget": budget}))
        return out

    def history_give_ups(self, tasks: list[PromptTask]) -> list[float]:
        """The prediction of each prompt's history (else its class's) that a group of G is uniform."""
        known = self.histories([(t.prompt_id, t.data_source, t.ground_truth) for t in tasks])
        floor = self.s.sampling_give_up
        return [max(floor, q) if (q := self.prediction(st, cls)[1]) is not None else floor for st, cls in known]

    def cost_give_ups(self, tasks: list[PromptTask]) -> list[float]:
        """Per task: give up where going on after an agreeing first round costs more than the run's ratio
        (buffer/curriculum.py cost_give_up); each task's cost and the ratio are exported as gauges."""
        names = sorted({t.data_source for t in tasks})
        costs, run = self.states.going_on(names)
        chance = {}
        for name, going_on in zip(names, costs, strict=True):
            chance[name] = cost_give_up(going_on, run, explore=self.s.sampling_explore, floor=self.s.sampling_give_up)
            if going_on is not None and (cost := going_on.cost()) is not None:
                self.m.going_on_cost.labels(name).set(cost)
        if run is not None and (ratio := run.ratio()) is not None:
            self.m.drawn_per_kept.set(ratio)
        return [chance[t.data_source] for t in tasks]

    def choose(self, slots: list[tuple[Item, int, int]]) -> list[bool]:
        """Which of these dispatch slots (item, epoch, position) go out: all of them with `uniform`; with
        `curriculum`, each with its chance from its prompt's state, or its class's when it has none
        (buffer/curriculum.py), seeded per slot."""
        if self.s.dispatch_policy == "uniform" or not slots:
            return [True] * len(slots)
        known = self.histories([(it.prompt_id, it.data_source, it.ground_truth) for it, _, _ in slots])
        return [
            decide(self.chance(st, cls), self.cursor.seed, epoch, position)
            for (_, epoch, position), (st, cls) in zip(slots, known, strict=True)
        ]

    def histories(self, prompts: list[tuple[str, str, str]]) -> list[tuple[PromptState | None, ClassState | None]]:
        """Each (prompt id, data source, ground truth)'s state, and its class's where it has none (two reads)."""
        states = self.states.get([pid for pid, _, _ in prompts])
        kinds = [None if st else self.klass(src, gt) for (_, src, gt), st in zip(prompts, states, strict=True)]
        names = sorted({k for k in kinds if k})
        classes = dict(zip(names, self.states.classes(names), strict=True))
        return [(st, classes.get(k) if k else None) for st, k in zip(states, kinds, strict=True)]

    def klass(self, data_source: str, ground_truth: str) -> str | None:
        return difficulty_class(data_source, ground_truth, self.s.curriculum_shared)

    def chance(self, state: PromptState | None, cls: ClassState | None = None) -> float:
        """The curriculum's chance of dispatching the prompt with this state (or, without one, of its class)."""
        s = self.s
        streak = state.streak if state is not None else 0
        _, q = self.prediction(state, cls)
        return dispatch_probability(q, streak, explore=s.curriculum_explore, streak_decay=s.curriculum_streak_decay)

    def prediction(self, state: PromptState | None, cls: ClassState | None) -> tuple[str, float | None]:
        """(basis, P(the prompt's next group is dropped)): from its own state ("prompt"), or without one from its
        class's ("class"); None where neither predicts."""
        if state is not None:
            return "prompt", self.predict(state)
        return "class", cls.predict() if cls is not None else None

    def predict(self, state: PromptState | None) -> float | None:
        """P(the prompt's next group is dropped by dynamic sampling); None: no history."""
        return zero_variance_probability(state, self.s.n_samples, prior=self.s.curriculum_prior)

    def _next_item(self) -> Item | None:
        n = len(self.source.train)
        if self.cursor.position >= n:
            if self.s.max_epochs is not None and self.cursor.epoch + 1 >= self.s.max_epochs:
                return None
            self.cursor.epoch += 1
            self.cursor.position = 0
        if self._order is None or self._order[0] != self.cursor.epoch:
            order = list(range(n))
            random.Random(self.cursor.seed * 1_000_003 + self.cursor.epoch).shuffle(order)
            self._order = (self.cursor.epoch, order)
        item = self.source.train[self._order[1][self.cursor.position]]
        self.cursor.position += 1
        return item

    # ------------------------------------------------------------------ accept

    def accept(self, d: Delivery[ScoredGroup], version: int) -> None:
        g = d.message
        if any(c.entry_id == d.entry_id for c in self.carry):  # the very entry we hold: never acknowledge it here
            log.warning("group %s delivered again while in the carry; kept once", g.group_id)
            return
        if self.is_duplicate(g):
            self._drop(d, "duplicate", version)
            return
        self.m.received.inc()
        self.m.samples_generated.inc(g.drawn)
        self.m.pass_rate.observe(pass_rate(g))
        stale = is_stale(g, version, self.s.max_staleness)
        self.learn(g, stale)
        if stale:
            self._drop(d, "stale", version)
            return
        verdict = "keep"
        if self.s.dynamic_sampling:
            verdict = filter_group(g, continuous=self.s.continuous_rewards, std_threshold=self.s.reward_std_threshold)
        self.recent.append(verdict == "keep")
        self.m.keep_ratio.set(sum(self.recent) / len(self.recent))
        self.m.task_groups.labels(g.task.data_source, verdict).inc()
        if verdict != "keep":
            self._drop(d, verdict, version)
            self._watch_degenerate(verdict)
            return
        self.filtered_streak = 0
        self.m.kept.inc()
        self.m.version_lag.observe(version_lag(g, version))
        self.carry.append(d)

    def learn(self, g: ScoredGroup, stale: bool) -> None:
        """Count the group in its prompt's state (every received group, stale ones too: they tell how hard the
        prompt is; in the costs of going on they count as drawn, not kept) and a prompt's first group in its
        class's, and the prediction the state held before it against what came (once per group: a group delivered
        again after a restart is neither counted nor scored again)."""
        correct = sum(s.acc for s in g.scores)
        agreed = correct in (0, len(g.scores))
        klass = self.klass(g.task.data_source, g.task.ground_truth)
        r = self.states.record(g, zero_variance=agreed, version=g.max_version, klass=klass, stale=stale)
        basis, q = self.prediction(r.before, r.class_before)
        if r.counted and q is not None:
            self.m.predicted.labels(basis).inc(q)
            self.m.predicted_groups.labels(basis).inc()
            self.m.observed.labels(basis).inc(agreed)

    def update_bands(self) -> None:
        """Prompts per difficulty band (HSCAN of the state, every BANDS_EVERY_S); "unseen": training prompts with
        no group yet."""
        counts = collections.Counter(band(state) for _, state in self.states.scan())
        counts["unseen"] = max(0, distinct_prompts(self.source.train) - sum(counts.values()))
        for name in ("unseen", *(label for _, label in BANDS)):
            self.m.bands.labels(name).set(counts.get(name, 0))
        self.next_bands = time.monotonic() + BANDS_EVERY_S

    def is_duplicate(self, g: ScoredGroup) -> bool:
        """Already in a batch (known here, or recorded in Redis with the batch: a copy that arrives after a restart
        of this buffer is caught too), or a copy of a group in the carry."""
        if g.group_id in self.published or any(c.message.group_id == g.group_id for c in self.carry):
            return True
        with redis_errors(self.client):
            return bool(self.client.sismember(KEY_PUBLISHED, g.group_id))

    def purge_stale(self, version: int) -> None:
        """The learner may have moved on while groups waited in the carry: check them again."""
        stale = [d for d in self.carry if is_stale(d.message, version, self.s.max_staleness)]
        if stale:
            gone = {d.entry_id for d in stale}
            self.carry = [d for d in self.carry if d.entry_id not in gone]
            for d in stale:
                self._drop(d, "stale", version)

    def _drop(self, d: Delivery[ScoredGroup], reason: str, version: int) -> None:
        """Acknowledge the group and record why, in one server-side step (the audit reads dapo:dropped)."""
        g = d.message
        record = DroppedGroup(
            task_id=g.task.task_id,
            prompt_id=g.task.prompt_id,
            reason=reason,
            replica_id=g.replica_id,
            min_version=g.min_version,
            at_version=version,
        )
        self.consumer.ack_and_publish([d.entry_id], [(STREAM_DROPPED, record)])
        self.m.filtered.labels(reason).inc()
        if self.episodes.wants(g.group_id):  # after the drop is durable; recording never stops the buffer
            try:
                self.episodes.write(
                    f"dropped-v{version:06d}.jsonl",
                    [group_record(g, "dropped", version, reason=reason)],
                    version=version,
                )
            except Exception as e:  # noqa: BLE001 (nothing of the log may stop the buffer)
                log.warning("could not record dropped group %s: %r", g.group_id, e)

    def _watch_degenerate(self, reason: str) -> None:
        """Never crash on a degenerate pass rate: say so, and pause dispatch if a cap is set."""
        self.filtered_streak += 1
        if len(self.recent) == self.recent.maxlen and not any(self.recent) and self.filtered_streak % 256 == 0:
            log.warning(
                "no group kept in the last %d (latest: %s): the tasks are too easy or too hard "
                "for the model; dispatch continues",
                len(self.recent),
                reason,
            )
        cap = self.s.degenerate_cap
        if cap is not None and self.filtered_streak >= cap and not self.paused_until:
            self.paused_until = time.monotonic() + self.s.degenerate_pause_s
            self.status = (
                f"paused {self.s.degenerate_pause_s:g} s: {self.filtered_streak} groups in a row "
                f"filtered (latest: {reason})"
            )
            self.m.paused.set(1)
            log.warning("dispatch %s", self.status)
            self.filtered_streak = 0

    # ------------------------------------------------------------------ assemble

    def publish_batch(self) -> TrainBatch:
        take, self.carry = self.carry[: self.s.batch_size], self.carry[self.s.batch_size :]
        with redis_errors(self.client):
            batch_id = int(self.client.incr(KEY_BATCH_ID)) - 1  # a crash before publishing leaves a gap only
        batch = TrainBatch.assemble(batch_id, [d.message for d in take])
        self.consumer.ack_and_publish(
            [d.entry_id for d in take],
            [(STREAM_BATCHES, batch)],
            record=(KEY_PUBLISHED, [d.message.group_id for d in take]),
        )
        for d in take:
            self.published[d.message.group_id] = None
        while len(self.published) > 100_000:
            self.published.popitem(last=False)
        now = time.monotonic()
        self.m.fill_seconds.observe(now - self.last_batch_at)
        self.last_batch_at = now
        self.m.batches.inc()
        self.m.samples_trained.inc(sum(len(d.message.samples) for d in take))
        log.info("batch %d: %d groups, versions %d..%d", batch_id, len(take), batch.min_version, batch.max_version)
        return batch
