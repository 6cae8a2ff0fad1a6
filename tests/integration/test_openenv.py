"""OpenEnv environments run as they are: a real OpenEnv server (openenv-core 0.3.0's own app, in its own venv,
serving tests/integration/openenv_guess.py) behind the environment service's adapter (`--openenv NAME=URL`), over
real HTTP and WebSockets. The adapted environment passes the conformance checker; an episode is an OpenEnv session
(its feedback the model's next user turn, its reward the episode's); an episode that ends or is closed frees its
session on the OpenEnv server; a full OpenEnv server is a 429, an unreachable one a 502."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from env_server.conformance import Checker
from services.child_process import ROOT, running, wait_ready
from services.redis_server import free_port
from tests.integration.env_http import reset, step

OPENENV_PY = ROOT / ".venv-openenv" / "bin" / "python"
SESSIONS = 2  # the OpenEnv server's max_concurrent_envs


@pytest.fixture(scope="module")
def openenv_url() -> Iterator[str]:
    if not OPENENV_PY.exists():
        if os.environ.get("DAPO_REQUIRE_TOOLS") or os.environ.get("CI"):
            pytest.fail("the OpenEnv venv is missing: `make test` builds .venv-openenv")
        pytest.skip("no .venv-openenv (`make test` builds it)")
    port = free_port()
    script = Path(__file__).with_name("openenv_guess.py")
    proc = subprocess.Popen([str(OPENENV_PY), str(script), "--port", str(port), "--sessions", str(SESSIONS)], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base + "/health", name="openenv", headers={}, timeout_s=60, poll_s=0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture(scope="module")
def env_url(openenv_url: str) -> Iterator[str]:
    entries = [f"guess={openenv_url}?max_turns=5&timeout_s=10", f"down=http://127.0.0.1:{free_port()}"]
    args = ("--openenv", ",".join(entries), "--step-timeout-s", "2")
    with running("env_server", *args, ready_path="/readyz") as (base, _):
        yield base


def test_an_openenv_environment_passes_the_conformance_checker(env_url: str) -> None:
    report = Checker(env_url).run(["guess"])
    assert report.ok, report.failed
    assert "guess: steps until done within max_turns; a retried step answers the same" in report.passed


def test_an_episode_is_an_openenv_session(env_url: str) -> None:
    """Binary search through the OpenEnv server's feedback: its observation is the model's next turn, its reward
    the episode's; the same seed, the same secret."""
    with httpx.Client(base_url=env_url, timeout=30) as http:
        spec = {e["name"]: e for e in http.get("/v1/envs").json()["envs"]}["guess"]
        assert spec["max_turns"] == 5 and spec["tool_format"] == "none"
        found = []
        for _ in range(2):
            opening = reset(http, "guess", seed=11)
            assert opening.messages[-1].role == "user" and "Guess my number" in opening.messages[-1].content
            lo, hi, turn, out = 1, 10, 0, None
            while out is None or not out.done:
                turn, guess = turn + 1, (lo + hi) // 2
                out = step(http, opening.episode_id, turn, f"I guess {guess}")
                if not out.done:
                    hint = out.messages[0].content
                    assert out.messages[0].role == "user" and hint in ("No: higher.", "No: lower."), hint
                    lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)
            assert out.reward == 1.0 and not out.truncated and turn <= 4
            found.append(guess)
        assert found[0] == found[1]
        eid = reset(http, "guess", task={"seed": 3}).episode_id
        outs = [step(http, eid, t, "no idea") for t in range(1, 6)]
        assert [o.done for o in outs] == [False] * 4 + [True] and outs[-1].truncated and outs[-1].reward == -1.0
        assert outs[0].messages[0].content == "No: not a number."


def test_sessions_are_freed_when_episodes_end_or_resets_time_out_and_a_full_server_is_429(env_url: str) -> None:
    with httpx.Client(base_url=env_url, timeout=30) as http:
        r = http.post("/v1/episodes", json={"env": "guess", "task": {"seed": 1, "delay": 3}})
        assert r.status_code == 504, r.text  # past --step-timeout-s; its session opens late, and is closed then
        time.sleep(2)  # the reset returns (and the sessions of the tests before close, in the background)
        held = [reset(http, "guess", seed=s).episode_id for s in range(SESSIONS)]
        r = http.post("/v1/episodes", json={"env": "guess", "seed": 9})
        assert r.status_code == 429 and "at capacity" in r.text and r.headers["Retry-After"] == "1", r.text
        assert http.delete(f"/v1/episodes/{held[0]}").status_code == 200  # closed: its session too
        deadline = time.monotonic() + 10
        while (r := http.post("/v1/episodes", json={"env": "guess", "seed": 9})).status_code == 429:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        for eid in (held[1], r.json()["episode_id"]):
            http.delete(f"/v1/episodes/{eid}")


def test_an_unreachable_openenv_server_is_a_502(env_url: str) -> None:
    with httpx.Client(base_url=env_url, timeout=30) as http:
        r = http.post("/v1/episodes", json={"env": "down", "seed": 1})
        assert r.status_code == 502 and "GET /schema failed" in r.text, r.text
        assert http.get("/readyz").status_code == 200  # the service itself is fine
