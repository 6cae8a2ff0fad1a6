"""`calculator`: multiplication with a calculator tool, called in the `tags` format (<calculator>12 * 34</calculator>).

A task is `a * b` with a of 2 digits and b of 1 (an explicit task may give any expression of numbers and + - * / ( )),
asked in one of four wordings ("What is 47 * 8?", "Multiply 47 by 8.", ...); the opening shows one exchange with the
tool as earlier turns of the chat. The model may call `calculator(expression)` as often as it likes within
`max_turns`; its first turn without a call is its final answer: +1 when its number (after "Answer:", else the last
one) is the task's, -1 otherwise. SmolLM2-135M-Instruct at temperature 1, 96 tokens a turn (held-out, 32 tasks x 4):
22.7%, 24 of its 29 right answers through the tool; 68% on questions worded as the example, 0-14% on the others.
Without the example it never found the tool (2.3%, its own arithmetic; instructions in prose or as a transcript in
the system prompt: 0-3%), and it never wrote a valid call in the `hermes` JSON format (0 of 128) — why tags.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from env_server.base import Environment, Outcome, Tool
from env_server.builtins.arith import bucket, evaluate, final_number, split_of
from services.episodes import ChatMessage
from services.tool_calls import render_tag_call


class CalcTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(min_length=1, max_length=200, pattern=r"^[0-9+\-*/() .]+$")


def calculator(expression: str) -> str:
    return evaluate(str(expression))


SYSTEM = (
    "You are a helpful assistant with a calculator. To use it, write <calculator>expression</calculator>; its result"
    " comes back to you. Then give the final answer as: Answer: <number>"
)
# the opening shows one exchange, as earlier turns of the chat: a 135M model never found the tool from instructions
# alone (0-2% of episodes), and copied it from one example (55% on questions worded as the example's)
EXAMPLE = [
    ChatMessage(role="system", content=SYSTEM),
    ChatMessage(role="user", content="What is 23 * 4?"),
    ChatMessage(role="assistant", content=render_tag_call("calculator", "23 * 4")),
    ChatMessage(role="tool", content="92", name="calculator", tool_call_id="call_1_0"),
    ChatMessage(role="assistant", content="Answer: 92"),
]
WORDINGS = (  # a product asked as the example asks it (1 in 4), or in words the model must turn into the call
    "What is {a} * {b}?",
    "Compute the product of {a} and {b}.",
    "Multiply {a} by {b}.",
    "What do you get when you multiply {a} by {b}?",
)


def question(expression: str) -> str:
    """The user's question: a drawn `a * b` in one of WORDINGS (fixed per task), any other expression as is."""
    m = re.fullmatch(r"(\d+) \* (\d+)", expression)
    if m is None:
        return f"What is {expression}?"
    wording = WORDINGS[bucket(expression, len(WORDINGS))]
    return wording.format(a=m[1], b=m[2])


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
        return [*EXAMPLE, ChatMessage(role="user", content=question(task["expression"]))], task

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        right = final_number(text) == final_number(evaluate(state["expression"]))
        return Outcome(reward=1.0 if right else -1.0, done=True, info={"correct": right})
