"""Gateway sessions without an engine: calls planned, answered and continued token-exactly, a rewritten history as
a new segment, the refusals, the final episode and the group its sessions make (one shared prompt)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from learner.tiny import tiny_tokenizer
from rollout.engines.base import Completion
from rollout.env_calls import EnvFailure
from rollout.episodes import Renderer
from rollout.gateway.core import Conflict, Gateway, TaskGroup
from rollout.gateway.metrics import GatewayMetrics
from rollout.gateway.schemas import ChatRequest, CompletionRequest, EndSession, OwnTask
from rollout.gateway.sessions import (
    CallRefused,
    ChatRenderer,
    Choice,
    Limits,
    Plan,
    Session,
    assistant_message,
)
from rollout.groups import common_prefix
from rollout.settings import RolloutSettings
from services.episodes import ChatMessage
from services.schemas import PromptTask, Score
from services.streams import Delivery

TOK = tiny_tokenizer()


def session(max_calls: int = 8, max_context: int = 4096) -> Session:
    return Session("s1", b"", "t1", ChatRenderer(TOK), Limits(max_calls, max_context), 0.0)


def chat(messages: list[dict[str, Any]], **kw: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "policy", "messages": messages, **kw})


def completion(text: str, finish: str = "stop") -> Completion:
    ids = list(TOK(text, add_special_tokens=False).input_ids)
    return Completion(ids, text, [-0.5] * len(ids), finish)  # type: ignore[arg-type]


def plan(s: Session, req: ChatRequest, max_tokens: int = 16, key: str = "k") -> Plan:
    """A call begun and planned, as the gateway does: the session taken (begin_call), then the prompt rendered."""
    s.begin_call(key, req.temperature, req.top_p)
    try:
        return s.plan_chat(req, max_tokens)
    except CallRefused:
        s.call_failed(key, 0.0)
        raise


def keep(s: Session, p: Plan, choices: list[Choice], key: str = "k") -> None:
    s.answered(key, p, choices, (1.0, 1.0), 1.0)


def answer(s: Session, req: ChatRequest, texts: list[str], version: int = 0) -> list[dict[str, Any]]:
    p = plan(s, req)
    choices = [Choice(c, version, assistant_message(c, False, "c")[0]) for c in map(completion, texts)]
    s.answered("k", p, choices, (req.temperature, req.top_p), 1.0)
    return [c.message or {} for c in choices]


def test_a_call_that_extends_the_last_continues_its_tokens() -> None:
    s = session()
    first = [{"role": "user", "content": "2+3?"}]
    req = chat(first)
    p1 = plan(s, req)
    assert p1.new and p1.prompt == list(
        TOK(
            TOK.apply_chat_template(first, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).input_ids
    )
    c = completion("five")
    keep(s, p1, [Choice(c, 0, assistant_message(c, False, "c")[0])])
    second = [*first, {"role": "assistant", "content": "five"}, {"role": "user", "content": "Sure?"}]
    p2 = plan(s, chat(second))
    rest = Renderer(TOK).continuation(c.token_ids, "stop", [ChatMessage(role="user", content="Sure?")])
    assert not p2.new and p2.prompt == p1.prompt + c.token_ids + rest
    c2 = completion("yes")
    keep(s, p2, [Choice(c2, 1, None)])
    ep = s.end(0, 1.0)
    assert ep.opening == p1.prompt and ep.ids == c.token_ids + rest + c2.token_ids
    assert [(t.role, t.tokens) for t in ep.turns] == [("model", 4), ("env", len(rest)), ("model", 3)]
    sample = ep.sample("")
    assert sample.loss_mask() == [1] * 4 + [0] * len(rest) + [1] * 3
    assert sample.token_versions() == [0] * (4 + len(rest)) + [1] * 3
    assert sample.episode is not None and sample.episode.model_turns == 2 and sample.episode.env == "gateway"


def test_the_choice_sent_back_is_the_one_continued() -> None:
    s = session()
    first = [{"role": "user", "content": "pick"}]
    answer(s, chat(first, n=2), ["left", "right"])
    back = [*first, {"role": "assistant", "content": " right "}, {"role": "user", "content": "ok"}]
    p = plan(s, chat(back), 8)
    assert not p.new and p.model is not None and p.model.c.text == "right"


def test_a_rewritten_history_starts_a_new_segment_and_says_why() -> None:
    s = session()
    first = [{"role": "user", "content": "long question"}]
    answer(s, chat(first), ["long answer"])
    edited = [{"role": "user", "content": "summary"}, {"role": "assistant", "content": "long answer"},
              {"role": "user", "content": "next"}]  # fmt: skip
    p = plan(s, chat(edited), 8)
    assert p.new and p.segment.reason.startswith("history rewritten")
    wrong_answer = [*first, {"role": "assistant", "content": "not what it said"}, {"role": "user", "content": "x"}]
    # the plan above was not answered: the session is still calling
    with pytest.raises(CallRefused, match="in flight") as e:
        plan(s, chat(wrong_answer), 8, key="k2")
    assert e.value.conflict and s.state == "calling"
    s.call_failed("another call's key", 2.0)  # not the call in flight: nothing changes
    assert s.state == "calling"
    s.call_failed("k", 2.0)
    assert s.state == "idle" and plan(s, chat(wrong_answer), 8).new


def test_refusals_temperature_calls_context() -> None:
    s = session(max_calls=2, max_context=64)
    with pytest.raises(CallRefused, match="context"):
        plan(s, chat([{"role": "user", "content": "x" * 80}]), 4)
    assert s.state == "idle"  # refused: free for the next call
    first = [{"role": "user", "content": "hi"}]
    answer(s, chat(first, temperature=0.7), ["yo"])
    with pytest.raises(CallRefused, match="one temperature"):
        plan(s, chat(first, temperature=1.0), 4)
    answer(s, chat(first, temperature=0.7), ["yo"])
    with pytest.raises(CallRefused, match="2 calls"):
        plan(s, chat(first, temperature=0.7), 4)
    with pytest.raises(CallRefused, match="choice 3"):
        s.end(3, 1.0)
    s.end(0, 1.0)
    with pytest.raises(CallRefused, match="over: ended") as e:
        s.end(0, 1.0)
    assert e.value.over
    with pytest.raises(CallRefused, match="no call"):
        session().end(0, 0.0)


def test_completions_continue_by_text_or_ids() -> None:
    s = session()

    def encode(text: str, special: bool) -> list[int]:
        return list(TOK(text, add_special_tokens=special).input_ids)

    p1 = s.plan_completion(CompletionRequest(model="policy", prompt="Q: 1+1\nA:"), 8, encode)
    c = completion(" 2")
    s.begin_call("k", 1.0, 1.0)
    keep(s, p1, [Choice(c, 0)])
    p2 = s.plan_completion(CompletionRequest(model="policy", prompt="Q: 1+1\nA: 2\nQ: 2+2\nA:"), 8, encode)
    assert not p2.new and p2.prompt == p1.prompt + c.token_ids + encode("\nQ: 2+2\nA:", False)
    ids = p1.prompt + c.token_ids + [65, 66]
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
    keep(s, plan(s, chat(first), 8), [Choice(c, 0, msg)])
    back = {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "call_x_0", "type": "function", "function": {"name": "add", "arguments": '{ "a": 2 }'}}]}  # fmt: skip
    nxt = plan(s, chat([*first, back, {"role": "tool", "tool_call_id": "call_x_0", "content": "2"}]), 8)
    assert not nxt.new


def test_a_group_of_sessions_shares_its_longest_common_prompt() -> None:
    s = RolloutSettings(model_dir="/nonexistent", replica_id="r")  # type: ignore[arg-type]
    gw = Gateway(s, TOK, GatewayMetrics(CollectorRegistry()))
    task = PromptTask(task_id="t1", prompt_id="p", prompt="q", ground_truth="1", verifier="dapo_math",
                      data_source="d", n_samples=3)  # fmt: skip
    g = gw.groups["t1"] = TaskGroup(task, Delivery("1-0", task, 1), 3)
    for i, system in enumerate(["Be brief.", "Be kind.", "Be brief."]):
        sess = gw._take(g).session
        answer(sess, chat([{"role": "system", "content": system}, {"role": "user", "content": "q"}]), [f"a{i}"])
        if i < 2:
            gw.end(sess, 0, Score(reward=float(i), acc=i > 0))
        else:
            gw.abandon(sess, "idle")
    g.closed = True  # no new client for the seat given back
    openings = [sess.segments[0].episode.opening for sess in g.sessions[:2]]
    answers = [sess.segments[0].last.choices[0].c.token_ids for sess in g.sessions[:2]]  # type: ignore[union-attr]
    consumer = _Consumer([])
    assert gw.publish(consumer) == 1  # type: ignore[arg-type]
    ((acked, [(_, group)]),) = consumer.published
    assert acked == ["1-0"] and group.task.n_samples == 2 and [x.reward for x in group.scores] == [0.0, 1.0]
    n = common_prefix(openings)
    assert 0 < n < min(map(len, openings)) and group.task.prompt_token_ids.tolist() == openings[0][:n]
    for sample, opening, answer_ids in zip(group.samples, openings, answers, strict=True):
        assert sample.response_token_ids.tolist() == opening[n:] + answer_ids
        assert sample.loss_mask() == [0] * (len(opening) - n) + [1] * len(answer_ids)
    # the sessions are retired with their group: their keys still say how they ended, their tokens are gone
    assert all(sess.segments == [] and sess.episode is None for sess in g.sessions)
    assert g.sessions[2].segment_rows()[0]["reason"] == "start" and g.sessions[2].state == "abandoned"


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
        plan(s, chat([{"role": "user", "content": "x"}]), 4)
    assert s.state == "idle"
    # a template that renders the last turn differently once more follow (as Qwen3's drops an empty <think>)
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}<last>{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    s = Session("s", b"", "t", ChatRenderer(tok), Limits(8, 4096), 0.0)
    first = [{"role": "user", "content": "x"}]
    answer(s, chat(first), ["y"])
    p = plan(s, chat([*first, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]), 4)
    assert p.new and p.segment.reason.startswith("the chat template cannot continue")


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
        self.published: list[Any] = []

    def read(self, count: int = 1, block_ms: int = 0) -> list[Any]:
        out, self.deliveries = self.deliveries[:count], self.deliveries[count:]
        return out

    def keep_alive(self) -> None: ...

    def release(self, *ids: str) -> None:
        self.released += ids

    def dead_letter(self, ds: list[Any], kind: str, why: str) -> None:
        self.dead += [(d.entry_id, kind) for d in ds]

    def ack_and_publish(self, ids: Any, outs: Any) -> None:
        self.published.append((list(ids), list(outs)))


class _Engine:
    version = 0

    def in_flight(self) -> int:
        return 0

    def cancel(self, key: str) -> bool:
        return False


def test_untaken_seats_and_duplicate_deliveries_are_not_held_forever() -> None:
    import asyncio

    from rollout.gateway.core import Waiter

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


# ---------------------------------------------------------------------------------------------------------------
# every end of a session is a named state, with one consequence each (the doors issue, 2026-12-06)


def gateway(**kw: Any) -> Gateway:
    s = RolloutSettings(model_dir="/nonexistent", replica_id="r", **kw)  # type: ignore[arg-type]
    return Gateway(s, TOK, GatewayMetrics(CollectorRegistry()))


def dispatched(gw: Gateway, verifier: str = "dapo_math", n: int = 2, task_id: str = "t1") -> TaskGroup:
    truth = '{"seed": 3}' if verifier.startswith("env:") else "1"
    task = PromptTask(task_id=task_id, prompt_id="p", prompt="q", ground_truth=truth, verifier=verifier,
                      data_source="d", n_samples=n)  # fmt: skip
    g = gw.groups[task_id] = TaskGroup(task, Delivery(f"{task_id}-0", task, 1), n)
    return g


def test_a_session_over_frees_its_seat_and_says_how_it_ended() -> None:
    gw = gateway(gateway_idle_s=5)
    g = dispatched(gw)
    seat = gw._take(g)
    s = seat.session
    assert s.state == "idle" and g.seats == 1 and gw.m.open._value.get() == 1
    s.last_seen -= 10  # idle past --gateway-idle-s
    gw._next_expiry = 0.0
    gw._expire(_Consumer([]))  # type: ignore[arg-type]
    assert s.state == "abandoned" and s.why.startswith("idle for") and g.seats == 2  # the seat is free again
    assert gw.m.open._value.get() == 0
    assert gw.authenticate(seat.key) == (None, f"session {s.sid} is over: abandoned ({s.why})")
    with pytest.raises(CallRefused, match="over: abandoned") as e:
        s.begin_call("k", 1.0, 1.0)
    assert e.value.over
    # an ended session keeps its seat (the group is one sample nearer)
    other = gw._take(g).session
    answer(other, chat([{"role": "user", "content": "q"}]), ["1"])
    gw.end(other, 0, Score(reward=1.0, acc=True))
    assert other.state == "ended" and g.seats == 1


def test_an_environment_that_fails_sessions_gives_up_their_task() -> None:
    gw = gateway(episode_retries=1)
    g = dispatched(gw, "env:calculator", n=2)
    a, b = gw._take(g).session, gw._take(g).session
    assert a.state == "opening" and g.seats == 0
    # an outage: the seat back, nothing counted
    gw.env_failed(a, EnvFailure("outage", "no answer"), "at its opening")
    assert a.state == "abandoned" and g.seats == 1 and g.failures == 0
    # the environment's failures: counted; past --episode-retries the task is given up, its sessions failed
    c = gw._take(g).session
    gw.env_failed(c, EnvFailure("failed", "not JSON"), "at its opening")
    assert c.state == "failed" and g.failures == 1 and g.failed is None and g.seats == 1
    assert gw.opened(gw._take(g), "http://env", [])  # another client takes the seat; it opens
    gw.env_failed(b, EnvFailure("failed", "a 500"), "at its opening")
    assert g.failed is not None and g.closed and all(s.over for s in g.sessions)
    assert [s.state for s in g.sessions] == ["abandoned", "failed", "failed", "failed"]
    consumer = _Consumer([])
    gw.publish(consumer)  # type: ignore[arg-type]
    assert consumer.dead == [("t1-0", "env_failed")] and "t1" not in gw.groups


def test_a_reward_is_not_taken_while_the_scorer_scores() -> None:
    """The scorer's verdict ends a session being scored; the client's reward only an idle one (409 meanwhile)."""
    s = session()
    answer(s, chat([{"role": "user", "content": "2+2"}]), ["4"])
    s.begin_scoring(0)
    with pytest.raises(CallRefused, match="being scored") as e:
        s.end(0, 1.0)  # a reward while the scorer scores
    assert e.value.conflict
    s.end(0, -1.0, scored=True)
    assert s.state == "ended" and s.reward == -1.0
    idle = session()
    answer(idle, chat([{"role": "user", "content": "2+2"}]), ["4"])
    with pytest.raises(CallRefused):
        idle.end(0, 1.0, scored=True)  # a verdict for a session nobody asked to score


def test_the_client_gives_a_reward_only_where_the_trust_model_lets_it() -> None:
    gw = gateway()
    math = gw._take(dispatched(gw, "dapo_math", task_id="m")).session
    env = gw._take(dispatched(gw, "env:calculator", task_id="e")).session
    client = gw._take(dispatched(gw, "client", task_id="c")).session
    own = gw._take(gw._own_group(OwnTask(task_id="mine", prompt="p", group_size=2))).session
    assert "scored by dapo_math, not by the client" in (gw.may_set_reward(math) or "")
    assert "scored by its environment (env:calculator)" in (gw.may_set_reward(env) or "")
    assert gw.may_set_reward(client) is None and gw.may_set_reward(own) is None


def test_an_own_task_id_used_again_makes_a_new_group() -> None:
    gw = gateway()
    own = OwnTask(task_id="mine", prompt="p", group_size=2)
    first = gw._own_group(own)
    assert gw._own_group(own) is first  # its second session joins the same group
    del gw.groups[first.key]  # published
    again = gw._own_group(own)
    assert again.task.task_id != first.task.task_id and again.task.prompt_id == first.task.prompt_id == "mine"
    with pytest.raises(Conflict, match="another prompt"):
        gw._own_group(OwnTask(task_id="mine", prompt="other", group_size=2))


def test_tools_changed_mid_session_start_a_new_segment() -> None:
    s = session()
    add = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    sub = [{"type": "function", "function": {"name": "sub", "parameters": {"type": "object"}}}]
    first = [{"role": "user", "content": "2+3"}]
    answer(s, chat(first, tools=add), ["five"])
    more = [*first, {"role": "assistant", "content": "five"}, {"role": "user", "content": "and 4-1?"}]
    p = plan(s, chat(more, tools=sub))
    assert p.new and p.segment.reason.startswith("tools changed") and "- sub()" in TOK.decode(p.prompt)
    s.call_failed("k", 1.0)
    assert not plan(s, chat(more, tools=add)).new  # the same tools: continued


def test_an_environments_own_tools_are_not_taught_twice() -> None:
    calc = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    other = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    taught = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": calc})
    s = Session("s", b"", "t", ChatRenderer(TOK), Limits(8, 4096), 0.0, taught=taught.tools)
    text = TOK.decode(plan(s, chat([{"role": "user", "content": "x"}], tools=calc)).prompt)
    assert "You can call tools" not in text  # the environment's opening teaches its tools itself
    s.call_failed("k", 0.0)
    text = TOK.decode(plan(s, chat([{"role": "user", "content": "x"}], tools=calc + other)).prompt)
    assert "- search()" in text and "- calculator(" not in text


class Spied:
    """The tokenizer (not under test), telling `seen` of each text it tokenises."""

    def __init__(self, tok: Any, seen: Any):
        self.tok, self.seen = tok, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __len__(self) -> int:
        return len(self.tok)

    def __call__(self, text: str, *a: Any, **kw: Any) -> Any:
        self.seen(text)
        return self.tok(text, *a, **kw)


def test_the_size_is_checked_before_anything_is_tokenised() -> None:
    from rollout.gateway import calls
    from rollout.gateway.auth import ApiError

    tokenised: list[int] = []
    s = RolloutSettings(model_dir="/nonexistent", replica_id="r", gateway_max_context=200)  # type: ignore[arg-type]
    gw = Gateway(s, Spied(TOK, lambda text: tokenised.append(len(text))), GatewayMetrics(CollectorRegistry()))
    assert gw.render.max_token_chars >= 1
    long = chat([{"role": "user", "content": "x" * (gw.render.max_token_chars * 200 + 1)}])
    for session in (None, gw._take(dispatched(gw)).session):  # uncaptured, and a session's call
        with pytest.raises(ApiError, match="cannot fit the 184 tokens") as e:
            calls.render(gw, session, long, 16)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert tokenised == []  # refused before the tokenizer saw any of it
    _, prompt = calls.render(gw, None, chat([{"role": "user", "content": "x" * 20}]), 16)  # one that may fit
    assert prompt and tokenised


def test_rendering_takes_neither_the_gateways_lock_nor_the_event_loop() -> None:
    import asyncio

    from rollout.gateway import calls
    from rollout.gateway.auth import Caller

    seen: list[tuple[bool, bool]] = []

    def watch(_: str) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((on_loop, gw.lock.locked()))

    s = RolloutSettings(model_dir="/nonexistent", replica_id="r")  # type: ignore[arg-type]
    gw = Gateway(s, Spied(TOK, watch), GatewayMetrics(CollectorRegistry()))
    sess = gw._take(dispatched(gw)).session
    req = chat([{"role": "user", "content": "long " * 200}])

    async def call() -> Any:
        return await calls.enter(gw, Caller("session", sess), req, 8)

    p = asyncio.run(call())
    assert seen and all(not on_loop and not locked for on_loop, locked in seen), seen
    assert sess.state == "calling" and sess.call_key == p.key and list(gw.inbox) == [p]


def test_a_leaving_replica_ends_every_session_and_answers_every_waiter() -> None:
    import asyncio

    from rollout.gateway.core import Leaving, Waiter

    gw = gateway()
    g = dispatched(gw)
    s1 = gw._take(g).session

    async def run() -> Any:
        w = Waiter()
        gw.seat_waiters.append(w)
        gw.close()
        return await asyncio.wait_for(w.future, 1)

    assert isinstance(asyncio.run(run()), Leaving)
    assert s1.state == "abandoned" and "replica left" in s1.why and g.seats == 1  # no seat handed out any more
    with pytest.raises(Leaving):
        gw.seat(None, None)  # type: ignore[arg-type]
