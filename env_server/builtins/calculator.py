"""`calculator`: arithmetic beyond what a small model does in its head, with a calculator tool that decides it.

A task is `a * b + c` (or `- c`) with a and c of 3 digits and b of 2 (`digits` in an explicit task changes a's).
The model may call `calculator(expression)` as often as it likes within `max_turns`; its first turn without a call
is its final answer: +1 when its number (after "Answer:", else the last one) is the task's, -1 otherwise.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from env_server.base import Environment, Outcome, Tool
from env_server.builtins.arith import evaluate, final_number
from services.episodes import ChatMessage
from services.tool_calls import instructions


class CalcTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(min_length=1, max_length=200, pattern=r"^[0-9+\-*/() .]+$")


def calculator(expression: str) -> str:
    return evaluate(str(expression))


class Calculator(Environment):
    name = "calculator"
    description = "a * b ± c with 3-digit numbers; a calculator tool; +1 for the right final number, else -1."
    max_turns = 4

    def tools(self) -> list[Tool]:
        return [Tool.of(calculator, "Evaluates an arithmetic expression exactly.", {"expression": {"type": "string"}})]

    def draw(self, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(100, 999)
        return {"expression": f"{a} * {b} {rng.choice('+-')} {c}"}

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        parsed = CalcTask.model_validate(task)
        evaluate(parsed.expression)  # ValueError (a 422) when it is not one
        return parsed.model_dump()

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        system = (
            "You are a helpful assistant that is bad at mental arithmetic and uses its calculator.\n"
            + instructions([t.spec for t in self.tools()])
            + "\nWhen you have the result, reply with the final answer as: Answer: <number>"
        )
        question = f"What is {task['expression']}?"
        return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)], task

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        right = final_number(text) == final_number(evaluate(state["expression"]))
        return Outcome(reward=1.0 if right else -1.0, done=True, info={"correct": right})
