"""A gateway session: an agent's episode, captured call by call as the tokens the model saw and sampled.

    session = Session(sid, key_hash, task, render, limits)
    plan = session.plan_chat(request)          # the call's prompt ids: the episode continued, or a new segment
    ...                                        # the engine samples plan.prompt
    session.answered(plan, choices)            # the call kept: its choices, one of which the next call may continue
    episode = session.final(choice=0, reward)  # the last segment with its last answer: what the learner trains on

A call continues the session's sequence when its messages are the previous call's messages, then the assistant
message the gateway returned for one of its choices, then new messages: the prompt is then the previous prompt, that
choice's sampled tokens and the new messages rendered as a continuation (rollout/episodes.py's Renderer: nothing
earlier is tokenised again), and the episode keeps the sampled tokens in the loss and the new messages out of it.
Any other call (a summary, a trimmed or edited history, a branch from an older call) starts a new segment rendered
from its messages in full, and the session says why (`segments`). Completions (`/v1/completions`) continue when the
prompt extends the previous prompt and a choice's text (or their token ids) exactly.

A session samples at one temperature and top_p (the learner corrects for one distribution per sample): a call
that changes them is refused. One call is in flight per session at a time (a second is a 409, which the OpenAI SDK
retries).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout.engines.base import Completion
from rollout.episodes import Episode, Renderer, template_dict
from rollout.gateway.schemas import ChatIn, ChatRequest, CompletionRequest
from services.episodes import ChatMessage, ToolSpec
from services.tool_calls import instructions, parse_calls, render_call, without_calls

ENV = "gateway"  # EpisodeInfo.env of a session's episode
State = Literal["open", "ended", "abandoned"]


class CallRefused(ValueError):
    """This call cannot be run in this session (a 400, or 409 when `conflict`)."""

    def __init__(self, message: str, *, conflict: bool = False, code: str | None = None):
        super().__init__(message)
        self.conflict, self.code = conflict, code


@dataclass(frozen=True)
class Limits:
    max_calls: int
    max_context: int


@dataclass
class Choice:
    c: Completion
    version: int  # the engine's when the call began (tokens without their own)
    message: dict[str, Any] | None = None  # chat: the assistant message as returned


@dataclass
class Call:
    kind: Literal["chat", "completion"]
    prompt: list[int]
    messages: list[ChatIn] | None = None  # chat: as sent
    text: str | None = None  # completions: the prompt text as sent (None: token ids)
    choices: list[Choice] = field(default_factory=list)


@dataclass
class Segment:
    episode: Episode
    reason: str  # why it began: "start", or why the previous segment could not be continued
    last: Call | None = None


@dataclass
class Plan:
    """A call's prompt, and what the session keeps once it is answered."""

    call: Call
    segment: Segment  # continued, or new (not yet the session's)
    new: bool
    model: Choice | None = None  # the previous answer the call continues
    context: list[int] = field(default_factory=list)  # the new messages' tokens after it

    @property
    def prompt(self) -> list[int]:
        return self.call.prompt


class ChatRenderer:
    """Conversations to token ids: in full (a segment's opening), or the messages after a model turn."""

    def __init__(self, tokenizer: Any, chat_template: bool = True):
        self.base = Renderer(tokenizer, chat_template)
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", None) if chat_template else None
        self.native_tools = isinstance(template, str) and "tools" in template

    def full(self, messages: list[ChatIn], tools: list[ToolSpec] | None) -> list[int]:
        try:
            return self._full(messages, tools)
        except CallRefused:
            raise
        except Exception as e:  # a template that refuses the conversation (roles out of order, ...), tools'
            # parameters it cannot read, text the tokenizer cannot take: the client's to fix
            raise CallRefused(f"the model's chat template refused these messages: {str(e)[:300]}") from e

    def _full(self, messages: list[ChatIn], tools: list[ToolSpec] | None) -> list[int]:
        if not self.base.template:
            return self.base.opening([plain(m) for m in messages])
        dicts = [self._dict(m) for m in messages]
        kw: dict[str, Any] = {}
        if tools and self.native_tools:
            kw["tools"] = [t.model_dump() for t in tools]
        elif tools:  # a template without tools: the format taught in the system prompt, as environments do
            if dicts and dicts[0]["role"] == "system":
                dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{instructions(tools)}"}
            else:
                dicts.insert(0, {"role": "system", "content": instructions(tools)})
        text = self.tok.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False, **kw)
        return list(self.tok(str(text), add_special_tokens=False).input_ids)

    def rest(self, model: Completion, messages: list[ChatIn]) -> list[int]:
        return self.base.continuation(model.token_ids, model.finish_reason, [plain(m) for m in messages])

    def _dict(self, m: ChatIn) -> dict[str, Any]:
        """A message for the template: tool calls as the template renders them, or written as the model writes
        them when it has no tools of its own."""
        if not (m.tool_calls and self.native_tools):
            return template_dict(plain(m))
        calls = [
            {"type": "function", "id": c.id, "function": {"name": c.function.name, "arguments": _args(c)}}
            for c in m.tool_calls
        ]
        return {**template_dict(plain(m)), "content": m.text(), "tool_calls": calls}


def plain(m: ChatIn) -> ChatMessage:
    text = m.text()
    if m.tool_calls:
        calls = "\n".join(render_call(c.function.name, _args(c)) for c in m.tool_calls)
        text = f"{text}\n{calls}" if text else calls
    role = "system" if m.role == "developer" else m.role
    return ChatMessage(role=role, content=text, name=m.name, tool_call_id=m.tool_call_id)


def _args(call: Any) -> Any:
    """A call's arguments as an object, or as the text they are when that is not JSON."""
    return _loads(call.function.arguments)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def assistant_message(c: Completion, tools: bool, call_id: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a completion (tool calls parsed from its text when tools were offered) and its
    finish reason in OpenAI's terms."""
    finish = "length" if c.finish_reason == "length" else "stop"
    if not tools:
        return {"role": "assistant", "content": c.text}, finish
    parsed = parse_calls(c.text, prefix=call_id)
    if not parsed.calls:
        return {"role": "assistant", "content": c.text}, finish
    content = without_calls(c.text) or None
    calls = [call.model_dump() for call in parsed.calls]
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def _same_answer(m: ChatIn, returned: dict[str, Any] | None) -> bool:
    """The client sent back the assistant message the gateway returned (content and tool calls, whitespace aside)."""
    if returned is None or m.role != "assistant":
        return False
    if m.text().strip() != (returned.get("content") or "").strip():
        return False
    sent = [(c.function.name, _norm(c.function.arguments)) for c in m.tool_calls or []]
    want = [(c["function"]["name"], _norm(c["function"]["arguments"])) for c in returned.get("tool_calls") or []]
    return sent == want


def _norm(arguments: str) -> str:
    """Arguments compared as the objects they are (key order and spacing aside)."""
    return json.dumps(_loads(arguments), sort_keys=True)


class Session:
    def __init__(self, sid: str, key_hash: bytes, task_id: str, render: ChatRenderer, limits: Limits, now: float):
        self.sid, self.key_hash, self.task_id = sid, key_hash, task_id
        self.render, self.limits = render, limits
        self.segments: list[Segment] = []
        self.calls = 0
        self.busy = False
        self.state: State = "open"
        self.sampling: tuple[float, float] | None = None  # (temperature, top_p) of its calls
        self.last_seen = now
        self.reward: float | None = None
        self.episode: Episode | None = None  # once ended: what the learner trains on
        self.tool_calls = 0
        self.env: tuple[str, str] | None = None  # an environment's task: (its instance, the episode id)

    # ------------------------------------------------------------------ a call

    def _begin(self, temperature: float, top_p: float) -> None:
        if self.state != "open":
            raise CallRefused(f"session {self.sid} is {self.state}")
        if self.busy:
            raise CallRefused("a call of this session is in flight: one at a time", conflict=True)
        if self.calls >= self.limits.max_calls:
            raise CallRefused(f"this session has made its {self.limits.max_calls} calls (--gateway-max-calls)")
        if self.sampling is not None and self.sampling != (temperature, top_p):
            t, p = self.sampling
            raise CallRefused(
                f"a session samples at one temperature and top_p (the learner corrects for one distribution per "
                f"episode): this one's are {t} and {p}"
            )

    def _check_length(self, prompt: list[int], max_tokens: int) -> None:
        if len(prompt) + max_tokens > self.limits.max_context:
            raise CallRefused(
                f"this call's prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) exceed the session's "
                f"context of {self.limits.max_context} tokens (--gateway-max-context)",
                code="context_length_exceeded",
            )

    def plan_chat(self, req: ChatRequest, max_tokens: int) -> Plan:
        self._begin(req.temperature, req.top_p)
        seg = self.segments[-1] if self.segments else None
        last = seg.last if seg is not None else None
        plan: Plan | None = None
        why = ""
        if seg is not None and last is not None and last.kind == "chat" and last.messages is not None:
            k = len(last.messages)
            if len(req.messages) > k + 1 and req.messages[:k] == last.messages:
                for choice in last.choices:
                    if _same_answer(req.messages[k], choice.message):
                        try:
                            rest = self.render.rest(choice.c, req.messages[k + 1 :])
                        except Exception as e:  # a template that cannot be continued: this call starts anew
                            why = f"the chat template cannot continue the sequence: {str(e)[:200]}"
                            break
                        prompt = seg.episode.prompt_ids() + choice.c.token_ids + rest
                        call = Call("chat", prompt, messages=list(req.messages))
                        plan = Plan(call, seg, False, choice, rest)
                        break
        if plan is None:
            prompt = self.render.full(req.messages, req.offered_tools())
            if seg is None:
                why = "start"
            elif not why:
                why = "history rewritten: the messages do not extend the last call's"
            call = Call("chat", prompt, messages=list(req.messages))
            plan = Plan(call, Segment(Episode(env=ENV, opening=prompt), why), True)
        self._check_length(plan.prompt, max_tokens)
        self.busy = True
        return plan

    def plan_completion(self, req: CompletionRequest, max_tokens: int, encode: Any) -> Plan:
        self._begin(req.temperature, req.top_p)
        seg = self.segments[-1] if self.segments else None
        last = seg.last if seg is not None else None
        plan: Plan | None = None
        if seg is not None and last is not None and last.kind == "completion":
            for choice in last.choices:
                before = last.prompt + choice.c.token_ids
                rest: list[int] | None = None
                if (
                    isinstance(req.prompt, list)
                    and req.prompt[: len(before)] == before
                    and len(req.prompt) > len(before)
                ):
                    rest = req.prompt[len(before) :]
                elif isinstance(req.prompt, str) and last.text is not None:
                    said = last.text + choice.c.text
                    if req.prompt.startswith(said) and len(req.prompt) > len(said):
                        rest = encode(req.prompt[len(said) :], False)
                if rest is not None:
                    call = Call("completion", before + rest, text=req.prompt if isinstance(req.prompt, str) else None)
                    plan = Plan(call, seg, False, choice, rest)
                    break
        if plan is None:
            ids = list(req.prompt) if isinstance(req.prompt, list) else encode(req.prompt, True)
            why = "start" if seg is None else "history rewritten: the prompt does not extend the last call's"
            call = Call("completion", ids, text=req.prompt if isinstance(req.prompt, str) else None)
            plan = Plan(call, Segment(Episode(env=ENV, opening=ids), why), True)
        self._check_length(plan.prompt, max_tokens)
        self.busy = True
        return plan

    def answered(self, plan: Plan, choices: list[Choice], temperature: float, top_p: float, now: float) -> None:
        """The call's answer kept: the episode takes the answer it continued, then the new messages."""
        self.busy = False
        self.calls += 1
        self.last_seen = now
        self.sampling = (temperature, top_p)
        if plan.new:
            self.segments.append(plan.segment)
        elif plan.model is not None:
            plan.segment.episode.add_model(plan.model.c, plan.model.version)
            plan.segment.episode.add_env(plan.context)
        plan.call.choices = choices
        plan.segment.last = plan.call
        self.tool_calls += sum(len((c.message or {}).get("tool_calls") or []) for c in choices)

    def failed(self, now: float) -> None:
        self.busy = False
        self.last_seen = now

    # ------------------------------------------------------------------ its end

    def end(self, choice: int, reward: float) -> Episode:
        """The episode trained on: the last segment, its last answer (`choice` of the last call) in the loss."""
        if self.state != "open":
            raise CallRefused(f"session {self.sid} is {self.state}")
        if self.busy:
            raise CallRefused("a call of this session is in flight: end it once answered", conflict=True)
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.last is None:
            raise CallRefused("this session made no call: there is nothing to train on")
        if choice >= len(seg.last.choices):
            raise CallRefused(f"choice {choice}: the last call has {len(seg.last.choices)} choices")
        ep = copy.deepcopy(seg.episode)  # the segment stays as it was: the final answer joins the copy
        answer = seg.last.choices[choice]
        ep.add_model(answer.c, answer.version)
        ep.reward = reward
        ep.ended = "max_tokens" if answer.c.finish_reason == "length" else "done"
        ep.tools.valid = self.tool_calls
        self.state, self.reward, self.episode = "ended", reward, ep
        return ep

    def last_answer(self, choice: int) -> Completion:
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.last is None or choice >= len(seg.last.choices):
            raise CallRefused("no such answer to score: the session's last call has no such choice")
        return seg.last.choices[choice].c


def rebase(ep: Episode, n: int) -> Episode:
    """The same episode opening on its first `n` tokens: the rest of its opening becomes context (out of the loss),
    so that a group's episodes share one prompt (the learner's) when their openings differ after it."""
    if n == len(ep.opening):
        return ep
    extra = ep.opening[n:]
    out = Episode(env=ep.env, opening=ep.opening[:n], reward=ep.reward, ended=ep.ended, tools=ep.tools)
    out.add_env(extra)
    out.ids += ep.ids
    out.logprobs += ep.logprobs
    first = ep.versions[0] if ep.versions else 0
    out.versions = [first] * len(extra) + ep.versions
    for t in ep.turns:
        out._turn(t.role, t.tokens)
    out.model_turns = ep.model_turns
    return out


def common_prefix(seqs: list[list[int]]) -> int:
    """How many leading tokens all of these share."""
    n = min((len(s) for s in seqs), default=0)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n
