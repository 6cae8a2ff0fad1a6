"""Runs a rollout replica: HTTP (health, metrics) from a thread, the heartbeat and the weight receiver from two
more, the loop here.

    python -m rollout --model-dir DIR --redis-url URL --reward-url http://127.0.0.1:8001 ...

Loads the engine and the newest weights, then runs `Worker.step()` (rollout/worker.py) until stopped.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from rollout.engine import Engine, load_engine
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient
from rollout.settings import RolloutSettings
from rollout.stream_worker import StreamWorker
from rollout.streaming import StreamingEngine
from rollout.vllm_engine import VllmEngine
from rollout.weight_receiver import WeightReceiver
from rollout.worker import Worker
from services.dtype import resolve_dtype
from services.placement import place
from services.service_process import ServiceProcess

log = logging.getLogger(__name__)


def engine_placement(s: RolloutSettings) -> dict[str, Any]:
    """vLLM binds its OpenMP pool itself (VLLM_CPU_OMP_THREADS_BIND); the HF engine is torch in this process."""
    if s.engine == "hf":
        place(s.cpu_cores, None, log)
        return {}
    return {"kv_cache_gib": s.vllm_kv_cache_gib, "eager": s.vllm_eager, "cpu_cores": s.cpu_cores}


def make_worker(
    s: RolloutSettings,
    client: redis.Redis,
    engine: Engine,
    reward: RewardClient,
    metrics: RolloutMetrics,
    receiver: WeightReceiver | None,
) -> Worker:
    """vLLM: the streaming loop (continuous batching, in-flight weight updates); HF, or vLLM with --no-stream:
    engine calls of `prompts_per_call` prompts, weights between calls."""
    if isinstance(engine, VllmEngine) and s.stream:
        stream = StreamingEngine(engine, update=s.weight_update, seed=s.seed)
        log.info(
            "streaming replica: up to %d sequences in flight, weight updates: %s", s.max_in_flight, s.weight_update
        )
        return StreamWorker(s, client, stream, reward, metrics, receiver)
    log.info("%s engine: %d prompts per engine call, weights loaded between calls", s.engine, s.prompts_per_call)
    return Worker(s, client, engine, reward, metrics, receiver)


def run(settings: RolloutSettings, stop: threading.Event) -> Worker:
    s = settings
    reward = RewardClient(
        s.reward_url,
        token=s.reward_token.get_secret_value() if s.reward_token else None,
        timeout_s=s.reward_timeout_s,
        retries=s.reward_retries,
    )
    beat_stop = threading.Event()
    heartbeat: threading.Thread | None = None
    with ServiceProcess("rollout", s, loading="loading the engine") as proc:
        try:
            metrics = RolloutMetrics(proc.registry)
            engine = load_engine(s.model_dir, s.engine, dtype=resolve_dtype(s.dtype, log), **engine_placement(s))
            receiver = WeightReceiver(s, proc.client, metrics) if s.sync_broadcast else None
            worker = make_worker(s, proc.client, engine, reward, metrics, receiver)
            proc.ready_when(lambda: (worker.state == "ready", worker.state))
            worker.sync_weights()  # a late joiner starts from the newest snapshot, then joins the next round
            worker.warm_up()
            metrics.version.set(engine.version)
            worker.heartbeat()
            heartbeat = threading.Thread(
                target=worker.heartbeat_forever, args=(beat_stop,), name="heartbeat", daemon=True
            )
            heartbeat.start()
            if receiver is not None:
                threading.Thread(target=receiver.run, args=(beat_stop,), name="weight-sync", daemon=True).start()
            log.info("replica %s ready (%s engine, version %d)", s.replica_id, s.engine, engine.version)
            while not stop.is_set() and (s.max_prompts is None or worker.done < s.max_prompts):
                worker.step()
            if isinstance(worker, StreamWorker):
                worker.stop()
            return worker
        finally:
            beat_stop.set()
            if heartbeat is not None:  # it deletes its key on the way out: before the client closes
                heartbeat.join(10)
            reward.close()
