"""`compute`: questions a program answers better than a head — with the `python` tool, run in the sandbox service.

A task is one of four kinds, its numbers drawn from the seed: the sum of the squares of 1..n, the primes below n,
the n-th Fibonacci number, the sum of the digits of a**b. The opening shows one exchange with the tool as earlier
turns of the chat (as `calculator`'s: a small model copies an example, it does not find a tool from prose), in the
`tags` format (<python>print(sum(range(1, 51)))</python>); its first turn without a call is its final answer: +1
when its number (after "Answer:", else the last one) is the task's, -1 otherwise. Served only by an environment
service started with --sandbox-url (the tool needs the sandbox).
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from env_server.base import Environment, Outcome, Tool
from env_server.builtins.arith import final_number
from env_server.python_tool import python_tool
from services.episodes import ChatMessage
from services.tool_calls import render_tag_call

SYSTEM = (
    "You are a helpful assistant with a Python interpreter. To run a program, write <python>program</python>; what it"
    " prints comes back to you. Then give the final answer as: Answer: <number>"
)
EXAMPLE = [
    ChatMessage(role="system", content=SYSTEM),
    ChatMessage(role="user", content="What is the sum of the integers from 1 to 50?"),
    ChatMessage(role="assistant", content=render_tag_call("python", "print(sum(range(1, 51)))")),
    ChatMessage(role="tool", content="1275", name="python", tool_call_id="call_1_0"),
    ChatMessage(role="assistant", content="Answer: 1275"),
]
Kind = Literal["squares", "primes", "fibonacci", "digits"]


class ComputeTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Kind
    n: int = Field(ge=1, le=10_000)
    m: int = Field(1, ge=1, le=200)  # the exponent of `digits`


def question(t: ComputeTask) -> str:
    return {
        "squares": f"What is the sum of the squares of the integers from 1 to {t.n}?",
        "primes": f"How many prime numbers are there below {t.n}?",
        "fibonacci": f"What is Fibonacci number {t.n}, counting F(1) = F(2) = 1?",
        "digits": f"What is the sum of the digits of {t.n} to the power {t.m}?",
    }[t.kind]


def solve(t: ComputeTask) -> int:
    if t.kind == "squares":
        return t.n * (t.n + 1) * (2 * t.n + 1) // 6
    if t.kind == "primes":
        sieve = bytearray([1]) * t.n
        sieve[:2] = b"\0\0"[: min(2, t.n)]
        for p in range(2, int(t.n**0.5) + 1):
            if sieve[p]:
                sieve[p * p :: p] = bytearray(len(range(p * p, t.n, p)))
        return sum(sieve)
    if t.kind == "fibonacci":
        a, b = 0, 1
        for _ in range(t.n):
            a, b = b, a + b
        return a
    return sum(int(d) for d in str(t.n**t.m))


class Compute(Environment):
    name = "compute"
    description = "squares, primes, Fibonacci, digit sums; a python tool (the sandbox); +1 for the right number."
    max_turns = 4

    @property
    def tool_format(self) -> Literal["hermes", "tags", "none"]:
        return "tags"

    def tools(self) -> list[Tool]:
        return [python_tool()]

    def draw(self, seed: int) -> dict[str, Any]:
        r = random.Random(seed)
        kind: Kind = r.choice(["squares", "primes", "fibonacci", "digits"])
        n = {"squares": r.randint(100, 999), "primes": r.randint(100, 5000), "fibonacci": r.randint(30, 90)}
        return ComputeTask(kind=kind, n=n.get(kind, r.randint(2, 9)), m=r.randint(20, 60)).model_dump()

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        return ComputeTask.model_validate(task).model_dump()

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        return [*EXAMPLE, ChatMessage(role="user", content=question(ComputeTask.model_validate(task)))], task

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        right = final_number(text) == solve(ComputeTask.model_validate(state))
        return Outcome(reward=1.0 if right else -1.0, done=True, info={"correct": right})
