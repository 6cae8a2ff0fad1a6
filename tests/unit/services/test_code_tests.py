"""A coding task's tests as its dataset row gives them: each layout read, a malformed one refused with what is wrong,
and a dataset holding one refused when it is loaded, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.code_tests import parse_tests
from services.datasets import file_source


def test_each_layout_is_read() -> None:
    assert parse_tests('{"inputs": ["1\\n"], "outputs": ["2\\n"]}').kind == "stdio"
    call = parse_tests({"inputs": ["1\n[2, 3]"], "outputs": ["[5]"], "fn_name": "f"})  # JSON lines, as verl's
    assert (call.kind, call.inputs, call.outputs) == ("call", [[1, [2, 3]]], [[5]])
    call = parse_tests({"inputs": [[1, "x"]], "outputs": ["x1"], "fn_name": "f"})  # argument lists, as APPS's
    assert (call.inputs, call.outputs) == ([[1, "x"]], ["x1"])  # a string return value stays a string
    mbpp = parse_tests({"asserts": ["assert f(1) == 2"], "setup": "import math", "difficulty": 3})
    assert (mbpp.kind, mbpp.count) == ("assert", 1)
    he = parse_tests({"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"})
    assert he.kind == "assert" and he.asserts is not None and he.asserts[0].endswith("check(f)")


@pytest.mark.parametrize(
    ("truth", "says"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not an object"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs and 0 outputs"),
        ({"inputs": [], "outputs": []}, "at least 1"),
        ({"inputs": [1], "outputs": [2]}, "strings"),
        ({"inputs": [{"a": 1}], "outputs": [2], "fn_name": "f"}, "list of the function's arguments"),
        ({"inputs": ["{"], "outputs": ["1"], "fn_name": "f"}, "JSON lines"),
        ({"inputs": [[1]], "outputs": [1], "fn_name": "no such name"}, "fn_name"),
        ({"asserts": []}, "empty"),
        ({"asserts": ["assert 1"], "inputs": ["1"]}, "not both"),
        ({"test": "def check(c): pass"}, "entry_point"),
        ({"outputs": ["1"]}, "give inputs and outputs"),
        ({"inputs": ["1"] * 300, "outputs": ["1"] * 300}, "at most 256"),
    ],
)
def test_malformed_tests_are_refused_with_what_is_wrong(truth: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_tests(truth if isinstance(truth, str) else json.dumps(truth))


def test_a_dataset_with_a_malformed_code_row_is_refused_when_loaded(tmp_path: Path) -> None:
    good = {"prompt": "add", "reward_model": {"ground_truth": {"asserts": ["assert add(1, 2) == 3"]}}}
    bad = {"prompt": "sub", "reward_model": {"ground_truth": json.dumps({"inputs": ["1"], "outputs": []})}}
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"code.jsonl row 1: the tests: .*1 inputs and 0 outputs"):
        file_source(path, eval_size=0, seed=0, template="none", verifier="code")
    path.write_text(json.dumps(good) + "\n")
    (item,) = file_source(path, eval_size=0, seed=0, template="none", verifier="code").train
    assert parse_tests(item.ground_truth).asserts == ["assert add(1, 2) == 3"]  # a JSON object kept as JSON
