"""Redis Streams transport: the only place where messages are serialised (msgpack, never pickle).

    producer = StreamProducer(client, STREAM_ROLLOUTS)
    producer.publish(group)                            # XADD type=ScoredGroup data=<msgpack>
    consumer = StreamConsumer(client, STREAM_ROLLOUTS, "buffer", "buffer-0", ScoredGroup)
    for d in consumer.read(count=8, block_ms=1000):    # own pending, reclaimed, then new entries
        ...                                            # make the effect durable, then
        consumer.ack(d.entry_id)                       # or consumer.ack_and_publish(ids, outputs)

Delivery is at least once: an entry stays pending in its consumer group until acknowledged, and a
live consumer reclaims entries another consumer left idle for `claim_idle_ms` (a bounded XPENDING scan, then
XCLAIM with the idle bound again, so an entry another consumer took meanwhile stays theirs; a consumer keeps
what it holds alive with XCLAIM JUSTID). Consumers therefore deduplicate where a duplicate matters, by content
identity: the buffer by group id (its published set in Redis), the learner by the batch's digest in its
checkpoint (a batch id can be handed out again after Redis loses writes).
An entry that cannot be decoded or validated, or that was delivered more than `max_deliveries`
times, is moved to the dead-letter stream with the reason and its original bytes, and acknowledged:
one bad message never stops a consumer. Administration (trimming, pending and lag, dead letters)
lives in `stream_admin`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, get_args
from weakref import WeakKeyDictionary

import msgpack
import redis
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from pydantic import ValidationError
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from services.schemas import SCHEMA_VERSION, Message
from services.settings import RedisSettings

log = logging.getLogger(__name__)

STREAM_PROMPTS = "dapo:prompts"
STREAM_ROLLOUTS = "dapo:rollouts"
STREAM_BATCHES = "dapo:batches"
STREAM_EVAL = "dapo:eval"  # EvalResult records: held-out avg@k / pass@k per evaluated policy version
STREAM_DROPPED = "dapo:dropped"  # DroppedGroup records: what the buffer decided not to train, and why
DEAD_LETTER_STREAM = "dapo:dead-letter"
KEY_POLICY_VERSION = "dapo:policy_version"  # the learner's current version, an integer
KEY_BATCH_ID = "dapo:buffer:batch_id"  # the buffer's INCR counter of batch ids (ids start at 0); the learner
# raises it past every id its checkpoint holds (raise_counter), so ids stay unique after Redis loses writes
KEY_BUFFER_LEASE = "dapo:buffer:lease"  # which buffer leads: `<consumer>@<host>:<random>`, TTL (services/lease.py)
GROUP_ROLLOUT = "rollout"  # rollout servers, on the prompts stream
GROUP_BUFFER = "buffer"  # the buffer, on the rollouts stream
GROUP_LEARNER = "learner"  # the learner, on the batches stream
REPLICA_KEY_PREFIX = "dapo:replica:"  # + replica id: a packed ReplicaHeartbeat with a TTL
KEY_SYNC_GENERATION = "dapo:sync:generation"  # weight sync (services/weight_wire.py): INCR per group built
KEY_SYNC_GROUP = "dapo:sync:group"  # a packed SyncGroup: the learner's current broadcast group
KEY_WEIGHTS = "dapo:weights"  # a packed WeightVersion: the last broadcast round
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
RECLAIM_SCAN = 100  # pending entries looked at per reclaim pass, and held entries touched per call

M = TypeVar("M", bound=Message)

# Add entries to output streams, then acknowledge inputs, in one server-side step. Unlike MULTI/EXEC
# (which runs every queued command even after one fails), a script stops at the first error, so the
# inputs are acknowledged only if every output was added. Single-node Redis: keys need not share a slot.
# KEYS: output streams..., input stream[, a set][, a lease].  ARGV: group, n_outputs, n_members, fence token (''
# for none), per output (n_fields, k1, v1, ...), set members..., ids...  The set (optional) gets the members in the
# same step: a record that these inputs' effect happened (the buffer's published groups), as durable as the outputs
# themselves. With a fence token, nothing happens unless the lease key still holds it (services/lease.py).
_FORWARD_LUA = """
if ARGV[4] ~= '' and redis.call('GET', KEYS[#KEYS]) ~= ARGV[4] then
  return redis.error_reply('FENCED: ' .. KEYS[#KEYS] .. ' no longer holds ' .. ARGV[4])
end
local n = tonumber(ARGV[2])
local m = tonumber(ARGV[3])
local pos = 5
local added = {}
for i = 1, n do
  local nf = tonumber(ARGV[pos])
  local fields = {}
  for j = 1, 2 * nf do fields[j] = ARGV[pos + j] end
  added[i] = redis.call('XADD', KEYS[i], '*', unpack(fields))
  pos = pos + 1 + 2 * nf
end
if m > 0 then
  local members = {}
  for j = pos, pos + m - 1 do members[#members + 1] = ARGV[j] end
  redis.call('SADD', KEYS[n + 2], unpack(members))
  pos = pos + m
end
local ids = {}
for j = pos, #ARGV do
  ids[#ids + 1] = ARGV[j]
  if #ids == 500 then redis.call('XACK', KEYS[n + 1], ARGV[1], unpack(ids)); ids = {} end
end
if #ids > 0 then redis.call('XACK', KEYS[n + 1], ARGV[1], unpack(ids)) end
return added
"""


_RAISE_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]); return 1 end
return 0
"""


def raise_counter(client: redis.Redis, key: str, floor: int) -> bool:
    """Set an INCR counter to `floor` if it is lower (atomically); True if it was lower."""
    with redis_errors(client):
        return bool(client.eval(_RAISE_LUA, 1, key, floor))


class TransportError(RuntimeError):
    """A Redis-level failure the caller cannot fix by retrying right away."""


class RedisUnavailable(TransportError):
    """Redis could not be reached after the configured retries."""


class Fenced(TransportError):
    """A write was refused because this process no longer holds the lease that fences it (services/lease.py)."""


class DecodeError(ValueError):
    """An entry is not a valid message of the expected type; `kind` labels the metric."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# --------------------------------------------------------------------------- codec


def pack(msg: Message) -> bytes:
    """A message's msgpack body (for keys such as replica heartbeats)."""
    return msgpack.packb(msg.model_dump(mode="python"))  # type: ignore[no-any-return]


def unpack(data: bytes, model: type[M]) -> M:
    return decode({b"type": model.__name__.encode(), b"data": data}, model)


def encode(msg: Message) -> dict[bytes, bytes]:
    """A message as stream-entry fields: its type name and its msgpack body."""
    return {b"type": type(msg).__name__.encode(), b"data": pack(msg)}


def decode(fields: dict[bytes, bytes], model: type[M], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> M:
    """Fields of a stream entry -> a validated `model`, or DecodeError saying what is wrong."""
    kind = fields.get(b"type")
    data = fields.get(b"data")
    if kind is None or data is None:
        raise DecodeError("malformed", f"entry lacks the 'type' or 'data' field (fields: {sorted(fields)})")
    if kind != model.__name__.encode():
        raise DecodeError("wrong_type", f"entry is a {kind!r}, this consumer reads {model.__name__}")
    if len(data) > max_bytes:
        raise DecodeError("too_large", f"entry body is {len(data)} bytes, the limit is {max_bytes}")
    try:
        body = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException) as e:
        raise DecodeError("not_msgpack", f"body is not valid msgpack: {e}") from e
    known = get_args(model.model_fields["schema_version"].annotation) or (SCHEMA_VERSION,)
    if isinstance(body, dict) and body.get("schema_version", SCHEMA_VERSION) not in known:
        speaks = " or ".join(map(str, known)) if len(known) < 3 else f"{', '.join(map(str, known[:-1]))} or {known[-1]}"
        raise DecodeError(
            "schema_version",
            f"schema_version {body['schema_version']!r} is not {speaks}, what this consumer speaks: upgrade the "
            "consumer or drain the stream with the old version",
        )
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, x['loc'])) or '<root>'}: {x['msg']}" for x in e.errors())
        raise DecodeError("invalid", f"invalid {model.__name__}: {errors}") from e


# --------------------------------------------------------------------------- connection


def connect(url: str, *, password: str | None = None, timeout_s: float = 10.0, retries: int = 5) -> redis.Redis:
    """A client whose network calls time out and retry with jittered exponential backoff.

    `timeout_s` bounds every socket wait; blocking reads must block for less than that.
    """
    return redis.Redis.from_url(
        url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=min(timeout_s, 5.0),
        retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=2.0), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def connect_from(settings: RedisSettings) -> redis.Redis:
    """The client a service's settings describe (URL, password, timeout, retries)."""
    password = settings.redis_password.get_secret_value() if settings.redis_password else None
    return connect(
        settings.require_redis_url(),
        password=password,
        timeout_s=settings.redis_timeout_s,
        retries=settings.redis_retries,
    )


def _where(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"


@contextmanager
def redis_errors(client: redis.Redis) -> Iterator[None]:
    """Turn a connection failure that survived the client's retries into a clear RedisUnavailable."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise RedisUnavailable(
            f"Redis at {_where(client)} did not answer after retries with backoff ({e}). "
            "Check that it runs and that DAPO_REDIS_URL points at it."
        ) from e


# --------------------------------------------------------------------------- metrics


class StreamMetrics:
    """Counters of the transport, one set per Prometheus registry."""

    _per_registry: WeakKeyDictionary[CollectorRegistry, StreamMetrics] = WeakKeyDictionary()

    def __init__(self, registry: CollectorRegistry):
        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.published = counter("dapo_stream_published_messages", "Messages published.", ["stream"])
        self.delivered = counter(
            "dapo_stream_delivered_messages", "Valid messages handed to a consumer.", ["stream", "group"]
        )
        self.acked = counter("dapo_stream_acked_messages", "Messages acknowledged.", ["stream", "group"])
        self.reclaimed = counter(
            "dapo_stream_reclaimed_messages", "Entries reclaimed from idle consumers.", ["stream", "group"]
        )
        self.dead = counter(
            "dapo_stream_dead_lettered_messages",
            "Entries moved to the dead-letter stream.",
            ["stream", "group", "reason"],
        )

    @classmethod
    def of(cls, registry: CollectorRegistry | None) -> StreamMetrics:
        registry = registry or REGISTRY
        if registry not in cls._per_registry:
            cls._per_registry[registry] = cls(registry)
        return cls._per_registry[registry]


# --------------------------------------------------------------------------- producer


class StreamProducer:
    """Publishes messages of any type to one stream."""

    def __init__(self, client: redis.Redis, stream: str, *, registry: CollectorRegistry | None = None):
        self.client, self.stream = client, stream
        self._metrics = StreamMetrics.of(registry)

    def publish(self, msg: Message) -> str:
        with redis_errors(self.client):
            entry_id = self.client.xadd(self.stream, encode(msg))  # type: ignore[arg-type]
        self._metrics.published.labels(self.stream).inc()
        return as_str(entry_id)

    def publish_many(self, msgs: Iterable[Message]) -> list[str]:
        """Publish several messages in one MULTI/EXEC: all of them or none."""
        pipe = self.client.pipeline(transaction=True)
        n = 0
        for msg in msgs:
            pipe.xadd(self.stream, encode(msg))  # type: ignore[arg-type]
            n += 1
        with redis_errors(self.client):
            ids = pipe.execute()
        self._metrics.published.labels(self.stream).inc(n)
        return [as_str(i) for i in ids]


# --------------------------------------------------------------------------- consumer


@dataclass(frozen=True)
class Delivery(Generic[M]):
    entry_id: str
    message: M
    deliveries: int  # how many times this entry has been delivered, this one included


class StreamConsumer(Generic[M]):
    """One consumer of a consumer group, reading messages of type `model`.

    `read` returns, in this order: this consumer's own pending entries (once, after a restart under
    the same name), entries reclaimed after `claim_idle_ms` without progress, then new entries.

    What `read` returned is *held* until it is acknowledged (`ack`, `ack_and_publish`, dead-lettered) or
    given back (`release`). A held entry is never reclaimed, by this consumer or by another: the
    consumer touches its held entries (XCLAIM JUSTID: their idle time restarts, their delivery count
    does not grow) so that a buffer holding a group in its carry, or a learner holding a trained batch
    until its checkpoint, keeps it. Reclaimed are other consumers' idle entries (a dead or stalled
    consumer), and this consumer's own entries it no longer holds (released, or from before a restart).
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        model: type[M],
        *,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 5,
        dead_letter_stream: str = DEAD_LETTER_STREAM,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        registry: CollectorRegistry | None = None,
        create_group: bool = True,
    ):
        self.client, self.stream, self.group, self.name, self.model = client, stream, group, consumer, model
        self.claim_idle_ms, self.max_deliveries = claim_idle_ms, max_deliveries
        self.dead_letter_stream, self.max_message_bytes = dead_letter_stream, max_message_bytes
        self._metrics = StreamMetrics.of(registry)
        self._own_cursor: str | None = "0-0"  # None once our own pending list has been replayed
        self._claim_cursor = "-"
        self._next_claim = 0.0
        self.held: set[str] = set()  # delivered by read(), not yet acknowledged or released
        self.fence: tuple[str, str] | None = None  # (lease key, token): acks and publishes only while it holds it
        self._next_touch = 0.0
        self._forward_script = client.register_script(_FORWARD_LUA)
        if create_group:
            ensure_group(client, stream, group)

    # -- reading

    def read(self, count: int = 1, block_ms: int = 1000) -> list[Delivery[M]]:
        """Up to `count` valid messages; blocks up to `block_ms` when nothing is waiting (0: returns at once)."""
        timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if timeout is not None and block_ms >= timeout * 1000:
            raise ValueError(f"block_ms={block_ms} must be shorter than the socket timeout ({timeout} s)")
        with redis_errors(self.client):
            self._touch_held()
            out = self._replay_own(count) if self._own_cursor is not None else []
            if len(out) < count and time.monotonic() >= self._next_claim:
                out += self._reclaim(count - len(out))
            if not out:
                out = self._read_new(count, block_ms)
        return out

    def _replay_own(self, count: int) -> list[Delivery[M]]:
        """Entries this consumer name held before a restart (XREADGROUP from an id, not '>')."""
        assert self._own_cursor is not None
        resp = self.client.xreadgroup(self.group, self.name, {self.stream: self._own_cursor}, count=count)
        entries = resp[0][1] if resp else []
        self._own_cursor = as_str(entries[-1][0]) if len(entries) == count else None
        return self._admit(entries, counted=True)

    def _reclaim(self, count: int) -> list[Delivery[M]]:
        """Idle pending entries that are not held here: another consumer's, or ours but released."""
        scan = max(count, RECLAIM_SCAN)
        pend = self.client.xpending_range(
            self.stream, self.group, min=self._claim_cursor, max="+", count=scan, idle=self.claim_idle_ms
        )
        ids = [i for p in pend if (i := as_str(p["message_id"])) not in self.held][:count]
        if len(pend) < scan:  # a full pass: wait before scanning the pending list again
            self._claim_cursor = "-"
            self._next_claim = time.monotonic() + max(self.claim_idle_ms / 4000, 0.05)
        else:
            self._claim_cursor = next_id(ids[-1] if len(ids) == count else as_str(pend[-1]["message_id"]))
        if not ids:
            return []
        # XCLAIM with the idle bound again: an entry another consumer took meanwhile stays theirs
        claimed = self.client.xclaim(self.stream, self.group, self.name, self.claim_idle_ms, ids)
        entries = [e for e in claimed if e and e[0] is not None]  # Redis 6.2: (None, None) for a deleted entry
        got = {as_str(e[0]) for e in entries}
        gone = [i for i in ids if i not in got and not self.client.xrange(self.stream, min=i, max=i)]
        if gone:  # deleted while pending (trimmed): nothing left to process
            self._ack_ids(gone)
        if entries:
            self._metrics.reclaimed.labels(self.stream, self.group).inc(len(entries))
            log.info("reclaimed %d idle entries of %s/%s", len(entries), self.stream, self.group)
        return self._admit(entries, counted=True)

    def keep_alive(self) -> None:
        """Keep the held entries from being reclaimed while not reading (read() does this itself)."""
        with redis_errors(self.client):
            self._touch_held()

    def _touch_held(self) -> None:
        """Restart the idle time of the entries held here that are still ours, so that no consumer reclaims them;
        JUSTID leaves their delivery counts alone. Only entries idle for a third of the claim time are touched,
        so one that another consumer has just taken (idle ~0) is not taken back."""
        every_ms = max(self.claim_idle_ms // 3, 1)
        if not self.held or time.monotonic() < self._next_touch:
            return
        self._next_touch = time.monotonic() + every_ms / 1000
        held = sorted(self.held, key=parse_id)
        for start in range(0, len(held), RECLAIM_SCAN):
            chunk = held[start : start + RECLAIM_SCAN]
            self.client.xclaim(self.stream, self.group, self.name, every_ms, chunk, justid=True)

    def release(self, *entry_ids: str) -> None:
        """Give entries back without acknowledging them: once idle for `claim_idle_ms`, any consumer (this one
        too) reclaims them."""
        self.held.difference_update(entry_ids)

    def _read_new(self, count: int, block_ms: int) -> list[Delivery[M]]:
        block = block_ms if block_ms > 0 else None  # BLOCK 0 would wait forever: 0 means do not wait
        resp = self.client.xreadgroup(self.group, self.name, {self.stream: ">"}, count=count, block=block)
        return self._admit(resp[0][1] if resp else [], counted=False)

    def _admit(self, entries: list[Any], *, counted: bool) -> list[Delivery[M]]:
        """Decode entries; dead-letter the bad ones, acknowledge the deleted ones, return the rest."""
        if not entries:
            return []
        times = self._delivery_counts([as_str(e[0]) for e in entries]) if counted else {}
        good: list[Delivery[M]] = []
        dead: list[tuple[str, dict[bytes, bytes], str, str]] = []
        gone: list[str] = []
        for raw_id, fields in entries:
            entry_id = as_str(raw_id)
            n = times.get(entry_id, 1)
            if not fields:  # trimmed or deleted while pending (Redis 6.2): nothing left to process
                gone.append(entry_id)
            elif n > self.max_deliveries:
                dead.append((entry_id, fields, "max_deliveries", f"delivered {n} times without an ack"))
            else:
                try:
                    msg = decode(fields, self.model, max_bytes=self.max_message_bytes)
                    good.append(Delivery(entry_id, msg, n))
                except DecodeError as e:
                    dead.append((entry_id, fields, e.kind, e.reason))
        if gone:
            self._ack_ids(gone)
        if dead:
            self._dead_letter(dead)
        self.held.update(d.entry_id for d in good)
        self._metrics.delivered.labels(self.stream, self.group).inc(len(good))
        return good

    def _delivery_counts(self, ids: list[str]) -> dict[str, int]:
        pipe = self.client.pipeline(transaction=False)
        for i in ids:
            pipe.xpending_range(self.stream, self.group, min=i, max=i, count=1)
        return {as_str(r[0]["message_id"]): int(r[0]["times_delivered"]) for r in pipe.execute() if r}

    def dead_letter(self, deliveries: Iterable[Delivery[M]], kind: str, reason: str) -> None:
        """Move messages that fail on their own (not because a dependency is down) to the dead-letter stream, with
        why; `dapo-mesh redrive` puts them back once the cause is fixed."""
        with redis_errors(self.client):
            self._dead_letter([(d.entry_id, encode(d.message), kind, reason) for d in deliveries])

    def _dead_letter(self, dead: list[tuple[str, dict[bytes, bytes], str, str]]) -> None:
        """Copy each entry to the dead-letter stream with its reason, then ack it (one script)."""
        outputs = []
        for entry_id, fields, kind, reason in dead:
            record: dict[bytes, bytes] = {
                b"stream": self.stream.encode(),
                b"group": self.group.encode(),
                b"consumer": self.name.encode(),
                b"entry_id": entry_id.encode(),
                b"kind": kind.encode(),
                b"reason": reason.encode(),
                b"at": repr(time.time()).encode(),
            }
            record.update({b"orig:" + k: v for k, v in fields.items()})
            outputs.append((self.dead_letter_stream, record))
            log.warning("dead-lettered %s %s: %s", self.stream, entry_id, reason)
        self._forward(outputs, [d[0] for d in dead])
        for _, _, kind, _ in dead:
            self._metrics.dead.labels(self.stream, self.group, kind).inc()

    def _forward(
        self,
        outputs: list[tuple[str, dict[bytes, bytes]]],
        ack_ids: list[str],
        record: tuple[str, list[str]] | None = None,
    ) -> list[str]:
        keys = [stream for stream, _ in outputs] + [self.stream] + ([record[0]] if record else [])
        if self.fence and not self.fence[1]:
            raise Fenced(
                f"{self.stream}/{self.group}: fenced by {self.fence[0]} without a token (the lease is not held)"
            )
        keys += [self.fence[0]] if self.fence else []
        members = record[1] if record else []
        args: list[bytes | str | int] = [self.group, len(outputs), len(members), self.fence[1] if self.fence else ""]
        for _, fields in outputs:
            args.append(len(fields))
            for k, v in fields.items():
                args += [k, v]
        args += members
        args += ack_ids
        try:
            added = [as_str(i) for i in self._forward_script(keys=keys, args=args)]
        except redis.ResponseError as e:
            if str(e).startswith("FENCED"):
                raise Fenced(f"{self.stream}/{self.group}: {e}") from e
            raise
        self.held.difference_update(ack_ids)
        return added

    # -- acknowledging

    def ack(self, *entry_ids: str) -> None:
        if entry_ids:
            with redis_errors(self.client):
                self._ack_ids(list(entry_ids))

    def _ack_ids(self, entry_ids: list[str]) -> None:
        self.client.xack(self.stream, self.group, *entry_ids)
        self.held.difference_update(entry_ids)
        self._metrics.acked.labels(self.stream, self.group).inc(len(entry_ids))

    def ack_and_publish(
        self,
        entry_ids: Iterable[str],
        outputs: Iterable[tuple[str, Message]],
        *,
        record: tuple[str, list[str]] | None = None,
    ) -> list[str]:
        """Publish `outputs` (stream, message), then acknowledge `entry_ids`, in one server-side step; with
        `record` = (set key, members), add the members to that set in the same step.

        The inputs are acknowledged only if every output was added; a crash or a failed output
        leaves them pending, to be processed again. Returns the ids of the published entries.
        """
        ids, outs = list(entry_ids), list(outputs)
        with redis_errors(self.client):
            added = self._forward([(stream, encode(msg)) for stream, msg in outs], ids, record)
        for stream, _ in outs:
            self._metrics.published.labels(stream).inc()
        self._metrics.acked.labels(self.stream, self.group).inc(len(ids))
        return added


# --------------------------------------------------------------------------- administration


def ensure_group(client: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Create the consumer group (and the stream) if missing; from the start of the stream by default."""
    with redis_errors(client):
        try:
            client.xgroup_create(stream, group, id=start_id, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def as_str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def next_id(entry_id: str) -> str:
    ms, seq = parse_id(entry_id)
    return f"{ms}-{seq + 1}"
