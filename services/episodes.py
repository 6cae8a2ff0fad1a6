"""The environment protocol (`dapo-env/1`): how a replica runs an episode against an environment over HTTP.

An environment server holds many episodes. A client lists its environments, resets one with a task (or a seed
the environment turns into a task), then steps it with each model turn until the answer says `done`:

    GET    /v1/envs                          -> EnvList: each environment, its tools (OpenAI function schema)
    POST   /v1/episodes              ResetRequest -> ResetResponse: the opening messages
    POST   /v1/episodes/{id}/step    StepRequest  -> StepResponse: new messages, reward, done
    DELETE /v1/episodes/{id}                      -> Closed

Retries are safe: a reset with an `episode_id` that exists and the same env/seed/task answers the same opening; a
step with the turn number already answered answers the same response. Anything else out of order is 409. The
whole protocol, with every status code, is written up in docs/services/environments.md; the conformance checker
(`python -m env_server.conformance URL`) drives any server through it. These classes are the contract: the
environment service answers with them, the replica and the checker read them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

ENV_PROTOCOL: Literal["dapo-env/1"] = "dapo-env/1"
MAX_CONTENT_CHARS = 200_000
NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class _Strict(BaseModel):
    """Requests refuse unknown fields (a typo is a 422, not ignored); answers are read leniently (a server may say
    more than the protocol asks)."""

    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ToolFunction(_Open):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field("", max_length=4096)
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the arguments object.",
    )


class ToolSpec(_Open):
    """A tool an environment offers, in OpenAI's function-calling schema."""

    type: Literal["function"] = "function"
    function: ToolFunction


class CalledFunction(_Open):
    name: str = Field(max_length=256)
    arguments: str = Field(max_length=MAX_CONTENT_CHARS, description="The arguments object as JSON text.")


class ToolCall(_Open):
    """A call the model made (OpenAI's shape); a client that parsed the model's text sends these."""

    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_CONTENT_CHARS)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=128, description="On a tool message: the call it answers.")
    name: str | None = Field(None, max_length=256, description="On a tool message: the tool's name.")


class EnvSpec(_Open):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field("", max_length=4096)
    tools: list[ToolSpec] = Field(default_factory=list)
    tool_format: Literal["hermes", "tags", "none"] = Field(
        "none",
        description='How the model writes a call in its text: `hermes` = <tool_call>{"name": ..., "arguments": '
        "{...}}</tool_call>; `tags` = <name>argument</name>, for tools of one string argument "
        "(services/tool_calls.py); the server parses them when a step gives no `tool_calls`.",
    )
    max_turns: int = Field(ge=1, le=1024, description="Model turns after which the episode ends, truncated.")


class EnvList(_Open):
    protocol: Literal["dapo-env/1"] = ENV_PROTOCOL
    envs: list[EnvSpec]


class ResetRequest(_Strict):
    env: str = Field(pattern=NAME_PATTERN, description="Which environment.")
    episode_id: str | None = Field(
        None, pattern=ID_PATTERN, description="The client's id for the episode (makes a retried reset safe)."
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="The environment draws a task from it.")
    task: dict[str, Any] | None = Field(None, description="An explicit task, in the environment's own shape.")
    split: Literal["train", "eval"] = Field(
        "train",
        description="With a seed: the split to draw from. An environment with few distinct tasks keeps its held-out "
        "ones apart (an evaluation asks `eval`, training `train`); most serve any task to both and ignore it.",
    )

    @model_validator(mode="after")
    def _seed_or_task(self) -> Self:
        if (self.seed is None) == (self.task is None):
            raise ValueError("give exactly one of `seed` (the environment draws a task) and `task`")
        return self

    def key(self) -> str:
        """Identity of what was asked: a retried reset must ask the same thing."""
        body = json.dumps([self.env, self.seed, self.task, self.split], sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]


class ResetResponse(_Open):
    episode_id: str
    env: str
    task_id: str = Field(description="Stable id of the task (the same task from any seed gives the same id).")
    messages: list[ChatMessage] = Field(min_length=1, description="The opening: system prompt, the user's turn.")
    tools: list[ToolSpec] = Field(default_factory=list)
    max_turns: int = Field(ge=1)


class StepRequest(_Strict):
    turn: int = Field(ge=1, le=1024, description="1 for the model's first turn, then 2, ...")
    message: ChatMessage

    @model_validator(mode="after")
    def _assistant(self) -> Self:
        if self.message.role != "assistant":
            raise ValueError(f"message.role must be 'assistant' (the model's turn), not {self.message.role!r}")
        return self


class ToolStats(_Open):
    """Tool calls in one step: run, unreadable, of a tool the environment lacks, and raising."""

    valid: int = Field(0, ge=0)
    malformed: int = Field(0, ge=0)
    unknown: int = Field(0, ge=0)
    failed: int = Field(0, ge=0)


class StepResponse(_Open):
    messages: list[ChatMessage] = Field(default_factory=list, description="Tool results, feedback, a user turn.")
    reward: FiniteFloat | None = Field(None, description="Set when the episode is done (and may be earlier).")
    done: bool
    truncated: bool = Field(False, description="Done because max_turns was reached, not by the task.")
    error: str | None = Field(
        None,
        description="The environment itself failed (timed out, raised): the episode is over and must not be trained.",
    )
    tools: ToolStats = Field(default_factory=ToolStats)
    info: dict[str, Any] = Field(default_factory=dict)


class Closed(_Open):
    episode_id: str
    closed: bool = True
