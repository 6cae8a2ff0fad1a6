"""`retry`: a question the model may answer up to three times, told after each wrong answer that it was wrong.

A task is a sum or difference of two 2-digit numbers ("Calculate 47 + 86."). Right at any attempt: +1 and done;
wrong: "That is not right. Try again." until the last attempt, which ends the episode at -1. SmolLM2-135M-Instruct,
held-out avg@4 (32 tasks, k = 4, temperature 1, 128 tokens a turn): 4.7% (pass@4 12.5%); with three or four terms
it scored 0.4%.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from env_server.base import Environment, Outcome, user
from env_server.builtins.arith import evaluate, final_number
from services.episodes import ChatMessage


class RetryTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(min_length=1, max_length=200, pattern=r"^[0-9+\-*/() .]+$")


class Retry(Environment):
    name = "retry"
    description = "a ± b (2 digits each), up to 3 attempts with feedback; +1 when right, -1 after the last wrong one."
    max_turns = 3

    def draw(self, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        return {"expression": f"{rng.randint(10, 99)} {rng.choice('+-')} {rng.randint(10, 99)}"}

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        parsed = RetryTask.model_validate(task)
        evaluate(parsed.expression)
        return parsed.model_dump()

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        system = "Solve the problem. End with: Answer: <number>. If you are wrong you will be told, and may try again."
        opening = [ChatMessage(role="system", content=system), user(f"Calculate {task['expression']}.")]
        return opening, {"answer": final_number(evaluate(task["expression"]))}

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        if final_number(text) == state["answer"]:
            return Outcome(reward=1.0, done=True, info={"correct": True, "attempts": turn})
        if turn >= self.max_turns:
            return Outcome(reward=-1.0, done=True, info={"correct": False, "attempts": turn})
        return Outcome(messages=[user("That is not right. Try again.")])
