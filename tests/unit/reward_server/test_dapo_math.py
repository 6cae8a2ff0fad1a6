"""The DAPO rule reward: golden cases, and parity with the authors' reference in verl 0.9.1."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_server.verifiers.dapo_math import dapo_math, normalize
from tests.unit.reward_server.dapo_math_cases import CASES

REF_WHEEL = Path(sys.prefix) / "ref" / "verl-0.9.1-py3-none-any.whl"  # fetched by `make setup`


def test_at_least_150_cases() -> None:
    assert len(CASES) >= 150
    assert len({(r, g) for r, g, _, _ in CASES}) == len(CASES), "duplicate case"


@pytest.mark.parametrize(("response", "gt", "acc", "pred"), CASES)
def test_golden_case(response: str, gt: str, acc: bool, pred: str) -> None:
    v = dapo_math(response, gt)
    assert (v.acc, v.pred) == (acc, pred)
    assert v.score == (1.0 if acc else -1.0)


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    if not REF_WHEEL.exists():
        pytest.skip(f"reference wheel not at {REF_WHEEL}; `make setup` downloads it")
    with zipfile.ZipFile(REF_WHEEL) as z:
        source = z.read("verl/utils/reward_score/math_dapo.py").decode()
    spec = importlib.util.spec_from_loader("verl_math_dapo_reference", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, "verl/utils/reward_score/math_dapo.py", "exec"), module.__dict__)
    return module


def _same(reference: ModuleType, response: str, gt: str) -> None:
    ref = reference.compute_score(response, gt)
    ours = dapo_math(response, gt)
    assert (ours.score, ours.acc, ours.pred) == (ref["score"], ref["acc"], ref["pred"])


@pytest.mark.parametrize(("response", "gt"), [(r, g) for r, g, _, _ in CASES])
def test_parity_on_golden_cases(reference: ModuleType, response: str, gt: str) -> None:
    _same(reference, response, gt)


PIECES = [
    "Answer:", "answer :", "ANSWER:", "\n", " ", "=", "$", "\\$", "\\boxed{", "{", "}", "\\frac", "\\sqrt",
    "12", "1,000", "3", "x", "a ", "an ", "dollars", "\\text{", "\\textbf{", "\\overline{", "^\\circ",
    "{,}", ".", ",", "\\;", "cm", "[INVALID]", "\\dfrac", "-", "\\pi", "ab",
]  # fmt: skip
text = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@settings(max_examples=3000, deadline=None)
@given(response=text, gt=text)
def test_parity_on_random_inputs(reference: ModuleType, response: str, gt: str) -> None:
    _same(reference, response, gt)


@settings(max_examples=500, deadline=None)
@given(response=st.text(max_size=400), gt=st.text(max_size=20))
def test_parity_on_arbitrary_unicode(reference: ModuleType, response: str, gt: str) -> None:
    _same(reference, response, gt)


@settings(max_examples=1000, deadline=None)
@given(answer=text)
def test_normalize_parity(reference: ModuleType, answer: str) -> None:
    assert normalize(answer) == reference.normalize_final_answer(answer)


EDGES = ["$", "\n", "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "}", "{", "a", " ", "="]


@settings(max_examples=2000, deadline=None)
@given(answer=st.lists(st.sampled_from(EDGES), max_size=30).map("".join))
def test_normalize_parity_on_the_rewrites(reference: ModuleType, answer: str) -> None:
    """Dense in what the line-by-line rewrites replace: $ spans, \\text{...}, \\boxed{...}, newlines."""
    assert normalize(answer) == reference.normalize_final_answer(answer)


def test_long_inputs_normalise_in_linear_time() -> None:
    """What makes the reference's regexes quadratic (minutes at 100k characters): a long line with one `$`, or many
    openers without a closing brace. Each finishes here well inside the suite's per-test timeout."""
    assert normalize("$" + "x" * 100_000 + "\n5") == "x" * 100_000 + "\n5"
    assert normalize("\\text{" * 20_000) == "\\text{" * 20_000
    assert normalize("\\boxed{" * 15_000 + "7") == "\\boxed{" * 15_000 + "7"
    assert dapo_math("Answer: 5", "$" + "y" * 100_000 + "$5$\n").acc is False
    assert dapo_math("Answer: y", "$y$" + "$" * 100_000).acc is True
