"""Fixtures of the rollout and weight-sync tests: a tiny Llama vLLM can load and a reward server (both once a
session: the tests read the model and only score through the server), a fresh Redis per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from learner.tiny import tiny_llama
from services.child_process import running
from services.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "m", hidden=256, tokenizer=True)  # head_dim 64 for vLLM


@pytest.fixture(scope="session")
def reward_url() -> Iterator[str]:
    with running("reward_server", "--workers", "1", ready_path="/readyz") as (base, _):
        yield base


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path / "redis") as s:
        yield s
