"""`retry`: a question the model may answer twice, told after a wrong first answer that it was wrong.

A task is a sum or product of two 1-digit numbers ("Calculate 7 * 8."). Right at either attempt: +1 and done;
wrong: "That is not right. Try again.", and a wrong second answer ends the episode at -1. SmolLM2-135M-Instruct at
temperature 1, 96 tokens a turn, held-out avg@4 over 48 tasks (its sampled arithmetic is poor; greedy it does better):
a op b of 1 digit, 2 attempts: 30.2% (pass@4 71%); the same with 3 attempts 34.9% (above the 3-30% a preset should
start in); a + b of 2 digits + 1 digit 6.3%, a +- b of 2 digits each 4.7-8.2%, a + b + c of 1 digit 3.1% — too few
groups with a right episode to learn from in the preset's 30 minutes (a first run kept 1 group of 16).
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from env_server.base import Environment, Outcome, user
from env_server.builtins.arith import evaluate, final_number, split_of
from services.episodes import ChatMessage


class RetryTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(min_length=1, max_length=200, pattern=r"^[0-9+\-*/() .]+$")


class Retry(Environment):
    name = "retry"
    description = "a + b or a * b (1 digit each), 2 attempts with feedback; +1 when right, -1 after a wrong second one."
    max_turns = 2

    def draw(self, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        return {"expression": f"{rng.randint(2, 9)} {rng.choice('+*')} {rng.randint(2, 9)}"}

    def split(self, task: dict[str, Any]) -> Literal["train", "eval"]:
        return split_of(task["expression"])  # few distinct questions: a third held out

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
