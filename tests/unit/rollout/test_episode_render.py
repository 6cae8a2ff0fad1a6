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
