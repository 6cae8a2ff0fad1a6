"""The test cases of a coding task, as a dataset row's ground truth carries them (verifier `code`). A contract of the
ground: the buffer checks every row when it loads a dataset, the reward server runs them.

The layouts the code datasets ship in (a JSON object, or a JSON string of one):

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}
        stdin/stdout: APPS, CodeContests, TACO, DeepCoder (verl's prime_code layout)
    {"inputs": [[1, 2], ...], "outputs": [3, ...], "fn_name": "add"}
        a function called with each input's arguments: APPS/TACO call-based, LiveCodeBench functional (a method
        of `class Solution` too); an input may also be a string of JSON lines, one argument a line, with its
        output a JSON string (LiveCodeBench's and verl's prime_code's form of the same)
    {"asserts": ["assert add(1, 2) == 3", ...], "setup": "import math"}
        assertions, one test each: MBPP's test_list and test_setup_code
    {"test": "def check(candidate): ...", "entry_point": "add"}
        HumanEval: one test, check(add)
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_TESTS = 256  # the sandbox's default --max-batch: one run per test


class CodeTests(BaseModel):
    """One task's tests, in one of the layouts above; `kind` says which."""

    model_config = ConfigDict(extra="ignore")  # datasets carry more (difficulty, source, ...): not ours to refuse
    inputs: list[Any] | None = None
    outputs: list[Any] | None = None
    fn_name: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    asserts: list[str] | None = None
    setup: str = ""
    test: str | None = None
    entry_point: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @property
    def kind(self) -> Literal["stdio", "call", "assert"]:
        if self.asserts is not None or self.test is not None:
            return "assert"
        return "call" if self.fn_name else "stdio"

    @model_validator(mode="after")
    def _one_layout(self) -> CodeTests:
        if self.test is not None:
            if not self.entry_point:
                raise ValueError("a HumanEval test needs its entry_point")
            self.asserts = [f"{self.test}\ncheck({self.entry_point})"]
        if self.asserts is not None:
            if self.inputs is not None:
                raise ValueError("give inputs/outputs or asserts, not both")
            if not self.asserts:
                raise ValueError("asserts is empty")
            n = len(self.asserts)
        else:
            if self.inputs is None or self.outputs is None:
                raise ValueError("give inputs and outputs (stdin/stdout or fn_name), asserts, or test and entry_point")
            if len(self.inputs) != len(self.outputs) or not self.inputs:
                raise ValueError(f"{len(self.inputs)} inputs and {len(self.outputs)} outputs: give as many, at least 1")
            if not self.fn_name and not all(isinstance(x, str) for x in self.inputs + self.outputs):
                raise ValueError("stdin/stdout tests are strings (give fn_name for a function's arguments)")
            if self.fn_name:
                self._decode_call_cases()
            n = len(self.inputs)
        if n > MAX_TESTS:
            raise ValueError(f"{n} tests; at most {MAX_TESTS} per task")
        return self

    def _decode_call_cases(self) -> None:
        """A function's cases as lists of arguments and return values. LiveCodeBench and verl's prime_code give each
        input as a string of JSON lines (one argument a line) and each output as a JSON string: decoded here."""
        assert self.inputs is not None and self.outputs is not None
        if all(isinstance(x, str) for x in self.inputs):
            try:
                self.inputs = [[json.loads(line) for line in x.split("\n") if line.strip()] for x in self.inputs]
                self.outputs = [json.loads(y) if isinstance(y, str) else y for y in self.outputs]
            except json.JSONDecodeError as e:
                raise ValueError(f"a fn_name case given as text is not JSON lines: {e}") from None
        elif not all(isinstance(x, list) for x in self.inputs):
            raise ValueError("each input of a fn_name test is the list of the function's arguments (or JSON lines)")

    @property
    def count(self) -> int:
        return len(self.asserts) if self.asserts is not None else len(self.inputs or [])


def parse_tests(ground_truth: str | dict[str, Any]) -> CodeTests:
    """A row's tests, or ValueError saying what is wrong with them."""
    try:
        raw = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    except json.JSONDecodeError as e:
        raise ValueError(f"the tests are not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"the tests are a JSON {type(raw).__name__}, not an object")
    try:
        return CodeTests.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"the tests: {where + ': ' if where else ''}{first['msg']}") from None
