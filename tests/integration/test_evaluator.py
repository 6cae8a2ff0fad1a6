"""A replica's evaluator reads the held-out file the buffer wrote, only the parts `--eval-tasks` names; a task the
file lacks is said once and turns the evaluation off, where it would otherwise evaluate nothing at every version."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from rollout.evaluator import Evaluator
from rollout.metrics import RolloutMetrics
from rollout.reward_client import RewardClient
from rollout.settings import RolloutSettings
from services.datasets import Item, write_items


def items() -> list[Item]:
    return [
        Item(f"p{i}", f"q{i}", "1", f"reasoning_gym:{task}", f"reasoning_gym/{task}")
        for i, task in enumerate(["chain_sum", "basic_arithmetic", "chain_sum", "chain_sum", "basic_arithmetic"])
    ]


def evaluator(client: redis.Redis, path: Path, tasks: list[str]) -> Evaluator:
    s = RolloutSettings(eval_every=3, eval_data=str(path), eval_size=4, eval_tasks=tasks)
    reward = RewardClient("http://127.0.0.1:9", timeout_s=1.0)  # not called: held_out reads the file only
    return Evaluator(s, client, reward, RolloutMetrics(CollectorRegistry()))


def test_an_evaluator_reads_the_named_tasks_of_the_first_eval_size_items(client: redis.Redis, tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    write_items(path, items())
    ev = evaluator(client, path, ["reasoning_gym/basic_arithmetic"])
    assert ev.due(0)
    assert [it.prompt_id for it in ev.held_out(0) or []] == ["p1"]  # p4 is past eval_size
    assert [it.prompt_id for it in evaluator(client, path, []).held_out(0) or []] == ["p0", "p1", "p2", "p3"]


def test_a_task_the_held_out_file_lacks_turns_the_evaluation_off(
    client: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "eval.jsonl"
    write_items(path, items())
    ev = evaluator(client, path, ["env/calculator"])
    with caplog.at_level(logging.ERROR, logger="rollout.evaluator"):
        assert ev.held_out(0) is None
    assert "held-out evaluation off" in caplog.text and "env/calculator" in caplog.text
    assert not ev.due(0) and not ev.due(3) and not ev.due(10**6)  # off for good, training goes on
