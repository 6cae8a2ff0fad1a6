"""The `python` tool over real HTTP: the environment service (`python -m env_server --sandbox-url ...`) runs an
agent's program in a real sandbox service, in the tags and the hermes format, its output (bounded) the tool
message; the built-in `compute` environment that needs it, served only with a sandbox."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from env_server.builtins.compute import ComputeTask, solve
from services.child_process import running

TOKEN = "python-tool-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    env = {"DAPO_AUTH_TOKEN": TOKEN}
    with running("sandbox", env=env, ready_path="/readyz", token=TOKEN) as (sandbox, _):
        args = ["--sandbox-url", sandbox, "--python-timeout-s", "2", "--python-output-chars", "300"]
        with running("env_server", *args, env=env, ready_path="/readyz", token=TOKEN) as (base, _):
            yield base


def step(http: httpx.Client, eid: str, turn: int, content: str) -> dict:
    r = http.post(f"/v1/episodes/{eid}/step", json={"turn": turn, "message": {"role": "assistant", "content": content}})
    assert r.status_code == 200, r.text
    return r.json()


def test_compute_is_solved_with_the_python_tool_in_the_tags_format(env_url: str) -> None:
    with httpx.Client(base_url=env_url, headers=AUTH, timeout=60) as http:
        envs = {e["name"]: e for e in http.get("/v1/envs").json()["envs"]}
        assert envs["compute"]["tool_format"] == "tags"
        assert [t["function"]["name"] for t in envs["compute"]["tools"]] == ["python"]
        task = {"kind": "primes", "n": 1000, "m": 1}
        opened = http.post("/v1/episodes", json={"env": "compute", "task": task}).json()
        eid = opened["episode_id"]
        assert "prime numbers are there below 1000" in opened["messages"][-1]["content"]
        program = "print(sum(all(n % d for d in range(2, int(n ** 0.5) + 1)) for n in range(2, 1000)))"
        out = step(http, eid, 1, f"Let me count.\n<python>{program}</python>")
        (reply,) = out["messages"]
        assert (reply["role"], reply["name"], reply["content"], out["done"]) == ("tool", "python", "168", False)
        assert out["tools"]["valid"] == 1
        done = step(http, eid, 2, "Answer: 168")
        assert done["done"] and done["reward"] == 1.0 and solve(ComputeTask(**task)) == 168


def test_the_tool_message_is_bounded_and_says_how_the_program_ended(env_url: str) -> None:
    with httpx.Client(base_url=env_url, headers=AUTH, timeout=60) as http:
        eid = http.post("/v1/episodes", json={"env": "compute", "seed": 7}).json()["episode_id"]
        cases = [
            ("print('x' * 5000)", lambda c: c.endswith("[output cut at 300 characters]") and len(c) < 400),
            ("raise ValueError('bad')", lambda c: "ValueError: bad" in c and c.endswith("[exit status 1]")),
            ("while True: pass", lambda c: c.endswith("[timeout]")),
            ("import os; print(sorted(k for k in os.environ if 'DAPO' in k))", lambda c: c == "[]"),
            ("import socket; print(socket.socket().connect_ex(('127.0.0.1', 6379)))", lambda c: c != "0"),
            ("pass", lambda c: c == "[no output]"),
        ]
        for turn, (program, holds) in enumerate(cases, 1):
            if turn == 4:  # max_turns 4: a fresh episode for the rest
                eid = http.post("/v1/episodes", json={"env": "compute", "seed": 8}).json()["episode_id"]
            (reply,) = step(http, eid, (turn - 1) % 3 + 1, f"<python>{program}</python>")["messages"]
            assert holds(reply["content"]), (program, reply["content"])


def test_the_tool_in_the_hermes_format_for_an_environment_of_ones_own(env_url: str) -> None:
    """The same tool in an environment that speaks hermes (JSON calls), as a user's own would hold it, pointed at the
    fixture's sandbox: a call written as JSON runs there."""
    from env_server import python_tool
    from env_server.base import Environment
    from env_server.settings import EnvSettings

    class Scratch(Environment):
        name = "scratch"

        def tools(self):  # type: ignore[no-untyped-def]
            return [python_tool.python_tool()]

    settings = EnvSettings(sandbox_url=_sandbox_of(env_url), sandbox_token=TOKEN)
    assert python_tool.configure(settings)
    call = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    message = {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"}
    from services.episodes import ChatMessage

    out = Scratch().step(None, ChatMessage.model_validate(message), 1)
    assert Scratch().tool_format == "hermes" and [m.content for m in out.messages] == ["42"]


def _sandbox_of(env_url: str) -> str:
    config = httpx.get(f"{env_url}/config", headers=AUTH, timeout=10).json()
    return config["sandbox_url"]


def test_compute_is_not_served_without_a_sandbox() -> None:
    with running("env_server", ready_path="/readyz") as (base, _):
        names = [e["name"] for e in httpx.get(f"{base}/v1/envs", timeout=10).json()["envs"]]
    assert "compute" not in names and "calculator" in names


def test_compute_knows_its_answers() -> None:
    assert solve(ComputeTask(kind="squares", n=100)) == sum(i * i for i in range(1, 101))
    assert [solve(ComputeTask(kind="fibonacci", n=n)) for n in (1, 2, 3, 10, 50)] == [1, 1, 2, 55, 12586269025]
    assert solve(ComputeTask(kind="digits", n=2, m=10)) == 1 + 0 + 2 + 4
    assert [solve(ComputeTask(kind="primes", n=n)) for n in (1, 2, 3, 100, 5000)] == [0, 0, 1, 25, 669]
