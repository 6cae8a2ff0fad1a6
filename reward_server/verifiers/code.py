"""The code verifier: a model's program run against its task's tests in the sandbox service, one sandbox per test.

    tests = parse_tests(ground_truth)                       # services/code_tests.py: the layouts
    program = build_program(tests, response)                # what to run, and one stdin per test
    passed = judge(tests, program, results)                 # each sandbox result -> passed or not

The pure parts live here (no I/O); reward_server/code_runner.py sends the program to the sandbox. The answer's code
is taken as verl's prime_code takes it (PRIME, DeepCoder): the text after the last "```python", up to the next
"```" (the whole response when it has no fence), with the imports APPS's evaluator puts before it. Outputs are
compared as APPS's evaluator does: line by line with the whitespace at each end stripped, else token by token with
numbers equal within a relative 1e-5; a function's return value equals the expected one, or the first element of
an expected list (APPS wraps them).
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

from services.code_tests import CodeTests
from services.sandbox_api import RunResult

RESULT_MARK = "@@dapo-mesh-result@@ "  # the line a call harness prints its return value on (not the program's)

# A call or assert test passes only once the harness, after the test, prints a line with a nonce the program is
# not given: a program that exits early (sys.exit(0), os._exit(0)) at import passes nothing. The harness reads the
# nonce before the program runs and keeps it in a local only; reaching it takes frame introspection.
CALL_HARNESS = """\
import json, sys
case = json.loads(sys.stdin.read())
nonce, args = case.pop("nonce"), case.pop("args")
import solution
target = getattr(solution, {name!r}, None)
if target is None and hasattr(solution, "Solution"):
    target = getattr(solution.Solution(), {name!r})
if target is None:
    raise SystemExit("no function {name} in the answer")
out = target(*args)
if isinstance(out, tuple):
    out = list(out)
print()
print({mark!r} + nonce + " " + json.dumps(out, default=repr))
"""

ASSERT_HARNESS = """\
import json, sys
case = json.loads(sys.stdin.read())
nonce, test = case.pop("nonce"), case.pop("test")
namespace = {{"__name__": "solution"}}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
exec(compile({setup!r}, "setup", "exec"), namespace)
exec(compile(test, "test", "exec"), namespace)
print()
print({mark!r} + nonce)
"""


@dataclass(frozen=True)
class Program:
    source: str
    files: dict[str, str]
    stdins: list[str]
    nonces: list[str]  # per test (call and assert layouts): the line that says the harness ran to its end


def extract_code(response: str) -> str:
    """verl prime_code's rule: the text after the last ```python, up to the next ```."""
    return response.split("```python")[-1].split("```")[0]


# What APPS's evaluator (and verl's prime_code after it) puts before a stdin/stdout or call-based answer: a program
# that uses `sqrt` or `Counter` without importing them passes there, so it passes here.
PREAMBLE = (
    "".join(
        f"from {m} import *\n"
        for m in "string re datetime collections heapq bisect copy math random statistics itertools functools "
        "operator io sys json builtins typing".split()
    )
    + "import string, re, datetime, collections, heapq, bisect, copy, math, random, statistics, itertools\n"
    + "import functools, operator, io, sys, json\nsys.setrecursionlimit(6 * 10**5)\n"
)


def build_program(tests: CodeTests, response: str) -> Program:
    code = extract_code(response)
    if tests.kind != "assert":
        code = PREAMBLE + code
    if tests.kind == "stdio":
        return Program(code, {}, [str(x) for x in tests.inputs or []], [])
    nonces = [secrets.token_hex(16) for _ in range(tests.count)]
    if tests.kind == "call":
        harness = CALL_HARNESS.format(name=tests.fn_name, mark=RESULT_MARK)
        cases = [{"nonce": n, "args": args} for n, args in zip(nonces, tests.inputs or [], strict=True)]
    else:
        harness = ASSERT_HARNESS.format(setup=tests.setup, mark=RESULT_MARK)
        cases = [{"nonce": n, "test": t} for n, t in zip(nonces, tests.asserts or [], strict=True)]
    return Program(harness, {"solution.py": code}, [json.dumps(c) for c in cases], nonces)


def judge(tests: CodeTests, program: Program, results: list[RunResult]) -> list[bool]:
    """Whether each test passed: its run ended `ok` and gave the expected output, or (call, assert) the harness ran
    to its end."""
    if tests.kind == "stdio":
        expected = [str(x) for x in tests.outputs or []]
        return [r.verdict == "ok" and same_output(r.stdout, want) for r, want in zip(results, expected, strict=True)]
    finished = [
        _harness_line(r.stdout, nonce) if r.verdict == "ok" else None
        for r, nonce in zip(results, program.nonces, strict=True)
    ]
    if tests.kind == "assert":
        return [line is not None for line in finished]
    return [
        line is not None and same_return(_json(line), want)
        for line, want in zip(finished, tests.outputs or [], strict=True)
    ]


def same_output(got: str, want: str) -> bool:
    """APPS's comparison of a program's stdout: lines stripped at both ends (blank lines at the end ignored), else
    whitespace-separated tokens with numbers within a relative 1e-5."""
    if _lines(got) == _lines(want):
        return True
    a, b = got.split(), want.split()
    return len(a) == len(b) and all(x == y or _close(x, y) for x, y in zip(a, b, strict=True))


def same_return(got: Any, want: Any) -> bool:
    if got == want:
        return True
    if isinstance(want, list) and len(want) >= 1 and got == want[0]:  # APPS wraps a return value in a list
        return True
    return isinstance(got, float | int) and isinstance(want, float | int) and _close_numbers(got, want)


_MISSING = object()


def _harness_line(stdout: str, nonce: str) -> str | None:
    """What the harness printed after its mark and the run's nonce (the return value, or ''); None when it did not
    get there."""
    mark = RESULT_MARK + nonce
    for line in reversed(stdout.split("\n")):  # not splitlines(): it splits on more than newlines
        if line.startswith(mark):
            return line[len(mark) :].strip()
    return None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _MISSING


def _lines(text: str) -> list[str]:
    lines = [line.strip() for line in text.strip().splitlines()]
    return lines


def _close(x: str, y: str) -> bool:
    try:
        return _close_numbers(float(x), float(y))
    except ValueError:
        return False


def _close_numbers(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-8 + 1e-5 * abs(b)  # numpy.allclose's rule
