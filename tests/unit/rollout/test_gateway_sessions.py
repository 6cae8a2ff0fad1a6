"""Gateway sessions without an engine: calls planned, answered and continued token-exactly, a rewritten history as
a new segment, the refusals, the final episode and the group its sessions make (one shared prompt)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from learner.tiny import tiny_tokenizer
from rollout.engines.base import Completion
from rollout.episodes import Renderer
from rollout.gateway.core import Gateway, TaskGroup
from rollout.gateway.metrics import GatewayMetrics
from rollout.gateway.schemas import ChatRequest, CompletionRequest, EndSession
from rollout.gateway.sessions import (
    CallRefused,
    ChatRenderer,
    Choice,
    Limits,
    Session,
    assistant_message,
    common_prefix,
)
from rollout.settings import RolloutSettings
from services.episodes import ChatMessage
from services.schemas import PromptTask, Score

TOK = tiny_tokenizer()


def session(max_calls: int = 8, max_context: int = 4096) -> Session:
    return Session("s1", b"", "t1", ChatRenderer(TOK), Limits(max_calls, max_context), 0.0)


def chat(messages: list[dict[str, Any]], **kw: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "policy", "messages": messages, **kw})


def completion(text: str, finish: str = "stop") -> Completion:
    ids = list(TOK(text, add_special_tokens=False).input_ids)
    return Completion(ids, text, [-0.5] * len(ids), finish)  # type: ignore[arg-type]


def answer(s: Session, req: ChatRequest, texts: list[str], version: int = 0) -> list[dict[str, Any]]:
    plan = s.plan_chat(req, 16)
    choices = [Choice(c, version, assistant_message(c, False, "c")[0]) for c in map(completion, texts)]
    s.answered(plan, choices, req.temperature, req.top_p, 1.0)
    return [c.message or {} for c in choices]


def test_a_call_that_extends_the_last_continues_its_tokens() -> None:
    s = session()
    first = [{"role": "user", "content": "2+3?"}]
    req = chat(first)
    plan = s.plan_chat(req, 16)
    assert plan.new and plan.prompt == list(
        TOK(
            TOK.apply_chat_template(first, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).input_ids
    )
    c = completion("five")
    s.answered(plan, [Choice(c, 0, assistant_message(c, False, "c")[0])], 1.0, 1.0, 1.0)
    second = [*first, {"role": "assistant", "content": "five"}, {"role": "user", "content": "Sure?"}]
    plan2 = s.plan_chat(chat(second), 16)
    rest = Renderer(TOK).continuation(c.token_ids, "stop", [ChatMessage(role="user", content="Sure?")])
    assert not plan2.new and plan2.prompt == plan.prompt + c.token_ids + rest
    c2 = completion("yes")
    s.answered(plan2, [Choice(c2, 1, None)], 1.0, 1.0, 2.0)
    ep = s.end(0, 1.0)
    assert ep.opening == plan.prompt and ep.ids == c.token_ids + rest + c2.token_ids
    assert [(t.role, t.tokens) for t in ep.turns] == [("model", 4), ("env", len(rest)), ("model", 3)]
    sample = ep.sample(1.0, 1.0, "")
    assert sample.loss_mask() == [1] * 4 + [0] * len(rest) + [1] * 3
    assert sample.token_versions() == [0] * (4 + len(rest)) + [1] * 3
    assert sample.episode is not None and sample.episode.model_turns == 2 and sample.episode.env == "gateway"


def test_the_choice_sent_back_is_the_one_continued() -> None:
    s = session()
    first = [{"role": "user", "content": "pick"}]
    answer(s, chat(first, n=2), ["left", "right"])
    back = [*first, {"role": "assistant", "content": " right "}, {"role": "user", "content": "ok"}]
    plan = s.plan_chat(chat(back), 8)
    assert not plan.new and plan.model is not None and plan.model.c.text == "right"


def test_a_rewritten_history_starts_a_new_segment_and_says_why() -> None:
    s = session()
    first = [{"role": "user", "content": "long question"}]
    answer(s, chat(first), ["long answer"])
    edited = [{"role": "user", "content": "summary"}, {"role": "assistant", "content": "long answer"},
              {"role": "user", "content": "next"}]  # fmt: skip
    plan = s.plan_chat(chat(edited), 8)
    assert plan.new and plan.segment.reason.startswith("history rewritten")
    wrong_answer = [*first, {"role": "assistant", "content": "not what it said"}, {"role": "user", "content": "x"}]
    # the plan above was not answered: the session is still busy
    with pytest.raises(CallRefused, match="in flight") as e:
        s.plan_chat(chat(wrong_answer), 8)
    assert e.value.conflict
    s.failed(2.0)
    assert s.plan_chat(chat(wrong_answer), 8).new


def test_refusals_temperature_calls_context() -> None:
    s = session(max_calls=2, max_context=64)
    with pytest.raises(CallRefused, match="context"):
        s.plan_chat(chat([{"role": "user", "content": "x" * 80}]), 4)
    first = [{"role": "user", "content": "hi"}]
    answer(s, chat(first, temperature=0.7), ["yo"])
    with pytest.raises(CallRefused, match="one temperature"):
        s.plan_chat(chat(first, temperature=1.0), 4)
    answer(s, chat(first, temperature=0.7), ["yo"])
    with pytest.raises(CallRefused, match="2 calls"):
        s.plan_chat(chat(first, temperature=0.7), 4)
    with pytest.raises(CallRefused, match="choice 3"):
        s.end(3, 1.0)
    s.end(0, 1.0)
    with pytest.raises(CallRefused, match="ended"):
        s.end(0, 1.0)
    with pytest.raises(CallRefused, match="no call"):
        session().end(0, 0.0)


def test_completions_continue_by_text_or_ids() -> None:
    s = session()

    def encode(text: str, special: bool) -> list[int]:
        return list(TOK(text, add_special_tokens=special).input_ids)

    plan = s.plan_completion(CompletionRequest(model="policy", prompt="Q: 1+1\nA:"), 8, encode)
    c = completion(" 2")
    s.answered(plan, [Choice(c, 0)], 1.0, 1.0, 1.0)
    p2 = s.plan_completion(CompletionRequest(model="policy", prompt="Q: 1+1\nA: 2\nQ: 2+2\nA:"), 8, encode)
    assert not p2.new and p2.prompt == plan.prompt + c.token_ids + encode("\nQ: 2+2\nA:", False)
    s.failed(2.0)
    ids = plan.prompt + c.token_ids + [65, 66]
    p3 = s.plan_completion(CompletionRequest(model="policy", prompt=ids), 8, encode)
    assert not p3.new and p3.context == [65, 66]


def test_tool_calls_are_parsed_from_the_text() -> None:
    c = completion('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')
    msg, finish = assistant_message(c, True, "call_x")
    assert finish == "tool_calls" and msg["content"] == "Let me add."
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert assistant_message(c, False, "call_x") == ({"role": "assistant", "content": c.text}, "stop")
    # sent back as returned, it continues the session
    s = session()
    first = [{"role": "user", "content": "add"}]
    plan = s.plan_chat(chat(first), 8)
    s.answered(plan, [Choice(c, 0, msg)], 1.0, 1.0, 1.0)
    back = {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "call_x_0", "type": "function", "function": {"name": "add", "arguments": '{ "a": 2 }'}}]}  # fmt: skip
    nxt = s.plan_chat(chat([*first, back, {"role": "tool", "tool_call_id": "call_x_0", "content": "2"}]), 8)
    assert not nxt.new


def test_a_group_of_sessions_shares_its_longest_common_prompt() -> None:
    s = RolloutSettings(model_dir="/nonexistent", replica_id="r")  # type: ignore[arg-type]
    gw = Gateway(s, TOK, GatewayMetrics(CollectorRegistry()))
    task = PromptTask(task_id="t1", prompt_id="p", prompt="q", ground_truth="1", verifier="dapo_math",
                      data_source="d", n_samples=3)  # fmt: skip
    g = TaskGroup(task, None, 0)
    for i, system in enumerate(["Be brief.", "Be kind.", "Be brief."]):
        sess = Session(f"s{i}", b"", "t1", gw.render, gw.limits, 0.0)
        answer(sess, chat([{"role": "system", "content": system}, {"role": "user", "content": "q"}]), [f"a{i}"])
        if i < 2:
            sess.end(0, float(i))
            g.scores[sess.sid] = Score(reward=float(i), acc=i > 0)
        else:
            sess.state = "abandoned"
        g.sessions.append(sess)
    group = gw.scored(g)
    assert group is not None and group.task.n_samples == 2 and [x.reward for x in group.scores] == [0.0, 1.0]
    openings = [sess.segments[0].episode.opening for sess in g.sessions[:2]]
    n = common_prefix(openings)
    assert 0 < n < min(map(len, openings)) and group.task.prompt_token_ids.tolist() == openings[0][:n]
    for sample, opening, sess in zip(group.samples, openings, g.sessions, strict=False):
        answer_ids = sess.segments[0].last.choices[0].c.token_ids  # type: ignore[union-attr]
        assert sample.response_token_ids.tolist() == opening[n:] + answer_ids
        assert sample.loss_mask() == [0] * (len(opening) - n) + [1] * len(answer_ids)


def test_end_takes_a_reward_or_a_scoring_not_both() -> None:
    assert EndSession(reward=1.0).reward == 1.0 and EndSession(score=True).score
    for bad in ({}, {"reward": 1.0, "score": True}):
        with pytest.raises(ValidationError):
            EndSession.model_validate(bad)
    with pytest.raises(ValidationError, match="presence_penalty"):
        chat([{"role": "user", "content": "x"}], presence_penalty=1.0)
    with pytest.raises(ValidationError, match="logit_bias"):
        chat([{"role": "user", "content": "x"}], logit_bias={"1": 5})


def test_a_template_that_refuses_or_cannot_continue() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    s = Session("s", b"", "t", ChatRenderer(tok), Limits(8, 4096), 0.0)
    with pytest.raises(CallRefused, match="roles must alternate"):
        s.plan_chat(chat([{"role": "user", "content": "x"}]), 4)
    assert not s.busy
    # a template that renders the last turn differently once more follow (as Qwen3's drops an empty <think>)
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}<last>{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    s = Session("s", b"", "t", ChatRenderer(tok), Limits(8, 4096), 0.0)
    first = [{"role": "user", "content": "x"}]
    answer(s, chat(first), ["y"])
    plan = s.plan_chat(chat([*first, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]), 4)
    assert plan.new and plan.segment.reason.startswith("the chat template cannot continue")


def test_a_template_with_tools_renders_them_itself() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}[call {{ c['function']['name'] }}]{% endfor %}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    render = ChatRenderer(tok)
    assert render.native_tools
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    req = chat([{"role": "user", "content": "2+3"}], tools=tools)
    text = tok.decode(render.full(req.messages, req.tools))
    assert text.startswith("<tools>add;</tools>\n") and "You can call tools" not in text
    back = chat([{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}])  # fmt: skip
    assert "[call add]" in tok.decode(render.full(back.messages, None))
    with pytest.raises(ValidationError, match="tool_choice"):
        chat([{"role": "user", "content": "x"}], tools=tools, tool_choice="required")


class _Consumer:  # the prompts stream, as the gateway uses it (the stream itself is tested with real Redis)
    def __init__(self, deliveries: list[Any]):
        self.deliveries, self.released, self.dead = deliveries, [], []

    def read(self, count: int = 1, block_ms: int = 0) -> list[Any]:
        out, self.deliveries = self.deliveries[:count], self.deliveries[count:]
        return out

    def keep_alive(self) -> None: ...

    def release(self, *ids: str) -> None:
        self.released += ids

    def dead_letter(self, ds: list[Any], kind: str, why: str) -> None:
        self.dead += [(d.entry_id, kind) for d in ds]

    def ack_and_publish(self, ids: Any, outs: Any) -> None: ...


class _Engine:
    version = 0

    def in_flight(self) -> int:
        return 0

    def cancel(self, key: str) -> bool:
        return False


def test_untaken_seats_and_duplicate_deliveries_are_not_held_forever() -> None:
    import asyncio

    from rollout.gateway.core import Waiter
    from services.streams import Delivery

    s = RolloutSettings(model_dir="/nonexistent", replica_id="r", gateway_idle_s=0.01)  # type: ignore[arg-type]
    gw = Gateway(s, TOK, GatewayMetrics(CollectorRegistry()))
    task = PromptTask(task_id="t1", prompt_id="p", prompt="q", ground_truth="1", verifier="dapo_math",
                      data_source="d", n_samples=2)  # fmt: skip
    consumer = _Consumer([Delivery("1-0", task, 1), Delivery("2-0", task, 1)])

    async def opened() -> Any:
        w = Waiter()
        assert gw.seat(w, None) is None  # no task yet: it waits for the loop
        gw.advance(_Engine(), consumer)  # type: ignore[arg-type]
        return await asyncio.wait_for(w.future, 1)

    seat = asyncio.run(opened())
    assert seat.task.task_id == "t1" and gw.groups["t1"].seats == 1
    gw.seat_waiters.append(type("W", (), {"withdrawn": False, "resolve": lambda self, v: None})())  # type: ignore[arg-type]
    gw.groups["t1"].seats = 0  # full: the next waiter makes the loop read the second delivery, a duplicate id
    gw.advance(_Engine(), consumer)  # type: ignore[arg-type]
    assert gw.dead and gw.dead[0][1] == "duplicate_task" and gw.dead[0][0].delivery.entry_id == "2-0"
    gw.publish(consumer)  # type: ignore[arg-type]
    assert consumer.dead == [("2-0", "duplicate_task")]
    # a group nobody sits at any more closes: with no session, its delivery is given back for any replica
    gw.groups.clear()
    gw.groups["t2"] = TaskGroup(task.model_copy(update={"task_id": "t2"}), Delivery("3-0", task, 1), 2)
    import time

    time.sleep(0.05)
    gw._next_expiry = 0.0
    gw.seat_waiters.clear()
    gw.advance(_Engine(), consumer)  # type: ignore[arg-type]
    assert "t2" not in gw.groups and consumer.released == ["3-0"]
