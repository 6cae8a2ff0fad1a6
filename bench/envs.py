"""Environments of the benchmarks (loaded with --env-classes bench.envs:Latency)."""

from __future__ import annotations

import time
from typing import Any

from env_server.base import Environment, Outcome, user
from services.episodes import ChatMessage


class Latency(Environment):
    """An episode of `turns` model turns; each step takes `seconds` (sleeping: an environment's I/O or a tool's
    run time), answers "Go on." until the last, which ends it at +1. The task: {"seconds": s, "turns": n}."""

    name = "latency"
    max_turns = 64

    def draw(self, seed: int) -> dict[str, Any]:
        return {"seconds": 0.1, "turns": 4}

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        return {"seconds": float(task["seconds"]), "turns": int(task["turns"])}

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        return [user("Tell me a long story, one part at a time.")], task

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        time.sleep(state["seconds"])
        if turn >= state["turns"]:
            return Outcome(reward=1.0, done=True)
        return Outcome(messages=[user("Go on.")])
