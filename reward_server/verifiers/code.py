"""The code verifier: a model's program run against its task's tests in the sandbox service, one sandbox per test.

    tests = parse_tests(ground_truth)                       # services/code_tests.py: the layouts
    program = build_program(tests, response)                # what to run, and one stdin per test
    passed = judge(tests, program, results)                 # each sandbox result -> passed or not

The pure parts live here (no I/O); reward_server/code_runner.py sends the program to the sandbox. The answer's code
is taken as verl's prime_code takes it (PRIME, DeepCoder): the text after the last "```python", up to the next
"```" (the whole response when it has no fence), with the imports APPS's evaluator puts before it. Outputs are
compared as APPS's evaluator does: line by line with the whitespace at each end stripped, else token by token with
numbers equal within a relative 1e-5 (reals only); a function's return value equals the expected one, or the first
element of an expected list (APPS wraps them; verl's prime_code reads them so).
"""

from __future__ import annotations

import ast
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

from services.code_tests import CodeTests
from services.sandbox_api import RunResult

RESULT_MARK = "@@dapo-mesh-result@@ "  # the line a call harness prints its return value on (not the program's)

# How a value leaves the sandbox: JSON, a set as its sorted elements, anything else as its repr. The same on both
# sides (the harness in the sandbox, `plain` here), so a value compares equal to the expected one by its content.
ENCODER = """\
def _plain(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    return repr(o)
"""

# A call or assert test passes only on a line the harness prints after the test, with a nonce the program is not
# given: a program that exits early (sys.exit(0), os._exit(0)) or prints the mark itself passes nothing. A call's
# value and an `assert <expr> == <literal>`'s <expr> are printed and compared here, outside the sandbox: the expected
# value never enters it, so no object with a rigged __eq__ and no forged line can pass them. Other assertions
# (HumanEval's check, math.isclose, ...) run inside; the nonce lives in a local of the harness's function only, but a
# program that walks its caller's frames could read it there (docs: reward-server.md#code).
CALL_HARNESS = """\
import json, sys
{encoder}
def _main():
    case = json.loads(sys.stdin.read())
    nonce, args = case["nonce"], case["args"]
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
    print({mark!r} + nonce + " " + json.dumps(out, default=_plain))
_main()
"""

ASSERT_HARNESS = """\
import json, sys
{encoder}
def _main():
    case = json.loads(sys.stdin.read())
    nonce = case["nonce"]
    namespace = {{"__name__": "solution"}}
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    exec(compile({setup!r}, "setup", "exec"), namespace)
    if "expr" in case:
        out = json.dumps(eval(compile(case["expr"], "test", "eval"), namespace), default=_plain)
    else:
        exec(compile(case["test"], "test", "exec"), namespace)
        out = ""
    print()
    print({mark!r} + nonce + " " + out)
_main()
"""

_NOTHING = object()


def _plain(o: Any) -> Any:
    if isinstance(o, set | frozenset):
        return sorted(o, key=repr)
    return repr(o)


def plain(value: Any) -> Any:
    """A value as it comes back from the sandbox (ENCODER)."""
    return json.loads(json.dumps(value, default=_plain))


def split_assert(test: str) -> tuple[str, Any] | None:
    """`assert <expr> == <literal>` (either way round) -> (<expr>'s source, the literal's value); None for any other
    test (it then runs as it is, inside)."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    t = tree.body[0].test
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
        return None
    for expr, literal in ((t.left, t.comparators[0]), (t.comparators[0], t.left)):
        try:
            return ast.unparse(expr), plain(ast.literal_eval(literal))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    return None


@dataclass(frozen=True)
class Program:
    source: str
    files: dict[str, str]
    stdins: list[str]
    nonces: list[str]  # per test (call and assert layouts): the harness's line after the test
    expected: list[Any]  # per assert test: the value its <expr> must have, or _NOTHING (it runs inside)


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
        return Program(code, {}, [str(x) for x in tests.inputs or []], [], [])
    nonces = [secrets.token_hex(16) for _ in range(tests.count)]
    if tests.kind == "call":
        harness = CALL_HARNESS.format(encoder=ENCODER, name=tests.fn_name, mark=RESULT_MARK)
        cases = [{"nonce": n, "args": args} for n, args in zip(nonces, tests.inputs or [], strict=True)]
        return Program(harness, {"solution.py": code}, [json.dumps(c) for c in cases], nonces, [])
    harness = ASSERT_HARNESS.format(encoder=ENCODER, setup=tests.setup, mark=RESULT_MARK)
    cases, expected = [], []
    for n, test in zip(nonces, tests.asserts or [], strict=True):
        split = split_assert(test)
        cases.append({"nonce": n, "expr": split[0]} if split else {"nonce": n, "test": test})
        expected.append(split[1] if split else _NOTHING)
    return Program(harness, {"solution.py": code}, [json.dumps(c) for c in cases], nonces, expected)


def judge(tests: CodeTests, program: Program, results: list[RunResult]) -> list[bool]:
    """Whether each test passed: its run ended `ok` with the expected output, or (call, assert) with the harness's
    line after the test, carrying the expected value where there is one."""
    if len(results) != len(program.stdins):
        raise ValueError(f"{len(results)} results for {len(program.stdins)} tests")
    if tests.kind == "stdio":
        expected = [str(x) for x in tests.outputs or []]
        return [r.verdict == "ok" and same_output(r.stdout, want) for r, want in zip(results, expected, strict=True)]
    lines = [
        _harness_line(r.stdout, nonce) if r.verdict == "ok" else None
        for r, nonce in zip(results, program.nonces, strict=True)
    ]
    if tests.kind == "assert":
        return [
            line is not None and (want is _NOTHING or _json(line) == want)
            for line, want in zip(lines, program.expected, strict=True)
        ]
    return [
        line is not None and same_return(_json(line), want)
        for line, want in zip(lines, tests.outputs or [], strict=True)
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
        return _NOTHING


def _lines(text: str) -> list[str]:
    lines = [line.strip() for line in text.strip().splitlines()]
    return lines


def _close(x: str, y: str) -> bool:
    """Numbers within a relative 1e-5 when the expected one is written as a real (`.`, `e`): integers are exact."""
    if not any(c in y for c in ".eE"):
        return False
    try:
        return _close_numbers(float(x), float(y))
    except ValueError:
        return False


def _close_numbers(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-8 + 1e-5 * abs(b)  # numpy.allclose's rule
