"""A gateway session: an agent's episode, captured call by call as the tokens the model saw and sampled.

    session = Session(sid, key_hash, task_id, render, limits, now)
    session.begin_call(key, temperature, top_p)  # idle -> calling (under the gateway's lock)
    plan = session.plan_chat(request, max_tokens) # the call's prompt ids (outside the lock, off the event loop)
    ...                                           # the engine samples plan.prompt
    session.answered(key, plan, choices, ...)     # calling -> idle, its choices kept (one the next call may continue)
    episode = session.end(choice=0, reward=1.0)   # the last segment with its last answer: what the learner trains on

One owner of a session's state, this class; every transition a method, every failure path ending in a named state:

    opening --opened--> idle --begin_call--> calling --answered / call_failed--> idle
                         idle --begin_scoring--> scoring --end--> ended      (scoring_failed: back to idle)
                         idle --end (a reward)--> ended
    any state not over --stop--> abandoned (idle past --gateway-idle-s, its client or its replica gone)
                              or failed    (its environment failed it: never trained on)

A call continues the session's sequence when its messages are the previous call's messages, then the assistant
message the gateway returned for one of its choices, then new messages: the prompt is then the previous prompt, that
choice's sampled tokens and the new messages rendered as a continuation (rollout/episodes.py's Renderer: nothing
earlier is tokenised again), and the episode keeps the sampled tokens in the loss and the new messages out of it.
Any other call (a summary, a trimmed or edited history, a branch from an older call) starts a new segment rendered
from its messages in full, and the session says why (`segments`). Completions (`/v1/completions`) continue when the
prompt extends the previous prompt and a choice's text (or their token ids) exactly.

A call whose tools differ from the previous call's starts a new segment too (the model reads its tools where a
segment begins). A session samples at one temperature (the learner corrects for one distribution per sample): a
call that changes it is refused. One call is in flight per session at a time (a second is a 409, which the OpenAI
SDK retries).
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
State = Literal["opening", "idle", "calling", "scoring", "ended", "abandoned", "failed"]
OVER: frozenset[State] = frozenset(("ended", "abandoned", "failed"))


class CallRefused(ValueError):
    """This call cannot be run in this session: a 400; 409 when `conflict` (another call or its scoring is in
    flight: the SDK retries it), 410 when the session is `over`."""

    def __init__(self, message: str, *, conflict: bool = False, over: bool = False, code: str | None = None):
        super().__init__(message)
        self.conflict, self.over, self.code = conflict, over, code


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
    tools: list[ToolSpec] | None = None  # chat: the tools offered (the model read them where its segment began)


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
        self.native_tools = self.base.native_tools
        self.max_token_chars = max_token_chars(tokenizer)

    def full(
        self, messages: list[ChatIn], tools: list[ToolSpec] | None, taught: list[ToolSpec] | None = None
    ) -> list[int]:
        """The conversation in full, with its tools: rendered by the template when it renders tools (as an
        environment's opening on the replica: rollout/episodes.py), else taught in the system prompt — but for
        `taught`, the tools an environment's own opening already teaches."""
        try:
            return self._full(messages, tools, taught or [])
        except CallRefused:
            raise
        except Exception as e:  # a template that refuses the conversation (roles out of order, ...), tools'
            # parameters it cannot read, text the tokenizer cannot take: the client's to fix
            raise CallRefused(f"the model's chat template refused these messages: {str(e)[:300]}") from e

    def _full(self, messages: list[ChatIn], tools: list[ToolSpec] | None, taught: list[ToolSpec]) -> list[int]:
        if not self.base.template:
            return self.base.opening([plain(m) for m in messages])
        dicts = [self._dict(m) for m in messages]
        kw: dict[str, Any] = {}
        teach = [t for t in tools or [] if t not in taught]
        if tools and self.native_tools:
            kw["tools"] = [t.model_dump() for t in tools]
        elif teach:  # a template without tools: the format taught in the system prompt, as environments do
            if dicts and dicts[0]["role"] == "system":
                dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{instructions(teach)}"}
            else:
                dicts.insert(0, {"role": "system", "content": instructions(teach)})
        text = self.tok.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False, **kw)
        return list(self.tok(str(text), add_special_tokens=False).input_ids)

    def check_size(self, messages: list[ChatIn], tools: list[ToolSpec] | None, max_tokens: int) -> None:
        """Refuse a conversation that cannot fit `max_tokens` before tokenising it: no token covers more than
        `max_token_chars` characters, so text longer than that many tokens' worth is too long whatever it says."""
        chars = sum(len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or []) for m in messages)
        if chars > max_tokens * self.max_token_chars:
            raise CallRefused(
                f"these messages ({chars} characters) cannot fit the {max_tokens} tokens of context left (no token "
                f"of this model covers more than {self.max_token_chars} characters)",
                code="context_length_exceeded",
            )

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


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary decodes to (at least 1)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest = max((len(t) for t in vocab), default=0)  # byte-level pieces: one character per byte, at most
    return max(1, longest)


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
    """A session's state and its transitions, in one place (the gateway's lock held by every caller): nothing
    outside this class sets `state`."""

    def __init__(
        self,
        sid: str,
        key_hash: bytes,
        task_id: str,
        render: ChatRenderer,
        limits: Limits,
        now: float,
        *,
        opening: bool = False,
        taught: list[ToolSpec] | None = None,
    ):
        self.sid, self.key_hash, self.task_id = sid, key_hash, task_id
        self.render, self.limits = render, limits
        self.segments: list[Segment] = []
        self.calls = 0
        self.state: State = "opening" if opening else "idle"
        self.why = ""  # how it is over (ended, abandoned or failed): said to a client whose key is for it
        self.call_key: str | None = None  # the call in flight (state "calling")
        self.sampling: tuple[float, float] | None = None  # (temperature, top_p) of its calls
        self.last_seen = now
        self.reward: float | None = None
        self.episode: Episode | None = None  # once ended: what the learner trains on
        self.tool_calls = 0
        self.env: tuple[str, str] | None = None  # an environment's task: (its instance, the episode id)
        self.taught = list(taught or [])  # tools its environment's opening teaches (rendered as the replica does)
        self.rows: list[dict[str, Any]] = []  # its segments' summary once retired (segment_rows)

    @property
    def over(self) -> bool:
        return self.state in OVER

    def _refuse_unless(self, *states: State) -> None:
        if self.state in states:
            return
        if self.over:
            raise CallRefused(f"session {self.sid} is over: {self.state} ({self.why})", over=True)
        if self.state == "opening":
            raise CallRefused("the session's environment is still opening", conflict=True)
        what = "a call of this session is in flight" if self.state == "calling" else "the session is being scored"
        raise CallRefused(f"{what}: one at a time", conflict=True)

    # ------------------------------------------------------------------ opening (an environment's task)

    def opened(self, env: tuple[str, str], now: float) -> bool:
        """Its environment episode opened: the session is ready for calls (False: it was over meanwhile)."""
        if self.state != "opening":
            return False
        self.state, self.env, self.last_seen = "idle", env, now
        return True

    # ------------------------------------------------------------------ a call

    def begin_call(self, key: str, temperature: float, top_p: float) -> None:
        """idle -> calling; refused while opening, calling or scoring (409), once over, past the call limit, or at
        another sampling than its earlier calls'."""
        self._refuse_unless("idle")
        if self.calls >= self.limits.max_calls:
            raise CallRefused(f"this session has made its {self.limits.max_calls} calls (--gateway-max-calls)")
        if self.sampling is not None and self.sampling != (temperature, top_p):
            t, p = self.sampling
            raise CallRefused(
                f"a session samples at one temperature and top_p (the learner corrects for one distribution per "
                f"episode): this one's are {t} and {p}"
            )
        self.state, self.call_key = "calling", key

    def answered(self, key: str, plan: Plan, choices: list[Choice], sampling: tuple[float, float], now: float) -> None:
        """calling -> idle with the call's answer kept: the episode takes the answer it continued, then the new
        messages. A call no longer the session's (given up, the session over) changes nothing."""
        if self.state != "calling" or self.call_key != key:
            return
        self.state, self.call_key = "idle", None
        self.calls += 1
        self.last_seen = now
        self.sampling = sampling
        if plan.new:
            self.segments.append(plan.segment)
        elif plan.model is not None:
            plan.segment.episode.add_model(plan.model.c, plan.model.version)
            plan.segment.episode.add_env(plan.context)
        plan.call.choices = choices
        plan.segment.last = plan.call
        self.tool_calls += sum(len((c.message or {}).get("tool_calls") or []) for c in choices)

    def call_failed(self, key: str, now: float) -> None:
        """calling -> idle, nothing kept (refused, given up, cancelled); a call no longer the session's: nothing."""
        if self.state == "calling" and self.call_key == key:
            self.state, self.call_key, self.last_seen = "idle", None, now

    def plan_chat(self, req: ChatRequest, max_tokens: int) -> Plan:
        """The call's prompt: the session's sequence continued, or a new segment rendered in full. Runs outside the
        gateway's lock and off the event loop (rendering a long conversation takes time): only this call, the
        session's one in flight, reads or changes the session meanwhile."""
        seg = self.segments[-1] if self.segments else None
        last = seg.last if seg is not None else None
        tools = req.offered_tools()
        plan: Plan | None = None
        why = ""
        if seg is not None and last is not None and last.kind == "chat" and last.messages is not None:
            k = len(last.messages)
            if len(req.messages) > k + 1 and req.messages[:k] == last.messages:
                if _tool_names(tools) != _tool_names(last.tools):
                    why = "tools changed: the model reads its tools where a segment begins"
                else:
                    for choice in last.choices:
                        if _same_answer(req.messages[k], choice.message):
                            try:
                                rest = self.render.rest(choice.c, req.messages[k + 1 :])
                            except Exception as e:  # a template that cannot be continued: this call starts anew
                                why = f"the chat template cannot continue the sequence: {str(e)[:200]}"
                                break
                            prompt = seg.episode.prompt_ids() + choice.c.token_ids + rest
                            call = Call("chat", prompt, messages=list(req.messages), tools=tools)
                            plan = Plan(call, seg, False, choice, rest)
                            break
        if plan is None:
            prompt = self.render.full(req.messages, tools, taught=self.taught)
            if seg is None:
                why = "start"
            elif not why:
                why = "history rewritten: the messages do not extend the last call's"
            call = Call("chat", prompt, messages=list(req.messages), tools=tools)
            plan = Plan(call, Segment(Episode(ENV, prompt, temperature=req.temperature, top_p=req.top_p), why), True)
        self._check_length(plan.prompt, max_tokens)
        return plan

    def plan_completion(self, req: CompletionRequest, max_tokens: int, encode: Any) -> Plan:
        """As plan_chat, for a completion: continued when its prompt extends the last one and a choice exactly."""
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
            plan = Plan(call, Segment(Episode(ENV, ids, temperature=req.temperature, top_p=req.top_p), why), True)
        self._check_length(plan.prompt, max_tokens)
        return plan

    def _check_length(self, prompt: list[int], max_tokens: int) -> None:
        if len(prompt) + max_tokens > self.limits.max_context:
            raise CallRefused(
                f"this call's prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) exceed the session's "
                f"context of {self.limits.max_context} tokens (--gateway-max-context)",
                code="context_length_exceeded",
            )

    # ------------------------------------------------------------------ its end

    def begin_scoring(self, choice: int) -> Completion:
        """idle -> scoring (no call, no expiry, no second end meanwhile); the answer to score."""
        self._refuse_unless("idle")
        answer = self.last_answer(choice).c
        self.state = "scoring"
        return answer

    def scoring_failed(self, now: float) -> None:
        """scoring -> idle: the scorer could not answer now (an outage): the client may end it again."""
        if self.state == "scoring":
            self.state, self.last_seen = "idle", now

    def end(self, choice: int, reward: float, *, scored: bool = False) -> Episode:
        """idle -> ended with the client's reward, or scoring -> ended with the scorer's (`scored`): the episode
        trained on, the last segment with its last answer (`choice` of the last call) in the loss. A reward given
        while the scorer scores is refused (409), and the scorer's verdict while idle."""
        self._refuse_unless("scoring" if scored else "idle")
        answer = self.last_answer(choice)
        seg = self.segments[-1]
        ep = copy.deepcopy(seg.episode)  # the segment stays as it was: the final answer joins the copy
        ep.add_model(answer.c, answer.version)
        ep.reward = reward
        ep.ended = "max_tokens" if answer.c.finish_reason == "length" else "done"
        ep.tools.valid = self.tool_calls
        self.state, self.why, self.reward, self.episode = "ended", f"reward {reward:g}", reward, ep
        return ep

    def last_answer(self, choice: int) -> Choice:
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.last is None:
            raise CallRefused("this session made no call: there is nothing to train on")
        if choice >= len(seg.last.choices):
            raise CallRefused(f"choice {choice}: the last call has {len(seg.last.choices)} choices")
        return seg.last.choices[choice]

    def segment_rows(self) -> list[dict[str, Any]]:
        """Its segments as GET /v1/sessions/{id} shows them: why each began, its prompt's and its tokens' counts."""
        if not self.segments:
            return self.rows
        return [
            {"reason": g.reason, "prompt_tokens": len(g.episode.opening), "tokens": len(g.episode.ids)}
            for g in self.segments
        ]

    def retire(self) -> None:
        """Its group is out: only what its state reads is kept (the tokens go), for a late call told how it ended."""
        self.rows = self.segment_rows()
        self.segments, self.episode = [], None

    def stop(self, state: Literal["abandoned", "failed"], why: str) -> bool:
        """Any state not over -> abandoned (idle past its time, its client or replica gone) or failed (its
        environment failed it); False if it was over already."""
        if self.over:
            return False
        self.state, self.why, self.call_key = state, why, None
        return True


def _tool_names(tools: list[ToolSpec] | None) -> list[str]:
    return [json.dumps(t.model_dump(), sort_keys=True) for t in tools or []]
