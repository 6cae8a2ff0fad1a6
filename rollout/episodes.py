"""An episode on a replica, token-exact: the opening rendered once, each model turn kept as sampled, each
environment turn rendered by the chat template and appended — no earlier token is ever tokenised again.

    r = Renderer(tokenizer)
    ep = Episode(env="calculator", opening=r.opening(messages, tools), temperature=1.0, top_p=1.0)
    ep.add_model(completion, text)                          # its ids, log-probs, the version of every token
    ep.add_env(r.continuation(ep.last.token_ids, ep.last.finish_reason, new_messages))   # 0 in the loss mask
    prompt = ep.prompt_ids()                                 # what the engine continues from next
    sample = ep.sample(text)                                 # Sample schema 4: turns, versions, EpisodeInfo

How an environment turn is rendered: the template is applied to a probe conversation that ends with an assistant
message, with and without the new messages (and the generation prompt); the text between the two is the new
turn, and the text after the probe's assistant content is what closes a model turn (SmolLM2: `<|im_end|>\n`). A
model turn that ended on its end-of-turn token already holds the start of that closing; one cut by the length
limit gets all of it. Only the new text is tokenised.

An opening's tools: a chat template that renders tools (it names `tools`: Qwen, Llama 3, Hermes) gets them from the
template, on the replica's episodes and in the gateway's sessions alike; one that does not (SmolLM2) gets none from
here: an environment teaches its format in its own messages (the built-ins' system prompts), and the gateway
teaches a client's tools in the system prompt (rollout/gateway/sessions.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout.engines.base import Completion, encode_prompt
from services.episodes import ChatMessage, ToolSpec, ToolStats
from services.schemas import EpisodeInfo, Sample, Turn

PROBE = "\u2063probe-assistant-content\u2063"
Ended = Literal["done", "max_turns", "max_tokens"]


class Renderer:
    def __init__(self, tokenizer: Any, chat_template: bool = True):
        self.tok = tokenizer
        self.template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        template = getattr(tokenizer, "chat_template", None) if self.template else None
        self.native_tools = isinstance(template, str) and "tools" in template  # the template renders tools

    def problem(self) -> str | None:
        """Why this chat template cannot be continued token-exactly (None: it can). A template that renders an
        earlier turn differently once more turns follow (Qwen3 drops the last assistant turn's empty <think> block)
        would make the learner train on tokens the model never saw."""
        try:
            self.continuation([], "length", [ChatMessage(role="user", content="probe")])
        except ValueError as e:
            return str(e)
        return None

    def _apply(self, messages: list[dict[str, Any]], generation: bool, tools: Sequence[Any] = ()) -> str:
        kw = {"tools": [t.model_dump() for t in tools]} if tools and self.native_tools else {}
        out = self.tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False, **kw)
        return str(out)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids) if text else []

    def opening(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> list[int]:
        """The opening messages and the generation prompt, as the model will read them; `tools` rendered by the
        template when it renders tools."""
        if not self.template:
            return encode_prompt(self.tok, "\n\n".join(m.content for m in messages), chat_template=False)
        return self._encode(self._apply([template_dict(m) for m in messages], generation=True, tools=tools))

    def continuation(self, model_ids: list[int], finish: str, messages: list[ChatMessage]) -> list[int]:
        """The tokens after a model turn: the rest of its closing, the new messages, the next generation prompt."""
        if not self.template:
            return self._encode("".join(f"\n\n{m.content}" for m in messages) + "\n\n")
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": PROBE}]
        before = self._apply(probe, generation=False)
        after = self._apply(probe + [template_dict(m) for m in messages], generation=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders earlier turns differently once more follow: it cannot be "
                "continued token-exactly"
            )
        closing = before[before.index(PROBE) + len(PROBE) :]
        last = self.tok.decode(model_ids[-1:]) if model_ids and finish == "stop" else ""
        if last and closing.startswith(last):
            closing = closing[len(last) :]
        return self._encode(closing + after[len(before) :])


def template_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


@dataclass
class Episode:
    env: str
    opening: list[int]
    ids: list[int] = field(default_factory=list)  # the response: every token after the opening
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    model_turns: int = 0
    last: Completion | None = None  # the last model turn as sampled (a one-step episode's answer, text and all)
    tools: ToolStats = field(default_factory=ToolStats)
    reward: float | None = None
    ended: Ended | None = None
    env_seconds: float = 0.0
    generate_seconds: float = 0.0
    # a single-turn prompt's answer: scored by the reward server, published as a single-turn sample
    one_step: bool = False
    temperature: float = 1.0  # how its model turns were sampled: the learner recomputes for this distribution
    top_p: float = 1.0
    task_key: str | None = None  # the environment's id of its task (ResetResponse.task_id): a group is one task

    def prompt_ids(self) -> list[int]:
        return self.opening + self.ids

    def add_model(self, c: Completion, version: int) -> None:
        """A model turn as sampled; `version`: the engine's when the turn started (tokens without their own)."""
        runs = c.versions or ((version, len(c.token_ids)),)
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.versions += [v for v, n in runs for _ in range(n)]
        self.add_turn("model", len(c.token_ids))
        self.model_turns += 1
        self.last = c

    def add_env(self, ids: list[int]) -> None:
        """An environment turn as rendered: in the context, out of the loss (log-prob 0, the last model version)."""
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.add_turn("env", len(ids))

    def add_turn(self, role: Literal["model", "env"], n: int) -> None:
        if n == 0:
            return
        if self.turns and self.turns[-1].role == role:
            self.turns[-1].tokens += n
        else:
            self.turns.append(Turn(role=role, tokens=n))

    def model_runs(self) -> list[tuple[int, int]]:
        """(version, tokens) runs of the model's tokens only, oldest first."""
        runs: list[tuple[int, int]] = []
        at = 0
        for t in self.turns:
            if t.role == "model":
                runs += [(v, len(list(g))) for v, g in itertools.groupby(self.versions[at : at + t.tokens])]
            at += t.tokens
        return runs

    def count_tools(self, stats: ToolStats) -> None:
        for k, v in stats.model_dump().items():
            setattr(self.tools, k, getattr(self.tools, k) + v)

    def sample(self, text: str = "") -> Sample:
        runs = [(v, len(list(g))) for v, g in itertools.groupby(self.versions)]
        info = EpisodeInfo(
            env=self.env,
            model_turns=max(1, self.model_turns),
            ended=self.ended or "done",
            tool_calls=self.tools.model_dump(),
            env_seconds=self.env_seconds,
            generate_seconds=self.generate_seconds,
        )
        return Sample(
            response_token_ids=self.ids,
            response_text=text,
            logprobs=self.logprobs,
            finish_reason="length" if self.ended == "max_tokens" else "stop",
            policy_version=runs[0][0] if runs else 0,
            temperature=self.temperature,
            top_p=self.top_p,
            version_runs=runs or None,
            turns=self.turns,
            episode=info,
        )
