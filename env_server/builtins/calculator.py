"""`calculator`: multiplication with a calculator tool, called in the `tags` format (<calculator>12 * 34</calculator>).

A task is `a * b` with a of 2 digits and b of 1 (an explicit task may give any expression of numbers and + - * / ( )).
The model may call `calculator(expression)` as often as it likes within `max_turns`; its first turn without a call
is its final answer: +1 when its number (after "Answer:", else the last one) is the task's, -1 otherwise.
SmolLM2-135M-Instruct, held-out avg@4 (64 tasks, k = 4, temperature 1, 128 tokens a turn): 2.3%, its right answers
all from its own arithmetic; it wrote a <calculator> call in 25 of 256 episodes. With 3-digit by 2-digit
products it scored 0%, and it never wrote a valid call in the `hermes` JSON format (0 of 128) — why this
environment asks for tags.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from env_server.base import Environment, Outcome, Tool
from env_server.builtins.arith import evaluate, final_number, split_of
from services.episodes import ChatMessage
from services.tool_calls import render_tag_call


class CalcTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(min_length=1, max_length=200, pattern=r"^[0-9+\-*/() .]+$")


def calculator(expression: str) -> str:
    return evaluate(str(expression))


class Calculator(Environment):
    name = "calculator"
    description = "a * b (2 digits by 1); a calculator tool; +1 for the right final number, else -1."
    max_turns = 4

    @property
    def tool_format(self) -> Literal["hermes", "tags", "none"]:
        return "tags"  # <calculator>12 * 34</calculator>: a 135M model never wrote a valid JSON call in 128 tries

    def tools(self) -> list[Tool]:
        return [Tool.of(calculator, "Evaluates an arithmetic expression exactly.", {"expression": {"type": "string"}})]

    def draw(self, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        return {"expression": f"{rng.randint(11, 99)} * {rng.randint(3, 9)}"}

    def split(self, task: dict[str, Any]) -> Literal["train", "eval"]:
        return split_of(task["expression"])  # few distinct questions: a third held out

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        parsed = CalcTask.model_validate(task)
        evaluate(parsed.expression)  # ValueError (a 422) when it is not one
        return parsed.model_dump()

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        system = "You are a helpful assistant with a calculator."
        question = (
            f"What is {task['expression']}? Use the calculator: write the expression between <calculator> and "
            f"</calculator>, like {render_tag_call('calculator', '12 * 34')}, and read its result. Then give the "
            "final answer as: Answer: <number>"
        )
        return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)], task

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        right = final_number(text) == final_number(evaluate(state["expression"]))
        return Outcome(reward=1.0 if right else -1.0, done=True, info={"correct": right})
