"""What an environment is: a task, an opening, tools, and a verdict on each model turn. The service runs the rest.

    class Guess(Environment):
        name, max_turns = "guess", 3
        def draw(self, seed): return {"secret": random.Random(seed).randint(1, 10)}
        def check(self, task): return GuessTask.model_validate(task).model_dump()   # ValueError: 422
        def start(self, task): return [ChatMessage(role="user", content="Guess 1-10.")], dict(task)
        def answer(self, state, text, turn):
            right = str(state["secret"]) in text
            return Outcome(reward=1.0 if right else None, done=right, messages=[] if right else [user("No.")])

`step()` is the part every environment shares: it reads tool calls from the model's turn (given as `tool_calls`,
or written in the text in the environment's `tool_format`), runs them, and answers each with a tool message; a
malformed call, an unknown tool and a tool that raises become error messages to the model, counted, never an
exception. A turn without a call goes to `answer`. At `max_turns` an unfinished episode ends truncated.
Environment code runs in the service's worker threads, one step of an episode at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from services.episodes import ChatMessage, EnvSpec, StepResponse, ToolCall, ToolFunction, ToolSpec, ToolStats
from services.tool_calls import parse_calls, parse_tag_calls, render_call, render_tag_call


@dataclass(frozen=True)
class Tool:
    """A tool: its OpenAI function schema and the function that runs it (keyword arguments -> text)."""

    spec: ToolSpec
    run: Callable[..., str]

    @classmethod
    def of(cls, run: Callable[..., str], description: str, parameters: dict[str, Any]) -> Tool:
        schema = {"type": "object", "properties": parameters, "required": list(parameters)}
        return cls(ToolSpec(function=ToolFunction(name=run.__name__, description=description, parameters=schema)), run)


@dataclass
class Outcome:
    """The environment's answer to a model turn without tool calls."""

    messages: list[ChatMessage] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


class Environment:
    name: ClassVar[str]
    description: ClassVar[str] = ""
    max_turns: ClassVar[int] = 1
    failure_reward: ClassVar[float] = -1.0  # the reward of an episode cut at max_turns

    def tools(self) -> list[Tool]:
        return []

    def draw(self, seed: int) -> dict[str, Any]:
        """A task drawn from `seed` (the same seed, the same task)."""
        raise NotImplementedError

    def split(self, task: dict[str, Any]) -> Literal["train", "eval"] | None:
        """The split a task belongs to, for an environment with few distinct tasks that keeps its held-out ones
        apart (an evaluation must ask questions training never saw); None (the default): any task serves both."""
        return None

    def draw_for(self, seed: int, split: Literal["train", "eval"]) -> dict[str, Any]:
        """A task of `split` drawn from `seed`: `draw(seed)`, or, when that task is of the other split, the first of
        a fixed sequence of further seeds that draws one of this split (the same seed, the same task)."""
        for k in range(1024):
            task = self.draw(seed if k == 0 else (seed * 1_000_003 + k) % 2**63)
            if self.split(task) in (None, split):
                return task
        raise ValueError(f"{self.name} drew no {split} task from seed {seed} in 1024 tries")

    def check(self, task: dict[str, Any]) -> dict[str, Any]:
        """An explicit task from a client, validated (raise ValueError with a message when it is not one)."""
        raise NotImplementedError

    def task_id(self, task: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()[:16]

    def start(self, task: dict[str, Any]) -> tuple[list[ChatMessage], Any]:
        """The opening messages, and the episode's state (passed back to `answer`)."""
        raise NotImplementedError

    def answer(self, state: Any, text: str, turn: int) -> Outcome:
        """The verdict on a model turn that called no tool."""
        raise NotImplementedError

    def release(self, state: Any) -> None:
        """The episode is over (done, closed or expired): free what its state holds (a session, a sandbox). Called
        on the service's event loop: hand anything slow to a thread."""

    @property
    def tool_format(self) -> Literal["hermes", "tags", "none"]:
        """How the model writes calls: `hermes` (JSON) by default when there are tools; an environment whose tools
        each take one string may say `tags`."""
        return "hermes" if self.tools() else "none"

    def spec(self) -> EnvSpec:
        tools = [t.spec for t in self.tools()]
        return EnvSpec(
            name=self.name,
            description=self.description,
            tools=tools,
            tool_format=self.tool_format,
            max_turns=self.max_turns,
        )

    def step(self, state: Any, message: ChatMessage, turn: int) -> StepResponse:
        """One model turn: its tool calls run, or its answer judged; cut at max_turns."""
        calls, malformed = list(message.tool_calls or []), []
        if not calls and self.tool_format != "none":
            parsed = (
                parse_calls(message.content, prefix=f"call_{turn}")
                if self.tool_format == "hermes"
                else parse_tag_calls(message.content, self._single_arguments(), prefix=f"call_{turn}")
            )
            calls, malformed = parsed.calls, parsed.malformed
        if calls or malformed:
            stats = ToolStats(malformed=len(malformed))
            replies = [self._malformed(why) for why in malformed] + [self._run(c, stats) for c in calls]
            out = StepResponse(messages=replies, done=False, tools=stats)
        else:
            o = self.answer(state, message.content, turn)
            out = StepResponse(messages=o.messages, reward=o.reward, done=o.done, info=o.info)
        if not out.done and turn >= self.max_turns:
            out.done, out.truncated, out.reward = True, True, self.failure_reward
        return out

    def _single_arguments(self) -> dict[str, str]:
        """tool -> the name of its one argument (the `tags` format)."""
        out = {}
        for t in self.tools():
            params = list(t.spec.function.parameters.get("properties", {}))
            if len(params) == 1:
                out[t.spec.function.name] = params[0]
        return out

    def _malformed(self, why: str) -> ChatMessage:
        example = (
            render_call("tool_name", {"argument": "value"})
            if self.tool_format == "hermes"
            else render_tag_call(next(iter(self._single_arguments()), "tool"), "argument")
        )
        return ChatMessage(role="tool", content=f"error: your tool call could not be read: {why}. Write:\n{example}")

    def _run(self, call: ToolCall, stats: ToolStats) -> ChatMessage:
        name = call.function.name
        tools = {t.spec.function.name: t for t in self.tools()}
        reply = ChatMessage(role="tool", content="", tool_call_id=call.id, name=name)
        if name not in tools:
            stats.unknown += 1
            reply.content = f"error: there is no tool {name!r}; the tools are: {', '.join(sorted(tools)) or 'none'}"
            return reply
        try:
            args = json.loads(call.function.arguments)
            if not isinstance(args, dict):
                raise TypeError("the arguments are not an object")
            reply.content = str(tools[name].run(**args))
            stats.valid += 1
        except Exception as e:  # a tool's failure is the model's to read, not the service's to crash on
            stats.failed += 1
            reply.content = f"error: {name} failed: {type(e).__name__}: {str(e)[:500]}"
        return reply
