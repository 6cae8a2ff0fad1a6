"""Administration of the streams: trimming that keeps unacknowledged entries, lag, dead letters.

Used by the services (periodic trimming), `dapo-mesh status` and the metrics exporters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from services.streams import DEAD_LETTER_STREAM, as_str, next_id, parse_id, redis_errors

_LAG_SCAN_LIMIT = 10_000  # lag reported on Redis 6.2 (no XINFO lag field) is capped at this

# Redis 6.2 has no lag field: count the entries after the group's last-delivered id where they are, in pages
# (6.2's exclusive ranges), and send back the count alone. Reading them to the client instead moved every pending
# entry's bytes over the socket at each call: 59% of the buffer's CPU at 16 simulated replicas (docs/results/scale.md).
# KEYS: the stream. ARGV: the first id to count, the limit.
_LAG_LUA = """
local n, start, limit = 0, ARGV[1], tonumber(ARGV[2])
while n < limit do
  local chunk = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', math.min(200, limit - n))
  if #chunk == 0 then break end
  n = n + #chunk
  start = '(' .. chunk[#chunk][1]
end
return n
"""


def safe_trim(client: redis.Redis, stream: str, *, keep_last: int = 0) -> int:
    """Remove old entries, keeping the newest `keep_last` and every entry some group has not acked.

    An entry is safe to remove only when every consumer group has read it and none holds it
    pending. With no group on the stream nothing is known to be consumed, so nothing is removed.
    (Redis 8.2's `XTRIM ... ACKED` does this server-side; this works on Redis 6.2 and 7 too.)
    """
    with redis_errors(client):
        groups = client.xinfo_groups(stream) if client.exists(stream) else []
        if not groups:
            return 0
        floor: tuple[int, int] | None = None
        for g in groups:
            name = g["name"]
            bound = parse_id(next_id(as_str(g["last-delivered-id"])))
            if int(g["pending"]):  # (XPENDING's own count: the entries may be acked since XINFO's)
                summary = client.xpending(stream, name)
                if int(summary["pending"]):
                    bound = min(bound, parse_id(as_str(summary["min"])))
            floor = bound if floor is None else min(floor, bound)
        assert floor is not None
        if keep_last > 0:
            newest = client.xrevrange(stream, count=keep_last)
            if len(newest) < keep_last:
                return 0
            floor = min(floor, parse_id(as_str(newest[-1][0])))
        return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


@dataclass(frozen=True)
class GroupStats:
    name: str
    consumers: int
    pending: int
    last_delivered_id: str
    lag: int | None  # entries not yet delivered to the group (None if Redis cannot tell)


@dataclass(frozen=True)
class StreamStats:
    stream: str
    length: int
    groups: list[GroupStats]


def stream_stats(client: redis.Redis, stream: str) -> StreamStats:
    """Length, pending and lag per consumer group (for `dapo-mesh status`, metrics and autoscaling)."""
    with redis_errors(client):
        if not client.exists(stream):
            return StreamStats(stream, 0, [])
        groups = []
        for g in client.xinfo_groups(stream):
            last = as_str(g["last-delivered-id"])
            lag = g.get("lag")
            if lag is None:  # Redis < 7 has no lag field: count the entries after the last delivered one
                lag = client.eval(_LAG_LUA, 1, stream, next_id(last), _LAG_SCAN_LIMIT)
            groups.append(GroupStats(as_str(g["name"]), int(g["consumers"]), int(g["pending"]), last, int(lag)))
        return StreamStats(stream, int(client.xlen(stream)), groups)


def dead_letters(client: redis.Redis, count: int = 100) -> list[dict[str, Any]]:
    """The newest dead-lettered entries, decoded for display (original bytes kept as bytes)."""
    with redis_errors(client):
        rows = client.xrevrange(DEAD_LETTER_STREAM, count=count)
    out = []
    for entry_id, fields in rows:
        rec: dict[str, Any] = {"dead_letter_id": as_str(entry_id)}
        for k, v in fields.items():
            key = as_str(k)
            rec[key] = v if key.startswith("orig:") else as_str(v)
        out.append(rec)
    return out


_REDRIVE_LUA = """
local added = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('XDEL', KEYS[2], ARGV[1])
return added
"""  # KEYS: the original stream, the dead-letter stream; ARGV: the dead letter's id, then the original fields


@dataclass(frozen=True)
class Redriven:
    dead_letter_id: str
    stream: str
    kind: str
    reason: str
    new_id: str | None  # None in a dry run


def redrive(
    client: redis.Redis,
    *,
    stream: str | None = None,
    kind: str | None = None,
    match: str | None = None,
    dry_run: bool = False,
    limit: int = 10_000,
) -> list[Redriven]:
    """Dead letters back to the stream they came from, as new entries with their original fields; each moved in
    one server-side step (added there, deleted here). Filters: the original `stream`, the dead-letter `kind`
    (max_deliveries, reward_rejected, invalid, ...), text the `reason` contains. Oldest first."""
    script = client.register_script(_REDRIVE_LUA)
    out = []
    with redis_errors(client):
        rows = client.xrange(DEAD_LETTER_STREAM, count=limit)
        for entry_id, fields in rows:
            f = {as_str(k): v for k, v in fields.items()}
            origin, why, text = as_str(f.get("stream", b"")), as_str(f.get("kind", b"")), as_str(f.get("reason", b""))
            if (stream and origin != stream) or (kind and why != kind) or (match and match not in text) or not origin:
                continue
            orig = [x for k, v in f.items() if k.startswith("orig:") for x in (k.removeprefix("orig:"), v)]
            if not orig:
                continue
            new_id = None
            if not dry_run:
                new_id = as_str(script(keys=[origin, DEAD_LETTER_STREAM], args=[as_str(entry_id), *orig]))
            out.append(Redriven(as_str(entry_id), origin, why, text, new_id))
    return out
