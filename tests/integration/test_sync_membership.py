"""Weight-sync membership at the edges the control-plane simulation found (docs/results/scale.md): a replica that
joins a generation and leaves before the group has formed, or one that is invited and never joins, must not hold
the learner and everyone else until the timeout. The learner (the real WeightSender) and one replica (the real
WeightReceiver) are real; the other is scripted, since its behaviour at that exact moment is what is under test."""

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


def silent(url: str, invited: threading.Event) -> None:
    """Alive (its heartbeat asks for the broadcast) and invited, but never joins: a receiver that failed before it
    could (a store it could not reach, a manifest it refused) looks like this to the learner."""
    client = connect(url)
    beat(client, "silent", "scripted")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not invited.is_set():
        raw = client.get(KEY_SYNC_GROUP)
        if raw and "silent" in unpack(raw, SyncGroup).candidates:
            invited.set()
        time.sleep(0.05)


def publish_beside(tmp_path: Path, url: str, other, event: threading.Event, **settings):  # type: ignore[no-untyped-def]
    """Publish version 1 (then 2) with a real receiver ("stays") and the scripted `other` live: (seconds of the
    first publish, the two WeightVersions, the generations they went out in, the versions "stays" verified)."""
    client = connect(url)
    model_dir = write_model(tmp_path / "model", 4096)
    module = SimModule(4096)
    with torch.no_grad():
        module.w.fill_(1.0)
    sender = WeightSender(LearnerSettings(sync_port=0, sync_timeout_s=TIMEOUT_S, **settings), client, module,
                          CollectorRegistry())  # fmt: skip
    stop, got = threading.Event(), []
    threads = [threading.Thread(target=stays, args=(url, model_dir, stop, got), daemon=True),
               threading.Thread(target=other, args=(url, event), daemon=True)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        name = other.__name__
        while not (client.exists(REPLICA_KEY_PREFIX + "stays") and client.exists(REPLICA_KEY_PREFIX + name)):
            time.sleep(0.05)
        t0 = time.monotonic()
        first = sender.publish(1)
        seconds = time.monotonic() - t0
        generations = [sender.gen.number if sender.gen else None]
        second = sender.publish(2)
        generations.append(sender.gen.number if sender.gen else None)
        deadline = time.monotonic() + 10
        while 2 not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        return seconds, (first, second), generations, got
    finally:
        stop.set()
        sender.close()
        for t in threads:
            t.join(10)


def test_a_member_that_leaves_while_the_group_forms_does_not_hold_the_others(tmp_path, embedded_redis) -> None:
    left = threading.Event()
    seconds, (wv, _), _, got = publish_beside(tmp_path, embedded_redis.url, leaves, left)
    assert left.is_set()
    assert wv.replicas == ["stays"], wv  # the generation without the one that left formed at once, and took v1
    assert seconds < TIMEOUT_S / 2, seconds  # before: the group waited the whole timeout for it, then failed
    assert got and got[-1] == 2, got  # the replica that stayed serves the newest version


def test_an_invited_replica_that_never_joins_holds_the_learner_only_for_the_join_window(
    tmp_path, embedded_redis
) -> None:
    invited = threading.Event()
    seconds, (v1, v2), generations, got = publish_beside(tmp_path, embedded_redis.url, silent, invited, sync_join_s=5.0)
    assert invited.is_set()
    assert v1.replicas == ["stays"] and v2.replicas == ["stays"], (v1, v2)
    assert seconds < TIMEOUT_S / 2, seconds  # before: the join window was the whole sync timeout
    assert generations[0] == generations[1]  # set aside until its heartbeat moves: v2 went out without a rebuild
    assert got and got[-1] == 2, got  # the replica that stayed serves the newest version


def test_a_replica_told_to_leave_says_draining_at_once_and_is_not_invited(tmp_path, embedded_redis) -> None:
    """SIGTERM sets `leaving` while a step may run for many seconds more: the heartbeat must say so at once, or the
    learner invites it into a group it is about to leave (the simulation's churn: formations given up, rebuilt)."""
    from bench.sim_replicas import SimEngine
    from learner.tiny import tiny_tokenizer
    from rollout.membership import Membership

    url = embedded_redis.url
    client = connect(url)
    model_dir = write_model(tmp_path / "model", 4096)
    s = RolloutSettings(replica_id="goes", redis_url=url, model_dir=model_dir, sync_device="cpu")
    metrics = RolloutMetrics(CollectorRegistry())
    member = Membership(s, client, SimEngine(tiny_tokenizer(), 100.0, [8], 0), metrics,  # type: ignore[arg-type]
                        WeightReceiver(s, client, metrics))  # fmt: skip
    member.state = "ready"  # what warm_up sets once the engine has produced a token (not under test)
    member.heartbeat()
    sender = WeightSender(LearnerSettings(sync_port=0, sync_timeout_s=TIMEOUT_S), client, SimModule(4096),
                          CollectorRegistry())  # fmt: skip
    leaving, stop = threading.Event(), threading.Event()
    threads = [threading.Thread(target=member.heartbeat_forever, args=(stop,), daemon=True),
               threading.Thread(target=member.leave_when, args=(leaving, stop), daemon=True)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        assert "goes" in sender.live()
        leaving.set()  # the step in flight goes on: the heartbeat key stays until it has ended
        deadline = time.monotonic() + 5  # well under the heartbeat's period (TTL / 3 = 5 s by default)
        while "goes" in sender.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "goes" not in sender.live()
        assert sender.heartbeats()["goes"].state == "draining"  # still there, saying it leaves
    finally:
        stop.set()
        sender.close()
        for t in threads:
            t.join(10)
    assert not client.exists(REPLICA_KEY_PREFIX + "goes")  # gone with the heartbeat thread


def test_a_replica_loading_its_first_snapshot_is_not_invited_before_it_is_warm(tmp_path, embedded_redis) -> None:
    """A late joiner loads the newest snapshot before its warm-up and before its receiver runs: it used to say
    "ready" after that load, and the learner invited a replica that could not join yet."""
    from bench.sim_learner import snapshot
    from bench.sim_replicas import SimEngine
    from learner.tiny import tiny_tokenizer
    from rollout.membership import Membership

    url = embedded_redis.url
    client = connect(url)
    model_dir, hf = write_model(tmp_path / "model", 4096), tmp_path / "hf"
    snapshot(hf, 3, SimModule(4096))
    s = RolloutSettings(replica_id="late", redis_url=url, model_dir=model_dir, sync_device="cpu", weights_dir=hf)
    metrics = RolloutMetrics(CollectorRegistry())
    engine = SimEngine(tiny_tokenizer(), 100.0, [8], 0)
    member = Membership(s, client, engine, metrics, WeightReceiver(s, client, metrics))  # type: ignore[arg-type]
    sender = WeightSender(LearnerSettings(sync_port=0, sync_timeout_s=TIMEOUT_S), client, SimModule(4096),
                          CollectorRegistry())  # fmt: skip
    try:
        assert member.sync_weights() and engine.version == 3  # the snapshot is loaded, and the heartbeat sent
        assert sender.heartbeats()["late"].state == "starting" and "late" not in sender.live()
    finally:
        sender.close()
