"""The parts of the environment service that need no HTTP: reading tool calls from a model's text, the
calculator's evaluator, reading a final answer, and the shared step of an environment (tools, answer, cut)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from env_server.builtins.arith import evaluate, final_number
from env_server.builtins.calculator import Calculator
from env_server.builtins.retry import Retry
from services.episodes import CalledFunction, ChatMessage, ToolCall
from services.tool_calls import instructions, parse_calls, parse_tag_calls, render_call


def test_parse_calls_reads_every_call_and_says_why_one_is_unreadable() -> None:
    text = ("first " + render_call("calculator", {"expression": "1+2"}) + " then "
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            "<tool_call>{nope}</tool_call><tool_call>[1]</tool_call>"
            '<tool_call>{"name": "x", "arguments": 5}</tool_call><tool_call>{"name": "y"')  # fmt: skip
    parsed = parse_calls(text, prefix="call_3")
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("call_3_0", "calculator", {"expression": "1+2"}),
        ("call_3_1", "calculator", {"expression": "3"}),  # arguments given as a JSON string, as OpenAI's API does
    ]
    assert len(parsed.malformed) == 4
    assert parsed.malformed[0].startswith("not JSON") and "not an object" in parsed.malformed[1]
    assert '"arguments" of' in parsed.malformed[2] and "never closed" in parsed.malformed[3]
    assert not parse_calls("Answer: 5, no tools here").any


def test_instructions_name_each_tool_and_the_format() -> None:
    text = instructions([t.spec for t in Calculator().tools()])
    assert "<tool_call>" in text and "- calculator(expression: string): Evaluates" in text


EXACT = [("417 * 38 + 123", "15969"), ("2 ^ 10", "1024"), ("7 / 2", "3.5"), ("(1 + 2) * -3", "-9"),
         ("10 // 3 + 10 % 3", "4"), ("1/3", "0.3333333333")]  # fmt: skip


@pytest.mark.parametrize(("expr", "value"), EXACT)
def test_evaluate_is_exact_arithmetic(expr: str, value: str) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize(("expr", "why"), [("__import__('os')", "Call is not allowed"), ("x + 1", "Name"),
                                           ("2 ** 1000", "exponents"), ("1 / 0", "division by zero"),
                                           ("9" * 40 + " * " + "9" * 40, "digits"), ("1 +", "not an arithmetic"),
                                           ("True + 1", "Constant"), ("1" * 201, "longer than")])  # fmt: skip
def test_evaluate_refuses_everything_else(expr: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        evaluate(expr)


def test_final_number_prefers_the_answer_line() -> None:
    assert final_number("3 + 4 is 7. Answer: 1,234") == Fraction(1234)
    assert final_number("it is 12 or maybe -3.5") == Fraction(-7, 2)
    assert final_number("no idea") is None


def test_step_runs_tools_judges_answers_and_cuts_at_max_turns() -> None:
    env = Calculator()
    _, state = env.start(env.check({"expression": "12 * 11 - 2"}))
    call = ToolCall(id="c9", function=CalledFunction(name="calculator", arguments='{"expression": "12*11-2"}'))
    given = ChatMessage(role="assistant", content="", tool_calls=[call])
    out = env.step(state, given, 1)  # calls given as tool_calls (a client that parsed them) are used as they are
    assert out.messages[0].content == "130" and out.messages[0].tool_call_id == "c9" and out.tools.valid == 1
    assert env.step(state, ChatMessage(role="assistant", content="Answer: 130"), 2).reward == 1.0
    cut = env.step(state, ChatMessage(role="assistant", content="<calculator>1</calculator>"), 4)
    assert cut.done and cut.truncated and cut.reward == env.failure_reward


def test_drawn_tasks_are_stable_per_seed_and_answerable() -> None:
    for env in (Calculator(), Retry()):
        assert env.draw(5) == env.draw(5) != env.draw(6)
        assert env.check(env.draw(5)) == env.draw(5)
        assert evaluate(env.draw(5)["expression"])


def test_parse_tag_calls_reads_tools_of_one_argument() -> None:
    parsed = parse_tag_calls("a <calculator> 2 * 3 </calculator> <b>bold</b> <calculator>4 +", {"calculator": "x"})
    assert [json.loads(c.function.arguments) for c in parsed.calls] == [{"x": "2 * 3"}]
    assert parsed.malformed == ["a <calculator> is never closed with </calculator>"]
    assert not parse_tag_calls("<b>only text</b>", {"calculator": "x"}).any


def test_held_out_tasks_are_never_drawn_for_training() -> None:
    """The built-in environments have few distinct questions: an evaluation (split "eval") draws only from a third
    of them that training never draws ("a + b" and "b + a" being one question), both from any seed."""
    from env_server.builtins.arith import split_of
    from services.datasets import env_source

    src = env_source("retry", size=400, seed=1, eval_size=64)
    truths = [json.loads(it.ground_truth) for it in src.eval]
    assert all(t["split"] == "eval" for t in truths) and "split" not in json.loads(src.train[0].ground_truth)
    for env in (Calculator(), Retry()):
        train = {env.draw_for(json.loads(it.ground_truth)["seed"], "train")["expression"] for it in src.train}
        held = {env.draw_for(t["seed"], "eval")["expression"] for t in truths}
        assert len(held) > 20 and len(train) > 3 * 20
        assert {split_of(e) for e in train} == {"train"} and {split_of(e) for e in held} == {"eval"}
    assert split_of("7 + 8") == split_of("8 + 7") and split_of("7 * 8") == split_of("8 * 7")
    assert Retry().draw_for(5, "train") == Retry().draw_for(5, "train")  # the same seed, the same task


def test_an_environment_without_splits_serves_any_task_to_both() -> None:
    class Any_(Retry):
        def split(self, task):  # type: ignore[no-untyped-def]
            return None

    assert Any_().draw_for(7, "eval") == Any_().draw(7) == Any_().draw_for(7, "train")

    class Never(Retry):
        def split(self, task):  # type: ignore[no-untyped-def]
            return "train"

    with pytest.raises(ValueError, match="no eval task"):
        Never().draw_for(7, "eval")
