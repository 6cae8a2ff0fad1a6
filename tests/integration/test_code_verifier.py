"""The `code` verifier over real HTTP: a real reward server scoring through a real sandbox service (bubblewrap), in
every test layout, against right, wrong, slow, crashing and reward-hacking answers; and its verdicts beside verl's
own code reward (verl 0.9.1's prime_code, read from the wheel `make setup` fetches) on the same cases."""

from __future__ import annotations

import importlib
import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from services.child_process import running
from services.redis_server import free_port

REF_WHEEL = Path(sys.prefix) / "ref" / "verl-0.9.1-py3-none-any.whl"
SANDBOX_TOKEN = "code-sandbox-token-123"


def fence(code: str) -> str:
    return f"Let me write it.\n```python\n{code}\n```\nDone."


STDIO = {"inputs": ["1 2\n", "5 7\n", "-3 3\n"], "outputs": ["3\n", "12\n", "0\n"]}
CALL_LINES = {"inputs": ["1\n2", "5\n7"], "outputs": ["3", "12"], "fn_name": "sum_two"}  # verl's / LiveCodeBench's form
CALL_ARGS = {"inputs": [[1, 2], [5, 7]], "outputs": [[3], 12], "fn_name": "sum_two"}  # APPS's form
MBPP = {"asserts": ["assert add(1, 2) == 3", "assert add(5, 7) == 12"], "setup": "import math"}
HUMANEVAL = {
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n",
    "entry_point": "add",
}

ADD = "def add(a, b):\n    return a + b"
SUM_TWO = "def sum_two(a, b):\n    return a + b"  # not `add`: APPS's preamble imports operator.add
READ_ADD = "a, b = map(int, input().split())\nprint(a + b)"
# (name, answer, tests, passes): the verdict each case must get
CASES = [
    ("stdio right", fence(READ_ADD), STDIO, True),
    ("stdio right, no fence", READ_ADD, STDIO, True),
    (
        "stdio right, sqrt not imported (APPS's preamble)",
        fence("a, b = map(int, input().split())\nprint(int(sqrt((a + b) ** 2)) * (1 if a + b >= 0 else -1))"),
        STDIO,
        True,
    ),
    (
        "stdio right, spaces and blank lines",
        fence("a, b = map(int, input().split())\nprint(a + b, end='  \\n\\n')"),
        STDIO,
        True,
    ),
    (
        "stdio right, under __main__",
        fence(
            f"def main():\n    {READ_ADD.replace(chr(10), chr(10) + '    ')}\nif __name__ == '__main__':\n    main()"
        ),
        STDIO,
        True,
    ),
    ("stdio wrong", fence("a, b = map(int, input().split())\nprint(a - b)"), STDIO, False),
    ("stdio wrong on one test", fence("a, b = map(int, input().split())\nprint(0 if a == 5 else a + b)"), STDIO, False),
    ("stdio crash", fence("raise ValueError('no')"), STDIO, False),
    ("stdio exits early", fence("import sys\nsys.exit(0)"), STDIO, False),
    ("call right, JSON lines", fence(SUM_TWO), CALL_LINES, True),
    (
        "call right, class Solution",
        fence("class Solution:\n    def sum_two(self, a, b):\n        return a + b"),
        CALL_LINES,
        True,
    ),
    ("call wrong", fence("def sum_two(a, b):\n    return a - b"), CALL_LINES, False),
    ("call crash", fence("def sum_two(a, b):\n    return a / 0"), CALL_LINES, False),
    ("call no such function", fence("def plus(a, b):\n    return a + b"), CALL_LINES, False),
    ("call exits at import", fence("import os\nos._exit(0)"), CALL_LINES, False),
    ("call right, arguments as lists", fence(SUM_TWO), CALL_ARGS, True),
]
OURS_ONLY = [  # layouts verl's prime_code does not read, and reward hacks aimed at our harnesses
    ("mbpp right", fence(ADD), MBPP, True),
    ("mbpp wrong", fence("def add(a, b):\n    return a * b"), MBPP, False),
    ("mbpp exits at import", fence("import sys\nsys.exit(0)"), MBPP, False),
    ("mbpp prints the harness's mark", fence("print('@@dapo-mesh-result@@ ')\nimport os\nos._exit(0)"), MBPP, False),
    (
        "mbpp reads the nonce from __main__",
        fence("import __main__, os\nprint('@@dapo-mesh-result@@ ' + str(getattr(__main__, 'nonce', '')))\nos._exit(0)"),
        MBPP,
        False,
    ),
    (
        "mbpp returns an object equal to anything",
        fence(
            "def add(a, b):\n    class Any:\n        def __eq__(self, o):\n            return True\n    return Any()"
        ),
        MBPP,
        False,
    ),
    (
        "mbpp right, a set and a tuple",
        fence("def pair(a, b):\n    return {a, b}, (a, b)"),
        {"asserts": ["assert pair('x', 'y') == ({'y', 'x'}, ('x', 'y'))"]},
        True,
    ),
    ("humaneval right", fence(ADD), HUMANEVAL, True),
    ("humaneval wrong", fence("def add(a, b):\n    return 3"), HUMANEVAL, False),
    ("slow", fence("while True:\n    pass"), STDIO, False),
    ("memory hog", fence("x = bytearray(2 << 30)"), MBPP, False),
]


@pytest.fixture(scope="module")
def sandbox() -> Iterator[str]:
    with running("sandbox", env={"DAPO_SANDBOX_TOKEN": SANDBOX_TOKEN}, ready_path="/readyz") as (base, _):
        yield base


@pytest.fixture(scope="module")
def reward(sandbox: str) -> Iterator[str]:
    args = ["--workers", "1", "--sandbox-url", sandbox, "--code-test-timeout-s", "1", "--cache-size", "0"]
    with running("reward_server", *args, env={"DAPO_SANDBOX_TOKEN": SANDBOX_TOKEN}, ready_path="/readyz") as (base, _):
        yield base


def score(base: str, cases: list[tuple[str, str, dict, bool]]) -> dict[str, dict]:
    items = [{"id": n, "response": a, "ground_truth": json.dumps(t), "verifier": "code"} for n, a, t, _ in cases]
    r = httpx.post(f"{base}/v1/score", json={"items": items}, timeout=300)
    assert r.status_code == 200, r.text
    return {res["id"]: res for res in r.json()["results"]}


def test_answers_get_their_verdicts_in_every_layout(reward: str) -> None:
    got = score(reward, CASES + OURS_ONLY)
    wrong = {n: got[n] for n, _, _, passes in CASES + OURS_ONLY if got[n]["acc"] is not passes}
    assert not wrong, wrong
    for n, _, _, passes in CASES + OURS_ONLY:
        assert got[n]["score"] == (1.0 if passes else -1.0) and got[n]["error"] is None, got[n]
    assert got["stdio wrong on one test"]["pred"] == "2/3 tests passed"


def test_the_fraction_reward_counts_the_tests_passed(sandbox: str) -> None:
    args = ["--workers", "1", "--sandbox-url", sandbox, "--code-reward", "fraction"]
    env = {"DAPO_SANDBOX_TOKEN": SANDBOX_TOKEN}
    with running("reward_server", *args, env=env, ready_path="/readyz") as (base, _):
        got = score(base, [c for c in CASES if c[0] in ("stdio wrong on one test", "stdio right", "stdio wrong")])
    assert got["stdio wrong on one test"]["score"] == pytest.approx(2 * 2 / 3 - 1)
    assert (got["stdio right"]["score"], got["stdio wrong"]["score"]) == (1.0, -1.0)


def test_code_items_need_a_sandbox_and_a_sandbox_down_is_the_items_error(reward_url: str) -> None:
    item = {"id": "a", "response": fence(ADD), "ground_truth": json.dumps(MBPP), "verifier": "code"}
    r = httpx.post(f"{reward_url}/v1/score", json={"items": [item]}, timeout=30)  # a server without --sandbox-url
    assert r.status_code == 422 and "--sandbox-url" in r.text
    down = f"http://127.0.0.1:{free_port()}"
    with running("reward_server", "--workers", "1", "--sandbox-url", down, ready_path="/readyz") as (base, _):
        r = httpx.post(f"{base}/v1/score", json={"items": [item]}, timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["error"].startswith("sandbox unreachable"), r.text


def test_a_sandbox_refusing_the_token_is_the_items_error(sandbox: str) -> None:
    item = {"id": "a", "response": fence(ADD), "ground_truth": json.dumps(MBPP), "verifier": "code"}
    env = {"DAPO_SANDBOX_TOKEN": "not-the-token"}
    with running("reward_server", "--workers", "1", "--sandbox-url", sandbox, env=env, ready_path="/readyz") as (b, _):
        result = httpx.post(f"{b}/v1/score", json={"items": [item]}, timeout=60).json()["results"][0]
    assert result["acc"] is False and "401" in result["error"]


def verl_prime_code(tmp: Path) -> ModuleType:
    """verl 0.9.1's prime_code package, from the wheel, importable on its own (it needs numpy only)."""
    pkg = tmp / "verl_prime_code_ref"
    pkg.mkdir()
    with zipfile.ZipFile(REF_WHEEL) as z:
        for name in ("__init__.py", "utils.py", "testing_util.py"):
            (pkg / name).write_bytes(z.read(f"verl/utils/reward_score/prime_code/{name}"))
    sys.path.insert(0, str(tmp))
    try:
        return importlib.import_module("verl_prime_code_ref")
    finally:
        sys.path.remove(str(tmp))


@pytest.mark.slow
def test_verdicts_equal_verls_code_reward(reward: str, tmp_path: Path) -> None:
    """The cases verl's prime_code reads (stdin/stdout, and fn_name with JSON-lines or argument lists) scored by
    both: the same verdict on each. verl's is called as its default_compute_score calls it (continuous=True: 1.0
    when every test passes); it runs the answer in-process, with no sandbox."""
    ref = verl_prime_code(tmp_path)
    ours = score(reward, CASES)
    theirs = {}
    for name, answer, tests, _ in CASES:
        if name == "call right, arguments as lists":
            continue  # verl reads a fn_name case as JSON lines only (APPS's argument lists are not its layout)
        result, _ = ref.compute_score(answer, json.dumps(tests), continuous=True)
        theirs[name] = result is True or result == 1.0
    differ = {n: (ours[n]["acc"], t) for n, t in theirs.items() if ours[n]["acc"] is not t}
    assert not differ, f"(ours, verl's) differ: {differ}"
    assert sum(theirs.values()) >= 5 and sum(not v for v in theirs.values()) >= 5  # both kinds, on both sides
