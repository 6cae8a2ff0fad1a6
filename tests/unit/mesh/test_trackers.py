"""The trackers' pure parts: a metrics.jsonl row into metrics, the config into dotted parameters, names MLflow
accepts, an episode table as markdown, the [tracking] settings' checks, and Trackers' failure rule (with stand-in
trackers: the rule is Trackers' own; tests/integration/test_trackers.py runs it with the real libraries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mesh.trackers import (
    TrackerError,
    Trackers,
    TrackingSettings,
    flatten,
    markdown_table,
    metrics_of,
    mlflow_key,
    open_trackers,
)


def test_a_row_becomes_its_finite_numbers_under_their_own_names() -> None:
    row = {
        "kind": "eval",
        "step": 4,
        "policy_version": 4,
        "eval_acc": 0.5,
        "eval_acc/chain_sum": 0.25,
        "gap/lag1": -1,
        "eval_at": None,
        "batch_id": "b-7",
        "entropy": float("nan"),
        "seconds": float("inf"),
        "truncated": True,
    }
    assert metrics_of(row) == {
        "policy_version": 4.0,
        "eval_acc": 0.5,
        "eval_acc/chain_sum": 0.25,
        "gap/lag1": -1.0,
        "truncated": 1.0,
    }
    assert all(type(v) is float for v in metrics_of(row).values())


def test_params_flatten_to_dotted_keys() -> None:
    params = {"steps": 3, "learner": {"lr": 1e-6, "loss": {"eps_high": 0.28}}, "tasks": ["a", "b"], "extra": {}}
    assert flatten(params) == {
        "steps": 3,
        "learner.lr": 1e-6,
        "learner.loss.eps_high": 0.28,
        "tasks": ["a", "b"],
        "extra": {},
    }


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("eval_acc/chain_sum", "eval_acc/chain_sum"),
        ("tool_calls/valid", "tool_calls/valid"),
        ("eval_acc/gsm8k@code", "eval_acc/gsm8k_code"),
        ("a//b", "a/_/b"),
        ("/a/./b/", "_/a/_/b/_"),
        ("x/../y", "x/_/y"),
    ],
)
def test_mlflow_keys_keep_slashes_and_lose_what_mlflow_refuses(name: str, key: str) -> None:
    assert mlflow_key(name) == key


def test_an_episode_table_as_markdown() -> None:
    table = markdown_table(["prompt", "response", "reward"], [["2+3=", "<think>a|b</think>\n5", 1.0], ["x", "", 0]])
    assert table.splitlines() == [
        "| prompt | response | reward |",
        "| --- | --- | --- |",
        "| 2+3= | &lt;think&gt;a\\|b&lt;/think&gt;<br>5 | 1.0 |",
        "| x |  | 0 |",
    ]


def test_tracking_settings_refuse_what_would_fail_later() -> None:
    assert TrackingSettings().project == "dapo-mesh" and TrackingSettings().wandb_mode == "offline"
    for bad in ({"project": "../up"}, {"run_name": "a/b"}, {"table_every": 0}, {"wandb_mode": "cloud"}, {"x": 1}):
        with pytest.raises(ValidationError):
            TrackingSettings.model_validate(bad)


class Flaky:
    """A stand-in tracker whose calls fail while `failing` is set."""

    def __init__(self, failing: bool = False) -> None:
        self.failing, self.closed = failing, False
        self.points: list[tuple[int, dict[str, float]]] = []

    def log_points(self, points: list[tuple[int, dict[str, float]]]) -> None:
        if self.failing:
            raise ConnectionError("server [gone]")
        self.points += points

    def log_table(self, version: int, columns: list[str], rows: list[list[Any]]) -> None:
        if self.failing:
            raise ValueError("bad table")

    def close(self) -> None:
        self.closed = True


def test_a_failure_is_said_once_per_kind_and_three_in_a_row_turn_a_tracker_off() -> None:
    said: list[str] = []
    bad, good = Flaky(failing=True), Flaky()
    trackers = Trackers({"bad": bad, "good": good}, say=said.append)
    trackers.log_rows([{"kind": "train", "step": 1, "x": 1.0}])
    trackers.log_table(1, ["c"], [["v"]])
    assert said == [
        "[yellow]tracker bad failed at step 1: ConnectionError: server \\[gone]; training goes on[/]",
        "[yellow]tracker bad failed at version 1: ValueError: bad table; training goes on[/]",
    ]
    bad.failing = False
    trackers.log_rows([{"kind": "train", "step": 2, "x": 2.0}])  # a success: the count starts again
    bad.failing = True
    for step in (3, 4):
        trackers.log_rows([{"kind": "train", "step": step, "x": 1.0}])
    assert len(said) == 2 and not bad.closed  # two in a row, each already said
    trackers.log_rows([{"kind": "train", "step": 5, "x": 1.0}, {"kind": "eval", "step": 5, "note": "text only"}])
    assert said[2:] == ["[yellow]tracker bad failed 3 times in a row: off for this run[/]"] and bad.closed
    trackers.log_rows([{"kind": "train", "step": 6, "x": 1.0}])
    trackers.close()
    assert [s for s, _ in good.points] == [1, 2, 3, 4, 5, 6] and good.closed
    assert [s for s, _ in bad.points] == [2] and trackers.names == ["bad", "good"]


def test_no_tracker_is_no_work_and_an_unknown_one_an_error(tmp_path: Path) -> None:
    trackers = open_trackers([], TrackingSettings(), tmp_path, {})
    trackers.log_rows([{"kind": "train", "step": 1, "x": 1.0}])
    trackers.close()
    assert trackers.names == [] and not (tmp_path / "trackers").exists()
    with pytest.raises(TrackerError, match="unknown tracker 'tensorbord'"):
        open_trackers(["tensorbord"], TrackingSettings(), tmp_path, {})
