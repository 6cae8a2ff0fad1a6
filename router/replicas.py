"""The replicas a router sends to: those whose heartbeat (a Redis key with a TTL, services/schemas.py
ReplicaHeartbeat) names a gateway, read again every `refresh_s` — a replica that joins is used at once, one that
leaves (its heartbeat deleted, or expired after a kill) is gone within its TTL.

    table = Replicas(redis_client)
    await table.refresh()                         # from the router's event loop, every refresh_s
    table.of_session(sid)                         # the replica whose tag begins the session id (None: gone)
    table.placements()                            # where to open a new session, best first

Placement: a replica leaving (state draining) takes no new session; among the others, those with room for a session
first, and of them those holding free seats of tasks they have read (the new session joins a group begun there
instead of taking a new task), then those with the most room. A replica that failed to answer is set aside for a
few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis

from services.schemas import ReplicaHeartbeat
from services.session_keys import replica_tag, tag_of
from services.streams import REPLICA_KEY_PREFIX, DecodeError, unpack

log = logging.getLogger(__name__)
SET_ASIDE_S = 3.0  # a replica that refused a connection is not placed on for this long


@dataclass(frozen=True)
class Replica:
    replica_id: str
    url: str  # its gateway's
    tag: str
    free: int  # sessions it could open
    seats: int  # free seats of tasks it holds
    draining: bool


class Replicas:
    def __init__(self, client: redis.Redis):
        self.client = client
        self.by_tag: dict[str, Replica] = {}
        self.aside: dict[str, float] = {}  # replica id -> until when it is not placed on
        self.read_at = 0.0  # when the table was last read (0: never)

    async def refresh(self) -> None:
        """Read the heartbeats (off the event loop: Redis is a network call)."""
        self.by_tag = await asyncio.to_thread(self._read)
        self.read_at = time.monotonic()

    def _read(self) -> dict[str, Replica]:
        keys = list(self.client.scan_iter(match=REPLICA_KEY_PREFIX + "*", count=500))
        out: dict[str, Replica] = {}
        for raw in self.client.mget(keys) if keys else []:
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                hb = unpack(raw, ReplicaHeartbeat)
            except DecodeError as e:
                log.warning("a replica heartbeat that does not read: %s", e)
                continue
            if hb.gateway_url:
                tag = replica_tag(hb.replica_id, hb.incarnation)
                free, seats = hb.gateway_free, hb.gateway_seats
                out[tag] = Replica(hb.replica_id, hb.gateway_url, tag, free, seats, hb.state == "draining")
        return out

    def of_session(self, sid: str) -> Replica | None:
        tag = tag_of(sid)
        return self.by_tag.get(tag) if tag else None

    def placements(self) -> list[Replica]:
        """Where to open a new session, best first (module docstring)."""
        now = time.monotonic()
        live = [r for r in self.by_tag.values() if not r.draining and self.aside.get(r.replica_id, 0.0) <= now]
        return sorted(live, key=lambda r: (r.free == 0, r.seats == 0, -r.seats, -r.free, r.replica_id))

    def any(self) -> list[Replica]:
        """Where a call of no session may go (the model list, an uncaptured call): the least loaded first."""
        return sorted(self.placements(), key=lambda r: (-r.free, r.replica_id))

    def set_aside(self, replica: Replica) -> None:
        self.aside[replica.replica_id] = time.monotonic() + SET_ASIDE_S
