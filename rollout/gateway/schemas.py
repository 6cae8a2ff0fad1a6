"""The OpenAI API's requests, as the gateway accepts them (chat completions, completions, sessions), and its error
shape. Parameters that would change the distribution sampled from (top_p < 1, penalties, logit bias, top-k; top-k
log-probs beyond the sampled token's) are refused with a 400 that says why: the learner recomputes the log-probs of
the distribution at the sample's temperature, and these would make them wrong. Fields a client sends that do not
change sampling (`user`, `seed`, `parallel_tool_calls`, `metadata`, `store`) are accepted and ignored; anything else
is a 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

from services.episodes import MAX_CONTENT_CHARS, ToolCall, ToolSpec

MAX_MESSAGES = 512


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # accepted, not used: they do not change what is sampled
    user: str | None = Field(None, max_length=256)
    seed: int | None = Field(None, description="Accepted; vLLM on CPU cannot seed one request (not used).")
    metadata: dict[str, str] | None = None
    store: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str = Field(max_length=MAX_CONTENT_CHARS)


class ChatIn(BaseModel):
    """A message of the conversation (text content only: a string, or text parts)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, max_length=MAX_CONTENT_CHARS)
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=128)
    refusal: str | None = None
    # what the SDK's `message.model_dump()` carries back, unused here
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class Sampling(_Request):
    model: str = Field(min_length=1, max_length=256)
    n: int = Field(1, ge=1, le=128)
    temperature: FiniteFloat = Field(1.0, ge=0, le=2)
    top_p: FiniteFloat = Field(
        1.0,
        ge=1,
        le=1,
        description="Only 1: nucleus sampling truncates the distribution, and the learner recomputes log-probs of the "
        "whole one at the sample's temperature (the ratio would be wrong on every token).",
    )
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's extension: generate max_tokens whatever is sampled.")
    return_token_ids: bool = Field(
        False, description="vLLM's extension: the prompt's token ids (as the model read them) and each choice's."
    )
    presence_penalty: FiniteFloat = Field(0.0, ge=0, le=0, description="Only 0: a penalty changes the distribution.")
    frequency_penalty: FiniteFloat = Field(0.0, ge=0, le=0, description="Only 0: a penalty changes the distribution.")

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4 or any(not s or len(s) > 256 for s in stop):
            raise ValueError("stop: at most 4 strings of 1 to 256 characters")
        return tuple(stop)


class ChatRequest(Sampling):
    messages: list[ChatIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="0 only: the sampled token's log-prob is given.")
    tools: list[ToolSpec] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="auto or none; `required` and a named tool are refused (nothing constrains the sampling)."
    )
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def offered_tools(self) -> list[ToolSpec] | None:
        """The tools the model is offered: none when `tool_choice` is "none"."""
        return self.tools if self.tools and self.tool_choice != "none" else None


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(description="Text, or token ids (one prompt).")
    logprobs: int | None = Field(None, ge=0, le=1, description="0 or 1: the sampled tokens' log-probs.")
    echo: Literal[False] = False
    suffix: None = None

    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions


class OwnTask(BaseModel):
    """A task the client brings: scored by the reward server's verifier against `ground_truth` at the end (or
    by the reward the client gives). Sessions of the same task_id make one group of `group_size`."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(pattern=r"^[A-Za-z0-9_.:/-]{1,128}$")
    prompt: str = Field(min_length=1, max_length=MAX_CONTENT_CHARS)
    ground_truth: str = Field("", max_length=MAX_CONTENT_CHARS)
    verifier: str = Field("dapo_math", min_length=1, max_length=128)
    group_size: int = Field(ge=2, le=64)


class OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: OwnTask | None = Field(None, description="Unset: the next task the mesh hands out.")


class EndSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: FiniteFloat | None = Field(None, ge=-100, le=100, description="The episode's reward.")
    score: bool = Field(False, description="Ask the reward server to score the last answer against the task.")
    choice: int = Field(0, ge=0, le=127, description="Which choice of the last call is the episode's answer.")

    @model_validator(mode="after")
    def _one_way(self) -> EndSession:
        if (self.reward is not None) != self.score:
            return self
        raise ValueError("give a `reward`, or `score: true` (the reward server scores the answer), not both")


def error(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
