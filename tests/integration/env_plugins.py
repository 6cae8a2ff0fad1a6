"""Environments loaded into the environment service by the tests (--env-classes tests.integration.env_plugins:X):
one that hangs in its step, one that raises (a user's environment with a bug), one with a JSON-called tool."""

from __future__ import annotations

import time
from typing import Any

from env_server.base import Environment, Outcome, Tool, user
from services.episodes import ChatMessage


class _Plain(Environment):
    def draw(self, seed: int) -> dict[str, Any]:
        return {"seed": seed}

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        return dict(task)

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        return [user("Say anything.")], task


class Sleepy(_Plain):
    """Takes `seconds` (from the task, default 3) to answer a step, and `reset_seconds` (default 0) to reset."""

    name = "sleepy"

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        time.sleep(float(task.get("reset_seconds", 0)))
        return super().start(task)

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        time.sleep(float(state.get("seconds", 3)))
        return Outcome(reward=1.0, done=True)


class Broken(_Plain):
    name = "broken"

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        raise RuntimeError("a bug in the environment")


def capital(country: str) -> str:
    return {"France": "Paris", "Japan": "Tokyo"}[country]


class Lookup(_Plain):
    """A tool in the hermes (JSON) format: capital(country)."""

    name = "lookup"
    max_turns = 3

    def tools(self) -> list[Tool]:
        return [Tool.of(capital, "The capital of a country.", {"country": {"type": "string"}})]

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        return Outcome(reward=1.0 if "Paris" in text else -1.0, done=True)


class TasksOnly(Environment):
    """Takes explicit tasks only (no `draw`): a reset from a seed is the client's mistake."""

    name = "tasks-only"

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        return dict(task)

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        return [user("Say anything.")], task

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        return Outcome(reward=1.0, done=True)
