"""A replica's membership of the mesh: its heartbeat, and the weights it serves.

    membership = Membership(settings, client, engine, metrics, receiver)
    membership.sync_weights()       # a late joiner starts from the newest snapshot ...
    membership.warm_up()            # ... ready once the engine has produced a token
    threading.Thread(target=membership.heartbeat_forever, args=(stop,), daemon=True).start()
    threading.Thread(target=membership.leave_when, args=(leaving, stop), daemon=True).start()  # SIGTERM: "draining"
    membership.sync_weights()       # in either loop, where weights may change: a verified broadcast round, or a
                                    # newer snapshot (services/snapshots.py)

The heartbeat (a Redis key with a TTL, ReplicaHeartbeat) says the version and checksum of the weights held, so
the learner invites the replica to its broadcast group and the buffer knows how stale a group may be; it is sent
again at once after every load, not a TTL/3 later.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Literal

import redis

from rollout.engines.base import Engine, SamplingParams, encode_prompt
from rollout.metrics import RolloutMetrics
from rollout.settings import RolloutSettings
from rollout.weight_receiver import WeightReceiver
from services.schemas import ReplicaHeartbeat
from services.snapshots import Snapshot, latest_snapshot
from services.streams import REPLICA_KEY_PREFIX, RedisUnavailable, pack

log = logging.getLogger(__name__)
State = Literal["starting", "ready", "syncing", "draining"]  # ReplicaHeartbeat.state


class Membership:
    def __init__(
        self,
        s: RolloutSettings,
        client: redis.Redis,
        engine: Engine,
        metrics: RolloutMetrics,
        receiver: WeightReceiver | None = None,
    ):
        self.s, self.client, self.engine, self.m, self.receiver = s, client, engine, metrics, receiver
        self.state: State = "starting"
        self.tokens_per_s = 0.0  # the loop's generation speed, as the heartbeat reports it
        self.checksum: int | None = None  # of the broadcast weights the engine holds (None: from a snapshot)
        self.incarnation = receiver.incarnation if receiver is not None else uuid.uuid4().hex[:12]
        self.leaving = False  # told to leave: every heartbeat from then on says "draining", whatever `state` says
        self.beat_lock = threading.Lock()  # three threads beat: one heartbeat built and written at a time, in order
        self.gateway_url: str | None = None  # its gateway's address for the router (rollout/runner.py sets it)
        self.gateway_load: Callable[[], tuple[int, int]] = lambda: (0, 0)  # (sessions it could open, free seats)

    # ---------------------------------------------------------------- the heartbeat

    def heartbeat(self) -> None:
        with self.beat_lock:  # a heartbeat built before "draining" must not be written after it
            free, seats = self.gateway_load() if self.gateway_url else (0, 0)
            hb = ReplicaHeartbeat(
                replica_id=self.s.replica_id,
                host=self.s.host,
                port=self.s.port,
                weight_version=self.engine.version,
                tokens_per_s=self.tokens_per_s,
                state="draining" if self.leaving else self.state,
                weight_checksum=self.checksum,
                sync_broadcast=self.receiver is not None,
                incarnation=self.incarnation,
                gateway_url=self.gateway_url,
                gateway_free=free,
                gateway_seats=seats,
            )
            self.client.set(REPLICA_KEY_PREFIX + self.s.replica_id, pack(hb), px=int(self.s.heartbeat_ttl_s * 1000))

    def beat(self) -> None:
        """`heartbeat()` from a thread that must go on: a Redis error is logged (the next beat tries again)."""
        try:
            self.heartbeat()
        except (RedisUnavailable, redis.RedisError) as e:
            log.warning("heartbeat failed: %s", e)

    def heartbeat_forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.s.heartbeat_ttl_s / 3):
            self.beat()
        self.client.delete(REPLICA_KEY_PREFIX + self.s.replica_id)

    def leave_when(self, leaving: threading.Event, stop: threading.Event) -> None:
        """Say "draining" in the heartbeat as soon as `leaving` is set (SIGTERM), not when the step in flight has
        ended: the learner invites only ready replicas into a new broadcast group, and one that joins and then leaves
        while the group forms makes everyone form it again."""
        while not stop.is_set():
            if leaving.wait(0.2):
                self.leaving, self.state = True, "draining"
                self.beat()
                return

    def warm_up(self) -> None:
        """Ready means the engine has produced a token."""
        ids = encode_prompt(self.engine.tokenizer, "Hello", self.s.chat_template)
        self.engine.generate([ids], 1, SamplingParams(max_tokens=1))
        self.state = "ready"

    # ---------------------------------------------------------------- the weights

    def sync_weights(self) -> bool:
        """Load the newest weights now: a verified broadcast round, else a newer snapshot. The loop calls it where
        a load is allowed (the chunked loop: between engine calls; continuous batching: between two steps)."""
        if self.receiver is not None and self.receiver.ready is not None:
            t0 = time.perf_counter()
            got = self.receiver.take(self.engine.load_tensors)
            if got is not None:
                self._loaded(got.version, got.checksum, "broadcast", time.perf_counter() - t0, got.announced)
                return True
        newer = self.newer_snapshot()
        if newer is None:
            return False
        if self.state == "ready":  # not "starting": a replica is invited once warm, not while it loads its first
            self.state = "syncing"
        t0 = time.perf_counter()
        self.engine.load_weights(newer.path, newer.version)
        announced = time.monotonic() - max(0.0, time.time() - newer.written)
        self._loaded(newer.version, None, f"snapshot {newer.path.name}", time.perf_counter() - t0, announced)
        return True

    def weights_waiting(self) -> bool:
        """Newer weights are there to load (drain mode stops admitting prompts while they wait)."""
        return (self.receiver is not None and self.receiver.ready is not None) or self.newer_snapshot() is not None

    def newer_snapshot(self) -> Snapshot | None:
        """The learner's newest HF snapshot if newer than the engine's weights; never for a member of the broadcast
        group (it gets every version from it)."""
        if self.s.weights_dir is None or (self.receiver is not None and self.receiver.state != "idle"):
            return None
        newest = latest_snapshot(self.s.weights_dir)
        return newest if newest is not None and newest.version > self.engine.version else None

    def _loaded(self, version: int, checksum: int | None, source: str, seconds: float, announced: float) -> None:
        if self.state == "syncing" and not self.leaving:
            self.state = "ready"
        self.checksum = checksum
        self.m.version.set(version)
        self.m.weight_load_seconds.observe(seconds)
        self.m.weight_serve_seconds.observe(time.monotonic() - announced)
        log.info("serving weights version %d (%s), loaded in %.2f s", version, source, seconds)
        self.beat()  # the learner and the buffer see the new version now, not a TTL/3 later
