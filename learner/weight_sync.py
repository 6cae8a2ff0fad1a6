"""The learner's side of weight sync: broadcast every new version to the live rollout replicas.

    sender = WeightSender(settings, client, engine.module, registry, zero3=False)
    sender.publish(version, step=..., batch_id=...)   # after each batch, at the version boundary
    sender.close()

Membership comes from the replicas' heartbeat keys (those with `sync_broadcast`). When it differs from
the current group's, the group is rebuilt: a new generation is announced in Redis, the candidates that
join within the join window (`sync_join_s`) get a rank, and a fresh process group is built on our own TCPStore. A round
announces the version, broadcasts the buckets (gathered first under ZeRO-3), publishes the checksums
and waits for every member's acknowledgement. A member that does not acknowledge in time (dead,
stopped, stalled) is dropped and set aside until its heartbeat moves again; the generation is closed
and the next version rebuilds the group without it. Nothing here waits without a deadline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from learner import lora
from services.schemas import ReplicaHeartbeat, SyncGroup, WeightVersion
from services.streams import REPLICA_KEY_PREFIX, pack, unpack
from services.weight_wire import (
    KEY_SYNC_GENERATION,
    KEY_SYNC_GROUP,
    KEY_WEIGHTS,
    Manifest,
    SyncAborted,
    broadcast,
    checksum,
    dtype_of,
    mac,
    make_group_until,
    store_client,
    store_server,
    sync_key,
    total,
)

log = logging.getLogger(__name__)
QUARANTINE_MAX_S = 300.0
LAGGING_VERSIONS = 4  # a replica outside a capped group this many versions behind reads no snapshots: warned
ROLL_CALL_S = 0.25  # while members are awaited: one key check per member this often (all of them: every 20 ms)


class SyncMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.seconds = Histogram(
            "dapo_learner_sync_seconds",
            "Seconds per weight-broadcast round.",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.bytes = Counter("dapo_learner_sync_bytes", "Weight bytes broadcast (once per round).", registry=r)
        self.gbps = Gauge("dapo_learner_sync_gbps", "GB/s of the last round (bytes / round seconds).", registry=r)
        self.replicas = Gauge("dapo_learner_sync_replicas", "Replicas in the broadcast group.", registry=r)
        self.rebuilds = Counter("dapo_learner_sync_rebuilds", "Broadcast groups built.", registry=r)
        self.rebuild_seconds = Histogram(
            "dapo_learner_sync_rebuild_seconds",
            "Seconds to rebuild the broadcast group (announce, join window, forming the process group).",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.timeouts = Counter("dapo_learner_sync_timeouts", "Replicas dropped: no answer in time.", registry=r)
        self.failures = Counter("dapo_learner_sync_failures", "Rounds or rebuilds that failed.", registry=r)
        self.served = Gauge(
            "dapo_learner_replica_weight_version", "Version each live replica serves.", ("replica",), registry=r
        )


@dataclass
class Generation:
    number: int
    members: list[str]  # rank = index + 1
    store: Any  # PrefixStore g<number>/
    pg: Any
    round: int = 0


@dataclass
class Quarantine:
    """A replica that failed a round waits until its own heartbeat moves past `until_ts`."""

    stamp: float
    failures: int = 1
    until_ts: float = field(init=False)

    def __post_init__(self) -> None:
        self.until_ts = self.stamp

    def fail_again(self, stamp: float) -> None:
        self.failures += 1
        self.stamp = stamp
        self.until_ts = stamp + min(QUARANTINE_MAX_S, 2.0**self.failures)


Gather = Callable[[list[int], list[torch.nn.Parameter]], Any]  # (positions in the module, parameters) -> a context


def zero3_gather(index: list[int], params: list[torch.nn.Parameter]) -> Any:
    """The full values of ZeRO-3-partitioned `params` while in the context (every rank of the learner enters it)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def capped(live: list[str], members: list[str], cap: int) -> list[str]:
    """At most `cap` (0: all) of the live replicas, sorted: the group's current members first (a replica joining
    beyond the cap does not rebuild the group), then by id. The others load the snapshots."""
    if not cap or len(live) <= cap:
        return live
    current = set(members)
    return sorted(([r for r in live if r in current] + [r for r in live if r not in current])[:cap])


class WeightSender:
    def __init__(
        self,
        s: Any,
        client: redis.Redis,
        module: torch.nn.Module,
        registry: CollectorRegistry,
        *,
        zero3: bool = False,
        gather: Gather | None = None,
    ):
        self.s, self.client, self.module, self.zero3 = s, client, module, zero3
        self.gather = gather or zero3_gather  # ZeRO-3 on N ranks: learner/ranks.py's, which the other ranks join
        self.m = SyncMetrics(registry)
        self.timeout_s: float = s.sync_timeout_s
        adapter = None
        if lora.is_peft(module):  # LoRA: the adapter's tensors alone, by the names PEFT saves them under
            wired = list(lora.adapter_params(module))
            self.params = [(n, p) for n, _, p in wired]
            self.positions = [i for _, i, _ in wired]  # in module.parameters(): what the ZeRO-3 gather is told
            adapter = lora.adapter_info(s)
        else:
            self.params = [(n, p) for n, p in module.named_parameters()]
            self.positions = list(range(len(self.params)))
        specs = [(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in self.params]
        self.manifest = Manifest.plan(specs, int(s.sync_bucket_mb * 2**20), adapter=adapter)
        self.device = next(module.parameters()).device
        self.send_buffers: dict[str, torch.Tensor] = {}  # one reusable buffer per dtype, as big as its largest bucket
        for b, (dt, _) in enumerate(self.manifest.buckets):
            n = self.manifest.bucket_numel(b)
            if dt not in self.send_buffers or self.send_buffers[dt].numel() < n:
                self.send_buffers[dt] = torch.zeros(n, dtype=dtype_of(dt), device=self.device)
        self.key = sync_key(s)
        bind = s.sync_bind_host or s.sync_host
        try:
            self.store = store_server(bind, s.sync_port, self.timeout_s)
        except Exception as e:  # noqa: BLE001 -- OSError, torch's DistNetworkError/RuntimeError: say what to change
            raise RuntimeError(
                f"weight sync: cannot listen on {bind}:{s.sync_port} ({e}); set DAPO_SYNC_PORT / "
                "--sync-port (0 picks a free port) or --sync-bind-host"
            ) from e
        self.port = int(self.store.port)
        self.gen: Generation | None = None
        self.quarantine: dict[str, Quarantine] = {}
        self.last_checksum: int | None = None
        self.beyond_cap = 0  # live replicas left out of the group by sync_max_members (logged when it changes)
        self.lagging: set[str] = set()  # replicas outside the group that fell behind (warned once each)
        log.info(
            "weight sync: %d parameters in %d buckets (%.1f MB), rendezvous %s:%d",
            len(self.params),
            len(self.manifest.buckets),
            self.manifest.nbytes / 1e6,
            s.sync_host,
            self.port,
        )

    # ------------------------------------------------------------------ membership

    def heartbeats(self) -> dict[str, ReplicaHeartbeat]:
        beats: dict[str, ReplicaHeartbeat] = {}
        keys = list(self.client.scan_iter(match=REPLICA_KEY_PREFIX + "*", count=1000))
        for key, raw in zip(keys, self.client.mget(keys) if keys else [], strict=True):  # one round trip, not N
            if raw is None:  # expired between the scan and the read
                continue
            try:
                hb = unpack(raw, ReplicaHeartbeat)
            except Exception as e:  # noqa: BLE001 -- a bad heartbeat must not stop training
                log.warning("ignoring heartbeat %r: %s", key, e)
                continue
            beats[hb.replica_id] = hb
        self.m.served.clear()
        for rid, hb in beats.items():
            self.m.served.labels(rid).set(hb.weight_version)
        return beats

    def live(self) -> dict[str, ReplicaHeartbeat]:
        """Replicas that want the broadcast, are up, and are not set aside after a failure."""
        out = {}
        for rid, hb in self.heartbeats().items():
            if not hb.sync_broadcast or hb.state not in ("ready", "syncing"):
                continue
            q = self.quarantine.get(rid)
            if q is not None and hb.timestamp <= q.until_ts:
                continue
            out[rid] = hb
        return out

    def _capped(self, beats: dict[str, ReplicaHeartbeat], version: int) -> list[str]:
        live = sorted(beats)
        chosen = capped(live, self.gen.members if self.gen is not None else [], self.s.sync_max_members)
        if len(live) - len(chosen) != self.beyond_cap:
            self.beyond_cap = len(live) - len(chosen)
            log.info("weight sync: %d live replicas beyond the group's cap take the snapshots", self.beyond_cap)
        for r in set(live) - set(chosen) - self.lagging:
            if beats[r].weight_version < version - LAGGING_VERSIONS:  # once per replica: it reads no snapshots
                self.lagging.add(r)
                log.warning(
                    "weight sync: %s is outside the broadcast group (sync_max_members %d) and serves version %d of %d:"
                    " give it --weights-dir on the volume of the learner's HF snapshots",
                    r,
                    self.s.sync_max_members,
                    beats[r].weight_version,
                    version,
                )
        return chosen

    def _set_aside(self, ids: list[str], beats: dict[str, ReplicaHeartbeat], within_s: float | None = None) -> None:
        for rid in ids:
            stamp = beats[rid].timestamp if rid in beats else time.time()
            if rid in self.quarantine:
                self.quarantine[rid].fail_again(stamp)
            else:
                self.quarantine[rid] = Quarantine(stamp)
        if ids:
            waited = self.timeout_s if within_s is None else within_s
            log.warning("weight sync: dropped %s (gone, or no answer within %g s)", ", ".join(sorted(ids)), waited)
            self.m.timeouts.inc(len(ids))

    # ------------------------------------------------------------------ rounds

    def publish(
        self, version: int, *, step: int = 0, batch_id: int | None = None, checkpoint_dir: str | None = None
    ) -> WeightVersion:
        """Bring every live replica to `version`; returns the WeightVersion published in Redis."""
        t0 = time.perf_counter()
        acked: list[str] = []
        sums: list[int] = []
        for _ in range(3):  # a round broken, or a group given up, by a member that left: retried at once without it
            beats = self.live()
            members = self._capped(beats, version)
            retry = False
            if self.gen is None or members != self.gen.members:
                with self.m.rebuild_seconds.time():
                    retry = self._rebuild(members, beats)
            if self.gen is None:
                if retry:
                    continue
                break
            good, sums, retry = self._round(version, beats)
            acked = sorted(set(acked) | set(good))
            if not retry:
                break
        self.last_checksum = total(sums) if sums else self._checksum_now()
        if acked:
            self.quarantine = {k: v for k, v in self.quarantine.items() if k not in acked}
        seconds = time.perf_counter() - t0
        wv = WeightVersion(
            version=version,
            step=step,
            batch_id=batch_id,
            checkpoint_dir=checkpoint_dir,
            checksum=self.last_checksum,
            replicas=acked,
            sync_seconds=seconds,
        )
        self.client.set(KEY_WEIGHTS, pack(wv))
        if acked:
            self.m.seconds.observe(seconds)
            self.m.bytes.inc(self.manifest.nbytes)
            self.m.gbps.set(self.manifest.nbytes / seconds / 1e9 if seconds else 0.0)
        return wv

    def _rebuild(self, members: list[str], beats: dict[str, ReplicaHeartbeat]) -> bool:
        """Build the group of `members`; True: given up because a member left while it formed (try again now)."""
        self._close()
        if not members:
            self.m.replicas.set(0)
            return False
        number = int(self.client.incr(KEY_SYNC_GENERATION))  # type: ignore[arg-type]
        ps: Any = dist.PrefixStore(f"g{number}/", self.store)
        manifest = self.manifest.to_bytes()
        ps.set("manifest/mac", mac(self.key, "manifest", number, manifest))  # before the manifest: readers wait on it
        ps.set("manifest", manifest)
        invited = [beats[r].incarnation for r in members]
        announce = SyncGroup(
            generation=number,
            host=self.s.sync_host,
            port=self.port,
            candidates=members,
            timeout_s=self.timeout_s,
            incarnations=invited,
        )
        self.client.set(KEY_SYNC_GROUP, pack(announce))
        window = min(self.s.sync_join_s, self.timeout_s)  # not the whole timeout for a replica that cannot join
        joined = self._await(ps, {r: f"join/{r}" for r in members}, beats, window)
        self._set_aside([r for r in members if r not in joined], beats, window)
        roster = [r for r in members if r in joined]
        ps.set("roster", msgpack.packb(roster))
        if not roster:
            self.m.replicas.set(0)
            return False
        left: list[str] = []
        gone = self._gone_check(beats)

        def someone_left() -> bool:
            left[:] = gone(roster)
            return bool(left)

        # on a connection of its own: a formation given up goes on blocking its connection until the timeout
        own: Any = dist.PrefixStore(f"g{number}/", store_client(self.s.sync_host, self.port, self.timeout_s))
        try:  # a member that leaves now would hold everyone else until the timeout: given up at once instead
            pg = make_group_until(
                dist.PrefixStore("pg/", own), 0, len(roster) + 1, self.timeout_s, self.device, someone_left
            )
        except SyncAborted:
            log.warning("weight sync: generation %d given up while forming: %s left", number, ", ".join(left))
            self.m.failures.inc()
            ps.set("round/0", msgpack.packb({"closed": True}))  # the others stop forming it too
            return True
        except Exception as e:  # noqa: BLE001 -- torch raises RuntimeError/DistError: drop those who did not connect
            log.warning("weight sync: generation %d did not form: %s", number, e)
            self.m.failures.inc()
            ps.set("round/0", msgpack.packb({"closed": True}))
            self._set_aside([r for r in roster if not ps.check([f"connected/{r}"])], beats)
            return False
        self.gen = Generation(number, roster, ps, pg)
        self.m.rebuilds.inc()
        self.m.replicas.set(len(roster))
        log.info("weight sync: generation %d with %s", number, ", ".join(roster))
        return False

    def _round(self, version: int, beats: dict[str, ReplicaHeartbeat]) -> tuple[list[str], list[int], bool]:
        """One version to the current group: (members that verified it, bucket checksums, worth retrying)."""
        gen = self.gen
        assert gen is not None
        key = f"round/{gen.round}"
        gen.store.set(key, msgpack.packb({"version": version}))
        sums: list[int] = []
        error: Exception | None = None
        gone = self._gone_check(beats)
        try:
            for b in range(len(self.manifest.buckets)):
                buf = self._pack(b)
                sums.append(checksum(buf))
                broadcast(gen.pg, buf, self.timeout_s, interrupted=lambda: bool(gone(gen.members)))
        except Exception as e:  # noqa: BLE001 -- a peer died or stalled: abort so the others stop waiting
            error = e
            gen.store.set(f"{key}/abort", b"1")  # the survivors stop waiting and acknowledge (not ok)
            gen.pg.abort()
            log.warning("weight sync: round %d (version %d) broken: %s", gen.round, version, e)
        if error is None:
            packed = msgpack.packb(sums)
            gen.store.set(f"{key}/mac", mac(self.key, "round", gen.number, gen.round, version, packed))
            gen.store.set(f"{key}/sums", packed)
        answered = self._await(gen.store, {r: f"{key}/ack/{r}" for r in gen.members}, beats)
        good = []
        for r in answered:
            a = msgpack.unpackb(gen.store.get(f"{key}/ack/{r}"))
            if a.get("ok") and error is None and a.get("checksum") == total(sums):
                good.append(r)
            else:
                log.warning("weight sync: %s did not take version %d: %s", r, version, a.get("error"))
        gen.round += 1
        dropped = [r for r in gen.members if r not in answered]
        self._set_aside(dropped, beats)
        if error is None and len(good) == len(gen.members):
            return sorted(good), sums, False
        self.m.failures.inc()
        self._close()  # rebuilt from who is alive: at once when live members still lack this version
        return sorted(good), sums if error is None else [], bool(dropped) and len(good) < len(answered)

    def _gone_check(self, beats: dict[str, ReplicaHeartbeat]) -> Callable[[list[str]], list[str]]:
        """A function telling which of some members have died: heartbeat expired, or a new process under the
        same id (a restart is a new member). It reads the heartbeats at most once a second."""
        last = [time.monotonic()]
        seen: dict[str, ReplicaHeartbeat] = {}

        def gone(members: list[str]) -> list[str]:
            if time.monotonic() - last[0] >= 1.0:
                last[0] = time.monotonic()
                seen.clear()
                seen.update(self.heartbeats())
                dead = [
                    r for r in members if r not in seen or (r in beats and seen[r].incarnation != beats[r].incarnation)
                ]
                for r in dead:
                    log.warning(
                        "weight sync: %s is gone (%s)",
                        r,
                        "heartbeat expired" if r not in seen else "a new process has its id",
                    )
                return dead
            return []

        return gone

    def _await(
        self, store: Any, keys: dict[str, str], beats: dict[str, ReplicaHeartbeat], timeout_s: float | None = None
    ) -> set[str]:
        """The members whose key appeared within `timeout_s` (the sync timeout); stops waiting early for members that
        died."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        waiting = dict(keys)
        arrived: set[str] = set()
        gone = self._gone_check(beats)
        next_roll = 0.0

        def roll_call() -> None:
            for r, k in list(waiting.items()):
                if store.check([k]):
                    arrived.add(r)
                    del waiting[r]

        while waiting and time.monotonic() < deadline:
            if store.check(list(waiting.values())):  # all of them: one request, however many members wait
                arrived |= set(waiting)
                return arrived
            if time.monotonic() >= next_roll:  # who has arrived, one request each: every ROLL_CALL_S, not 20 ms
                roll_call()
                next_roll = time.monotonic() + ROLL_CALL_S
            for r in gone(list(waiting)):
                del waiting[r]
            time.sleep(0.02)
        roll_call()  # the last ones, arrived since the last roll call
        return arrived

    def _pack(self, b: int) -> torch.Tensor:
        dt, idx = self.manifest.buckets[b]
        buf = self.send_buffers[dt][: self.manifest.bucket_numel(b)]
        params = [self.params[i][1] for i in idx]
        gather = self.gather([self.positions[i] for i in idx], params) if self.zero3 else contextlib.nullcontext()
        with torch.no_grad(), gather:
            off = 0
            for p in params:
                n = p.numel()
                buf[off : off + n].copy_(p.data.reshape(-1))
                off += n
            buf[off:].zero_()
        return buf

    def _checksum_now(self) -> int:
        return total([checksum(self._pack(b)) for b in range(len(self.manifest.buckets))])

    def _close(self) -> None:
        gen, self.gen = self.gen, None
        if gen is None:
            return
        gen.store.set(f"round/{gen.round}", msgpack.packb({"closed": True}))
        gen.pg.abort()
        self.m.replicas.set(0)

    def close(self) -> None:
        """End the generation and withdraw the announcement (so no replica waits on a store that is gone)."""
        number = self.gen.number if self.gen else None
        self._close()
        try:
            raw = self.client.get(KEY_SYNC_GROUP)
            if raw is not None and number is not None and unpack(raw, SyncGroup).generation == number:
                self.client.delete(KEY_SYNC_GROUP)
        except redis.RedisError as e:
            log.warning("weight sync: could not withdraw the announcement: %s", e)
        self.store = None  # type: ignore[assignment]  # the port is free again
