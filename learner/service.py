"""The learner: TrainBatches from Redis in, DAPO updates, checkpoints, acknowledgements — one batch per step().

    learner = Learner(settings, client, trainer, state, LearnerMetrics(registry), sender)
    while not stop.is_set() and not learner.finished:
        learner.step()
    learner.close()        # checkpoints and acknowledges what is trained but not yet committed

A step reads one batch (own pending first after a restart, then reclaimed, then new); skips it if the
checkpointed weights already contain it; trains; writes the HF snapshot; bumps the policy version in Redis;
broadcasts the new weights to the live rollout replicas (learner/weight_sync.py); appends the ledger line; and
every `checkpoint_every` batches writes a checkpoint and only then acknowledges the batches it contains. A
crash therefore loses no batch and trains none twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import redis

from learner import record
from learner.checkpoint import LearnerState
from learner.episodes import trained_records
from learner.metrics import LearnerMetrics
from learner.ranks import Leader
from learner.settings import LearnerSettings
from learner.trainer import Trainer
from learner.weight_sync import WeightSender
from services import ledger
from services.episode_log import EpisodeLog, group_record
from services.schemas import DroppedGroup, LedgerEntry, ScoredGroup, TrainBatch
from services.stream_admin import safe_trim, stream_stats
from services.streams import (
    GROUP_LEARNER,
    KEY_BATCH_ID,
    KEY_POLICY_VERSION,
    STREAM_BATCHES,
    STREAM_DROPPED,
    Delivery,
    StreamConsumer,
    StreamProducer,
    raise_counter,
)

log = logging.getLogger(__name__)


class Learner:
    def __init__(
        self,
        s: LearnerSettings,
        client: redis.Redis,
        trainer: Trainer,
        state: LearnerState,
        metrics: LearnerMetrics,
        sender: WeightSender | None = None,
        ranks: Leader | None = None,
    ):
        self.s, self.client, self.trainer, self.state, self.m, self.sender = s, client, trainer, state, metrics, sender
        self.ranks = ranks or Leader(trainer)  # every collective step goes through it (N ranks: learner/ranks.py)
        self.consumer = StreamConsumer(
            client,
            STREAM_BATCHES,
            GROUP_LEARNER,
            s.consumer_name,
            TrainBatch,
            claim_idle_ms=s.claim_idle_ms,
            max_deliveries=s.max_deliveries,
            registry=metrics.registry,
        )
        self.done = set(state.keys())  # identities (content digests) of the batches whose update the weights contain
        self.unacked: list[str] = []  # trained, not yet in a checkpoint: acknowledged by the next commit()
        self.trained_now = 0  # batches this process trained
        self.ledger = ledger.open_ledger(s.run_dir)
        self.dropped = StreamProducer(client, STREAM_DROPPED)
        self.episodes = EpisodeLog(
            s.run_dir / "episodes",
            fraction=s.record_episodes,
            max_mb=s.record_episodes_mb,
            meta={"model_dir": str(s.model_dir)},  # the viewer's tokenizer
        )

    @property
    def finished(self) -> bool:
        return self.s.max_batches is not None and self.state.version >= self.s.max_batches

    def step(self) -> None:
        """Train at most one batch (waits up to a second for one)."""
        groups = stream_stats(self.client, STREAM_BATCHES).groups
        self.m.batches_pending.set(sum((g.lag or 0) + g.pending for g in groups if g.name == GROUP_LEARNER))
        got = self.consumer.read(count=1, block_ms=1000)
        if not got:
            self.ranks.idle()  # the other ranks wait for a command: one at least every second
        for d in got:
            # by content, not by id: a redelivery or a retried XADD is the same batch; a batch id handed out again
            # (a Redis that lost its last writes) is another batch, and is trained
            digest = d.message.digest()
            if {digest, f"#{d.message.batch_id}"} & self.done:  # its update is already in the weights
                self.consumer.ack(d.entry_id)
                self.m.batches_skipped.inc()
                continue
            self.train(d, digest)
            if len(self.unacked) >= self.s.checkpoint_every:
                self.commit()

    def fresh_part(self, d: Delivery[TrainBatch]) -> TrainBatch | None:
        """The batch without the groups that are past --max-staleness now, at the update (recorded as dropped); None
        when no group is left (the batch is acknowledged at once: nothing of it reaches the weights)."""
        batch, s, version = d.message, self.s, self.state.version
        if s.max_staleness is None:
            return batch
        stale = [g for g in batch.groups if version - g.min_version > s.max_staleness]
        if not stale:
            return batch
        self.m.stale_groups.labels(s.stale_groups).inc(len(stale))
        if s.stale_groups == "reweight":  # trained, under the off-policy correction
            return batch
        records = [(STREAM_DROPPED, self.stale_record(g, version)) for g in stale]
        gone = {g.group_id for g in stale}
        fresh = [g for g in batch.groups if g.group_id not in gone]
        log.warning(
            "batch %d: %d of %d groups are more than %d versions behind %d: dropped",
            batch.batch_id,
            len(stale),
            len(batch.groups),
            s.max_staleness,
            version,
        )
        if not fresh:
            self.consumer.ack_and_publish([d.entry_id], records)  # dropped and acknowledged in one step
            self.record_stale(batch, stale, version)
            return None
        self.dropped.publish_many(msg for _, msg in records)  # again if a crash redelivers the batch: harmless
        self.record_stale(batch, stale, version)
        return TrainBatch.assemble(batch.batch_id, fresh)

    @staticmethod
    def stale_record(g: ScoredGroup, version: int) -> DroppedGroup:
        return DroppedGroup(
            task_id=g.group_id,
            prompt_id=g.task.prompt_id,
            reason="stale_at_update",
            replica_id=g.replica_id,
            min_version=g.min_version,
            at_version=version,
        )

    def train(self, d: Delivery[TrainBatch], digest: str) -> None:
        """Train -> snapshot -> publish the version and the weights -> ledger; acknowledged at the next commit.
        `digest`: the consumed batch's (a redelivery of it is recognised, however staleness cut it)."""
        s, state = self.s, self.state
        batch = self.fresh_part(d)
        if batch is None:
            return
        m: dict[str, Any] = self.ranks.train(batch, version=state.version)
        if s.record_batches:  # before the update is reported anywhere: a replay holds every update the run made
            record.record_batch(s.run_dir, state.version, batch)
        lag = max(0, state.version - batch.min_version)
        state.advance(batch.batch_id, int(m.get("optimizer_steps", 0)), digest)  # the steps taken, not configured
        self.record_trained(batch, state.version)
        self.done.add(digest)
        self.m.record(m, state.version, lag)
        snapshot = None
        if s.hf_export:  # for late joiners, and the filesystem transport: replicas reload hf/latest
            snapshot = self.ranks.export(s.run_dir / "hf", state.version, keep=s.keep_checkpoints + 1)
        self.client.set(KEY_POLICY_VERSION, state.version)
        if self.sender is not None:
            wv = self.sender.publish(
                state.version,
                step=state.step,
                batch_id=batch.batch_id,
                checkpoint_dir=str(snapshot) if snapshot else None,
            )
            m |= {"sync_seconds": wv.sync_seconds, "sync_replicas": len(wv.replicas)}
        entry = LedgerEntry(
            batch_id=batch.batch_id,
            digest=digest,
            version=state.version,
            pid=os.getpid(),
            lag=lag,
            task_ids=[g.group_id for g in batch.groups],
            metrics=m,
        )  # the audit reads the task ids
        ledger.append(self.ledger, entry)
        self.unacked.append(d.entry_id)
        self.trained_now += 1
        log.info(
            "batch %d -> version %d: loss %.4f, %.1f s", batch.batch_id, state.version, m.get("loss", 0.0), m["seconds"]
        )

    def record_trained(self, batch: TrainBatch, version: int) -> None:
        """The batch's recorded share (--record-episodes) with the learner's numbers (learner/episodes.py). A file
        per version, replaced whole: a batch trained again after a crash is recorded once."""
        t = self.trainer.last
        if t is None or not any(self.episodes.wants(g.group_id) for g in batch.groups):
            return
        self._record(f"v{version:06d}.jsonl", version, lambda: trained_records(batch, t, version, self.episodes.wants))

    def record_stale(self, batch: TrainBatch, stale: list[ScoredGroup], version: int) -> None:
        """Groups dropped past the staleness bound at the update: a file per batch, replaced whole (a batch delivered
        again after a crash records them once)."""
        wanted = [g for g in stale if self.episodes.wants(g.group_id)]
        if wanted:
            name = f"stale-v{version:06d}-b{batch.batch_id}.jsonl"
            self._record(
                name, version, lambda: [group_record(g, "dropped", version, reason="stale_at_update") for g in wanted]
            )

    def _record(self, name: str, version: int, records: Callable[[], list[dict[str, Any]]]) -> None:
        """Recording is for reading: whatever goes wrong making or writing the records is said, and training goes
        on (the learner is between its update and its ledger line here)."""
        try:
            self.episodes.write(name, records(), version=version, replace=True)
        except Exception as e:  # noqa: BLE001 (nothing of the log may stop the learner)
            log.warning("could not record the episodes of version %d: %r", version, e)

    def commit(self) -> None:
        """Checkpoint, then acknowledge the batches the checkpoint holds, then trim the stream."""
        t0 = time.perf_counter()
        self.ranks.save(self.s.run_dir, self.state, keep=self.s.keep_checkpoints)  # every rank's shard, then on
        self.m.checkpoint_seconds.observe(time.perf_counter() - t0)
        self.consumer.ack(*self.unacked)
        self.unacked.clear()
        self.raise_batch_ids()
        safe_trim(self.client, STREAM_BATCHES, keep_last=self.s.keep_batches)  # a batch is ~B x G x 4 KB

    def raise_batch_ids(self) -> None:
        """Keep the buffer's batch-id counter past every id the checkpoint holds: a Redis restored from an older
        file would hand them out again (harmless — batches are known by content — but confusing to read)."""
        if self.state.trained and raise_counter(self.client, KEY_BATCH_ID, max(self.state.trained) + 1):
            log.warning(
                "the batch-id counter was behind the checkpoint (Redis lost writes?): raised to %d",
                max(self.state.trained) + 1,
            )

    def close(self) -> None:
        """After the last step: commit what is trained but not in a checkpoint."""
        if self.unacked:
            self.commit()
        self.ledger.close()
