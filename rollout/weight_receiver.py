"""A rollout replica's side of weight sync: join the learner's broadcast group, receive, verify.

    receiver = WeightReceiver(settings, client, metrics)
    threading.Thread(target=receiver.run, args=(stop,), daemon=True).start()
    ...
    receiver.take(engine.load_tensors)     # in the replica's loop (rollout/membership.py), where weights may load

The receiver runs in its own thread so that the learner never waits for an engine call to finish: it
watches the learner's announcement in Redis, joins a generation that invites it, and receives each
round into staging buckets (on the GPU with NCCL, in memory with gloo). A round is handed to the
engine only once every bucket's checksum matches the learner's; the loop loads the newest verified round
between engine calls or steps (it never blocks on the network: if a round is arriving, it loads later).
Every wait gives up at the round's timeout, or when the learner closes or replaces the generation, or
when its rendezvous store goes away; the receiver then waits for the next announcement.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis
import torch
import torch.distributed as dist

from rollout.metrics import RolloutMetrics
from rollout.settings import RolloutSettings
from services.adapters import fingerprint
from services.schemas import SyncGroup
from services.streams import unpack
from services.weight_wire import (
    KEY_SYNC_GROUP,
    BadRound,
    Buckets,
    Manifest,
    SyncAborted,
    broadcast,
    check_mac,
    check_manifest,
    checksum,
    make_group_until,
    model_specs,
    store_client,
    sync_key,
    total,
    wait_keys,
)

log = logging.getLogger(__name__)
ROSTER_WAIT = 3  # x the announced timeout: a joined replica's wait for the roster (the join window: at most 1x)
Loader = Callable[..., None]  # (named tensors, version, *, adapter: AdapterInfo | None): Engine.load_tensors


def closed(store: Any, n: int) -> bool:
    """The learner closed the generation at round n (the header is there and says so: a round's header that names
    a version may be there as soon as the group has formed, before this member's own formation has returned)."""
    return bool(store.check([f"round/{n}"]) and msgpack.unpackb(store.get(f"round/{n}")).get("closed"))


@dataclass(frozen=True)
class Received:
    version: int
    checksum: int
    announced: float  # time.monotonic() when the learner's round header arrived


class WeightReceiver:
    def __init__(self, s: RolloutSettings, client: redis.Redis, metrics: RolloutMetrics):
        self.s, self.client, self.m = s, client, metrics
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(auto if s.sync_device == "auto" else s.sync_device)
        self.lock = threading.Lock()  # held while a round writes the buckets and while the engine reads them
        self.buckets: Buckets | None = None
        self.ready: Received | None = None  # verified, not yet in the engine
        self.generation = 0  # the newest generation this replica has handled
        self.incarnation = uuid.uuid4().hex[:12]  # this process: the heartbeat says it, the learner invites it
        self.state = "idle"
        self.key = sync_key(s)
        self.expected: dict[str, tuple[int, ...]] | None = None  # this model's parameter shapes (read once)
        self.base: str | None = None  # LoRA: this base model's fingerprint (services/adapters.py)

    # ------------------------------------------------------------------ the loop's side

    def take(self, load: Loader) -> Received | None:
        """Load the newest verified round into the engine, unless a round is arriving right now."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            got = self.ready
            if got is None or self.buckets is None:
                return None
            load(self.buckets.named(), got.version, adapter=self.buckets.manifest.adapter)
            self.ready = None
            return got
        finally:
            self.lock.release()

    # ------------------------------------------------------------------ the thread

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                ann = self._announcement()
            except (redis.RedisError, ValueError) as e:
                log.warning("weight sync: cannot read the announcement: %s", e)
                stop.wait(1.0)
                continue
            if ann is None or ann.generation <= self.generation or not self._invited(ann):
                stop.wait(0.2)
                continue
            self.generation = ann.generation
            try:
                self._session(ann, stop)
            except SyncAborted as e:
                log.info("weight sync: left generation %d (%s)", ann.generation, e)
            except Exception as e:  # noqa: BLE001 -- a broken round or a lost learner: wait for the next generation
                self.m.sync_failures.inc()
                log.warning("weight sync: generation %d failed: %s", ann.generation, e)
            finally:
                self.state = "idle"

    def _invited(self, ann: SyncGroup) -> bool:
        """Invited: this replica id, and this process (after a restart, an older generation is someone else's)."""
        if self.s.replica_id not in ann.candidates:
            return False
        return not ann.incarnations or ann.incarnations[ann.candidates.index(self.s.replica_id)] == self.incarnation

    def _announcement(self) -> SyncGroup | None:
        raw = self.client.get(KEY_SYNC_GROUP)
        return None if raw is None else unpack(raw, SyncGroup)

    def _superseded(self, generation: int, last: list[float]) -> bool:
        now = time.monotonic()
        if now - last[0] < 1.0:
            return False
        last[0] = now
        try:
            ann = self._announcement()
        except (redis.RedisError, ValueError):
            return False
        return ann is not None and ann.generation > generation

    def _session(self, ann: SyncGroup, stop: threading.Event) -> None:
        rid, timeout = self.s.replica_id, ann.timeout_s
        last = [time.monotonic()]

        def cancelled() -> bool:
            return stop.is_set() or self._superseded(ann.generation, last)

        store: Any = dist.PrefixStore(f"g{ann.generation}/", store_client(ann.host, ann.port, timeout))
        manifest = self._checked_manifest(store, ann.generation)  # before anything is allocated
        with self.lock:
            if self.buckets is None or self.buckets.manifest != manifest:
                self.buckets = Buckets(manifest, self.device)
                self.ready = None
        store.set(f"join/{rid}", b"1")
        # the learner closes its join window (sync_join_s, at most `timeout`) after announcing, later on a loaded
        # machine: a replica that joined at once must wait that long and more, or it leaves a group it is in
        wait_keys(store, ["roster"], ROSTER_WAIT * timeout, cancelled=cancelled, poll_s=0.02)
        roster = [str(r) for r in msgpack.unpackb(store.get("roster"))]
        if rid not in roster:
            raise SyncAborted("not in the roster")
        # the group forms on a connection of its own: one given up goes on blocking its connection until the timeout
        own: Any = dist.PrefixStore(f"g{ann.generation}/", store_client(ann.host, ann.port, timeout))
        pg = make_group_until(  # given up if the learner gives the generation up (a member left while it formed)
            dist.PrefixStore("pg/", own),
            roster.index(rid) + 1,
            len(roster) + 1,
            timeout,
            self.device,
            cancelled=lambda: cancelled() or closed(store, 0),
        )
        store.set(f"connected/{rid}", b"1")
        self.state = "member"
        log.info(
            "weight sync: joined generation %d as rank %d of %d", ann.generation, roster.index(rid) + 1, len(roster) + 1
        )
        try:
            n = 0
            while True:  # rounds come once per learner step: wait as long as the generation lives
                wait_keys(store, [f"round/{n}"], float("inf"), cancelled=cancelled, poll_s=0.02)
                header = msgpack.unpackb(store.get(f"round/{n}"))
                if header.get("closed"):
                    raise SyncAborted("closed by the learner")
                self._receive(store, pg, n, int(header["version"]), timeout, cancelled)
                n += 1
        finally:
            pg.abort()

    def _checked_manifest(self, store: Any, generation: int) -> Manifest:
        """The generation's manifest, if its MAC is right and it fits this replica's own model; else BadRound
        (the replica does not join: the learner drops it at the timeout)."""
        raw = store.get("manifest")
        try:
            check_mac(self.key, store.get("manifest/mac"), "manifest", generation, raw)
            manifest = Manifest.from_bytes(raw)
            if self.expected is None:
                self.expected = model_specs(self.s.model_dir)
                self.base = fingerprint(self.s.model_dir) if self.s.lora_max_rank else None
            check_manifest(manifest, self.expected, base=self.base, max_rank=self.s.lora_max_rank)
        except (BadRound, ValueError, KeyError, TypeError) as e:
            self.m.sync_rejected.inc()
            raise BadRound(f"refused generation {generation}'s manifest: {e}") from e
        return manifest

    def _receive(
        self, store: Any, pg: Any, n: int, version: int, timeout: float, cancelled: Callable[[], bool]
    ) -> None:
        assert self.buckets is not None
        self.state = "receiving"
        t0, announced = time.perf_counter(), time.monotonic()
        ack: dict[str, Any] = {"ok": False, "checksum": None, "error": None}
        with self.lock:
            self.ready = None  # the buckets are about to be overwritten
            try:
                aborted = f"round/{n}/abort"
                for buf in self.buckets.buffers:
                    broadcast(pg, buf, timeout, interrupted=lambda: store.check([aborted]) or cancelled())
                wait_keys(store, [f"round/{n}/sums"], timeout, cancelled=cancelled)
                packed = store.get(f"round/{n}/sums")
                try:
                    check_mac(self.key, store.get(f"round/{n}/mac"), "round", self.generation, n, version, packed)
                except BadRound:
                    self.m.sync_rejected.inc()
                    raise
                sums = [int(x) for x in msgpack.unpackb(packed)]
                mine = [checksum(buf) for buf in self.buckets.buffers]
                ack["checksum"] = total(mine)
                bad = [b for b, (x, y) in enumerate(zip(mine, sums, strict=True)) if x != y]
                if bad:
                    ack["error"] = f"checksum mismatch in buckets {bad}"
                else:
                    ack["ok"] = True
                    self.ready = Received(version, total(mine), announced)
            except Exception as e:
                ack["error"] = f"{type(e).__name__}: {e}"[:500]
                raise
            finally:
                self.state = "member"
                try:
                    store.set(f"round/{n}/ack/{self.s.replica_id}", msgpack.packb(ack))
                except Exception as e:  # noqa: BLE001 -- the learner is gone; nothing to tell
                    log.debug("weight sync: could not acknowledge round %d: %s", n, e)
        seconds = time.perf_counter() - t0
        self.m.sync_receive_seconds.observe(seconds)
        if ack["ok"]:
            self.m.sync_rounds.inc()
            log.info(
                "weight sync: received version %d (%.1f MB) in %.2f s",
                version,
                self.buckets.manifest.nbytes / 1e6,
                seconds,
            )
        else:
            self.m.sync_failures.inc()
            log.warning("weight sync: version %d rejected: %s", version, ack["error"])
