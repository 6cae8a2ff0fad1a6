"""Queue: ScoredGroups (16 samples x 512 tokens) through publish -> consume -> ack, vs raw redis-py.

Ours: StreamProducer.publish + StreamConsumer.read + ack (pydantic validation and msgpack both
ways). Limit: a raw XADD / XREADGROUP / XACK loop carrying the same bytes, pre-encoded, on the
same Redis in the same run. Run: `python -m bench.queue [--redis-url URL] [--groups N]`.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid

import msgpack
import redis

from bench.common import Result, best_rates, print_table
from services.schemas import ScoredGroup
from services.selfcheck import example_group
from services.streams import StreamConsumer, StreamProducer, connect, encode

SAMPLES, TOKENS, READ_COUNT = 16, 512, 16


def _transport_round(client: redis.Redis, groups: list[ScoredGroup]) -> int:
    stream = f"bench:q:{uuid.uuid4().hex[:8]}"
    producer = StreamProducer(client, stream)
    consumer = StreamConsumer(client, stream, "g", "c", ScoredGroup)
    for g in groups:
        producer.publish(g)
    done = 0
    while done < len(groups):
        got = consumer.read(count=READ_COUNT, block_ms=1000)
        consumer.ack(*[d.entry_id for d in got])
        done += len(got)
    client.delete(stream)
    return done * SAMPLES


def _raw_round(client: redis.Redis, payloads: list[dict[bytes, bytes]]) -> int:
    stream = f"bench:raw:{uuid.uuid4().hex[:8]}"
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    for fields in payloads:
        client.xadd(stream, fields)  # type: ignore[arg-type]
    done = 0
    while done < len(payloads):
        resp = client.xreadgroup("g", "c", {stream: ">"}, count=READ_COUNT, block=1000)
        entries = resp[0][1] if resp else []
        client.xack(stream, "g", *[e[0] for e in entries])
        done += len(entries)
    client.delete(stream)
    return done * SAMPLES


def run(redis_url: str | None = None, n_groups: int = 400) -> list[Result]:
    from services.redis_server import EmbeddedRedis

    server = None if redis_url else EmbeddedRedis(tempfile.mkdtemp(prefix="dapo-bench-"), appendfsync="no")
    url = redis_url or server.start()  # type: ignore[union-attr]
    try:
        client = connect(url)
        groups = [example_group(i, n_samples=SAMPLES, n_tokens=TOKENS) for i in range(n_groups)]
        payloads = [encode(g) for g in groups]
        size = sum(len(p[b"data"]) for p in payloads) / n_groups
        _raw_round(client, payloads[:20]), _transport_round(client, groups[:20])  # warm-up
        raw, ours = best_rates(
            [lambda: _raw_round(client, payloads), lambda: _transport_round(client, groups)], repeats=5
        )
        assert msgpack.unpackb(payloads[0][b"data"])["task"]["task_id"] == groups[0].task.task_id
    finally:
        if server:
            server.stop()
    return [
        Result(
            "queue",
            f"ScoredGroup {SAMPLES}x{TOKENS} tok ({size / 1024:.0f} KiB) publish->consume->ack",
            ours,
            raw,
            "samples/s",
            "raw redis-py XADD/XREADGROUP/XACK, same bytes",
            "≥ 0.5",
        )
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--redis-url", default=None, help="default: an embedded Redis")
    ap.add_argument("--groups", type=int, default=400)
    args = ap.parse_args()
    print_table(run(args.redis_url, args.groups))


if __name__ == "__main__":
    main()
