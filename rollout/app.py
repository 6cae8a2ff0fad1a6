"""Runs a rollout replica: HTTP (health, metrics) from a thread, heartbeat from another, the loop here."""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from rollout.engine import load_engine
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient
from rollout.settings import RolloutSettings
from rollout.weight_receiver import WeightReceiver
from rollout.worker import Worker
from services.common.streams import connect_from
from services.common.web import create_app, serve_in_thread

log = logging.getLogger(__name__)


def run(settings: RolloutSettings, stop: threading.Event) -> Worker:
    s = settings
    client = connect_from(s)
    registry = CollectorRegistry()
    metrics = RolloutMetrics(registry)
    holder: dict[str, Worker] = {}

    def ready() -> tuple[bool, str]:
        w = holder.get("w")
        return (w is not None and w.state == "ready", w.state if w else "loading the engine")

    server = serve_in_thread(create_app("rollout", s, registry, ready=ready), s)
    reward = RewardClient(s.reward_url, token=s.reward_token.get_secret_value() if s.reward_token else None,
                          timeout_s=s.reward_timeout_s, retries=s.reward_retries)  # fmt: skip
    beat_stop = threading.Event()
    try:
        engine = load_engine(s.model_dir, s.engine, kv_cache_gib=s.vllm_kv_cache_gib, eager=s.vllm_eager)
        receiver = WeightReceiver(s, client, metrics) if s.sync_broadcast else None
        holder["w"] = worker = Worker(s, client, engine, reward, metrics, receiver)
        worker.sync_weights()  # a late joiner starts from the newest snapshot, then joins the next round
        worker.warm_up()
        metrics.version.set(engine.version)
        worker.heartbeat()
        threading.Thread(target=worker.heartbeat_forever, args=(beat_stop,), name="heartbeat", daemon=True).start()
        if receiver is not None:
            threading.Thread(target=receiver.run, args=(beat_stop,), name="weight-sync", daemon=True).start()
        log.info("replica %s ready (%s engine, version %d)", s.replica_id, s.engine, engine.version)
        while not stop.is_set() and (s.max_prompts is None or worker.done < s.max_prompts):
            worker.step()
        return worker
    finally:
        beat_stop.set()
        server.should_exit = True
        reward.close()
