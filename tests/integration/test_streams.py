"""The Redis Streams transport against real Redis servers (embedded 6.2 and the machine's 7)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import redis

from services.redis_server import EmbeddedRedis
from services.schemas import ScoredGroup, TrainBatch
from services.selfcheck import example_group, example_messages
from services.stream_admin import dead_letters, redrive, safe_trim, stream_stats
from services.streams import (
    DEAD_LETTER_STREAM,
    RedisUnavailable,
    StreamConsumer,
    StreamProducer,
    connect,
    encode,
)


def consumer(client, stream, name="c0", model=ScoredGroup, **kw) -> StreamConsumer:
    kw = {"claim_idle_ms": 60_000, "dead_letter_stream": f"{stream}:dead"} | kw
    return StreamConsumer(client, stream, "g", name, model, **kw)


def drain(c: StreamConsumer, want: int, timeout_s: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += c.read(count=want - len(got), block_ms=200)
    return got


@pytest.mark.parametrize("msg", example_messages(), ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips_through_a_stream(client, stream, msg) -> None:
    c = consumer(client, stream, model=type(msg))
    entry_id = StreamProducer(client, stream).publish(msg)
    [d] = drain(c, 1)
    assert (d.entry_id, d.message, d.deliveries) == (entry_id, msg, 1)
    c.ack(d.entry_id)
    assert client.xpending(stream, "g")["pending"] == 0


def test_two_consumers_share_the_work_without_overlap(client, stream) -> None:
    a, b = consumer(client, stream, "a"), consumer(client, stream, "b")
    sent = StreamProducer(client, stream).publish_many(example_group(i, n_tokens=4) for i in range(60))
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def work(c: StreamConsumer) -> None:
        while True:
            ds = c.read(count=3, block_ms=300)
            if not ds:
                return
            seen[c.name] += [d.entry_id for d in ds]
            time.sleep(0.01)  # let the other consumer take its turn
            c.ack(*[d.entry_id for d in ds])

    threads = [threading.Thread(target=work, args=(c,)) for c in (a, b)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert set(seen["a"]).isdisjoint(seen["b"])
    assert sorted(seen["a"] + seen["b"]) == sorted(sent)
    assert seen["a"] and seen["b"], "both consumers should have received work"


def test_killed_consumer_entries_are_reclaimed(client, stream, redis_url, repo_root: Path) -> None:
    groups = [example_group(i, n_tokens=8) for i in range(10)]
    consumer(client, stream, "survivor")  # creates the group
    sent = StreamProducer(client, stream).publish_many(groups)
    helper = repo_root / "tests/integration/hold_pending.py"
    env = os.environ | {"PYTHONPATH": str(repo_root)}
    proc = subprocess.Popen(
        [sys.executable, str(helper), redis_url, stream, "g", "doomed", "6"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        held = line.split()[1:]
        assert line.startswith("HELD") and len(held) == 6
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert client.xpending(stream, "g")["pending"] == 6

    survivor = consumer(client, stream, "survivor", claim_idle_ms=300)
    got = drain(survivor, 10)
    survivor.ack(*[d.entry_id for d in got])
    assert sorted(d.entry_id for d in got) == sorted(sent)
    reclaimed = {d.entry_id: d.deliveries for d in got if d.entry_id in held}
    assert set(reclaimed) == set(held) and all(n == 2 for n in reclaimed.values())
    assert {d.message.group_id for d in got} == {g.group_id for g in groups}
    assert client.xpending(stream, "g")["pending"] == 0


def test_restarted_consumer_replays_its_own_pending_first(client, stream) -> None:
    StreamProducer(client, stream).publish_many(example_group(i, n_tokens=4) for i in range(5))
    first = consumer(client, stream, "worker-0")
    held = drain(first, 3)
    again = consumer(client, stream, "worker-0")  # same name after a restart
    got = drain(again, 5)
    assert [d.entry_id for d in got[:3]] == [d.entry_id for d in held]
    assert [d.deliveries for d in got] == [2, 2, 2, 1, 1]


def test_malformed_entries_go_to_dead_letter_and_consumer_keeps_going(client, stream) -> None:
    c = consumer(client, stream)
    good = example_group(1, n_tokens=4)
    bad_body = good.model_dump()
    bad_body["scores"][0]["reward"] = float("nan")
    raw = [
        {b"type": b"ScoredGroup", b"data": b"\xc1 not msgpack"},
        {b"type": b"TrainBatch", b"data": encode(good)[b"data"]},
        {b"garbage": b"1"},
        {b"type": b"ScoredGroup", b"data": msgpack.packb(bad_body)},
    ]
    bad_ids = [client.xadd(stream, f).decode() for f in raw]
    good_id = StreamProducer(client, stream).publish(good)
    got = drain(c, 1)
    assert [(d.entry_id, d.message) for d in got] == [(good_id, good)]
    c.ack(good_id)
    assert client.xpending(stream, "g")["pending"] == 0  # the bad ones were acknowledged too
    dead = sorted(client.xrange(f"{stream}:dead"), key=lambda e: e[1][b"entry_id"])
    assert [e[1][b"entry_id"].decode() for e in dead] == sorted(bad_ids)
    by_id = {e[1][b"entry_id"].decode(): e[1] for e in dead}
    assert by_id[bad_ids[0]][b"kind"] == b"not_msgpack"
    assert by_id[bad_ids[0]][b"orig:data"] == b"\xc1 not msgpack"  # original bytes kept
    assert by_id[bad_ids[1]][b"kind"] == b"wrong_type"
    assert by_id[bad_ids[2]][b"kind"] == b"malformed" and by_id[bad_ids[2]][b"orig:garbage"] == b"1"
    assert by_id[bad_ids[3]][b"kind"] == b"invalid" and b"scores.0" in by_id[bad_ids[3]][b"reason"]


def test_poison_message_dead_lettered_after_max_deliveries(client, stream) -> None:
    entry_id = StreamProducer(client, stream).publish(example_group(0, n_tokens=4))
    deliveries = []
    for _ in range(4):  # the handler crashes every time: never acks, and the consumer restarts (same name)
        c = consumer(client, stream, claim_idle_ms=50, max_deliveries=3)
        deliveries += [d.deliveries for d in c.read(count=1, block_ms=100)]
    assert deliveries == [1, 2, 3]
    [(_, fields)] = client.xrange(f"{stream}:dead")
    assert fields[b"entry_id"].decode() == entry_id and fields[b"kind"] == b"max_deliveries"
    assert client.xpending(stream, "g")["pending"] == 0


def test_held_entries_are_never_reclaimed_released_ones_are(client, stream) -> None:
    """A consumer holding entries (a buffer's carry, a learner's trained-but-not-checkpointed batches) used to
    reclaim them from itself once idle (XAUTOCLAIM does not look at the owner) and to see them as new deliveries;
    another consumer could take them too. Held entries stay where they are; released ones are reclaimed."""
    a = consumer(client, stream, "a", claim_idle_ms=150)
    b = consumer(client, stream, "b", claim_idle_ms=150)
    ids = StreamProducer(client, stream).publish_many(example_group(i, n_tokens=4) for i in range(4))
    assert sorted(d.entry_id for d in drain(a, 4)) == sorted(ids)
    for _ in range(6):  # six claim times
        time.sleep(0.15)
        assert a.read(count=4, block_ms=10) == []  # not its own held entries again
        assert b.read(count=4, block_ms=10) == []  # nor another consumer's: `a` keeps them alive
    pending = client.xpending_range(stream, "g", min="-", max="+", count=10)
    assert {p["consumer"].decode() for p in pending} == {"a"} and {p["times_delivered"] for p in pending} == {1}
    a.release(ids[0])
    time.sleep(0.2)
    [d] = drain(b, 1)  # released, idle: reclaimed (by `b` here; `a` itself would too)
    assert (d.entry_id, d.deliveries) == (ids[0], 2)
    assert a.read(count=4, block_ms=10) == []
    a.ack(*ids[1:])
    b.ack(ids[0])
    assert client.xpending(stream, "g")["pending"] == 0 and not a.held and not b.held


def test_redrive_puts_dead_letters_back(client, stream) -> None:
    """Dead letters back on their stream once their cause is fixed: filtered, dry run first, each moved once."""
    client.delete(DEAD_LETTER_STREAM)
    try:
        c = consumer(client, stream, dead_letter_stream=DEAD_LETTER_STREAM)
        groups = [example_group(i, n_tokens=4) for i in range(3)]
        StreamProducer(client, stream).publish_many(groups)
        got = drain(c, 3)
        c.dead_letter(got[:2], "reward_rejected", "413: response too long")
        c.dead_letter(got[2:], "other", "something else")
        assert client.xpending(stream, "g")["pending"] == 0 and client.xlen(DEAD_LETTER_STREAM) == 3

        dry = redrive(client, kind="reward_rejected", dry_run=True)
        assert [(m.stream, m.kind, m.new_id) for m in dry] == [(stream, "reward_rejected", None)] * 2
        assert client.xlen(DEAD_LETTER_STREAM) == 3  # nothing moved
        moved = redrive(client, stream=stream, match="too long")
        assert len(moved) == 2 and client.xlen(DEAD_LETTER_STREAM) == 1
        again = drain(c, 2)
        assert [d.message for d in again] == groups[:2] and [d.entry_id for d in again] == [m.new_id for m in moved]
        assert redrive(client, stream="elsewhere") == [] and client.xlen(DEAD_LETTER_STREAM) == 1
    finally:
        client.delete(DEAD_LETTER_STREAM)


def test_ack_and_publish_is_atomic_forwarding(client, stream) -> None:
    out_stream = f"{stream}:out"
    try:
        c = consumer(client, stream)
        groups = [example_group(i, n_tokens=4) for i in range(3)]
        StreamProducer(client, stream).publish_many(groups)
        got = drain(c, 3)
        batch = TrainBatch.assemble(0, [d.message for d in got])
        [out_id] = c.ack_and_publish([d.entry_id for d in got], [(out_stream, batch)])
        assert client.xpending(stream, "g")["pending"] == 0
        [(entry_id, fields)] = client.xrange(out_stream)
        assert entry_id.decode() == out_id and fields == encode(batch)

        # A transaction that fails leaves the inputs pending: nothing acked without its effect.
        StreamProducer(client, stream).publish(example_group(9, n_tokens=4))
        [d] = drain(c, 1)
        client.set(f"{stream}:notastream", "x")
        with pytest.raises(redis.ResponseError):
            c.ack_and_publish([d.entry_id], [(f"{stream}:notastream", batch)])
        assert client.xpending(stream, "g")["pending"] == 1
    finally:
        client.delete(out_stream, f"{stream}:notastream")


def test_trim_keeps_unacknowledged_entries(client, stream) -> None:
    ids = StreamProducer(client, stream).publish_many(example_group(i, n_tokens=4) for i in range(10))
    assert safe_trim(client, stream) == 0  # no consumer group yet: nothing is known consumed
    c, slow = consumer(client, stream, "c"), StreamConsumer(client, stream, "slow", "s", ScoredGroup)
    got = drain(c, 5)
    c.ack(*[d.entry_id for d in got[:3]])  # entries 0-2 acked by g; 3, 4 pending; 5-9 undelivered
    slow_got = drain(slow, 8)
    slow.ack(*[d.entry_id for d in slow_got])  # the other group is further ahead
    removed = safe_trim(client, stream)
    assert removed == 3
    assert [e[0].decode() for e in client.xrange(stream)] == ids[3:]
    # the pending entries are still there to be reclaimed, with their content
    c2 = consumer(client, stream, "c2", claim_idle_ms=0)
    again = drain(c2, 7)
    assert sorted(d.entry_id for d in again) == ids[3:]
    c2.ack(*[d.entry_id for d in again])
    assert safe_trim(client, stream, keep_last=2) == 5  # g has acked all; "slow" read 8: keep 8, 9
    assert [e[0].decode() for e in client.xrange(stream)] == ids[8:]


def test_stream_stats_report_pending_and_lag(client, stream) -> None:
    StreamProducer(client, stream).publish_many(example_group(i, n_tokens=4) for i in range(7))
    c = consumer(client, stream)
    drain(c, 3)
    st = stream_stats(client, stream)
    assert st.length == 7
    [g] = st.groups
    assert (g.name, g.consumers, g.pending, g.lag) == ("g", 1, 3, 4)


def test_stream_stats_count_a_lag_longer_than_a_page(client, stream) -> None:
    """Redis 6.2 has no lag field: the entries after the last delivered one are counted server-side, in pages."""
    StreamProducer(client, stream).publish_many(example_group(i, n_tokens=1) for i in range(450))
    c = consumer(client, stream)
    drain(c, 3)
    [g] = stream_stats(client, stream).groups
    assert (g.pending, g.lag) == (3, 447)


def test_dead_letters_listing(client, stream) -> None:
    dlq = "dapo:dead-letter"
    before = client.xlen(dlq)
    c = StreamConsumer(client, stream, "g", "c", ScoredGroup)  # default dead-letter stream
    bad_id = client.xadd(stream, {b"type": b"ScoredGroup", b"data": b"\x00"}).decode()
    c.read(count=1, block_ms=100)
    try:
        assert client.xlen(dlq) == before + 1
        [rec] = [r for r in dead_letters(client) if r["entry_id"] == bad_id]
        assert rec["stream"] == stream and rec["kind"] == "invalid" and rec["orig:data"] == b"\x00"
    finally:
        for r in dead_letters(client):
            if r.get("stream") == stream:
                client.xdel(dlq, r["dead_letter_id"])


def test_unreachable_redis_gives_a_clear_error_after_bounded_retries() -> None:
    from services.redis_server import free_port

    client = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0, retries=3)
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable, match="did not answer after retries.*DAPO_REDIS_URL"):
        StreamProducer(client, "x").publish(example_group(0, n_tokens=2))
    assert time.monotonic() - t0 < 30  # bounded, not forever


def test_producer_survives_a_redis_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path)
    server.start()
    try:
        client = connect(server.url, timeout_s=2.0, retries=8)
        producer = StreamProducer(client, "s")
        c = StreamConsumer(client, "s", "g", "c", ScoredGroup)
        producer.publish(example_group(0, n_tokens=2))
        server.stop()
        restarter = threading.Timer(0.5, server.start)
        restarter.start()
        producer.publish(example_group(1, n_tokens=2))  # retried with backoff until Redis is back
        restarter.join()
        got = drain(c, 2)
        assert [d.message.task.prompt_id for d in got] == ["chain_sum/0", "chain_sum/1"]
    finally:
        server.stop()
