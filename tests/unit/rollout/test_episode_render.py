"""Rendering an episode's environment turns token-exactly (rollout/episodes.py), on the tiny byte-level tokenizer:
the continuation is what the chat template adds after a model turn, and a template that renders an earlier turn
differently once more follow is refused up front (the replica dead-letters its environment tasks with the reason)."""

from __future__ import annotations

from learner.tiny import tiny_tokenizer
from rollout.episodes import Renderer
from services.episodes import ChatMessage

FEEDBACK = [ChatMessage(role="user", content="No. Try again.")]


def test_the_continuation_closes_the_model_turn_and_opens_the_next() -> None:
    tok = tiny_tokenizer()
    r = Renderer(tok)
    assert r.problem() is None
    opening = r.opening([ChatMessage(role="user", content="Hi")])
    assert tok.decode(opening) == "<user>Hi\n<assistant>"
    model = list(tok("Answer: 3", add_special_tokens=False).input_ids)
    cont = r.continuation(model, "length", FEEDBACK)
    assert tok.decode(cont) == "\n<user>No. Try again.\n<assistant>"
    whole = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Answer: 3"},
         {"role": "user", "content": "No. Try again."}], add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert opening + model + cont == list(tok(whole, add_special_tokens=False).input_ids)  # token-exact


def test_a_model_turn_that_ended_on_the_closing_gets_only_the_rest_of_it() -> None:
    tok = tiny_tokenizer()
    r = Renderer(tok)
    newline = list(tok("\n", add_special_tokens=False).input_ids)
    model = list(tok("Answer: 3", add_special_tokens=False).input_ids) + newline
    assert tok.decode(r.continuation(model, "stop", FEEDBACK)) == "<user>No. Try again.\n<assistant>"
    assert tok.decode(r.continuation(model, "length", FEEDBACK)).startswith("\n<user>")  # cut: all of it


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = (  # as Qwen3 drops an earlier assistant turn's reasoning once another turn follows
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<assistant>[earlier]\n"
        "{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert "cannot be continued token-exactly" in (Renderer(tok).problem() or "")


NATIVE = (  # a chat template that renders tools itself (as Qwen's, Llama 3's, Hermes')
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_an_environments_tools_are_rendered_on_the_replicas_episodes_as_in_the_gateway() -> None:
    """The replica renders an environment's opening with its tools when the template renders tools (it ignored
    them), the same prompt a gateway client gets when it passes the opening's tools."""
    from prometheus_client import CollectorRegistry

    from rollout.engines.base import SamplingParams
    from rollout.env_client import Opening
    from rollout.episode_runner import EpisodeRunner, _Group, _Live
    from rollout.gateway.schemas import ChatRequest
    from rollout.gateway.sessions import ChatRenderer
    from rollout.metrics import RolloutMetrics
    from rollout.settings import RolloutSettings
    from services.episodes import ResetResponse
    from services.schemas import PromptTask
    from services.streams import Delivery

    tok = tiny_tokenizer()
    tok.chat_template = NATIVE
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    opening = ResetResponse(episode_id="e", env="calc", task_id="t", max_turns=2, tools=[tool],
                            messages=[{"role": "user", "content": "2*3?"}])  # fmt: skip
    runner = EpisodeRunner(RolloutSettings(model_dir="/nonexistent"), tok, RolloutMetrics(CollectorRegistry()))  # type: ignore[call-arg]
    task = PromptTask(task_id="t", prompt_id="p", prompt="x", ground_truth='{"seed": 1}', verifier="env:calc",
                      data_source="d", n_samples=1)  # fmt: skip
    lv = _Live(_Group(Delivery("1-0", task, 1), "calc", {}, SamplingParams(temperature=0.5), [None]), 0)
    runner._collected(lv, Opening("http://env", opening), 0.0)
    assert lv.ep is not None and tok.decode(lv.ep.opening) == "<tools>calculator;</tools>\n<user>2*3?\n<assistant>"
    assert lv.ep.task_key == "t" and lv.ep.temperature == 0.5
    req = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "2*3?"}], "tools": [tool]})
    assert ChatRenderer(tok).full(req.messages, req.tools, taught=req.tools) == lv.ep.opening
    runner.env.shutdown(set(), [])
