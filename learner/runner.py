"""Runs the learner: health and metrics over HTTP from a thread, the training loop here.

    python -m learner --model-dir DIR --redis-url URL [--checkpoint-every 1] ...

Loads the model and the newest checkpoint, publishes the version it resumed from (a crash may have left a
newer one in Redis that was lost) and broadcasts those weights, so replicas that held a lost version serve the
learner's again; then trains one batch per `Learner.step()` (learner/service.py) until stopped or
`--max-batches`, and checkpoints what is left before it exits.
"""

from __future__ import annotations

import logging
import os
import threading

from prometheus_client import CollectorRegistry

from learner import checkpoint, record
from learner.checkpoint import LearnerState
from learner.metrics import LearnerMetrics
from learner.ranks import Leader, follow
from learner.service import Learner
from learner.settings import LearnerSettings
from learner.trainer import Trainer
from learner.weight_sync import WeightSender
from services.placement import place
from services.service_process import ServiceProcess
from services.streams import KEY_POLICY_VERSION
from services.web import create_app, serve_in_thread

log = logging.getLogger(__name__)


def run(settings: LearnerSettings, stop: threading.Event) -> LearnerState:
    s = settings
    if int(os.environ.get("RANK", "0")) > 0:
        return run_follower(s)
    sender: WeightSender | None = None
    with ServiceProcess("learner", s, loading="loading the model") as proc:
        try:
            metrics = LearnerMetrics(proc.registry)
            place(s.cpu_cores, s.threads, log)
            trainer = Trainer(s)
            ranks = Leader(trainer)
            s.run_dir.mkdir(parents=True, exist_ok=True)
            if s.record_batches:
                record.record_settings(s.run_dir, s)
            state = checkpoint.load(trainer.engine, s.run_dir) or LearnerState()
            ranks.start(state.version)
            proc.client.set(KEY_POLICY_VERSION, state.version)  # a crash may have left a newer version that was lost
            metrics.policy_version.set(state.version)
            if s.weight_sync == "broadcast":
                zero3 = trainer.engine.zero_optimization_stage() == 3
                sender = WeightSender(
                    s, proc.client, trainer.engine.module, proc.registry, zero3=zero3, gather=ranks.gather
                )
                sender.publish(state.version, step=state.step)  # replicas serve exactly the weights we resume from
            learner = Learner(s, proc.client, trainer, state, metrics, sender, ranks)
            learner.raise_batch_ids()
            proc.ready_when(lambda: (True, "model loaded"))
            while not stop.is_set() and not learner.finished:
                learner.step()
            learner.close()  # not on an exception: a batch half-trained must not reach a checkpoint
            ranks.stop()
            if s.hold_after_max and not stop.is_set():
                log.info("trained %d batches; holding (metrics, weight sync) until stopped", learner.trained_now)
                stop.wait()
            return state
        finally:
            if sender is not None:
                sender.close()


def run_follower(s: LearnerSettings) -> LearnerState:
    """Rank > 0 of a multi-rank learner: no Redis, no HTTP; rank 0's collective steps until it stops (a SIGTERM
    here is ignored: rank 0, which torchrun signals too, finishes its batch and checkpoints with this rank)."""
    place(s.cpu_cores, s.threads, log)
    status: list[tuple[bool, str]] = [(False, "loading the model")]
    server = None
    if os.environ.get("LOCAL_RANK") == "0":  # the first rank of another node (a pod of its own): its probes' answer
        server = serve_in_thread(create_app("learner", s, CollectorRegistry(), ready=lambda: status[-1]), s)
    try:
        trainer = Trainer(s)
        state = checkpoint.load(trainer.engine, s.run_dir) or LearnerState()
        log.info("rank %d of %d: following rank 0 from version %d", trainer.rank, trainer.world, state.version)
        status.append((True, f"rank {trainer.rank} following rank 0"))
        follow(trainer, s.run_dir, state.version)
        return state
    finally:
        if server is not None:
            server.should_exit = True
