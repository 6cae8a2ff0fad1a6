"""Weight-sync membership at the edges the control-plane simulation found (docs/results/scale.md): a replica that
joins a generation and leaves before the group has formed must not hold the learner and everyone else until the
timeout. The learner (the real WeightSender) and one replica (the real WeightReceiver) are real; the one that leaves
is scripted, since its leaving at that exact moment is what is under test."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from bench.sim_learner import SimModule, write_model
from learner.settings import LearnerSettings
from learner.weight_sync import WeightSender
from rollout.metrics import RolloutMetrics
from rollout.settings import RolloutSettings
from rollout.weight_receiver import WeightReceiver
from services.schemas import ReplicaHeartbeat, SyncGroup
from services.streams import KEY_SYNC_GROUP, REPLICA_KEY_PREFIX, connect, pack, unpack
from services.weight_wire import store_client

TIMEOUT_S = 30.0


def beat(client, name: str, incarnation: str, version: int = 0) -> None:  # type: ignore[no-untyped-def]
    hb = ReplicaHeartbeat(replica_id=name, host="127.0.0.1", port=1, weight_version=version, state="ready",
                          sync_broadcast=True, incarnation=incarnation)  # fmt: skip
    client.set(REPLICA_KEY_PREFIX + name, pack(hb), px=int(TIMEOUT_S * 1000))


def stays(url: str, model_dir: Path, stop: threading.Event, got: list[int]) -> None:
    """A real receiver with its heartbeat; `got`: the versions it verified."""
    client = connect(url)
    s = RolloutSettings(replica_id="stays", redis_url=url, model_dir=model_dir, sync_device="cpu")
    r = WeightReceiver(s, client, RolloutMetrics(CollectorRegistry()))
    threading.Thread(target=r.run, args=(stop,), daemon=True).start()
    while not stop.is_set():
        taken = r.take(lambda named, version, adapter=None: got.append(version))
        beat(client, "stays", r.incarnation, got[-1] if got else 0)
        time.sleep(0.05 if taken is None else 0)
    client.delete(REPLICA_KEY_PREFIX + "stays")


def leaves(url: str, left: threading.Event) -> None:
    """Joins the first generation that invites it, waits for the roster, then leaves without connecting."""
    client = connect(url)
    beat(client, "leaves", "scripted")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        raw = client.get(KEY_SYNC_GROUP)
        ann = unpack(raw, SyncGroup) if raw else None
        if ann is not None and "leaves" in ann.candidates:
            import torch.distributed as dist

            store = dist.PrefixStore(f"g{ann.generation}/", store_client(ann.host, ann.port, TIMEOUT_S))
            store.set("join/leaves", b"1")
            store.wait(["roster"])
            client.delete(REPLICA_KEY_PREFIX + "leaves")  # gone: its heartbeat with it
            left.set()
            return
        time.sleep(0.05)


def test_a_member_that_leaves_while_the_group_forms_does_not_hold_the_others(tmp_path, embedded_redis) -> None:
    url = embedded_redis.url
    client = connect(url)
    model_dir = write_model(tmp_path / "model", 4096)
    module = SimModule(4096)
    with torch.no_grad():
        module.w.fill_(1.0)
    settings = LearnerSettings(sync_port=0, sync_timeout_s=TIMEOUT_S)
    sender = WeightSender(settings, client, module, CollectorRegistry())
    stop, left, got = threading.Event(), threading.Event(), []
    threads = [threading.Thread(target=stays, args=(url, model_dir, stop, got), daemon=True),
               threading.Thread(target=leaves, args=(url, left), daemon=True)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        while not (client.exists(REPLICA_KEY_PREFIX + "stays") and client.exists(REPLICA_KEY_PREFIX + "leaves")):
            time.sleep(0.05)
        t0 = time.monotonic()
        wv = sender.publish(1)
        seconds = time.monotonic() - t0
        assert left.is_set()
        assert wv.replicas == ["stays"], wv  # the generation without the one that left formed at once, and took v1
        assert seconds < TIMEOUT_S / 2, seconds  # before: the group waited the whole timeout for it, then failed
        deadline = time.monotonic() + 10
        while 1 not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 1 in got
    finally:
        stop.set()
        sender.close()
        for t in threads:
            t.join(10)
