"""The learner's main loop: TrainBatches from Redis in, DAPO updates, checkpoints, acknowledgements.

    python -m learner --model-dir DIR --redis-url URL [--checkpoint-every 1] ...

Read a batch (own pending first after a restart, then reclaimed, then new); skip it if the
checkpointed weights already contain it; train; write the HF snapshot; bump the policy version in
Redis; broadcast the new weights to the live rollout replicas (learner/weight_sync.py); every
`checkpoint_every` batches write a checkpoint and only then acknowledge the batches it contains.
A crash therefore loses no batch and trains none twice. At start the learner broadcasts the weights
it resumed from, so replicas that held a version lost in the crash serve the learner's again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from prometheus_client import CollectorRegistry

from learner import checkpoint
from learner.checkpoint import LearnerState
from learner.metrics import LearnerMetrics
from learner.settings import LearnerSettings
from learner.trainer import Trainer
from learner.weight_sync import WeightSender
from services.common.schemas import TrainBatch
from services.common.stream_admin import safe_trim, stream_stats
from services.common.streams import GROUP_LEARNER, KEY_POLICY_VERSION, STREAM_BATCHES, StreamConsumer, connect_from
from services.common.web import create_app, serve_in_thread

log = logging.getLogger(__name__)


def run(settings: LearnerSettings, stop: threading.Event) -> LearnerState:
    s = settings
    client = connect_from(s)
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    holder: dict[str, Trainer] = {}
    app = create_app("learner", s, registry, ready=lambda: ("t" in holder, "model loaded" if holder else "loading"))
    server = serve_in_thread(app, s)
    sender: WeightSender | None = None
    try:
        holder["t"] = trainer = Trainer(s)
        s.run_dir.mkdir(parents=True, exist_ok=True)
        state = checkpoint.load(trainer.engine, s.run_dir) or LearnerState()
        client.set(KEY_POLICY_VERSION, state.version)  # a crash may have left a newer version that was lost
        metrics.policy_version.set(state.version)
        if s.weight_sync == "broadcast":
            sender = WeightSender(
                s, client, trainer.engine.module, registry, zero3=trainer.engine.zero_optimization_stage() == 3
            )
            sender.publish(state.version, step=state.step)  # replicas serve exactly the weights we resume from
        consumer = StreamConsumer(
            client, STREAM_BATCHES, GROUP_LEARNER, s.consumer_name, TrainBatch,
            claim_idle_ms=s.claim_idle_ms, max_deliveries=s.max_deliveries, registry=registry,
        )  # fmt: skip
        done, trained_now = set(state.trained), 0
        unacked: list[str] = []  # trained, not yet in a checkpoint: acknowledged by the next commit()

        def commit() -> None:
            t0 = time.perf_counter()
            checkpoint.save(trainer.engine, s.run_dir, state, keep=s.keep_checkpoints)
            metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
            consumer.ack(*unacked)
            unacked.clear()
            safe_trim(client, STREAM_BATCHES, keep_last=s.keep_batches)  # a batch is ~B x G x 4 KB

        with open(s.run_dir / "trained.jsonl", "a") as ledger:
            while not stop.is_set() and (s.max_batches is None or state.version < s.max_batches):
                groups = stream_stats(client, STREAM_BATCHES).groups
                metrics.batches_pending.set(sum((g.lag or 0) + g.pending for g in groups if g.name == GROUP_LEARNER))
                for d in consumer.read(count=1, block_ms=1000):
                    batch = d.message
                    if batch.batch_id in done:  # redelivered, but its update is already in the weights
                        consumer.ack(d.entry_id)
                        metrics.batches_skipped.inc()
                        continue
                    m = trainer.train(batch)
                    lag = max(0, state.version - batch.min_version)
                    state.advance(batch.batch_id, s.minibatches)
                    done.add(batch.batch_id)
                    metrics.record(m, state.version, lag)
                    snapshot = None
                    if s.hf_export:  # for late joiners, and the filesystem transport: replicas reload hf/latest
                        snapshot = checkpoint.export_hf(
                            trainer.engine,
                            s.run_dir / "hf",
                            state.version,
                            tokenizer=trainer.tokenizer,
                            keep=s.keep_checkpoints + 1,
                        )
                    client.set(KEY_POLICY_VERSION, state.version)
                    if sender is not None:
                        wv = sender.publish(
                            state.version,
                            step=state.step,
                            batch_id=batch.batch_id,
                            checkpoint_dir=str(snapshot) if snapshot else None,
                        )
                        m = m | {"sync_seconds": wv.sync_seconds, "sync_replicas": len(wv.replicas)}
                    entry = {"batch_id": batch.batch_id, "version": state.version, "pid": os.getpid(), "lag": lag, **m,
                             "task_ids": [g.group_id for g in batch.groups]}  # fmt: skip  # the audit reads these
                    ledger.write(json.dumps(entry) + "\n")
                    ledger.flush()
                    unacked.append(d.entry_id)
                    trained_now += 1
                    log.info("batch %d -> version %d: loss %.4f, %.1f s", batch.batch_id, state.version,
                             m.get("loss", 0.0), m["seconds"])  # fmt: skip
                    if len(unacked) >= s.checkpoint_every:
                        commit()
            if unacked:
                commit()
        if s.hold_after_max and not stop.is_set():
            log.info("trained %d batches; holding (metrics, weight sync) until stopped", trained_now)
            stop.wait()
        return state
    finally:
        if sender is not None:
            sender.close()
        server.should_exit = True
        client.close()
